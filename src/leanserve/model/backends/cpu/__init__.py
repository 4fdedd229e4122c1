"""The CPU backend. Read bottom-up: `kernels/` (the numba kernels), `views.py` (typed weights as numpy views),
`arrays.py` (the model's pieces as kernel calls on numpy arrays), `decode.py` (a decode-sized step whole),
`backend.py` (CpuBackend: which op takes the kernels, at which sizes)."""

from leanserve.model.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
