"""`leanserve bench throughput`: offline output tokens/s of leanserve and of transformers' `generate` on the
same checkpoint, prompts and greedy workload, side by side in one run, with the ratio.

Each batch size runs both engines on identical prompts (equal length, so transformers needs no padding),
alternating which goes first over `--repeats` rounds; the median round is reported. Greedy tokens of the two
engines are compared as a check that the work is the same.

Each dtype loads both engines in it. In bfloat16, transformers rounds every activation to bfloat16, while
leanserve on the CPU keeps the weights in bfloat16 and computes in float32 (deepseek_v4.activation_dtype):
its tokens are then its float32 tokens, and may differ from transformers' bfloat16 ones.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class ThroughputRow:
    dtype: str
    batch_size: int
    leanserve_tok_s: float
    transformers_tok_s: float
    speedup: float
    identical_sequences: int


def _prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def throughput(
    model: str,
    batch_sizes: list[int],
    prompt_len: int = 64,
    max_tokens: int = 32,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    repeats: int = 3,
    seed: int = 0,
) -> list[ThroughputRow]:
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        raise ValueError("bench throughput needs transformers (pip install 'transformers>=5.24').") from None
    rows = []
    for dtype in dtypes:
        rows += _throughput(model, batch_sizes, prompt_len, max_tokens, dtype, repeats, seed)
    return rows


def _throughput(
    model: str, batch_sizes: list[int], prompt_len: int, max_tokens: int, dtype: str, repeats: int, seed: int
) -> list[ThroughputRow]:
    from transformers import DeepseekV4ForCausalLM

    from leanserve import LLM, SamplingParams

    torch_dtype = getattr(torch, dtype)
    hf = DeepseekV4ForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    hf.generation_config.eos_token_id = None  # both engines generate exactly max_tokens
    llm = LLM(
        model,
        dtype=dtype,
        max_model_len=prompt_len + max_tokens,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(2048, max(batch_sizes) * prompt_len),
        load_progress=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size

    def run_hf(ids: torch.Tensor) -> tuple[float, list[list[int]]]:
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()

    def run_lean(ids: torch.Tensor) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": row} for row in ids.tolist()], params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    warm = _prompts(1, prompt_len, vocab, seed + 999)
    run_hf(warm)
    run_lean(warm)
    rows = []
    for batch in batch_sizes:
        ids = _prompts(batch, prompt_len, vocab, seed + batch)
        lean_times, hf_times = [], []
        for r in range(repeats):
            order = (run_lean, run_hf) if r % 2 == 0 else (run_hf, run_lean)
            for fn in order:
                dt, tokens = fn(ids)
                (lean_times if fn is run_lean else hf_times).append(dt)
                if fn is run_lean:
                    lean_tokens = tokens
                else:
                    hf_tokens = tokens
        lean_tps = batch * max_tokens / statistics.median(lean_times)
        hf_tps = batch * max_tokens / statistics.median(hf_times)
        same = sum(a == b for a, b in zip(lean_tokens, hf_tokens, strict=True))
        speedup = round(lean_tps / hf_tps, 2)
        rows.append(ThroughputRow(dtype, batch, round(lean_tps, 1), round(hf_tps, 1), speedup, same))
    llm.shutdown()
    return rows


def print_rows(rows: list, output: str, headers: dict[str, str] | None = None) -> None:
    """Rows of one dataclass as JSON, or as a table with `headers` (field -> column title; all fields if None)."""
    dicts = [asdict(r) for r in rows]
    if output == "json":
        print(json.dumps(dicts))
        return
    if not dicts:
        return
    headers = headers or {k: k for k in dicts[0]}
    cells = [[_cell(d[k]) for k in headers] for d in dicts]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers.values())]
    print("  ".join(h.rjust(w) for h, w in zip(headers.values(), widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


THROUGHPUT_HEADERS = {
    "dtype": "dtype",
    "batch_size": "batch",
    "leanserve_tok_s": "leanserve tok/s",
    "transformers_tok_s": "transformers tok/s",
    "speedup": "speedup",
    "identical_sequences": "same tokens",
}


# --- bench copy: the target-hidden copy the seed measured ----------------------------------------------
PRO_HC_DIM = 4 * 7168  # DeepSeek-V4-Pro: hc_mult * hidden_size
COPY_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


@dataclass
class CopyRow:
    tokens: int
    bytes: int
    latency_us: float
    gbps: float
    peak_gbps: float


def _timer(device: torch.device):
    """fn, repeats -> median seconds per call (CUDA: timed with events after a synchronize)."""

    def median_s(fn, repeats: int) -> float:
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            return statistics.median(times)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median_s


def copy_bench(
    device: str = "cpu",
    dtype: str = "bfloat16",
    hc_dim: int = PRO_HC_DIM,
    tokens: tuple[int, ...] = COPY_TOKENS,
    repeats: int = 20,
) -> list[CopyRow]:
    """Latency of copying `tokens` rows of pre-hc_head streams [T, hc_dim] into a preallocated
    [max(tokens), hc_dim] buffer (what the last stage does each step when the buffer exists), beside the
    device's peak copy bandwidth (the best of a few copies of the largest size)."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    most = max(tokens)
    src = torch.randn(most, hc_dim, device=dev).to(dt)
    buffer = torch.empty(most, hc_dim, device=dev, dtype=dt)
    median_s = _timer(dev)
    peak = max(src.numel() * src.element_size() / median_s(lambda: buffer.copy_(src), 3) for _ in range(3)) / 1e9
    rows = []
    for t in tokens:
        nbytes = t * hc_dim * src.element_size()
        reps = max(3, min(repeats * 50, int(2e9 / max(nbytes, 1))))  # many repeats for small copies
        secs = median_s(lambda t=t: buffer[:t].copy_(src[:t]), min(reps, 2000))
        rows.append(CopyRow(t, nbytes, round(secs * 1e6, 2), round(nbytes / secs / 1e9, 2), round(peak, 2)))
    return rows


COPY_HEADERS = {
    "tokens": "tokens",
    "bytes": "bytes",
    "latency_us": "latency us",
    "gbps": "GB/s",
    "peak_gbps": "peak GB/s",
}


# --- bench step: one decode step with the target-hidden buffer on vs off ---------------------------------
@dataclass
class StepRow:
    batch_size: int
    off_us: float
    on_us: float
    copy_us: float
    ratio: float
    buffer_bytes: int


def step_bench(
    model: str, batch_sizes: list[int], max_num_batched_tokens: int = 8192, repeats: int = 50, prompt_len: int = 16
) -> list[StepRow]:
    """Times one decode step of the model's last stage with the target-hidden buffer present (MTP on: the
    forward copies the pre-hc_head streams into it) and absent, alternating on the same caches."""
    from leanserve.engine.runner import SampleSpec, StepPlan
    from leanserve.model.batch import Chunk
    from leanserve.sampling_params import SamplingParams

    most = max(batch_sizes)
    runner = _mtp_runner(model, most, prompt_len + repeats + 8, max(max_num_batched_tokens, most * prompt_len))
    runner.proposer = None  # time the trunk step alone: the two arms differ only by the copy
    buffer = runner.target_hidden
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for batch in batch_sizes:
        prefill = tuple(Chunk(s, 0, tuple(range(3, 3 + prompt_len))) for s in range(batch))
        runner.execute(StepPlan(prefill, (), ()))

        def decode(on: bool, position: int, batch: int = batch) -> float:
            runner.target_hidden = buffer if on else None
            chunks = tuple(Chunk(s, position, (5,)) for s in range(batch))
            plan = StepPlan(chunks, tuple(range(batch)), tuple(SampleSpec(s, greedy, 0, 0) for s in range(batch)))
            start = time.perf_counter()
            runner.execute(plan)
            return time.perf_counter() - start

        decode(True, prompt_len), decode(False, prompt_len)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats):
            # Both arms decode at the same position (the second rewrites the first's: a rollback by one), so
            # they do identical work apart from the copy; which goes first alternates.
            for on in (True, False) if r % 2 else (False, True):
                times[on].append(decode(on, prompt_len + r))
        off, on = statistics.median(times[False]) * 1e6, statistics.median(times[True]) * 1e6
        # The copy's cost: the median of the per-position differences, robust to drift over the run.
        diff = statistics.median(a - b for a, b in zip(times[True], times[False], strict=True)) * 1e6
        rows.append(StepRow(batch, round(off, 1), round(on, 1), round(diff, 1), round(on / off, 3), buffer.nbytes))
    runner.target_hidden = buffer
    return rows


def _mtp_runner(model: str, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, dtype: str = "auto"):
    """A one-stage runner of `model` with the MTP drafter (k = 1), for timing its parts directly."""
    from leanserve.config import EngineConfig, ModelConfig
    from leanserve.engine.llm_engine import check_speculative, resolve_dtype
    from leanserve.engine.runner import StageRunner
    from leanserve.engine.topology import PipelineTopology

    cfg = ModelConfig.from_hf(model)
    config = EngineConfig(
        model, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )  # fmt: skip
    check_speculative(config.speculative_config, cfg, model)
    return StageRunner(
        cfg, config, PipelineTopology.build(cfg, 1).layout(0), resolve_dtype(dtype, model),
        config.resolved_max_model_len(cfg), progress=False,
    )  # fmt: skip


STEP_HEADERS = {
    "batch_size": "batch",
    "off_us": "buffer off us",
    "on_us": "buffer on us",
    "copy_us": "paired diff us",
    "ratio": "on/off",
    "buffer_bytes": "buffer bytes",
}


# --- bench spec: speculative decoding vs none, on held-out code --------------------------------------------
SPEC_CONFIGS: dict[str, dict | None] = {
    "none": None,
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


@dataclass
class SpecRow:
    batch_size: int
    method: str
    tok_s: float
    speedup: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    # What a speculative step costs in plain decode steps: mean accepted length / speedup (the prefill, the
    # same for every method, counts in both, so this slightly understates it).
    step_cost: float | None
    same_tokens: str


def code_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts from held-out code (the Python standard library's held-out files, which the shipped model
    never trained on): each starts at a top-level `def` line and is cut to `prompt_tokens` tokens."""
    from leanserve.train.data import default_corpus_dir, find_py_files, is_heldout

    prompts = []
    for rel, path in find_py_files(default_corpus_dir()):
        if not is_heldout(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        start = text.find("\ndef ")
        while start >= 0:  # every top-level function of the file, in order
            ids = tokenizer.encode(text[start + 1 : start + 1 + 40 * prompt_tokens])[:prompt_tokens]
            if len(ids) == prompt_tokens:
                prompts.append(ids)
            if len(prompts) == count:
                return prompts
            start = text.find("\ndef ", start + 1)
    raise ValueError(f"found only {len(prompts)} held-out code prompts of {prompt_tokens} tokens")


def spec_bench(
    model: str,
    batch_sizes: list[int],
    max_tokens: int = 64,
    prompt_tokens: int = 48,
    repeats: int = 3,
    dtype: str = "float32",
    configs: dict[str, dict | None] | None = None,
) -> list[SpecRow]:
    """Greedy output tokens/s of each speculative method against none, on the same held-out code prompts,
    alternating the order of the methods over `repeats` rounds (median round), with the acceptance figures
    and how many sequences came out identical to no speculation."""
    from leanserve import LLM, SamplingParams

    configs = configs or SPEC_CONFIGS
    engines = {
        name: LLM(model, dtype=dtype, max_num_seqs=max(batch_sizes), load_progress=False, speculative_config=c)
        for name, c in configs.items()
    }
    first = next(iter(engines.values()))
    if first.get_tokenizer() is None:
        raise ValueError(f"{model} has no tokenizer.json; bench spec prompts with held-out code text.")
    prompts = code_prompts(first.get_tokenizer(), max(batch_sizes) + 1, prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate({"prompt_token_ids": prompts[-1]}, params)
    rows = []
    for batch in batch_sizes:
        batch_prompts = [{"prompt_token_ids": p} for p in prompts[:batch]]
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        accepted = {}
        for r in range(repeats):
            names = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in names:
                llm = engines[name]
                before = llm.spec_decode_metrics()
                start = time.perf_counter()
                outs = llm.generate(batch_prompts, params)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
                after = llm.spec_decode_metrics()
                prev = accepted.get(name, (0, 0, 0))
                accepted[name] = (
                    prev[0] + after["num_accepted_tokens"] - before["num_accepted_tokens"],
                    prev[1] + after["num_draft_tokens"] - before["num_draft_tokens"],
                    prev[2] + after["num_drafts"] - before["num_drafts"],
                )
        base = batch * max_tokens / statistics.median(times["none"])
        for name in engines:
            tps = batch * max_tokens / statistics.median(times[name])
            acc, drafted, drafts = accepted[name]
            same = sum(a == b for a, b in zip(tokens[name], tokens["none"], strict=True))
            length = 1 + acc / drafts if drafts else None
            rows.append(
                SpecRow(
                    batch, name, round(tps, 1), round(tps / base, 2),
                    round(acc / drafted, 3) if drafted else None, round(length, 2) if length else None,
                    round(length * base / tps, 2) if length else None, f"{same}/{batch}",
                )
            )  # fmt: skip
    for llm in engines.values():
        llm.shutdown()
    return rows


SPEC_HEADERS = {
    "batch_size": "batch",
    "method": "method",
    "tok_s": "tok/s",
    "speedup": "vs none",
    "acceptance_rate": "acceptance",
    "mean_acceptance_length": "mean accepted len",
    "step_cost": "step cost (plain steps)",
    "same_tokens": "same tokens",
}


# --- bench spec-cost: what a one-token MTP step costs, in plain decode steps -------------------------------
@dataclass
class SpecCostRow:
    batch_size: int
    plain_ms: float  # a plain decode step: the trunk over one token per sequence, the head, sampling
    verify: float  # the trunk over two tokens per sequence (the token and its draft) and verification, x plain
    propose_rejected: float  # the MTP layer's proposal after a rejected draft (over one position), x plain
    propose_accepted: float  # ... after an accepted draft (over two positions), x plain
    step_all_accepted: float  # verify + propose_accepted: a speculative step when every draft is accepted
    ceiling: float  # 2 / step_all_accepted: the speed-up of k = 1 if every draft were accepted


def spec_cost_bench(
    model: str, batch_sizes: list[int], repeats: int = 50, prompt_len: int = 32, dtype: str = "float32"
) -> list[SpecCostRow]:
    """Times the parts of a one-token MTP speculative step against a plain decode step on the same caches,
    interleaved at the same positions (each arm rewrites the last one's: a rollback), medians over `repeats`.
    A step yields at most 2 tokens, so 2 / (its cost in plain steps) bounds MTP k = 1's speed-up."""
    from leanserve.engine.proposers import ProposeItem
    from leanserve.engine.runner import SampleSpec, StepPlan
    from leanserve.model.batch import Chunk
    from leanserve.sampling_params import SamplingParams

    most = max(batch_sizes)
    runner = _mtp_runner(model, most, prompt_len + repeats + 8, max(2048, most * prompt_len), dtype)
    proposer, buffer = runner.proposer, runner.target_hidden
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    rows = []
    for batch in batch_sizes:
        prefill = tuple(Chunk(s, 0, tuple(range(3, 3 + prompt_len))) for s in range(batch))
        runner.proposer = None
        runner.execute(StepPlan(prefill, (), (), (5,) * batch))

        def trunk(position: int, drafts: int, batch: int = batch) -> float:
            runner.proposer, runner.target_hidden = None, buffer if drafts else None
            chunks = tuple(Chunk(s, position, (5,) * (1 + drafts)) for s in range(batch))
            samples = tuple(SampleSpec(s, greedy, 0, 0, s, (5,) * drafts) for s in range(batch))
            plan = StepPlan(chunks, tuple(range(batch * (1 + drafts))), samples, (-1,) * batch)
            start = time.perf_counter()
            runner.execute(plan)
            return time.perf_counter() - start

        def propose(position: int, accepted: bool, batch: int = batch) -> float:
            # After a verify step at `position`: catch up over 1 (rejected) or 2 (accepted) positions, then draft.
            known = (5, 5, 7) if accepted else (5, 7)
            items = [ProposeItem(s, position, known, 2 * s, s, greedy, 1, 1) for s in range(batch)]
            start = time.perf_counter()
            proposer.propose(items, dict.fromkeys(range(batch), 0))
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"plain": [], "verify": [], "rejected": [], "accepted": []}
        for r in range(repeats + 2):
            position = prompt_len + r
            for name, drafts in (("plain", 0), ("verify", 1)) if r % 2 else (("verify", 1), ("plain", 0)):
                times[name].append(trunk(position, drafts))
            # the proposals read the verify step's streams (any order of the two)
            for name in ("rejected", "accepted") if r % 2 else ("accepted", "rejected"):
                times[name].append(propose(position, name == "accepted"))
        med = {k: statistics.median(v[2:]) for k, v in times.items()}  # (the first two rounds warm up)
        plain = med["plain"]
        step = (med["verify"] + med["accepted"]) / plain
        rows.append(
            SpecCostRow(
                batch, round(plain * 1e3, 3), round(med["verify"] / plain, 2), round(med["rejected"] / plain, 2),
                round(med["accepted"] / plain, 2), round(step, 2), round(2 / step, 2),
            )
        )  # fmt: skip
    runner.proposer, runner.target_hidden = proposer, buffer
    return rows


SPEC_COST_HEADERS = {
    "batch_size": "batch",
    "plain_ms": "plain step ms",
    "verify": "verify (x plain)",
    "propose_rejected": "MTP after reject",
    "propose_accepted": "MTP after accept",
    "step_all_accepted": "k=1 step, all accepted",
    "ceiling": "k=1 ceiling",
}


# --- bench serve: a bounded loopback load generator against a real server process ------------------------
@dataclass
class ServeRow:
    concurrency: int
    requests: int
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def serve_bench(
    model: str,
    concurrencies: list[int],
    requests_per_level: int = 32,
    max_tokens: int = 32,
    prompt_tokens: int = 48,
    server_args: list[str] | None = None,
) -> list[ServeRow]:
    """Starts `leanserve serve` on a free loopback port, then for each concurrency c keeps c streaming
    completions in flight until `max(requests_per_level, c)` have finished; reports requests/s, output
    tokens/s, time to first token and inter-token latency (p50, p99). Everything is bounded in count."""
    try:
        import httpx
    except ImportError:
        raise ValueError("bench serve needs httpx (pip install httpx).") from None
    import asyncio
    import subprocess
    import sys

    from leanserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    if tokenizer is None:
        raise ValueError(f"{model} has no tokenizer.json; bench serve prompts with held-out code text.")
    most = max(max(concurrencies), requests_per_level)
    prompts = code_prompts(tokenizer, min(most, 64), prompt_tokens)
    cmd = [sys.executable, "-m", "leanserve.cli", "--log-level", "warning", "serve", "--model", model, "--port", "0"]
    cmd += ["--max-num-seqs", str(max(concurrencies)), *(server_args or [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stderr:
            if "serving" in line:
                url = line.strip().rsplit(" ", 1)[1]  # http://127.0.0.1:PORT/v1
                break
        if url is None:
            raise ValueError(f"the server did not start (exit code {proc.poll()})")
        name = model

        async def one(client, prompt, ttfts, itls) -> int:
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            start = last = time.perf_counter()
            tokens = 0
            async with client.stream("POST", url + "/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if tokens == 0:
                        ttfts.append(now - start)
                    else:
                        itls.append(now - last)
                    last = now
                    tokens += 1
            return tokens

        async def level(c: int) -> ServeRow:
            n = max(requests_per_level, c)
            ttfts, itls = [], []
            queue = list(range(n))
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c)) as client:

                async def worker() -> int:
                    done = 0
                    while queue:
                        i = queue.pop()
                        done += await one(client, prompts[i % len(prompts)], ttfts, itls)
                    return done

                await one(client, prompts[0], [], [])  # warm-up
                start = time.perf_counter()
                counts = await asyncio.gather(*(worker() for _ in range(c)))
                elapsed = time.perf_counter() - start
            return ServeRow(
                c, n, round(n / elapsed, 2), round(sum(counts) / elapsed, 1),
                round(1000 * _percentile(ttfts, 50), 1), round(1000 * _percentile(ttfts, 99), 1),
                round(1000 * _percentile(itls, 50), 1), round(1000 * _percentile(itls, 99), 1),
            )  # fmt: skip

        return [asyncio.run(level(c)) for c in concurrencies]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


SERVE_HEADERS = {
    "concurrency": "concurrency",
    "requests": "requests",
    "req_s": "req/s",
    "output_tok_s": "output tok/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
}
