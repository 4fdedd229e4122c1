"""`leanserve bench long`: prefill time, peak memory and decode speed at long context (4K to 128K tokens), on a
model with DeepSeek-V4-Flash's attention shapes, and what they come to at 1M tokens on paper.

The model is bench/formats.py's `bench_config`: Flash's shipped config (64 heads of 512, q rank 1024, 8 output
groups of rank 1024, an indexer of 64 heads of 128 choosing the top 512 compressed rows, a window of 128, experts of
2048, top-6) with few layers and experts, by default 2 layers (CSA at rate 4, then HCA at rate 128) and 8 routed
experts, and a hidden size of 1024 (`--hidden`; Flash's is 4096): the attention's shapes and its cost per query
are Flash's, while the rest of a token's work (its linears from and to the hidden size, the MoE) is about a third,
so that 128K tokens prefill in about 20 minutes on 2 cores instead of an hour. Less work that does not grow with
depth makes the per-token growth the benchmark reports larger, not smaller. Its random weights are written once as
bf16 to `--dir` (reused while they hold the same model); the engine runs them as stored on the CPU backend (the
numba kernels: bf16 weights widened as read, float32 activations and caches). `--model DIR` runs another
checkpoint instead (a small one for a quick check).

The model's own cost grows with depth: at position t the CSA layer's indexer scores t/4 compressed rows with 64
heads of 128 and the HCA layer reads t/128 rows, while the linears, the MoE and attention over the window and the
512 chosen rows cost the same at any depth. So the prefill's time per token should grow slowly and linearly with
length, and its memory only by the caches. Each length runs in a fresh process (its peak memory its own):
  - the engine is built for one sequence of the length plus the decode steps (max_model_len), prefix caching off;
  - a random prompt of that length is prefilled in chunks of `--chunk` tokens (the engine's max_num_batched_tokens)
    and timed until its first token; during it the CPU backend's parts are timed by wrapping them: the kernels
    `index_select` (indexer: scoring and choosing the rows) and `attend` (attention), and the backend's `compress`
    (both compressors), `moe` (router, experts, shared expert) and `linears` / `grouped_linear`; a call inside
    another timed one counts for the outer one (the shared expert's linears are MoE); "other" is the rest (norms,
    RoPE, mHC, embedding, the head's sampling, the engine's own work);
  - the peak resident memory of the prefill (the high-water mark reset just before it, /proc/self/clear_refs);
  - then `--decode-steps` greedy decode steps at that depth, timed one by one (the median reported).
The time per token and the decode step time are fitted as a + b * length (least squares; a slope that comes out
negative, the timings' noise, is taken as flat) and extrapolated to 1,048,576 tokens; last, the issue's three targets against the measured ratios (the longest length vs the first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from leanserve.bench.common import print_rows
from leanserve.bench.options import add_output, add_threads

MILLION = 1 << 20  # the "1M" context on paper
HIDDEN = 1024  # the default hidden size (see the notes above)
PARTS = ("indexer", "attention", "compressor", "moe", "linears")
# What each part times: (part, where, attribute); "kernels": the CPU kernels' module as arrays.py calls it (ck),
# "backend": the CpuBackend class.
WRAPPED = (
    ("indexer", "kernels", "index_select"),
    ("attention", "kernels", "attend"),
    ("compressor", "backend", "compress"),
    ("moe", "backend", "moe"),
    ("moe", "backend", "experts"),
    ("linears", "backend", "linears"),
    ("linears", "backend", "grouped_linear"),
)
# The targets: the longest length against the first (there 131072 against 4096).
PREFILL_MOST = 2.0  # prefill time per token, at most this many times the first's
MEMORY_MOST = 1.10  # peak memory less the engine's buffers, at most this many times the first's
DECODE_LEAST = 0.7  # decode tokens/s, at least this share of the first's


@dataclass
class LongRow:
    tokens: int
    prefill_s: float
    ms_per_token: float
    vs_first: float  # ms_per_token / the first length's
    indexer_ms: float  # each part: ms per prompt token
    attention_ms: float
    compressor_ms: float
    moe_ms: float
    linears_ms: float
    other_ms: float
    peak_gib: float  # the prefill's peak resident memory
    cache_mib: float  # the attention caches (the memory ledger's kv_cache)
    buffers_mib: float  # every buffer in the ledger (caches, RoPE tables, ...)
    rest_vs_first: float  # (peak - buffers) / the first length's
    decode_tok_s: float  # at this depth, median step
    decode_vs_first: float


HEADERS = {
    "tokens": "tokens",
    "prefill_s": "prefill s",
    "ms_per_token": "ms/token",
    "vs_first": "x first",
    "indexer_ms": "indexer",
    "attention_ms": "attention",
    "compressor_ms": "compressor",
    "moe_ms": "MoE",
    "linears_ms": "linears",
    "other_ms": "other",
    "peak_gib": "peak GiB",
    "cache_mib": "cache MiB",
    "buffers_mib": "buffers MiB",
    "rest_vs_first": "peak-buffers x first",
    "decode_tok_s": "decode tok/s",
    "decode_vs_first": "x first",
}


@dataclass(frozen=True)
class Measured:
    """One length's raw measurements (what a child process sends back)."""

    tokens: int
    prefill_s: float
    parts_s: dict[str, float]
    peak_bytes: int
    peak_reset: bool  # whether the high-water mark was reset before the prefill (else: the process's peak)
    cache_bytes: int
    buffers_bytes: int
    decode_steps_s: list[float]
    backend: str


# --- the options --------------------------------------------------------------------------------------------
def length(text: str) -> int:
    """A token count: an integer, or one with a K (x1024) or M (x1048576) suffix: 4096, 4K, 128k, 1M."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096 or 4K, got {text!r}")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]


def length_list(text: str) -> list[int]:
    """An argparse type: comma-separated token counts (length's forms), e.g. 4K,16K,64K,128K."""
    return [length(t) for t in text.split(",") if t.strip()]


def check(lengths: list[int], decode_steps: int, chunk: int, max_positions: int) -> None:
    """ValueError, in one sentence, for options that cannot run: before any checkpoint is written or engine built."""
    if not lengths:
        raise ValueError("--lengths needs at least one length.")
    if min(lengths) < 1:
        raise ValueError(f"--lengths must be positive, got {min(lengths)}.")
    if decode_steps < 1 or chunk < 1:
        raise ValueError("--decode-steps and --chunk must be positive.")
    longest = max(lengths) + decode_steps + 1
    if longest > max_positions:
        raise ValueError(
            f"the longest length ({max(lengths)}) plus {decode_steps + 1} decode tokens exceeds the model's "
            f"max_position_embeddings ({max_positions})."
        )


# --- the model ----------------------------------------------------------------------------------------------
def make_checkpoint(model_dir: Path, cfg, seed: int = 0, log=print) -> Path:
    """Random bf16 weights of `cfg` written to model_dir, unless it holds that model already."""
    import torch

    from leanserve.bench.formats import SHARD, _same_model
    from leanserve.make_random import randomize_
    from leanserve.model.build import build_model
    from leanserve.model.loader import save_checkpoint

    if not _same_model(model_dir, cfg):
        log(f"writing the random bf16 checkpoint to {model_dir} ...")
        model = build_model(cfg, max_positions=1, dtype=torch.bfloat16, with_mtp=False)
        randomize_(model, seed, by_slice=True)
        save_checkpoint(model, model_dir, dtype=torch.bfloat16, max_shard_size=SHARD)
    return model_dir


# --- one length ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def part_timer():
    """Times the CPU backend's parts (WRAPPED) while the block runs; yields {part: seconds}. A call made inside
    another timed call counts for the outer one only, so the parts never overlap."""
    from leanserve.model.backends.cpu import arrays
    from leanserve.model.backends.cpu.backend import CpuBackend

    owners = {"kernels": arrays.ck, "backend": CpuBackend}
    totals = dict.fromkeys(PARTS, 0.0)
    inside = [False]
    patched = []

    def wrap(part, fn):
        def timed(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            inside[0] = True
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part] += time.perf_counter() - start
                inside[0] = False

        return timed

    for part, where, name in WRAPPED:
        owner = owners[where]
        fn = getattr(owner, name, None)
        if fn is None:  # (renamed: that part then reads 0 and its time is "other")
            continue
        patched.append((owner, name, vars(owner).get(name, None)))
        setattr(owner, name, wrap(part, fn))
    try:
        yield totals
    finally:
        for owner, name, before in reversed(patched):
            if before is None:  # (inherited: drop the wrapper)
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(model: str, tokens: int, chunk: int, decode_steps: int, seed: int = 0, threads: int | None = None):
    """One length's Measured: the engine built for it, a `tokens`-token prefill in chunks of `chunk`, then
    `decode_steps` greedy decode steps."""
    import torch

    from leanserve import LLM, SamplingParams
    from leanserve.bench.common import random_prompts
    from leanserve.memory import KV_CACHE

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(
        model, max_model_len=tokens + decode_steps + 1, max_num_seqs=1, max_num_batched_tokens=chunk,
        enable_prefix_caching=False, load_progress=False,
    )  # fmt: skip
    try:
        engine = llm.engine
        ledger = llm.memory_ledger()
        backend = getattr(getattr(getattr(engine.executor, "runner", None), "model", None), "ops", None)
        prompt = random_prompts(1, tokens, engine.model_config.vocab_size, seed)[0].tolist()
        # A throw-away request of one chunk first: kernels the engine's own warm-up did not reach at this size are
        # compiled (or loaded from numba's cache) here, not in the timed prefill.
        llm.generate([{"prompt_token_ids": prompt[: min(tokens, chunk)]}], SamplingParams(max_tokens=2))
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True))
        reset = _reset_peak()
        with part_timer() as parts:
            start = time.perf_counter()
            while engine.has_unfinished and not any(u.new_tokens for u in engine.step()):
                pass
            prefill_s = time.perf_counter() - start
        peak = _peak_bytes()
        steps = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    return Measured(
        tokens, prefill_s, dict(parts), peak, reset, sum(s.by_feature().get(KV_CACHE, 0) for s in ledger),
        sum(s.buffers_bytes for s in ledger), steps, getattr(backend, "name", "?"),
    )  # fmt: skip


def _child(conn, args) -> None:
    try:
        conn.send(measure(*args))
    except BaseException as e:  # (sent back whole: the parent raises it)
        conn.send(e)
    finally:
        conn.close()


def measure_apart(*args) -> Measured:
    """measure(*args) in a fresh process (spawned: nothing of this one's memory in its peak)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, args))
    child.start()
    send.close()
    try:
        out = receive.recv()
    except EOFError:
        child.join()
        out = RuntimeError(f"the process measuring {args[1]} tokens died (exit code {child.exitcode}).")
    child.join()
    if isinstance(out, BaseException):
        raise out
    return out


# --- the rows -----------------------------------------------------------------------------------------------
def rows_of(measured: list[Measured]) -> list[LongRow]:
    """One row per length, each ratio against the first (shortest) length's."""
    rows = []
    first = None
    for m in measured:
        per_token = m.prefill_s * 1e3 / m.tokens
        rest = m.peak_bytes - m.buffers_bytes
        tok_s = 1 / statistics.median(m.decode_steps_s)
        first = first or (per_token, rest, tok_s)
        parts = {p: round(m.parts_s.get(p, 0.0) * 1e3 / m.tokens, 3) for p in PARTS}
        other = max(0.0, m.prefill_s - sum(m.parts_s.values())) * 1e3 / m.tokens
        rows.append(
            LongRow(m.tokens, round(m.prefill_s, 2), round(per_token, 3), round(per_token / first[0], 2),
                    *parts.values(), round(other, 3), round(m.peak_bytes / 2**30, 3), round(m.cache_bytes / 2**20, 3),
                    round(m.buffers_bytes / 2**20, 3), round(rest / first[1], 3), round(tok_s, 3),
                    round(tok_s / first[2], 2))
        )  # fmt: skip
    return rows


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b * x; one point (or all at one x): (its mean y, 0)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


@dataclass(frozen=True)
class OnPaper:
    tokens: int
    prefill_ms_per_token: float  # fitted a + b * tokens
    prefill_s: float  # tokens * that
    decode_tok_s: float  # 1 / the fitted step time at that depth
    prefill_fit: tuple[float, float]  # (a ms, b ms per token of length)
    decode_fit: tuple[float, float]  # (a s, b s per token of depth)
    flat: tuple[str, ...]  # the fits whose slope came out negative, taken as flat ("prefill", "decode")


def rising_fit(xs: list[float], ys: list[float]) -> tuple[float, float, bool]:
    """linear_fit's (a, b), and False; (the mean y, 0, True) where its slope is negative: the model's cost does
    not fall with depth, so a falling fit is the timings' noise, and extrapolated it would reach zero."""
    a, b = linear_fit(xs, ys)
    return (a, b, False) if b >= 0 else (sum(ys) / len(ys), 0.0, True)


def on_paper(rows: list[LongRow], tokens: int = MILLION) -> OnPaper:
    """The rows' time per token and decode step time, each fitted as a + b * length (rising_fit), at `tokens`."""
    xs = [float(r.tokens) for r in rows]
    pa, pb, pflat = rising_fit(xs, [r.ms_per_token for r in rows])
    da, db, dflat = rising_fit(xs, [1 / r.decode_tok_s for r in rows])
    per_token, step = pa + pb * tokens, da + db * tokens
    flat = tuple(name for name, f in (("prefill", pflat), ("decode", dflat)) if f)
    return OnPaper(tokens, per_token, per_token * tokens / 1e3, 1 / step, (pa, pb), (da, db), flat)


@dataclass(frozen=True)
class Target:
    name: str
    ratio: float | None  # the longest length's against the first's (None: a single length)
    bound: float
    at_most: bool  # the ratio must be at most (else at least) the bound
    met: bool | None


def targets(rows: list[LongRow]) -> list[Target]:
    """The issue's three targets against the measured ratios of the longest length to the first."""
    last = rows[-1] if len(rows) > 1 else None
    out = []
    for name, field, bound, at_most in (
        ("prefill time per token", "vs_first", PREFILL_MOST, True),
        ("peak memory less the buffers", "rest_vs_first", MEMORY_MOST, True),
        ("decode tokens/s", "decode_vs_first", DECODE_LEAST, False),
    ):
        ratio = getattr(last, field) if last else None
        met = None if ratio is None else (ratio <= bound if at_most else ratio >= bound)
        out.append(Target(name, ratio, bound, at_most, met))
    return out


def target_lines(rows: list[LongRow]) -> list[str]:
    first, last = rows[0].tokens, rows[-1].tokens
    lines = []
    for t in targets(rows):
        want = f"{'at most' if t.at_most else 'at least'} {t.bound}x"
        if t.ratio is None:
            lines.append(f"{t.name}: {want} (needs two lengths)")
        else:
            verdict = "met" if t.met else "NOT met"
            lines.append(f"{t.name} at {last} vs {first}: {t.ratio:.2f}x, target {want}: {verdict}")
    return lines


def paper_line(p: OnPaper) -> str:
    flat = f" ({' and '.join(p.flat)} fell with length, within the noise: taken as flat)" if p.flat else ""
    return (
        f"{p.tokens} tokens on paper (a + b * length fitted over the measured lengths{flat}): prefill "
        f"{p.prefill_ms_per_token:.2f} ms/token, {p.prefill_s / 3600:.2f} h; decode at that depth "
        f"{p.decode_tok_s:.2f} tok/s"
    )


# --- the benchmark ------------------------------------------------------------------------------------------
def long_bench(
    model: str, lengths: list[int], chunk: int, decode_steps: int, seed: int = 0, threads: int | None = None,
    apart: bool = True, log=print,
) -> list[Measured]:  # fmt: skip
    """Measured for each length, shortest first, each in a fresh process unless `apart` is False."""
    out = []
    for n in sorted(set(lengths)):
        log(f"length {n}: starting{' (a fresh process)' if apart else ''} ...")
        start = time.perf_counter()
        m = (measure_apart if apart else measure)(model, n, chunk, decode_steps, seed, threads)
        log(
            f"length {n}: done in {time.perf_counter() - start:.0f} s (prefill {m.prefill_s:.1f} s, "
            f"decode {1 / statistics.median(m.decode_steps_s):.2f} tok/s)"
        )
        out.append(m)
    return out


def notes(model_line: str, measured: list[Measured], chunk: int, decode_steps: int, apart: bool) -> list[str]:
    import torch

    reset = all(m.peak_reset for m in measured)
    return [
        model_line,
        f"backend {measured[0].backend}; prefill in chunks of {chunk} tokens; decode: the median of {decode_steps} "
        f"greedy steps after the prefill; torch threads {torch.get_num_threads()}",
        "parts in ms per prompt token, the wall time of the outermost timed call (indexer: index_select; "
        "attention: attend; compressor; MoE with its shared expert; linears); other: the rest of the prefill",
        ("each length in a fresh process; " if apart else "all lengths in one process (peaks include what earlier "
         "lengths left); ")
        + ("peak: the prefill's high-water mark of resident memory (reset before it)" if reset
           else "peak: the process's high-water mark (it could not be reset: loading included)")
        + "; buffers: every tensor in the engine's memory ledger (caches, RoPE tables)",
    ]  # fmt: skip


HELP = "long context (4K-128K): prefill time by part, peak memory and decode at depth; 1M on paper"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths", type=length_list, default=[4096, 16384, 65536, 131072], help="prompt lengths, e.g. 4K,16K,128K"
    )
    p.add_argument("--decode-steps", type=int, default=16, help="greedy decode steps timed at each depth")
    p.add_argument(
        "--chunk", type=int, default=None, help="prefill chunk: max_num_batched_tokens (default: the engine's)"
    )
    p.add_argument("--dir", default="build/bench-long", help="where the random checkpoint is written (or reused)")
    p.add_argument("--layers", type=int, default=2, help="layers (CSA and HCA alternating)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer (top-6)")
    p.add_argument(
        "--hidden", type=int, default=HIDDEN,
        help=f"hidden size (default {HIDDEN}; Flash's is 4096; the attention's shapes stay Flash's whatever it is)",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="run this checkpoint instead of the Flash-shaped one")
    p.add_argument(
        "--same-process", action="store_true", help="every length in this process (peaks then include earlier ones)"
    )
    p.add_argument("--seed", type=int, default=0)
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    from leanserve.engine.config import EngineConfig
    from leanserve.model.config import ModelConfig

    chunk = EngineConfig.max_num_batched_tokens if args.chunk is None else args.chunk  # (the field's default)
    if args.model is None:
        from leanserve.bench.formats import FLASH_CONFIG, bench_config

        top_k = ModelConfig.from_json_file(FLASH_CONFIG).num_experts_per_tok
        if args.layers < 1:
            raise ValueError("--layers must be positive.")
        if args.experts < top_k:
            raise ValueError(f"--experts must be at least the top-k ({top_k}).")
        cfg = bench_config(args.layers, args.experts)
        if args.hidden < 64 or args.hidden % 64:
            raise ValueError("--hidden must be a positive multiple of 64.")
        cfg = dataclasses.replace(cfg, hidden_size=args.hidden)
    else:
        if not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model {args.model}: no config.json there.")
        cfg = ModelConfig.from_hf(args.model)
    check(args.lengths, args.decode_steps, chunk, cfg.max_position_embeddings)
    log = print if args.output == "table" else (lambda *a: print(*a, file=sys.stderr))
    if args.model is None:
        model = str(make_checkpoint(Path(args.dir), cfg, args.seed, log))
        model_line = (
            f"model: DeepSeek-V4-Flash's attention shapes ({cfg.num_attention_heads} heads of {cfg.head_dim}, "
            f"q rank {cfg.q_lora_rank}, {cfg.o_groups} output groups of rank {cfg.o_lora_rank}, "
            f"indexer {cfg.index_n_heads} x {cfg.index_head_dim}, top-{cfg.index_topk}, window {cfg.sliding_window}), "
            f"{args.layers} layers ({', '.join(cfg.layer_types)}), {args.experts} routed experts of "
            f"{cfg.moe_intermediate_size} (top-{cfg.num_experts_per_tok}) + 1 shared, hidden {cfg.hidden_size}; bf16 "
            "weights, float32 "
            f"activations; random, in {model}"
        )
    else:
        model, model_line = args.model, f"model: {args.model} ({', '.join(cfg.layer_types)})"
    apart = not args.same_process
    measured = long_bench(model, args.lengths, chunk, args.decode_steps, args.seed, args.threads, apart, log)
    rows = rows_of(measured)
    paper, lines = on_paper(rows), notes(model_line, measured, chunk, args.decode_steps, apart)
    if args.output == "json":
        print(json.dumps({
            "notes": lines, "rows": [dataclasses.asdict(r) for r in rows], "on_paper": dataclasses.asdict(paper),
            "targets": [dataclasses.asdict(t) for t in targets(rows)],
        }))  # fmt: skip
        return 0
    for line in lines:
        print(f"# {line}")
    print_rows(rows, "table", HEADERS)
    print(f"# {paper_line(paper)}")
    for line in target_lines(rows):
        print(f"# target: {line}")
    return 0
