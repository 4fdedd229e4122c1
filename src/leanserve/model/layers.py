"""The modules' common ground: `UsesBackend` (a module's `self.ops`, the stage's backend) and `set_backend`, and
the small shared modules: Linear, RMSNorm and Embedding (called through the stage's backend), RoPE tables (plain
and YaRN)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.model.backends.torch import TORCH, TorchBackend
from leanserve.model.config import RopeConfig
from leanserve.model.quant import FP8_BLOCK, Fp8Weight


class UsesBackend:
    """Mixin of the model's modules: `self.ops` is the stage's backend (torch until `set_backend`)."""

    ops: TorchBackend = TORCH


def set_backend(model: nn.Module, backend: TorchBackend) -> None:
    """Hands `backend` to every module of `model` (build_model does this once, when the stage is built)."""
    for m in model.modules():
        if isinstance(m, UsesBackend):
            m.ops = backend


def fp32_param(*shape: int) -> nn.Parameter:
    # Small parameters DeepSeek keeps in float32 whatever the model dtype (norms, mHC, sinks, biases).
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32))


class Linear(UsesBackend, nn.Linear):
    """nn.Linear (no bias here) through the stage's backend. With quant "fp8" the weight is stored as published:
    `weight` float8_e4m3fn [out, in] and `scale` uint8 UE8M0 exponents per 128x128 block (see quant.py); `inputs`
    is then the Fp8Weight's (build_model's fp8_inputs sets it)."""

    inputs = torch.float32

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.quant = quant
        if quant == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), False)
            blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
            self.register_buffer("scale", torch.empty(blocks, dtype=torch.uint8))
        elif quant is not None:
            raise ValueError(f"Linear layers are stored plain or as fp8, not {quant!r}.")

    def w(self) -> torch.Tensor | Fp8Weight:
        """The weight as stored: a tensor, or an Fp8Weight."""
        return self.weight if self.quant is None else Fp8Weight(self.weight, self.scale, self.inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linears(x, (self.w(),))[0]


class Embedding(nn.Module):
    """The token embedding table. (Not nn.Embedding: its random init, run even on the meta device, imports
    torch._dynamo, seconds of start-up; the loader fills this table anyway.)"""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(UsesBackend, nn.Module):
    # The weight stays float32 (as in DeepSeek's release); the product is cast back once.
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = fp32_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.eps, self.weight)


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """One frequency per interleaved channel pair: [rope_dim // 2] float64."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
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
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


ROPE_CHUNK = 1 << 16  # positions per piece of a RoPE table made in float64


class Rotary(nn.Module):
    """RoPE angles for positions [0, max_positions) as complex numbers `scale * e^(i*theta)`, one per
    interleaved channel pair (2i, 2i+1) of the trailing `rope_dim` channels of a head."""

    def __init__(self, rope: RopeConfig, rope_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.rope_dim, self.max_positions = rope, rope_dim, max_positions
        # On the meta device (build_model) the table is only allocated, and reset_tables computes it on the real
        # device: a meta arange runs torch's Python reference, whose first call imports torch._dynamo (a large
        # part of every process's start-up).
        if torch.empty(0).is_meta:
            freqs = torch.empty(max_positions, rope_dim // 2, dtype=torch.complex64)
        else:
            freqs = self._freqs()
        self.register_buffer("freqs", freqs, persistent=False)

    def _freqs(self) -> torch.Tensor:
        # Angles in float64, cast once made: in float32, position x frequency loses up to 0.03 rad by position
        # 1M (a float32 holds 24 bits). Made ROPE_CHUNK positions at a time, so a 1M-position table never has a
        # float64 copy whole.
        inv_freq = rope_inv_freq(self.rope, self.rope_dim)
        freqs = torch.empty(self.max_positions, self.rope_dim // 2, dtype=torch.complex64)
        for p0 in range(0, self.max_positions, ROPE_CHUNK):
            angles = torch.arange(p0, min(p0 + ROPE_CHUNK, self.max_positions), dtype=torch.float64)[:, None] * inv_freq
            freqs[p0 : p0 + angles.shape[0]] = torch.polar(torch.full_like(angles, self.rope.attention_factor), angles)
        return freqs

    def reset_tables(self) -> None:
        # After construction on the meta device: compute the table for real on the buffer's device.
        with torch.device(self.freqs.device):
            self.freqs.copy_(self._freqs())

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        return self.freqs[positions]  # [..., rope_dim / 2] complex
