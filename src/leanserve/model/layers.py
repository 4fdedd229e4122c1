"""Small shared pieces: RMSNorm, partial interleaved RoPE (plain and YaRN)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.config import RopeConfig
from leanserve.model import cpu_kernels


def fp32_param(*shape: int) -> nn.Parameter:
    # Small parameters DeepSeek keeps in float32 whatever the model dtype (norms, mHC, sinks, biases).
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


# Up to this many rows, a linear layer runs as a compiled loop on the CPU: at these sizes torch's matmul
# costs several times the arithmetic in call and packing overhead (decode steps).
FEW_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, owner: nn.Module | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T in x's dtype (a bfloat16 weight meets float32 activations on the CPU, see
    deepseek_v4.activation_dtype); `owner`, if given, keeps the weight's numpy view for the kernel."""
    return linears(x, (weight,), owner)[0]


def linears(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], owner: nn.Module | None = None
) -> tuple[torch.Tensor, ...]:
    """linear(x, w) for each of `weights` (one dtype), in one compiled call on the kernels' path (the
    projections that read the same input). `owner`, if given, keeps the weights' numpy views."""
    rows = x.numel() // x.shape[-1]
    one_dtype = len(weights) == 1 or all(w.dtype == weights[0].dtype for w in weights)
    if rows <= FEW_ROWS and one_dtype and cpu_kernels.fast(x, weights=weights):
        if owner is not None:
            views = cpu_kernels.numpy_views(owner, *weights)
        else:
            views = tuple([cpu_kernels.weight_np(w) for w in weights])
        outs = cpu_kernels.matmuls(x.view(rows, x.shape[-1]).numpy(), views)
        return tuple([torch.from_numpy(o).view(*x.shape[:-1], o.shape[1]) for o in outs])
    return tuple([F.linear(x, w.to(x.dtype)) for w in weights])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, G, in], weight [G, out, in] -> [T, G, out]: group g of every row times weight[g]^T."""
    if x.shape[0] <= FEW_ROWS and cpu_kernels.fast(x, weights=(weight,)):
        out = x.new_empty(x.shape[0], x.shape[1], weight.shape[1])
        work = x.shape[0] * weight.numel()
        cpu_kernels.grouped_linear(work, x.numpy(), cpu_kernels.weight_np(weight), out.numpy())
        return out
    return torch.einsum("tgi,goi->tgo", x, weight.to(x.dtype))


class Linear(nn.Linear):
    """nn.Linear (no bias here) through `linear`, which keeps the weight's numpy view on the module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self)


class Embedding(nn.Module):
    """The token embedding table. (Not nn.Embedding: its random init, run even on the meta device, imports
    torch._dynamo, seconds of start-up; the loader fills this table anyway.)"""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    # The weight stays float32 (as in DeepSeek's release); the product is cast back once.
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = fp32_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (times `weight` if given), computed in float32, returned in x's dtype."""
    if cpu_kernels.fast(x, weight):
        flat = x.view(x.numel() // x.shape[-1], x.shape[-1])
        out = torch.empty_like(flat)
        cpu_kernels.rms_norm(flat.shape[0], flat.numpy(), cpu_kernels.np_(weight), eps, out.numpy())
        return out.view(x.shape)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """One frequency per interleaved channel pair: [rope_dim // 2]."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    extrapolation = 1.0 / (rope.theta**exponent)
    if rope.rope_type != "yarn":
        return extrapolation
    # YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp between the two.
    interpolation = 1.0 / (rope.factor * rope.theta**exponent)

    def correction_dim(num_rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return rope_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary(nn.Module):
    """RoPE angles for positions [0, max_positions) as complex numbers `scale * e^(i*theta)`, one per
    interleaved channel pair (2i, 2i+1) of the trailing `rope_dim` channels of a head."""

    def __init__(self, rope: RopeConfig, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.rope_dim, self.max_positions = rope, rope_dim, max_positions
        self.register_buffer("freqs", self._freqs(), persistent=False)

    def _freqs(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.rope, self.rope_dim)
        angles = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq  # [P, rope_dim/2]
        return torch.polar(torch.full_like(angles, self.rope.attention_factor), angles)

    def reset_tables(self) -> None:
        # After construction on the meta device: compute the table for real on the buffer's device.
        with torch.device(self.freqs.device):
            self.freqs.copy_(self._freqs())

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        return self.freqs[positions]  # [..., rope_dim / 2] complex


def norm_rope(x: torch.Tensor, freqs: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope(rms_norm(x, eps, weight), freqs), in one pass on the CPU kernels' path."""
    if cpu_kernels.fast(x, weight):
        return _rope_kernel(x, freqs, False, True, eps, weight)
    return apply_rope(rms_norm(x, eps, weight), freqs)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [N, ..., D]; freqs from Rotary.table, [N, rope_dim/2], broadcast over the middle dims. Rotates the
    trailing rope_dim channels in interleaved pairs (as complex numbers); `inverse` rotates by -angle."""
    if cpu_kernels.fast(x):
        return _rope_kernel(x, freqs, inverse, False, 0.0, None)
    rope_dim = 2 * freqs.shape[-1]
    freqs = freqs.view((freqs.shape[0],) + (1,) * (x.dim() - 2) + (-1,))
    if inverse:
        freqs = freqs.conj()
    out = x.clone()
    rope = out[..., -rope_dim:]
    if x.dtype == torch.float32:
        torch.view_as_complex(rope.unflatten(-1, (-1, 2))).mul_(freqs)
    else:  # rotate in float32, store back in x's dtype
        rotated = torch.view_as_complex(rope.float().unflatten(-1, (-1, 2))) * freqs
        rope.copy_(torch.view_as_real(rotated).flatten(-2))
    return out


def _rope_kernel(x, freqs, inverse: bool, normalize: bool, eps: float, weight) -> torch.Tensor:
    flat = x.view(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])  # [N, heads, D]
    out = torch.empty_like(flat)
    angles = torch.view_as_real(freqs.contiguous()).numpy()  # [N, rope_dim/2, 2]
    cpu_kernels.norm_rope(
        flat.shape[0], flat.numpy(), cpu_kernels.np_(weight), eps, normalize, angles, inverse, out.numpy()
    )
    return out.view(x.shape)
