"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams.

hc_pre:  from the RMS-normalised flattened streams, a learned projection gives `pre` (sigmoid), `post`
         (2*sigmoid) and `comb` (softmax, then Sinkhorn row/column normalisation); the block input is
         sum_i pre_i * x_i.
hc_post: output streams = post_j * f(x) + sum_i comb[i, j] * x_i.
hc_head: collapses the streams with its own sigmoid weights before the final norm and head.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from leanserve.model.layers import rms_norm

_NUMPY_MAX = 64 * 16  # elements: up to 64 tokens at hc_mult 4


def hc_pre(
    streams: torch.Tensor,  # [T, hc, D]
    fn: torch.Tensor,  # [(2 + hc) * hc, hc * D], float32
    base: torch.Tensor,  # [(2 + hc) * hc]
    scale: torch.Tensor,  # [3]: pre, post, comb
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (block input [T, D], post [T, hc], comb [T, hc, hc]); post and comb in float32."""
    hc = streams.shape[1]
    mixes = F.linear(rms_norm(streams.flatten(1).float(), norm_eps), fn.float())  # [T, (2+hc)*hc]
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = sinkhorn(comb, hc_eps, sinkhorn_iters)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def sinkhorn(comb: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp: project positive [T, hc, hc] matrices towards doubly-stochastic ones (columns first,
    then rows and columns, `iters` times in all)."""
    if comb.device.type == "cpu" and not comb.requires_grad and comb.numel() <= _NUMPY_MAX:
        # ~60 tiny ops per call: on CPU numpy's per-op cost is a fraction of torch's, and the math is the same.
        c = comb.numpy()  # a view: normalised in place
        eps32 = np.float32(eps)
        c /= c.sum(axis=-2, keepdims=True) + eps32
        for _ in range(iters - 1):
            c /= c.sum(axis=-1, keepdims=True) + eps32
            c /= c.sum(axis=-2, keepdims=True) + eps32
        return comb
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_post(
    block_out: torch.Tensor,  # [T, D]
    streams: torch.Tensor,  # [T, hc, D]
    post: torch.Tensor,  # [T, hc]
    comb: torch.Tensor,  # [T, hc, hc]
) -> torch.Tensor:
    dtype = streams.dtype
    # out[j] = post[j] * f(x) + sum_i comb[i, j] * x[i]  (comb is applied transposed)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head(
    streams: torch.Tensor,  # [T, hc, D]
    fn: torch.Tensor,  # [hc, hc * D]
    base: torch.Tensor,  # [hc]
    scale: torch.Tensor,  # [1]
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    mixes = F.linear(rms_norm(streams.flatten(1).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
