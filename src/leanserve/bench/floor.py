"""The host's floor for a decode step's weight reads (`bench formats`): every weight read at the slower of two
rates, the machine's measured read and what the kernels' cores decode of its format with the weight in cache (one
core's rate, `profile.decode_rates`, times the cores). A step reads every weight once, so it can take no less than
the sum; the share of that floor a step reaches is what its kernels leave, once the host's arithmetic is counted.
Where every format decodes faster than the cores' share of the read, the floor is the read alone.

Formats are named as `decode_rates` names them: FP4 and FP8 (values and scales), each also with bfloat16 inputs
(`--fp4-inputs` / `--fp8-inputs`), bfloat16 and float32; bytes of any other kind (the hash-routing row) count at
the read."""

from __future__ import annotations

import torch

from leanserve.model.config import ModelConfig

BF16_INPUTS = ", bfloat16 inputs"  # (suffix of a quantized format whose weights meet inputs rounded to bfloat16)


def format_name(base: str, inputs: torch.dtype) -> str:
    """A quantized format's name for decode rates: `base` (FP4 or FP8), with BF16_INPUTS where its inputs are
    rounded to bfloat16."""
    return base + (BF16_INPUTS if inputs == torch.bfloat16 else "")


def token_format_bytes(cfg: ModelConfig, published: bool, fp4_inputs: str = "float32", fp8_inputs: str = "float32"):
    """Format name -> the bytes a batch-1 decode token of `cfg` (plain weights: bf16) or of its published form reads
    in that format (engine/costs.token_read_bytes), its FP4 and FP8 weights meeting the inputs named."""
    import dataclasses

    from leanserve.engine.costs import model_tensors, stored_dtype, token_read_bytes
    from leanserve.quantize import quantized_config

    cfg = quantized_config(cfg) if published else dataclasses.replace(cfg, quantization=None)
    quant = cfg.quantization
    fp4, fp8 = format_name("FP4", _dtype(fp4_inputs)), format_name("FP8", _dtype(fp8_inputs))
    reads = token_read_bytes(cfg)
    out: dict[str, float] = {}
    for name, t in model_tensors(cfg).items():
        if ".experts." in name and quant is not None:
            fmt = fp4 if quant.experts == "fp4" else fp8
        elif t.dtype == torch.float8_e4m3fn or (quant is not None and name.endswith(".scale")):
            fmt = fp8  # (an FP8 linear's values and its block scales)
        else:
            fmt = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(stored_dtype(name, t), "other")
        out[fmt] = out.get(fmt, 0) + reads[name]
    return out


def _dtype(inputs: str) -> torch.dtype:
    return torch.bfloat16 if inputs == "bfloat16" else torch.float32


def floor_seconds(by_format: dict, read_gb_s: float, cores: int, rates: dict) -> float:
    """The least time reading `by_format` (format name -> bytes) can take: each format's bytes at the slower of
    `read_gb_s` and `cores` times its one-core decode rate `rates[format]` (GB/s; a format without a rate at the
    read), summed."""
    return sum(nbytes / 1e9 / min(read_gb_s, cores * rates.get(fmt, read_gb_s)) for fmt, nbytes in by_format.items())


def floor_note(floors: dict, read_seconds: dict, cores: int) -> str:
    """`bench formats`' note on the floor at batch 1: per row, the floor and the share of the read it allows."""
    rows = "; ".join(
        f"{row} {floors[row] * 1e3:.2f} ms (the read alone {read_seconds[row] * 1e3:.2f} ms: at most "
        f"{read_seconds[row] / floors[row]:.0%} of the read)"
        for row in floors
    )
    return (
        f"floor at batch 1, each weight at the slower of the read and {cores} cores' in-cache decode of its format: "
        f"{rows}; 'of floor' is the floor / the step"
    )
