"""`leanserve memory --plan`: the memory ledger at real scale without weights or allocation.

Each stage is built exactly as the engine builds it, on the meta device, so the plan is the engine's own
ledger (same code, same buffers), not a separate estimate. Weights are counted as stored: the shipped configs
carry the published quantization (FP8 linears, FP4 routed experts, with their UE8M0 scales), so the plan's
weight bytes are the checkpoint's; the planned dtype is that of the activations, caches and unquantized
weights (embedding, head, norms, router, compressors).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from leanserve.engine.config import EngineConfig
from leanserve.engine.kv_budget import kv_summary, plan_kv, window_bytes
from leanserve.engine.llm_engine import check_speculative
from leanserve.engine.runner import StageRunner
from leanserve.engine.topology import PipelineTopology
from leanserve.memory import StageMemory
from leanserve.model.config import ConfigError, ModelConfig

SHIPPED_CONFIGS = ("deepseek-v4-flash", "deepseek-v4-pro")


def load_config(source: str) -> ModelConfig:
    """A shipped config's name, a config.json path, or a model directory."""
    if source in SHIPPED_CONFIGS:
        text = (resources.files("leanserve") / "configs" / f"{source}.json").read_text()
        return ModelConfig.from_dict(json.loads(text), source=source)
    path = Path(source)
    if path.is_dir():
        return ModelConfig.from_hf(path)
    if not path.is_file():
        raise ConfigError(f"{source!r} is neither a shipped config ({', '.join(SHIPPED_CONFIGS)}) nor a file.")
    return ModelConfig.from_json_file(path)


def plan_memory(source: str, dtype: str = "bfloat16", **engine_kwargs) -> list[StageMemory]:
    """The per-stage ledger for `source` under the engine options in engine_kwargs (EngineConfig's fields:
    pipeline_parallel_size, pipeline_layer_counts, speculative_config, max_model_len, max_num_seqs,
    max_num_batched_tokens, kv_cache_memory, kv_block_size)."""
    return plan_deployment(source, dtype, **engine_kwargs)[0]


def plan_deployment(source: str, dtype: str = "bfloat16", **engine_kwargs) -> tuple[list[StageMemory], dict]:
    """plan_memory's ledger and the paged cache's summary (engine/kv_budget.py: kv_summary). The default cache
    budget is planned without the cap by this machine's free memory (the plan is for another machine)."""
    cfg = load_config(source)
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if v is not None}
    config = EngineConfig(model=source, dtype=dtype, **engine_kwargs)
    topology = PipelineTopology.build(cfg, config.pipeline_parallel_size, config.pipeline_layer_counts)
    check_speculative(config.speculative_config, cfg, source, weights=False)
    torch_dtype = getattr(torch, cfg.torch_dtype if dtype == "auto" else dtype)
    max_len = config.resolved_max_model_len(cfg)
    itemsize = torch_dtype.itemsize  # (the planned caches' dtype: the meta stages allocate them in it)
    kv = plan_kv(cfg, config, topology, max_len, itemsize)
    stages = [
        StageRunner(
            cfg, config, topology.layout(i), torch_dtype, max_len, device="meta", num_blocks=kv.num_blocks
        ).memory
        for i in range(topology.num_stages)
    ]
    summary = kv_summary(cfg, topology, kv, itemsize, max_len, config.max_num_seqs, window_bytes(stages))
    return stages, summary
