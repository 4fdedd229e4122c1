"""The small model's architecture and its initialisation: the default shipped config (every attention kind and
both MoE kinds), the layer pattern, the checks the batched training forward needs, and a trainable init."""

from __future__ import annotations

import math
from typing import Any

import torch

from leanserve.model.build import build_model
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig, RopeConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.layers import RMSNorm
from train import data as data_mod

# The default shipped model (models/dsv4-stdlib-12l): 12 blocks, so that the MTP layer is one block of 13 as
# in DeepSeek-V4 it is one of 44; every attention kind and both MoE kinds, windows and compression rates small
# enough that a 512-token context crosses many boundaries, and an indexer that keeps 16 of the 128 CSA rows.
DEFAULT_MODEL: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=192,
    moe_intermediate_size=64,
    num_hidden_layers=12,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=96,
    o_groups=2,
    o_lora_rank=96,
    n_routed_experts=8,
    num_experts_per_tok=2,
    hc_mult=4,
    sliding_window=64,
    compress_rate_csa=4,
    compress_rate_hca=16,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
)


def layer_pattern(num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Attention kinds: sliding first (two layers from 6 on, as DeepSeek-V4 starts), then CSA / HCA alternating;
    MoE: a hash layer first, then top-k."""
    if num_layers < 3:
        raise ConfigError(
            f"num_hidden_layers must be >= 3 so that every attention kind (sliding, CSA, HCA) is trained, got {num_layers}."
        )
    sliding = 2 if num_layers >= 6 else 1
    attn = tuple([SLIDING] * sliding + [CSA if i % 2 == 0 else HCA for i in range(num_layers - sliding)])
    mlp = tuple([HASH_MOE] + [MOE] * (num_layers - 1))
    return attn, mlp


def model_config(**overrides: Any) -> ModelConfig:
    """DEFAULT_MODEL with `overrides`; ModelConfig's own validation names any field that does not fit."""
    fields_ = {**DEFAULT_MODEL, **overrides}
    n = fields_["num_hidden_layers"]
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigError(f"num_hidden_layers must be an integer, got {n!r}.")
    attn, mlp = layer_pattern(n)
    fields_.setdefault("layer_types", attn)
    fields_.setdefault("mlp_layer_types", mlp)
    fields_.setdefault("compress_rope", RopeConfig(theta=160000.0))
    fields_.update(
        bos_token_id=data_mod.BOS_ID,
        eos_token_ids=(data_mod.EOS_ID,),
        pad_token_id=data_mod.PAD_ID,
        torch_dtype="bfloat16",
    )
    try:
        return ModelConfig(**fields_)
    except TypeError as e:
        raise ConfigError(f"Bad model field: {e}.") from None


def check_trainable(cfg: ModelConfig, seq_len: int) -> None:
    """What the batched training forward needs beyond ModelConfig's own validation."""
    if cfg.num_nextn_predict_layers != 1:
        raise ConfigError(
            f"Training supports exactly one MTP layer, got num_nextn_predict_layers={cfg.num_nextn_predict_layers}."
        )
    if seq_len < 8:
        raise ConfigError(f"seq_len must be at least 8, got {seq_len}.")
    if seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"seq_len ({seq_len}) exceeds max_position_embeddings ({cfg.max_position_embeddings}).")
    if seq_len < cfg.compress_rate_hca:
        raise ConfigError(
            f"seq_len ({seq_len}) is shorter than one HCA window ({cfg.compress_rate_hca}); HCA would never be trained."
        )


def parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = DeepseekV4(cfg, max_positions=1, with_mtp=cfg.has_mtp)
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_weights_(model: DeepseekV4, seed: int) -> DeepseekV4:
    """A trainable init (GPT-2-like): projections N(0, 0.02), the projections writing into the residual
    scaled by 1/sqrt(2 * blocks), norms 1, mHC as transformers initialises it (fn N(0, 0.02), base 0,
    scale 1), sinks / ape / router biases 0, hash routing: distinct random experts per token id."""
    gen = torch.Generator().manual_seed(seed)
    std = model.cfg.initializer_range
    blocks = model.cfg.num_hidden_layers + model.cfg.num_nextn_predict_layers
    residual_std = std / math.sqrt(2 * blocks)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in norms or leaf.endswith("_scale"):
            p.fill_(1.0)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
            p.zero_()
        else:
            out_proj = name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight", "experts.w2"))
            p.copy_(torch.randn(p.shape, generator=gen) * (residual_std if out_proj else std))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.cfg.n_routed_experts
            buf.copy_(torch.rand(buf.shape[0], experts, generator=gen).argsort(dim=-1)[:, : buf.shape[1]])
    return model


def new_model(cfg: ModelConfig, seq_len: int, seed: int) -> DeepseekV4:
    model = build_model(
        cfg, max_positions=seq_len, dtype=torch.float32, with_mtp=True, backend="torch"
    )  # (training: the torch statement, under autograd)
    init_weights_(model, seed)
    for name, p in model.named_parameters():
        # the router's correction bias is set by the balancing rule, not by gradients
        p.requires_grad_(not name.endswith("gate.bias"))
    return model
