"""The backend seam: which statement of the model's math a stage runs, chosen once when the stage is built.

The model's modules own the parameters and say what is computed, op by op, through `self.ops`, the stage's
backend; they hold no backend or device branches. Every op takes typed weights (model/weights.py) and
activations. A backend is a class with the methods of `TorchBackend` (torch.py: the torch statement of every op,
the reference); `CpuBackend` (cpu/) runs the numba kernels where they apply and falls back to TorchBackend's
statement for the rest.

`select_backend` is the one place that decides, from the device, the weight dtype and whether the kernels are
available; `build_model` hands the choice to every module (`set_backend`). A new device (CUDA) is a new backend
class in REGISTRY; a new weight format is a weight type the backends' `linears` / `experts` / `moe` take.
"""

from __future__ import annotations

import torch

from leanserve.model.backends.cpu import CpuBackend
from leanserve.model.backends.torch import TorchBackend

# name -> backend class, in the order "auto" tries them (the first that can run the stage).
REGISTRY: dict[str, type[TorchBackend]] = {"cpu": CpuBackend, "torch": TorchBackend}


def select_backend(device: str | torch.device, weight_dtype: torch.dtype, name: str = "auto") -> TorchBackend:
    """The backend a stage runs: "auto" takes the first of REGISTRY that can run on `device` with `weight_dtype`
    weights (the CPU kernels on a CPU for float32 or bfloat16 weights when numba is installed, else torch); a name
    asks for that one (a ValueError says why it cannot run)."""
    if name == "auto":
        return next(cls() for cls in REGISTRY.values() if cls.why_not(device, weight_dtype) is None)
    if name not in REGISTRY:
        raise ValueError(f"Unknown backend {name!r}; choose one of auto, {', '.join(REGISTRY)}.")
    cls = REGISTRY[name]
    why = cls.why_not(device, weight_dtype)
    if why is not None:
        raise ValueError(f"The {name} backend needs {cls.needs}, but {why}.")
    return cls()


__all__ = ["REGISTRY", "CpuBackend", "TorchBackend", "select_backend"]
