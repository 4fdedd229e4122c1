"""DeepSeek-V4 MoE: routed experts (top-k by score + correction bias, or a frozen token-id hash table on
hash layers), a shared expert, SwiGLU with clamped pre-activations, routed_scaling_factor.

This module holds the parameters; the math is torch_math/moe.py. Routed tokens are grouped by expert (no
per-token loop) and run through the stage's backend (`experts`: one matmul per expert in torch; on the CPU a
grouped or padded batched matmul, and a decode-sized step's whole MoE as one compiled call).
"""

from __future__ import annotations

import torch
from torch import nn

from leanserve.model.config import HASH_MOE, ModelConfig
from leanserve.model.layers import Linear, UsesBackend, fp32_param
from leanserve.model.quant import FP4_GROUP, FP8_BLOCK, Fp4Weight, Fp8Experts
from leanserve.model.weights import MoEWeights


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.is_hash, self.top_k = is_hash, cfg.num_experts_per_tok
        self.scoring_func, self.scale = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:  # token id -> its experts, fixed at training time
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:  # correction bias: shifts the selection only, not the weights
            self.bias = fp32_param(cfg.n_routed_experts)


class Experts(nn.Module):
    """Stacked per-expert weights; the checkpoint's experts.E.w1/w3 fill w13 rows [0, I) / [I, 2I). A published
    checkpoint's stay as stored (quant.py): FP4 packed two per byte with a scale per 32 inputs (`w13_scale`,
    `w2_scale`), or block-scaled FP8 (the w1 and w3 halves keep their own scale grids)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w13_entries = 2 * inter * hidden  # (one expert's gate | up, however stored)
        self.quant = cfg.quantization.experts if cfg.quantization is not None else None
        self.fp4_inputs = self.fp8_inputs = torch.float32  # (the weights' `inputs`: build_model sets them)
        if self.quant is None:
            self.w13 = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.zeros(experts, hidden, inter))
        elif self.quant == "fp4":
            self.w13 = nn.Parameter(torch.zeros(experts, 2 * inter, hidden // 2, dtype=torch.uint8), False)
            self.w2 = nn.Parameter(torch.zeros(experts, hidden, inter // 2, dtype=torch.uint8), False)
            self.register_buffer("w13_scale", torch.zeros(experts, 2 * inter, hidden // FP4_GROUP, dtype=torch.uint8))
            self.register_buffer("w2_scale", torch.zeros(experts, hidden, inter // FP4_GROUP, dtype=torch.uint8))
        else:
            f8, blocks = torch.float8_e4m3fn, lambda n: -(-n // FP8_BLOCK)
            self.w13 = nn.Parameter(torch.zeros(experts, 2 * inter, hidden, dtype=f8), False)
            self.w2 = nn.Parameter(torch.zeros(experts, hidden, inter, dtype=f8), False)
            self.register_buffer("w13_scale", torch.zeros(experts, 2, blocks(inter), blocks(hidden), dtype=torch.uint8))
            self.register_buffer("w2_scale", torch.zeros(experts, 1, blocks(hidden), blocks(inter), dtype=torch.uint8))

    def stored(self) -> tuple:
        """(w13, w2) as stored: tensors, Fp4Weight or Fp8Experts."""
        if self.quant is None:
            return self.w13, self.w2
        if self.quant == "fp4":
            inputs = self.fp4_inputs
            return Fp4Weight(self.w13, self.w13_scale, inputs), Fp4Weight(self.w2, self.w2_scale, inputs)
        inputs = self.fp8_inputs
        return Fp8Experts(self.w13, self.w13_scale, inputs), Fp8Experts(self.w2, self.w2_scale, inputs)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        fp8 = "fp8" if cfg.quantization is not None else None
        self.w1 = Linear(hidden, inter, quant=fp8)
        self.w2 = Linear(inter, hidden, quant=fp8)
        self.w3 = Linear(hidden, inter, quant=fp8)


class MoE(UsesBackend, nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str) -> None:
        super().__init__()
        self.gate = Gate(cfg, is_hash=mlp_type == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (hash layers route by `input_ids` [T])."""
        return self.ops.moe(self.weights(), x, input_ids)

    def weights(self) -> MoEWeights:
        gate, experts, shared = self.gate, self.experts, self.shared_experts
        return MoEWeights(
            gate.weight, None if gate.is_hash else gate.bias, gate.tid2eid if gate.is_hash else None, gate.top_k,
            gate.scoring_func, gate.scale, *experts.stored(), shared.w1.w(), shared.w3.w(), shared.w2.w(),
            experts.limit,
        )  # fmt: skip
