"""DeepSeek-V4 MoE: routed experts (top-k by score + correction bias, or a frozen token-id hash table on
hash layers), a shared expert, SwiGLU with clamped pre-activations, routed_scaling_factor.

Routed tokens are grouped by expert (no per-token loop) and run through the stage's backend (`experts`: one
matmul per expert in torch; on the CPU a grouped or padded batched matmul, and a decode-sized step's whole MoE
as one compiled call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.config import HASH_MOE, ModelConfig
from leanserve.model.backend import UsesBackend
from leanserve.model.layers import Linear, fp32_param
from leanserve.model.torch_ops import swiglu


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
        scores = score(F.linear(x, self.weight.to(x.dtype)).float(), self.scoring_func)  # [T, E]
        if self.is_hash:
            experts = self.tid2eid[input_ids]
        else:
            experts = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts


class Experts(UsesBackend, nn.Module):
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
        counts = torch.bincount(flat, minlength=self.w13.shape[0])
        ys = self.ops.experts(x[token_of], counts, self.w13, self.w2, self.limit)
        ys = ys * weights.flatten()[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(hidden, inter, bias=False)
        self.w2 = Linear(inter, hidden, bias=False)
        self.w3 = Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


@dataclass(frozen=True)
class MoEWeights:
    """A MoE layer's tensors and routing constants, for a backend that runs the layer whole."""

    gate: torch.Tensor  # [E, hidden]
    bias: torch.Tensor | None  # a top-k router's correction bias [E]; None on hash layers
    tid2eid: torch.Tensor | None  # a hash layer's token -> experts table [vocab, k]; None on top-k layers
    top_k: int
    scoring: str  # sqrtsoftplus | sigmoid | softmax
    route_scale: float  # routed_scaling_factor
    w13: torch.Tensor  # [E, 2I, hidden]: gate | up
    w2: torch.Tensor  # [E, hidden, I]
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor
    limit: float  # SwiGLU clamp


class MoE(UsesBackend, nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str) -> None:
        super().__init__()
        self.gate = Gate(cfg, is_hash=mlp_type == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.moe(self, x, input_ids)

    def forward_torch(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.routed_torch(x, input_ids)[0]

    def routed_torch(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's torch statement: (its output [T, hidden], the experts each row went to [T, k]; training
        counts those to balance the router)."""
        weights, experts = self.gate(x, input_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x), experts

    def weights(self) -> MoEWeights:
        gate, experts, shared = self.gate, self.experts, self.shared_experts
        return MoEWeights(
            gate.weight, None if gate.is_hash else gate.bias, gate.tid2eid if gate.is_hash else None, gate.top_k,
            gate.scoring_func, gate.scale, experts.w13, experts.w2, shared.w1.weight, shared.w3.weight,
            shared.w2.weight, experts.limit,
        )  # fmt: skip
