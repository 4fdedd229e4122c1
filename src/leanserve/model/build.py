"""Building a stage's model: the modules on the meta device, the checkpoint's headers checked against them, storage
allocated on the device, the backend chosen and handed to every module. (Here rather than in deepseek_v4.py so
that the model does not import the loader, which imports the model.)"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import torch

from leanserve.model.backends import select_backend
from leanserve.model.config import ModelConfig
from leanserve.model.deepseek_v4 import DeepseekV4, StageLayout
from leanserve.model.layers import Linear, Rotary, set_backend
from leanserve.model.loader import check_checkpoint
from leanserve.model.moe import Experts
from leanserve.model.quant import INPUTS, check_inputs

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64


def empty(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Uninitialised storage for a (meta) tensor's shape and dtype on `device`. On a CPU a tensor of at least two huge
    pages gets memory of its own advised for transparent huge pages (madvise; where the kernel grants them): a
    decode step streams every weight, and 2 MiB pages take the page walks of 4 KiB ones off those reads. Exactly
    its bytes, so the memory ledger's figures stay the tensors' own."""
    nbytes = t.numel() * t.element_size()
    if torch.device(device).type != "cpu" or nbytes < 2 * HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one would be shmem)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype = torch.float32,
    stage: StageLayout | None = None,
    with_mtp: bool = False,
    device: str = "cpu",
    backend: str = "auto",
    checkpoint: str | Path | None = None,
    fp4_inputs: str = "float32",
    fp8_inputs: str = "float32",
) -> DeepseekV4:
    """Builds on the meta device (no init cost), then allocates uninitialised storage on `device`; the
    loader (or a random init) must fill every parameter and persistent buffer. With `checkpoint` (a model
    directory), its safetensors headers are checked against the meta model first, so a checkpoint that does
    not fit fails before anything is allocated. The stage's backend is chosen here, once (see
    backends.select_backend), and sets the activations' dtype. `fp4_inputs` / `fp8_inputs` (float32 or bfloat16;
    int8 too for FP4): what the FP4 experts / the FP8 weights of a published checkpoint multiply (a quantized
    weight's `inputs`); a rounding where the model has no such weights is an error (it would change nothing)."""
    quant = cfg.quantization
    check_inputs(fp4_inputs, fp8_inputs, quant is not None and quant.experts == "fp4", quant is not None)
    ops = select_backend(device, dtype, backend)
    with torch.device("meta"), _default_dtype(dtype):
        model = DeepseekV4(cfg, max_positions, stage, with_mtp)
    if checkpoint is not None:
        check_checkpoint(model, checkpoint)
    # (as to_empty, but torch.empty: empty_like of a meta tensor runs torch's Python reference, whose first call
    # imports sympy, slowing every process's start-up)
    model._apply(lambda t: empty(t, device))
    set_backend(model, ops)
    for m in model.modules():
        if isinstance(m, Experts):
            m.fp4_inputs, m.fp8_inputs = INPUTS[fp4_inputs], INPUTS[fp8_inputs]
        elif isinstance(m, Linear) and m.quant == "fp8":
            m.inputs = INPUTS[fp8_inputs]
    model.act_dtype = ops.activation_dtype(dtype)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset_tables()
    return model.eval().requires_grad_(False)
