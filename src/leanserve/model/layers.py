"""Small shared pieces: RMSNorm, partial interleaved RoPE (plain and YaRN)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.config import RopeConfig


def fp32_param(*shape: int) -> nn.Parameter:
    # Small parameters DeepSeek keeps in float32 whatever the model dtype (norms, mHC, sinks, biases).
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


class RMSNorm(nn.Module):
    # The weight stays float32 (as in DeepSeek's release); the product is cast back once.
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = fp32_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # Unweighted RMSNorm over the last dim; the statistic is computed in float32.
    return F.rms_norm(x, (x.shape[-1],), None, eps)


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
    """cos/sin tables for positions [0, max_positions), looked up by position; RoPE rotates the trailing
    `rope_dim` channels of each head, in interleaved pairs (2i, 2i+1)."""

    def __init__(self, rope: RopeConfig, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.rope_dim, self.max_positions = rope, rope_dim, max_positions
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.rope, self.rope_dim)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq  # [P, rope_dim/2]
        scale = self.rope.attention_factor
        return freqs.cos() * scale, freqs.sin() * scale

    def reset_tables(self) -> None:
        # After construction on the meta device: compute the tables for real on the buffers' device.
        with torch.device(self.cos.device):
            cos, sin = self._tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), [..., rope_dim] each: a channel pair (2i, 2i+1) shares one angle, and the sin
        carries the rotation's sign (-sin on even channels), so RoPE is x * cos + swap_pairs(x) * sin."""
        cos = self.cos[positions].repeat_interleave(2, dim=-1)
        sin = self.sin[positions]
        return cos, torch.stack((-sin, sin), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [N, ..., D]; cos/sin from Rotary.table, [N, rope_dim], broadcast over the middle dims. Rotates the
    trailing rope_dim channels in interleaved pairs; `inverse` rotates by the opposite angle."""
    rope_dim = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos, sin = cos.view(shape), sin.view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    swapped = rope.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    if x.dtype != torch.float32:
        rope, swapped = rope.float(), swapped.float()
    rope = torch.addcmul(rope * cos, swapped, sin, value=-1.0 if inverse else 1.0).to(x.dtype)
    return torch.cat([nope, rope], dim=-1)
