"""DeepSeek-V4 MoE: routed experts (top-k by score + correction bias, or a frozen token-id hash table on
hash layers), a shared expert, SwiGLU with clamped pre-activations, routed_scaling_factor.

Routed tokens are grouped by expert and run as one grouped matmul per projection (no per-token loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.config import HASH_MOE, ModelConfig
from leanserve.model.layers import fp32_param


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


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

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k] float32, expert ids [T, k])."""
        scores = score(F.linear(x, self.weight).float(), self.scoring_func)  # [T, E]
        if self.is_hash:
            experts = self.tid2eid[input_ids]
        else:
            experts = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts


class Experts(nn.Module):
    # Stacked per-expert weights; the checkpoint's experts.E.w1/w3 fill w13 rows [0, I) / [I, 2I).
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w13 = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.zeros(experts, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
        token_of = order // experts.shape[1]
        ends = torch.cumsum(torch.bincount(flat, minlength=self.w13.shape[0]), 0)
        gate, up = grouped_mm(x[token_of], self.w13, ends).chunk(2, dim=-1)  # [N, I] each
        ys = grouped_mm(swiglu(gate, up, self.limit), self.w2, ends)  # [N, hidden]
        ys *= weights.flatten()[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x times w[e]^T: x [N, in], w [E, out, in] -> [N, out]. Each expert's
    weights are read once, and only its own rows are computed."""
    if x.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e].T, out=out[start:end])
        start = end
    return out


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str) -> None:
        super().__init__()
        self.gate = Gate(cfg, is_hash=mlp_type == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, input_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)
