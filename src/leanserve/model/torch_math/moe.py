"""The torch statement of the DeepSeek-V4 MoE (see moe.py for what it computes): the router, the routed experts
over tokens grouped by expert (the SwiGLU itself is `ops.experts`) and the shared expert. `ops` is the stage's
backend, through which the linears and the experts run.

Changes together with the CPU backend's whole-MoE kernel (backends/cpu/kernels/moe.py, which training does not
use: training calls `routed` here for the router's loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from leanserve.model.torch_math.ops import swiglu
from leanserve.model.weights import MoEWeights

if TYPE_CHECKING:
    from leanserve.model.backends.torch import TorchBackend


def moe(ops: TorchBackend, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The layer: x [T, hidden] -> [T, hidden]."""
    return routed(ops, w, x, input_ids)[0]


def routed(
    ops: TorchBackend, w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output [T, hidden], the experts each row went to [T, k]; training counts those to balance
    the router)."""
    weights, experts = route(w, x, input_ids)
    return routed_experts(ops, w, x, weights, experts) + shared_expert(ops, w, x), experts


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def route(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: (weights [T, k] float32, expert ids [T, k]). Hash layers take their experts from the token id;
    top-k layers by score plus the correction bias, which shifts the selection only, not the weights."""
    scores = score(F.linear(x, w.gate.to(x.dtype)).float(), w.scoring)  # [T, E]
    if w.tid2eid is not None:
        experts = w.tid2eid[input_ids]
    else:
        experts = torch.topk(scores + w.bias, w.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * w.route_scale, experts


def routed_experts(
    ops: TorchBackend, w: MoEWeights, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """The routed experts' weighted sum [T, hidden]: the (token, k) pairs grouped by expert (no per-token loop)
    through `ops.experts`."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    token_of = order // experts.shape[1]
    counts = torch.bincount(flat, minlength=w.gate.shape[0])
    ys = ops.experts(x[token_of], counts, w.w13, w.w2, w.limit)
    ys = ys * weights.flatten()[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


def shared_expert(ops: TorchBackend, w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    gate, up = ops.linears(x, (w.shared_w1,))[0], ops.linears(x, (w.shared_w3,))[0]
    return ops.linears(swiglu(gate, up, w.limit), (w.shared_w2,))[0]
