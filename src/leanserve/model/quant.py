"""The published checkpoints' weight formats, kept as stored: block-scaled FP8 linears and FP4 experts.

- FP8: q [out, in] float8_e4m3fn, scale [ceil(out / 128), ceil(in / 128)] uint8 UE8M0 exponents:
  W[n, k] = q[n, k] * 2^(scale[n // 128, k // 128] - 127).
- FP4 (e2m1): two values per byte, packed [out, in / 2] uint8 (element 2j in the low nibble of byte j, 2j + 1
  in the high one; bit 3 of a nibble is the sign), scale [out, in / 32] uint8 exponents:
  W[n, k] = LUT[nibble(n, k)] * 2^(scale[n, k // 32] - 127).

Both are exact in bfloat16 and float32. A weight object says its format; backends read it their own way (the torch
backend dequantizes per call, one expert at a time for the MoE). Stacked experts carry a leading [E] dimension
(FP8 experts: their w1 and w3 halves keep their own scale blocks, scale [E, 2, ceil(I / 128), ceil(H / 128)] for
w13).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.model.config import ConfigError

FP8_BLOCK = 128  # rows and columns of an FP8 scale block
FP4_GROUP = 32  # inputs of a row that share an FP4 scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0  # the largest e4m3 value
FP4_MAX = 6.0
INT8_MAX = 127  # the largest magnitude of x rounded to 8 bits (int8_rounded)


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (uint8) -> float32 powers of two."""
    return torch.exp2(scale.to(torch.float32) - 127.0)


def _blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A per-block scale [..., ceil(rows/128), ceil(cols/128)] expanded to [..., rows, cols] (float32)."""
    s = ue8m0(scale).repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return s[..., :rows, :cols]


@dataclass(frozen=True)
class Fp8Weight:
    """A block-scaled FP8 matrix (or a stack of them, leading dims first). `inputs` as for Fp4Weight: bfloat16
    takes x rounded to bfloat16, where every product of an e4m3 value and a bfloat16 is exact in float32
    (`--fp8-inputs`)."""

    q: torch.Tensor  # [..., out, in] float8_e4m3fn
    scale: torch.Tensor  # [..., ceil(out / 128), ceil(in / 128)] uint8
    inputs: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.q.shape[-2:]
        return (self.q.to(torch.float32) * _blocks(self.scale, rows, cols)).to(dtype)


@dataclass(frozen=True)
class Fp4Weight:
    """An FP4 e2m1 matrix with a scale per 32 inputs of a row (or a stack of them, leading dims first). `inputs`:
    the precision of what it multiplies. float32 (the default) takes x as it is; bfloat16 takes x rounded to
    bfloat16 (to nearest, ties to even), where every product of an FP4 value and a bfloat16 is exact in float32
    and the sums stay float32: what lets a CPU with AVX512-BF16 multiply 32 pairs per instruction; int8 (torch's
    dtype as the name) takes x rounded to 8 bits a block of 32 inputs (int8_rounded), where a group's products
    and their sum are exact integers: what lets a CPU with AVX2 multiply 32 pairs per instruction
    (`--fp4-inputs`, docs/checkpoints.md)."""

    packed: torch.Tensor  # [..., out, in / 2] uint8
    scale: torch.Tensor  # [..., out, in / 32] uint8
    inputs: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=self.packed.device)
        low, high = lut[(self.packed & 0xF).long()], lut[(self.packed >> 4).long()]
        values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., out, in]
        scale = ue8m0(self.scale).repeat_interleave(FP4_GROUP, dim=-1)
        return (values * scale).to(dtype)


@dataclass(frozen=True)
class Fp8Experts:
    """Stacked FP8 experts' w13 (gate | up) with a scale grid per half: q [E, 2I, H], scale [E, 2, ceil(I / 128),
    ceil(H / 128)]; or their w2: q [E, H, I], scale [E, 1, ceil(H / 128), ceil(I / 128)]. `inputs` as for
    Fp8Weight."""

    q: torch.Tensor
    scale: torch.Tensor
    inputs: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's matrix, dequantized to float32."""
        halves = self.scale.shape[1]
        parts = self.q[e].chunk(halves, dim=0)
        return torch.cat([Fp8Weight(p, self.scale[e, h]).dequantize() for h, p in enumerate(parts)])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self.expert(e) for e in range(self.q.shape[0])]).to(dtype)


QuantWeight = Fp8Weight | Fp4Weight | Fp8Experts


def is_quantized(w) -> bool:
    return isinstance(w, Fp8Weight | Fp4Weight | Fp8Experts)


INPUTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # `inputs` by name
FP8_INPUTS = ("float32", "bfloat16")  # (int8 is FP4's only: e4m3 values are not small integers)
# A quantized weight's `inputs` as the kernels take it (an integer: one compiled build for all three)
FLOAT32_CODE, BF16_CODE, INT8_CODE = 0, 1, 2
INPUT_CODES = {torch.float32: FLOAT32_CODE, torch.bfloat16: BF16_CODE, torch.int8: INT8_CODE}


def bf16_inputs(w) -> bool:
    """Whether weight w multiplies its inputs rounded to bfloat16 (a quantized weight's `inputs`)."""
    return is_quantized(w) and w.inputs == torch.bfloat16


def input_code(w) -> int:
    """A weight's `inputs` as the kernels take it (INPUT_CODES; 0 for a plain weight)."""
    return INPUT_CODES[w.inputs] if is_quantized(w) else FLOAT32_CODE


def check_inputs(fp4_inputs: str, fp8_inputs: str, has_fp4: bool = True, has_fp8: bool = True) -> None:
    """Refuses an `inputs` name that is not one (INPUTS; FP8_INPUTS for FP8 weights), and one other than float32
    for a format the model lacks."""
    for name, value, names, has, what in (("fp4_inputs", fp4_inputs, tuple(INPUTS), has_fp4, "FP4 experts"),
                                          ("fp8_inputs", fp8_inputs, FP8_INPUTS, has_fp8, "FP8 weights")):  # fmt: skip
        if value not in names:
            raise ConfigError(f"{name} must be one of {names}, got {value!r}.")
        if value != "float32" and not has:
            raise ConfigError(f"{name} {value!r} applies to {what}, and this model has none.")


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x (float32, its last dimension a multiple of 32) rounded to 8 bits a block of 32: q * d with d = a block's
    largest magnitude / 127 and q = round(x * (127 / that magnitude)) (ties to even; 0 for a block of zeros), each
    step one float32 operation. llama.cpp's Q8_0 rounds activations this way (its d a float16)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, FP4_GROUP)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-INT8_MAX, INT8_MAX)
    return (q * (amax / INT8_MAX)).reshape(x.shape).to(x.dtype)


def inputs_for(w, x: torch.Tensor) -> torch.Tensor:
    """x as weight w multiplies it: rounded to bfloat16 (and back to x's dtype) where bf16_inputs(w), to 8 bits a
    block (int8_rounded) where its `inputs` are int8."""
    if bf16_inputs(w):
        return x.to(torch.bfloat16).to(x.dtype)
    if is_quantized(w) and w.inputs == torch.int8:
        return int8_rounded(x)
    return x


def dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a plain tensor of `dtype` (a quantized one dequantized: the torch backend's way)."""
    return w.dequantize(dtype) if is_quantized(w) else w.to(dtype)


def expert_matrix(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix of stacked experts `w`, dequantized alone (never the whole stack)."""
    if isinstance(w, Fp8Experts):
        return w.expert(e).to(dtype)
    if isinstance(w, Fp4Weight):
        return Fp4Weight(w.packed[e], w.scale[e]).dequantize(dtype)
    return w[e].to(dtype)


# --- quantizing (make-random --format published, leanserve quantize) -------------------------------------------
def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """UE8M0 exponents e with amax / 2^(e - 127) <= top (the smallest such power of two; 2^-127 for zeros)."""
    exponent = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / top))
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [out, in] (float) -> block-scaled FP8 with power-of-two scales, values rounded to nearest."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK).abs().amax(dim=(1, 3))
    scale = _pow2_scale(amax, FP8_MAX)
    q = (w.float() / _blocks(scale, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale)


def quantize_fp4(w: torch.Tensor) -> Fp4Weight:
    """w [out, in] (float, in a multiple of 32) -> FP4 e2m1 with a power-of-two scale per 32 inputs, values
    rounded to the nearest representable one."""
    rows, cols = w.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 needs inputs in multiples of {FP4_GROUP}, got {cols}.")
    groups = w.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=-1), FP4_MAX)
    scaled = (groups / ue8m0(scale)[..., None]).view(rows, cols)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    nearest = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # magnitude code 0..7 (ties: the lower)
    codes = (nearest | ((scaled < 0) & (nearest > 0)).long() << 3).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Fp4Weight(packed, scale)
