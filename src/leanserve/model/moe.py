"""DeepSeek-V4 MoE: routed experts (top-k by score + correction bias, or a frozen token-id hash table on
hash layers), a shared expert, SwiGLU with clamped pre-activations, routed_scaling_factor.

Routed tokens are grouped by expert (no per-token loop): on the CPU in float32 a decode-sized step is one
compiled call (cpu_kernels.moe_tokens); otherwise two batched matmuls over experts padded to the largest
count, or one grouped matmul per projection.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from leanserve.config import HASH_MOE, ModelConfig
from leanserve.model import cpu_kernels
from leanserve.model.layers import Linear, fp32_param

# Up to this many tokens, the CPU runs the whole MoE as one compiled loop over tokens (decode batches),
# reading each chosen expert's weights once per token; above it, batched matmuls over tokens grouped by expert.
FEW_TOKENS = 64
SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
NO_TABLE = np.empty((0, 0), dtype=np.int64)


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
        scores = score(F.linear(x, self.weight.to(x.dtype)).float(), self.scoring_func)  # [T, E]
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
        counts = torch.bincount(flat, minlength=self.w13.shape[0])
        rows = x[token_of]
        w13, w2 = self.w13.to(x.dtype), self.w2.to(x.dtype)  # (bfloat16 weights, float32 activations: CPU)
        ys = padded_experts(rows, counts, w13, w2, self.limit)
        if ys is None:
            ends = torch.cumsum(counts, 0)
            gate, up = grouped_mm(rows, w13, ends).chunk(2, dim=-1)  # [N, I] each
            ys = grouped_mm(swiglu(gate, up, self.limit), w2, ends)  # [N, hidden]
        ys *= weights.flatten()[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)


def padded_experts(
    rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float
) -> torch.Tensor | None:
    """The experts as two batched matmuls over [E, M, ...], every expert's rows padded to the largest count M:
    rows [N, hidden] grouped by expert, counts [E] -> [N, hidden]. On the CPU this beats a grouped matmul
    once the padding is at most half the work (decode batches); None when it would not (tiny or skewed
    batches, long prefills), or off the CPU."""
    num_experts, n = counts.shape[0], rows.shape[0]
    if rows.device.type != "cpu" or n < num_experts:
        return None
    most = int(counts.max())
    if num_experts * most > 2 * n or most > 256:
        return None
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(num_experts), counts)
    slot = expert_of * most + torch.arange(n) - starts[expert_of]  # row i -> its place in [E * M]
    padded = rows.new_zeros(num_experts * most, rows.shape[1])
    padded[slot] = rows
    gate, up = torch.bmm(padded.view(num_experts, most, -1), w13.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(swiglu(gate, up, limit), w2.transpose(1, 2))  # [E, M, hidden]
    return out.view(num_experts * most, -1)[slot]


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
        self.w1 = Linear(hidden, inter, bias=False)
        self.w2 = Linear(inter, hidden, bias=False)
        self.w3 = Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str) -> None:
        super().__init__()
        self.gate = Gate(cfg, is_hash=mlp_type == HASH_MOE)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FEW_TOKENS and cpu_kernels.fast(x, weights=self._matrices()):
            return self._few_tokens(x, input_ids)
        weights, experts = self.gate(x, input_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)

    def _matrices(self) -> tuple[torch.Tensor, ...]:
        """The weight matrices (Parameter objects: loading and `.data` assignments keep them)."""
        matrices = self.__dict__.get("_matrix_params")
        if matrices is None:
            experts, shared = self.experts, self.shared_experts
            matrices = (self.gate.weight, experts.w13, experts.w2, shared.w1.weight, shared.w3.weight, shared.w2.weight)
            self.__dict__["_matrix_params"] = matrices
        return matrices

    def _few_tokens(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.kernel(x.numpy(), input_ids.numpy(), out.numpy())
        return out

    def kernel(self, x: np.ndarray, input_ids: np.ndarray, out: np.ndarray, params: tuple | None = None) -> None:
        """The whole MoE as one compiled call on numpy arrays: x, out [T, hidden] float32; `params` from
        kernel_params() (made here if not given)."""
        cpu_kernels.moe_tokens(x.shape[0], x, input_ids, *(params or self.kernel_params()), out)

    def kernel_params(self) -> tuple:
        """The kernel's fixed arguments: the weights' numpy views and the routing constants."""
        gate, experts = self.gate, self.experts
        routing = gate.tid2eid if gate.is_hash else gate.bias
        gate_w, w13, w2, sw1, sw3, sw2, route = cpu_kernels.numpy_views(self, *self._matrices(), routing)
        bias, table = (cpu_kernels.EMPTY, route) if gate.is_hash else (route, NO_TABLE)
        scoring = SCORING[gate.scoring_func]
        return gate_w, bias, table, gate.top_k, scoring, gate.scale, w13, w2, sw1, sw3, sw2, experts.limit
