"""`leanserve bench formats`: decode at real per-layer scale, the published format (FP8 linears, FP4 experts) vs
bf16, side by side in one run, with the weight bytes a token reads and the memory bandwidth that achieves.

The model is DeepSeek-V4-Flash's shipped config (configs/deepseek-v4-flash.json: hidden 4096, 64 heads of 512,
q_lora_rank 1024, 8 output groups of rank 1024, an indexer of 64 heads of 128, experts of 2048, top-6) with fewer
layers and experts: by default 2 layers, CSA (rate 4) then HCA (rate 128), as Flash's layers 2 and 3 (its layers
0-1 are sliding-window ones and 0-2 hash-routed), both routed top-k MoE, 64 experts; no MTP layer. The vocabulary is
chosen so that the head's share of a decode token's weight bytes (published format) is real Flash's, which a
2-layer model with Flash's 129280-token head would not have (the head would dominate); `--vocab-size` overrides.

The random bf16 checkpoint is written first, then quantized with leanserve's own quantizer, so both hold the same
model. Each loads into its own runner; decode steps (greedy, each sampled token fed back) alternate between the two
(which goes first alternating too); the medians are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leanserve.bench import peer
from leanserve.bench.common import GreedyDecoder, print_rows, stage_runner
from leanserve.bench.host import (
    BANDWIDTH_REPEATS,
    PAIRED_READ_GIB,
    ReadProbe,
    cores,
    decode_note,
    decode_rates,
    floor_note,
    floor_seconds,
    kernel_peak_gflops,
    memory_bandwidth,
    numba,
    share_of_reads_then,
    token_format_bytes,
)
from leanserve.bench.options import FLOAT32_INPUTS, add_inputs, add_output, add_threads, inputs_of, int_list
from leanserve.bench.peer import PEERS
from leanserve.bench.profile import PROFILE_HEADERS, profile_rows
from leanserve.model.config import CSA, HCA, MOE, ModelConfig

FLASH_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "deepseek-v4-flash.json"
FORMATS = ("bf16", "published")
SHORT_INPUTS = {"bfloat16": "bf16", "int8": "int8"}  # (the third row's name: the roundings its options ask for)
SHARD = 2 * 10**9  # bytes per safetensors shard written (safetensors copies a shard in memory as it writes)


@dataclass
class FormatRow:
    format: str
    batch_size: int
    step_ms: float
    tok_s: float
    mb_per_step: float  # the weight bytes a step reads (StepCost)
    gb_s: float  # mb_per_step / the step's time
    of_bandwidth: float  # gb_s / the measured memory bandwidth
    of_reads_then: float | None  # the median over the steps of gb_s / the mean of the reads just before and after
    of_floor: float | None  # batch 1: the host's floor for the step's reads (host.floor_seconds) / the step's time
    gflop_s: float  # the model's float32 arithmetic (StepCost) / the step's time
    of_compute: float  # gflop_s / the kernels' measured float32 peak
    bound: str  # the nearer limit: "bytes" or "arithmetic"
    vs_bf16: float  # tok/s / bf16's at the same batch


FORMAT_HEADERS = {
    "format": "format",
    "batch_size": "batch",
    "step_ms": "step ms",
    "tok_s": "tok/s",
    "mb_per_step": "MB/step",
    "gb_s": "GB/s",
    "of_bandwidth": "of bandwidth",
    "of_reads_then": "of read then",
    "of_floor": "of floor",
    "gflop_s": "GFLOP/s",
    "of_compute": "of compute",
    "bound": "near",
    "vs_bf16": "x bf16",
}


@dataclass(frozen=True)
class TokenBytes:
    """The weight bytes one decode token reads, at batch 1: every dense tensor of the blocks (attention, indexer,
    compressors, norms, mHC, router, shared expert) and the final norm / hc_head, the top-k routed experts of each
    MoE layer (k / E of the layer's expert bytes, scales included), the head, and one embedding row."""

    dense: int
    experts: int
    head: int
    embed_row: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.head + self.embed_row


def token_bytes(cfg: ModelConfig, published: bool) -> TokenBytes:
    """TokenBytes of `cfg` (plain weights: bf16) or of its published form (engine/costs.token_read_bytes)."""
    from leanserve.engine.costs import token_read_bytes
    from leanserve.quantize import quantized_config

    cfg = quantized_config(cfg) if published else dataclasses.replace(cfg, quantization=None)
    dense = experts = head = embed = 0
    for name, nbytes in token_read_bytes(cfg).items():
        if ".experts." in name:
            experts += nbytes
        elif name == "head.weight":
            head += nbytes
        elif name == "embed.weight" or name.endswith("tid2eid"):
            embed += nbytes
        else:
            dense += nbytes
    return TokenBytes(dense, experts, head, embed)


@dataclass(frozen=True)
class StepCost:
    """What a decode step of `batch` tokens (one per sequence, short contexts) costs in weights and arithmetic: the
    dense weights, the head and `batch` embedding rows once, and each MoE layer's distinct routed experts, expected
    under uniform routing (E * (1 - (1 - k/E)^batch) of E experts, top-k); the arithmetic is two float32 operations
    per weight a token multiplies (its top-k experts, not the union), the kernels' work whatever the format
    (FP8 and FP4 weights are decoded to float32 first)."""

    mb: float
    gflop: float


def step_cost(cfg: ModelConfig, published: bool, batch: int) -> StepCost:
    b, plain = token_bytes(cfg, published), token_bytes(cfg, False)
    k, experts = cfg.num_experts_per_tok, cfg.n_routed_experts
    distinct = experts * (1 - (1 - k / experts) ** batch)
    nbytes = b.dense + b.head + batch * b.embed_row + b.experts * distinct / k
    weights = (plain.dense + plain.experts + plain.head) / 2  # (bf16: two bytes a weight)
    return StepCost(nbytes / 1e6, 2 * weights * batch / 1e9)


def head_share(cfg: ModelConfig) -> float:
    """The head's share of a decode token's weight bytes in the published format."""
    b = token_bytes(cfg, published=True)
    return b.head / b.total


def bench_config(layers: int = 2, experts: int = 64, vocab_size: int | None = None, mtp: bool = False) -> ModelConfig:
    """Flash's shipped config with `layers` layers (CSA and HCA alternating, top-k MoE), `experts` routed experts,
    its MTP layer only with `mtp`, bf16; vocab_size None: matched_vocab's."""
    flash = ModelConfig.from_json_file(FLASH_CONFIG)
    cfg = dataclasses.replace(
        flash, num_hidden_layers=layers, layer_types=tuple(CSA if i % 2 == 0 else HCA for i in range(layers)),
        mlp_layer_types=(MOE,) * layers, n_routed_experts=experts, num_nextn_predict_layers=int(mtp), quantization=None,
        torch_dtype="bfloat16",
    )  # fmt: skip
    return dataclasses.replace(cfg, vocab_size=vocab_size or matched_vocab(cfg, head_share(flash)))


def matched_vocab(cfg: ModelConfig, share: float, multiple: int = 256) -> int:
    """The vocabulary (a multiple of `multiple`) that gives the head `share` of cfg's published token bytes."""
    b = token_bytes(cfg, published=True)
    row = b.head // cfg.vocab_size  # bytes per head row (bf16 in both formats)
    rest = b.total - b.head
    return max(multiple, round(share / (1 - share) * rest / row / multiple) * multiple)


def _same_model(model_dir: Path, cfg: ModelConfig) -> bool:
    from leanserve.model.loader import INDEX_FILE, SINGLE_FILE

    # (a write that stopped part-way leaves no index / single file: the weights are written after config.json)
    if not (model_dir / "config.json").is_file() or not any(
        (model_dir / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)
    ):
        return False
    have = ModelConfig.from_hf(model_dir)
    keys = (
        "vocab_size",
        "num_hidden_layers",
        "n_routed_experts",
        "layer_types",
        "hidden_size",
        "num_nextn_predict_layers",
    )
    return all(getattr(have, k) == getattr(cfg, k) for k in keys)


def make_checkpoints(root: Path, cfg: ModelConfig, seed: int = 0, log=print) -> dict[str, Path]:
    """root/bf16 (random bf16 weights) and root/published (that checkpoint through `leanserve quantize`); each
    reused when it holds cfg's model already."""
    from leanserve.make_random import randomize_
    from leanserve.model.build import build_model
    from leanserve.model.loader import save_checkpoint
    from leanserve.quantize import quantize_checkpoint

    dirs = {"bf16": root / "bf16", "published": root / "published"}
    if not _same_model(dirs["bf16"], cfg):
        log(f"writing the random bf16 checkpoint to {dirs['bf16']} ...")
        model = build_model(cfg, max_positions=1, dtype=torch.bfloat16, with_mtp=cfg.has_mtp)
        randomize_(model, seed, by_slice=True)
        save_checkpoint(model, dirs["bf16"], dtype=torch.bfloat16, max_shard_size=SHARD)
        del model
        (dirs["published"] / "config.json").unlink(missing_ok=True)  # (stale: remade from the new weights)
    if not _same_model(dirs["published"], cfg):
        log(f"quantizing it to the published format in {dirs['published']} ...")
        quantize_checkpoint(dirs["bf16"], dirs["published"], force=True, max_shard_size=SHARD)
    return dirs


PROBE_EVERY, PROBE_REPEATS = 5, 3  # among a batch size's timings: every 5 rounds, 3 reads of each kind


def formats_bench(
    root: str | Path,
    batch_sizes: list[int],
    layers: int = 2,
    experts: int = 64,
    vocab_size: int | None = None,
    rounds: int = 20,
    prompt_len: int = 16,
    seed: int = 0,
    log=print,
    profile: list | None = None,
    mtp: bool = False,
    inputs: dict[str, str] | None = None,
) -> tuple[list[FormatRow], list[str]]:
    """(rows, notes): decode tok/s of the published and bf16 checkpoints of bench_config's model at each batch
    size, with the batch-1 bytes per token, GB/s and share of the measured memory bandwidth: of the best read of
    the run, and of the reads just before and after each step (host.ReadProbe, between every two timed steps).
    `profile`, a list: the batch-1 step of the profiled row (profiled_row) kernel by kernel is appended to it
    (bench/profile.py), after the timings.
    `inputs` (EngineConfig's fp4_inputs / fp8_inputs) with a rounding: the published checkpoint also with those
    weights meeting their inputs so rounded (a third row, inputs_row, timed with the other two, and the one
    profiled)."""
    root = Path(root)
    cfg = bench_config(layers, experts, vocab_size, mtp)
    flash = ModelConfig.from_json_file(FLASH_CONFIG)
    dirs = make_checkpoints(root, cfg, seed, log)
    inputs = inputs or FLOAT32_INPUTS
    formats = rows_of(inputs)
    if len(formats) > len(FORMATS):
        dirs[inputs_row(inputs)] = dirs["published"]  # (the third row loads the published files again)
    sizes = {f: sum(p.stat().st_size for p in dirs[f].glob("*.safetensors")) for f in formats}
    available = _mem_available()
    # (loading both peaked at about 1.65x their files' bytes here: leave that much and some room)
    together = available is None or 1.8 * sum(sizes.values()) < available
    max_len = prompt_len + rounds + 8
    # The read is measured before, among and after the timings (the host's memory speed moves within minutes): the
    # best of each kind is kept, so a share is of the fastest read seen in the run.
    bws = [memory_bandwidth()]
    reads = BANDWIDTH_REPEATS
    peaks = [kernel_peak_gflops()]
    medians: dict[tuple[str, int], float] = {}
    probe = ReadProbe() if numba is not None else None  # (a read just before and after every timed step)
    then: dict[tuple[str, int], list[tuple[float, float, float]]] = {}  # (row, batch) -> (step, read before, after)
    runners, profiled_steps = {}, None  # (the profiled row's kernel totals, steps and mean step: _profile)
    for group in [formats] if together else [(f,) for f in formats]:  # all loaded, or one after the other
        runners = {f: stage_runner(dirs[f], max(batch_sizes), max_len, **_inputs_of_row(f, inputs)) for f in group}
        for batch in batch_sizes:
            decoders = {f: GreedyDecoder(r, batch, prompt_len) for f, r in runners.items()}
            for d in decoders.values():  # warm-up (compiles)
                d(), d()
            times: dict[str, list[float]] = {f: [] for f in group}
            before = probe() if probe else None
            for r in range(rounds):
                for f in group if r % 2 == 0 else group[::-1]:
                    times[f].append(decoders[f]())
                    if probe:
                        after = probe()
                        then.setdefault((f, batch), []).append((times[f][-1], before, after))
                        before = after
                if r % PROBE_EVERY == PROBE_EVERY - 1 and r < rounds - 1:  # (between rounds, untimed)
                    bws.append(memory_bandwidth(repeats=PROBE_REPEATS))
                    reads += PROBE_REPEATS
            medians |= {(f, batch): statistics.median(v) for f, v in times.items()}
            bws.append(memory_bandwidth())
            reads += BANDWIDTH_REPEATS
            peaks.append(kernel_peak_gflops())
        profiled = profiled_row(inputs)
        if profile is not None and profiled in runners:
            profiled_steps = _profile(runners[profiled], prompt_len, rounds)
        del runners
    bw = {k: max(b[k] for b in bws) for k in bws[0]}
    peak = max(peaks)
    rates, threads = decode_rates() if numba is not None else None, cores()
    decoding = decode_note(rates, bw["machine"] / threads) if rates else None
    per_token = {f: token_bytes(cfg, published=f == "published") for f in FORMATS}
    floors, read_alone = {}, {}  # (row -> the floor of a batch-1 step; its reads at the machine's read alone)
    for f in formats if rates else ():
        by_format = token_format_bytes(cfg, f != "bf16", **_inputs_of_row(f, inputs))
        floors[f] = floor_seconds(by_format, bw["machine"], threads, rates)
        read_alone[f] = sum(by_format.values()) / bw["machine"] / 1e9
    if profiled_steps is not None:
        floor = (lambda b: floor_seconds(b, bw["machine"], threads, rates)) if rates else None
        profile += profile_rows(*profiled_steps, floor)
    rows = []
    for batch in batch_sizes:
        for f in ("published", *formats[2:], "bf16"):
            step = medians[(f, batch)]
            cost = step_cost(cfg, f != "bf16", batch)
            gbs, gflops = cost.mb / step / 1e3, cost.gflop / step
            share, busy = gbs / bw["machine"], gflops / peak
            paired = then.get((f, batch))
            share_then = round(share_of_reads_then(cost.mb, paired), 3) if paired else None
            of_floor = round(floors[f] / step, 2) if batch == 1 and f in floors else None
            rows.append(
                FormatRow(f, batch, round(step * 1e3, 2), round(batch / step, 2), round(cost.mb, 1), round(gbs, 2),
                          round(share, 3), share_then, of_floor, round(gflops, 1), round(busy, 3),
                          "bytes" if share >= busy else "arithmetic",
                          round(medians[("bf16", batch)] / step, 2))
            )  # fmt: skip
    b, fb = per_token["published"], token_bytes(flash, published=True)
    paired_reads = [r for v in then.values() for _, before, after in v for r in (before, after)]
    notes = [
        f"model: DeepSeek-V4-Flash's per-layer shapes, {layers} layers ({', '.join(cfg.layer_types)}), "
        f"{experts} routed experts (top-{cfg.num_experts_per_tok}) + 1 shared, "
        f"{'an MTP layer (not run here)' if mtp else 'no MTP'}; vocabulary {cfg.vocab_size}",
        f"vocabulary: the head is {b.head / b.total:.1%} of a published token's bytes here, "
        f"{fb.head / fb.total:.1%} in real Flash (43 layers x {(fb.total - fb.head) / 43 / 1e6:.0f} MB + "
        f"a {fb.head / 1e9:.2f} GB head)" + ("" if vocab_size else ": vocabulary chosen to match"),
        "bytes/token (batch 1): "
        + "; ".join(
            f"{f} {t.total / 1e6:.1f} MB = dense {t.dense / 1e6:.1f} + routed experts {t.experts / 1e6:.1f} "
            f"+ head {t.head / 1e6:.1f} + embedding row"
            for f, t in per_token.items()
        ),
        f"memory bandwidth (best of {reads} reads of 1 GiB, before, among and after the timings): "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items() if k != "machine")
        + f"; shares are of {bw['machine']:.1f} GB/s"
        + (
            f"; 'of read then': each step against a two-thread read of {PAIRED_READ_GIB:g} GiB just before and after "
            f"it (the median over the steps; those reads {min(paired_reads):.1f}-{max(paired_reads):.1f} GB/s)"
            if paired_reads
            else ""
        ),
        f"arithmetic: two float32 operations per weight each token multiplies (FP8 / FP4 decoded first); the "
        f"kernels' float32 peak, best of {5 * len(peaks)} runs of 64 rows through a 4096 x 4096 linear: "
        f"{peak:.1f} GFLOP/s; bytes at batch > 1: the distinct routed experts expected under uniform routing",
        f"checkpoints: {', '.join(f'{f} {sizes[f] / 1e9:.2f} GB' for f in FORMATS)} in {root}; "
        + ("all loaded, steps interleaved" if together else "loaded one after the other (memory)")
        + f"; {rounds} steps per format and batch after 2 warm-up, medians; torch threads {torch.get_num_threads()}",
    ]
    if decoding:
        notes.append(decoding)
    if floors:
        notes.append(floor_note(floors, read_alone, threads))
    return rows, notes


def _inputs_of_row(row: str, inputs: dict[str, str]) -> dict[str, str]:
    """The fp4_inputs / fp8_inputs of a row's runner: the options asked for on their row (inputs_row), float32
    else."""
    return inputs if row == inputs_row(inputs) else FLOAT32_INPUTS


def inputs_row(inputs: dict[str, str]) -> str:
    """The name of the published checkpoint's row whose weights meet `inputs` (fp4_inputs / fp8_inputs), e.g.
    "published, bf16 inputs", or "published, int8/bf16 inputs" for FP4's int8 and FP8's bfloat16."""
    kinds = [SHORT_INPUTS[v] for v in inputs.values() if v != "float32"]
    return "published, " + "/".join(dict.fromkeys(kinds)) + " inputs"


def rows_of(inputs: dict[str, str] | None) -> tuple[str, ...]:
    """The rows the bench times: FORMATS, and inputs_row(inputs) where `inputs` (fp4_inputs / fp8_inputs) ask for
    a rounding."""
    return FORMATS + ((inputs_row(inputs),) if inputs and inputs != FLOAT32_INPUTS else ())


def profiled_row(inputs: dict[str, str] | None) -> str:
    """The row that `--profile` times kernel by kernel: the one with rounded inputs when there is one."""
    rows = rows_of(inputs)
    return rows[-1] if len(rows) > len(FORMATS) else "published"


def _profile(runner, prompt_len: int, rounds: int) -> tuple[dict, int, float]:
    """(the kernel profile's totals, the steps, the mean step in seconds) of `rounds` batch-1 steps."""
    from leanserve.bench.profile import kernel_profile

    decoder = GreedyDecoder(runner, 1, prompt_len)
    decoder(), decoder()  # (warm-up)
    with kernel_profile() as totals:
        total = sum(decoder() for _ in range(rounds))
    return dict(totals), rounds, total / rounds


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rows_json(rows: list[FormatRow], notes: list[str]) -> str:
    return json.dumps({"notes": notes, "rows": [dataclasses.asdict(r) for r in rows]})


HELP = "decode at DeepSeek-V4-Flash's per-layer scale: the published format vs bf16, side by side"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="build/bench-formats", help="where the two checkpoints are made (or reused)")
    p.add_argument("--layers", type=int, default=2, help="layers (CSA and HCA alternating)")
    p.add_argument("--experts", type=int, default=64, help="routed experts per layer (top-6)")
    p.add_argument(
        "--vocab-size", type=int, default=None, help="default: the head's share of a token's bytes as in real Flash"
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument("--rounds", type=int, default=20, help="decode steps per format and batch size")
    p.add_argument(
        "--profile", action="store_true", help="also: the published format's batch-1 step (the third row's with "
        "--fp4-inputs / --fp8-inputs), kernel by kernel"
    )  # fmt: skip
    p.add_argument("--mtp", action="store_true", help="give the model Flash's MTP layer (for bench spec-cost --model)")
    p.add_argument("--peer", choices=PEERS, default=None, help="also: a peer engine's batch-1 decode (bench/peer.py)")
    p.add_argument("--peer-converter", default=None, help="--peer llama.cpp: its convert_hf_to_gguf.py (or its dir)")
    add_inputs(p, "a third row, the one --profile and --peer run")
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if min(args.layers, args.experts, args.rounds, args.vocab_size or 1) < 1:
        raise ValueError("--layers, --experts, --rounds and --vocab-size must be positive.")
    log = print if args.output == "table" else (lambda *a: None)
    profile = [] if args.profile else None
    converter = peer.require(args.peer_converter) if args.peer else None  # (before any long work)
    rows, notes = formats_bench(
        args.dir, args.batch_sizes, args.layers, args.experts, args.vocab_size, args.rounds, log=log, profile=profile,
        mtp=args.mtp, inputs=inputs_of(args),
    )  # fmt: skip
    peer_rows, peer_notes = (
        peer.peer_bench(args.dir, converter, args.rounds, log=log, inputs=inputs_of(args)) if converter else ([], [])
    )
    if args.output == "json":
        out = json.loads(rows_json(rows, notes))
        if profile is not None:
            out["profile"] = [asdict(r) for r in profile]
        if converter:
            out["peer"] = {"notes": peer_notes, "rows": [asdict(r) for r in peer_rows]}
        print(json.dumps(out))
    else:
        for line in notes:
            print(f"# {line}")
        print_rows(rows, args.output, FORMAT_HEADERS)
        if profile:
            print(
                f"# the batch-1 step of '{profiled_row(inputs_of(args))}', kernel by kernel (wall-clock time of each call)"
            )
            print_rows(profile, "table", PROFILE_HEADERS)
        if converter:
            print(f"# the peer, {args.peer}: batch-1 decode of the same published checkpoint")
            for line in peer_notes:
                print(f"# {line}")
            print_rows(peer_rows, "table", peer.PEER_HEADERS)
    return 0
