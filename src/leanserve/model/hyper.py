"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams.

hc_pre:  from the RMS-normalised flattened streams, a learned projection gives `pre` (sigmoid), `post`
         (2*sigmoid) and `comb` (softmax, then Sinkhorn row/column normalisation); the block input is
         sum_i pre_i * x_i.
hc_post: output streams = post_j * f(x) + sum_i comb[i, j] * x_i.
hc_head: collapses the streams with its own sigmoid weights, then the final norm (before the head).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from leanserve.model import cpu_kernels
from leanserve.model.layers import rms_norm

MANY_TOKENS = 256  # from this many tokens, hc_pre's projection runs as a torch matmul


def hc_pre(
    streams: torch.Tensor,  # [T, hc, D]
    fn: torch.Tensor,  # [(2 + hc) * hc, hc * D], float32
    base: torch.Tensor,  # [(2 + hc) * hc]
    scale: torch.Tensor,  # [3]: pre, post, comb
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor,  # [D]: the block's RMSNorm of its input (attn_norm / ffn_norm)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (normalised block input [T, D], post [T, hc], comb [T, hc, hc]); post and comb in float32."""
    hc = streams.shape[1]
    if cpu_kernels.fast(streams, fn, norm_weight):
        # One call: the projection (RMS-normalising the flat streams scales each row of the mixes by one number,
        # applied after it), the mHC weights, the collapse of the streams and the block input's RMSNorm.
        params = _views(fn, scale, base, norm_weight)
        projected = None
        if streams.shape[0] >= MANY_TOKENS:  # (a prefill: torch's blocked matmul beats the kernel's row loops)
            projected = F.linear(streams.flatten(1), fn.detach()).numpy()
        x, weights = hc_pre_arrays(streams.numpy(), *params, norm_eps, hc_eps, sinkhorn_iters, projected)
        x, weights = torch.from_numpy(x), torch.from_numpy(weights)
        return x, weights[:, hc : 2 * hc], weights[:, 2 * hc :].unflatten(-1, (hc, hc))
    mixes = F.linear(rms_norm(streams.flatten(1).float(), norm_eps), fn.float())  # [T, (2+hc)*hc]
    pre, post, comb = mhc_weights(mixes, scale, base, hc, hc_eps, sinkhorn_iters)
    collapsed = torch.bmm(pre.unsqueeze(1).to(streams.dtype), streams).squeeze(1)  # sum_i pre_i * x_i
    return rms_norm(collapsed, norm_eps, norm_weight), post, comb


def _views(*params: torch.Tensor) -> tuple[np.ndarray, ...]:
    return tuple([p.detach().numpy() for p in params])


def hc_pre_arrays(
    streams, fn, scale, base, norm_weight, norm_eps: float, hc_eps: float, sinkhorn_iters: int, projected=None
):
    """hc_pre's kernel on numpy arrays: (normalised block input [T, D], pre | post | comb weights [T, M]).
    `projected`, if given, is flat streams @ fn^T [T, M], computed by the caller."""
    n = streams.shape[0]
    x = np.empty((n, streams.shape[2]), dtype=np.float32)
    weights = np.empty((n, fn.shape[0]), dtype=np.float32)
    projected = cpu_kernels.EMPTY_2D if projected is None else projected
    cpu_kernels.hc_pre(
        n, streams, fn, projected, scale, base, hc_eps, sinkhorn_iters, norm_eps, norm_weight, x, weights
    )  # fmt: skip
    return x, weights


def hc_post_arrays(block_out, streams, post, comb) -> np.ndarray:
    """hc_post's kernel on numpy arrays: the new streams [T, hc, D]."""
    out = np.empty_like(streams)
    cpu_kernels.hc_post(streams.shape[0], block_out, streams, post, comb, out)
    return out


def mhc_weights(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre = sigmoid + eps, post = 2 * sigmoid, comb = Sinkhorn(softmax + eps): [T, hc], [T, hc], [T, hc, hc]."""
    if cpu_kernels.fast(mixes, scale, base):
        # One compiled call instead of ~130 tiny torch ops (the Sinkhorn loop dominates a decode step).
        out = mixes.new_empty(mixes.shape[0], (2 + hc) * hc)  # pre | post | comb
        params = scale.detach().numpy(), base.detach().numpy()
        cpu_kernels.mhc_weights(
            mixes.shape[0], mixes.detach().numpy(), *params, hc, hc_eps, sinkhorn_iters, out.numpy()
        )
        return out[:, :hc], out[:, hc : 2 * hc], out[:, 2 * hc :].unflatten(-1, (hc, hc))
    return mhc_weights_torch(mixes, scale, base, hc, hc_eps, sinkhorn_iters)


def mhc_weights_torch(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    if cpu_kernels.fast(block_out, streams, strided=(post, comb)):
        return torch.from_numpy(hc_post_arrays(block_out.numpy(), streams.numpy(), post.numpy(), comb.numpy()))
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
    norm_weight: torch.Tensor,  # [D]: the RMSNorm before the head
) -> torch.Tensor:
    """The head's input [T, D]: RMSNorm_w(sum_i pre_i * x_i), pre = sigmoid(mixes * scale + base) + hc_eps."""
    if cpu_kernels.fast(streams, fn, norm_weight):  # hc_pre's kernel: the pre weights are all it computes here
        params = _views(fn, scale, base, norm_weight)
        return torch.from_numpy(hc_pre_arrays(streams.numpy(), *params, norm_eps, hc_eps, 0)[0])
    mixes = F.linear(rms_norm(streams.flatten(1).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return rms_norm((pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), norm_eps, norm_weight)
