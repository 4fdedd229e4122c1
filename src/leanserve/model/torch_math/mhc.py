"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams. The torch statement of the
math (TorchBackend runs it, and training; the CPU backend's kernels state it again, see
backends/cpu/kernels/mix.py).

hc_pre:  from the RMS-normalised flattened streams, a learned projection gives `pre` (sigmoid), `post`
         (2*sigmoid) and `comb` (softmax, then Sinkhorn row/column normalisation); the block input is
         sum_i pre_i * x_i, RMS-normalised by the block's input norm.
hc_post: output streams = post_j * f(x) + sum_i comb[i, j] * x_i.
hc_head: collapses the streams with its own sigmoid weights, then the final norm (before the head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leanserve.model.torch_math.ops import rms_norm
from leanserve.model.weights import MixWeights


def hc_pre(streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (normalised block input [T, D], post [T, hc], comb [T, hc, hc]); post and comb in
    float32."""
    hc = streams.shape[1]
    pre, post, comb = mhc_weights(_mixes(streams, w), w.scale, w.base, hc, w.hc_eps, w.sinkhorn_iters)
    collapsed = torch.bmm(pre.unsqueeze(1).to(streams.dtype), streams).squeeze(1)  # sum_i pre_i * x_i
    return rms_norm(collapsed, w.norm_eps, w.norm_weight), post, comb


def _mixes(streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
    """The projection of the RMS-normalised flat streams, [T, M] float32. (Normalising a row scales its mixes by
    one number: applied to the few mixes rather than to the [T, hc * D] streams.)"""
    flat = streams.flatten(1).float()
    inv_rms = torch.rsqrt(torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1] + w.norm_eps)
    return F.linear(flat, w.fn.float()) * inv_rms


def mhc_weights(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre = sigmoid + eps, post = 2 * sigmoid, comb = Sinkhorn(softmax + eps): [T, hc], [T, hc], [T, hc, hc]."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    # Sinkhorn-Knopp: columns first, then rows and columns, `sinkhorn_iters` times in all.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_post(
    block_out: torch.Tensor,  # [T, D]
    streams: torch.Tensor,  # [T, hc, D]
    post: torch.Tensor,  # [T, hc]
    comb: torch.Tensor,  # [T, hc, hc]
) -> torch.Tensor:
    """out[j] = post[j] * f(x) + sum_i comb[i, j] * x[i], as one bmm (comb applied transposed)."""
    dtype = streams.dtype
    mix = torch.cat([post.to(dtype).unsqueeze(-1), comb.to(dtype).transpose(-1, -2)], dim=-1)  # [T, hc, 1 + hc]
    return torch.bmm(mix, torch.cat([block_out.unsqueeze(1), streams], dim=1))


def hc_head(streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
    """The head's input [T, D]: RMSNorm_w(sum_i pre_i * x_i), pre = sigmoid(mixes * scale + base) + hc_eps."""
    pre = torch.sigmoid(_mixes(streams, w) * w.scale.float() + w.base.float()) + w.hc_eps
    return rms_norm((pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), w.norm_eps, w.norm_weight)
