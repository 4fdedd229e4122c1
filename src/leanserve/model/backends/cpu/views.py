"""Typed weights as the kernels read them: each tensor replaced by its numpy view, made once and kept while the
tensors keep their storage (making them costs about a microsecond a tensor, dozens a layer, more than a
decode step's arithmetic at batch 1)."""

from __future__ import annotations

import dataclasses

import torch

from leanserve.model.backends.cpu import kernels as ck


def numpy_views(obj):
    """A typed weights value (a dataclass of tensors, nested ones and constants) with each tensor replaced by its
    numpy view (bfloat16 as raw uint16 bits)."""
    if isinstance(obj, torch.Tensor):
        return ck.weight_np(obj)
    if dataclasses.is_dataclass(obj):
        return type(obj)(**{f.name: numpy_views(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, tuple):
        return tuple([numpy_views(o) for o in obj])
    return obj


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor of a typed weights value."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, tuple):
        return [t for o in obj for t in tensors_of(o)]
    return []


def data_ptrs(tensors: list[torch.Tensor]) -> list[int]:
    """Where each tensor's storage is: views of them are current while these stay the same."""
    return list(map(torch.Tensor.data_ptr, tensors))


class KeptViews:
    """numpy views of typed weights, kept per weights object (the model makes its typed weights once, see
    DeepseekV4.forget_weights) and made again when one of its tensors changes storage (`.data =`)."""

    def __init__(self) -> None:
        # (id(w), what) -> (w, its tensors, their pointers, the views); w is kept so that its id is not reused
        self._kept: dict[tuple[int, str], tuple] = {}

    def get(self, w, what: str = "views", make=numpy_views):
        """make(w) (default: numpy_views(w)), kept while w's tensors keep their storage."""
        key = (id(w), what)
        kept = self._kept.get(key)
        if kept is None or data_ptrs(kept[1]) != kept[2]:
            tensors = tensors_of(w)
            kept = self._kept[key] = (w, tensors, data_ptrs(tensors), make(w))
        return kept[3]
