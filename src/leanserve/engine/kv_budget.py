"""How many cache blocks a deployment gets: the paged pools (model/cache.py) sized by the cache budget.

`kv_cache_memory` is the bytes each stage may give its pools; a block costs each stage the compressed rows of
`kv_block_size` tokens in every one of its layers, so every stage holds the same number of blocks: what the
budget buys on the stage whose layers cost the most. The pools never hold more than max_num_seqs sequences of
max_model_len need (blocks past that could never be used), and never fewer than one such sequence needs (a
request the engine accepts must be able to finish alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.engine.config import EngineConfig
from leanserve.engine.topology import PipelineTopology
from leanserve.memory import KV_CACHE, StageMemory, format_bytes
from leanserve.model.backends import select_backend
from leanserve.model.cache import blocks_for, check_block_tokens, default_block_tokens
from leanserve.model.config import CSA, SLIDING, ConfigError, ModelConfig

# The default budget's cap: this share of the memory free when the engine starts.
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class KvPlan:
    block_tokens: int
    num_blocks: int
    block_bytes: tuple[int, ...]  # per stage: one block over the stage's layers
    budget: int | None  # bytes per stage the pools may take (None: nothing is paged, the model has no compressed layer)
    capped: bool  # the default budget was cut to DEFAULT_SHARE of the memory free

    @property
    def tokens(self) -> int:
        """Tokens the pools hold, over all sequences."""
        return self.num_blocks * self.block_tokens


def row_bytes(cfg: ModelConfig, layer_type: str, itemsize: int) -> int:
    """Bytes of one compressed row of a layer (its entry, and the indexer's key for CSA); 0 for a sliding layer."""
    if layer_type == SLIDING:
        return 0
    return (cfg.head_dim + (cfg.index_head_dim if layer_type == CSA else 0)) * itemsize


def block_bytes(cfg: ModelConfig, layer_types: list[str], block_tokens: int, itemsize: int) -> int:
    """Bytes one block takes over `layer_types`' layers."""
    return sum(block_tokens // cfg.compress_rate(k) * row_bytes(cfg, k, itemsize) for k in layer_types if k != SLIDING)


def stage_layer_types(cfg: ModelConfig, topology: PipelineTopology) -> list[list[str]]:
    return [
        list(cfg.layer_types[topology.layout(i).first_layer : topology.layout(i).end_layer])
        for i in range(topology.num_stages)
    ]


def cache_dtype(config: EngineConfig, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the stages' caches take (the backend's activation dtype)."""
    return select_backend(config.device, weight_dtype, config.backend).activation_dtype(weight_dtype)


def available_memory(device: str) -> int | None:
    """Bytes free on `device` now (the host's available memory for a CPU); None when unknown."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan_kv(
    cfg: ModelConfig,
    config: EngineConfig,
    topology: PipelineTopology,
    max_model_len: int,
    itemsize: int,
    available: int | None = None,
) -> KvPlan:
    """The pools' size for `config` (ConfigError naming the sizes when the budget holds less than one request of
    max_model_len). `available`: memory free now, capping the default budget (None: no cap)."""
    tokens = config.kv_block_size or default_block_tokens(cfg)
    try:
        check_block_tokens(cfg, tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per_seq = blocks_for(max_model_len, tokens)
    full = config.max_num_seqs * per_seq
    costs = tuple(block_bytes(cfg, kinds, tokens, itemsize) for kinds in stage_layer_types(cfg, topology))
    dearest = max(costs)
    if dearest == 0:  # only sliding-window layers: nothing grows with a sequence
        return KvPlan(tokens, full, costs, None, False)
    capped = False
    budget = config.kv_cache_memory
    if budget is None:
        budget = full * dearest
        if available is not None and budget > available * DEFAULT_SHARE:
            budget, capped = int(available * DEFAULT_SHARE), True
    num_blocks = min(budget // dearest, full)
    if num_blocks < per_seq:
        stage = costs.index(dearest)
        where = f" on stage {stage}" if len(costs) > 1 else ""
        source = "kv_cache_memory" if config.kv_cache_memory is not None else "the default cache budget"
        raise ConfigError(
            f"{source} ({format_bytes(budget)}) holds {num_blocks * tokens} tokens{where}, fewer than one request "
            f"of max_model_len ({max_model_len} tokens) needs ({format_bytes(per_seq * dearest)}); raise "
            f"kv_cache_memory or lower max_model_len."
        )
    return KvPlan(tokens, num_blocks, costs, budget, capped)


# --- what a plan says about the cache -------------------------------------------------------------------------
def window_bytes(stages: list[StageMemory]) -> int:
    """The bytes of the stages' trunk caches bounded by the window (per slot: not paged, not in the budget)."""
    return sum(
        e.bytes for s in stages for e in s.buffers
        if e.feature == KV_CACHE and not e.name.endswith(("_rows", "kv_block_table"))
    )  # fmt: skip


REQUEST_LENGTHS = (8192, 131072)  # request sizes a summary reports, with max_model_len


def kv_summary(cfg: ModelConfig, topology: PipelineTopology, kv: KvPlan, itemsize: int, max_model_len: int,
               max_num_seqs: int, window_bytes: int) -> dict:  # fmt: skip
    """The paged cache of a deployment as a dict: its blocks, the bytes a token takes per attention kind (over
    every stage), and how many requests of a few sizes the pools hold at once. `window_bytes`: the per-slot caches
    bounded by the window (every stage's), which the budget does not include."""
    kinds: dict[str, list[int]] = {}
    for k in cfg.layer_types[: sum(topology.layer_counts)]:
        if k != SLIDING:
            kinds.setdefault(k, [0, 0])
            kinds[k][0] += 1
            kinds[k][1] += row_bytes(cfg, k, itemsize)
    per_token = {k: {"layers": n, "bytes": b / cfg.compress_rate(k)} for k, (n, b) in kinds.items()}
    dearest = max(kv.block_bytes)
    requests = {}
    for length in sorted({*REQUEST_LENGTHS, max_model_len}):
        blocks = blocks_for(length, kv.block_tokens)
        requests[str(length)] = {
            "held": kv.num_blocks // blocks,
            "bytes_each": blocks * dearest,  # on the dearest stage
            f"bytes_for_{max_num_seqs}": max_num_seqs * blocks * sum(kv.block_bytes) + window_bytes,
        }
    return {
        "block_tokens": kv.block_tokens,
        "num_blocks": kv.num_blocks,
        "tokens": kv.tokens,
        "budget_bytes": kv.budget,
        "block_bytes": list(kv.block_bytes),
        "bytes_per_token": per_token,
        "window_bytes": window_bytes,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "requests": requests,
    }


def format_kv_summary(s: dict) -> str:
    head = f"paged cache: {s['num_blocks']} blocks of {s['block_tokens']} tokens ({s['tokens']:,} tokens)"
    if s["budget_bytes"] is None:
        head += ", nothing paged (no compressed layer)"
    else:
        pools = s["num_blocks"] * max(s["block_bytes"])
        head += f", {format_bytes(pools)} per stage of a {format_bytes(s['budget_bytes'])} budget"
        if pools + max(s["block_bytes"]) <= s["budget_bytes"]:
            head += f" (all {s['max_num_seqs']} slots' max_model_len fits)"
    lines = [head]
    kinds = [f"{k} ({v['layers']} layers) {v['bytes']:,.1f} B" for k, v in s["bytes_per_token"].items()]
    total = sum(v["bytes"] for v in s["bytes_per_token"].values())
    lines.append(f"  bytes per token, every stage: {', '.join(kinds) or 'none'}; {total:,.1f} B in all")
    n = s["max_num_seqs"]
    for length, r in s["requests"].items():
        need = r[f"bytes_for_{n}"]
        lines.append(
            f"  requests of {int(length):,} tokens: the pools hold {r['held']} at once; {n} of them need "
            f"{format_bytes(need)} (their blocks, and {format_bytes(s['window_bytes'])} of per-slot windows)"
        )
    return "\n".join(lines)
