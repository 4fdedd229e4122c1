"""Step metadata: the compiled builder for steps of short chunks equals the general numpy builder."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from leanserve.model import batch
from leanserve.model.backends.cpu import kernels as cpu_kernels
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.cache import CacheGeometry
from leanserve.model.config import ModelConfig

pytestmark = pytest.mark.skipif(batch._short_kernels is None, reason="numba is not installed")


def _fields(obj, path: str = ""):
    """(path, value) of every tensor / scalar in a ForwardBatch, recursively."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _fields(obj[k], f"{path}[{k}]")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _fields(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _fields(getattr(obj, f.name), f"{path}.{f.name}")
    else:
        yield path, obj


@pytest.mark.parametrize("num_spec", [0, 1, 3])
def test_short_chunks_metadata_equals_the_general_builder(tiny_ckpt, num_spec):
    cfg = ModelConfig.from_hf(tiny_ckpt)
    geo = CacheGeometry.build(cfg, num_slots=6, max_model_len=256, num_spec_tokens=num_spec)
    rng = random.Random(num_spec)
    shorts = 0
    for _ in range(60):
        slots = rng.sample(range(6), rng.randint(1, 6))
        # positions near 0 (window 0 of CSA has no previous window) and across compression boundaries
        chunks = [
            Chunk(
                s,
                rng.choice([0, 1, 3, 7, 15, 16, 63, 64, rng.randint(0, 200)]),
                [rng.randint(3, 99)] * rng.randint(1, num_spec + 1),
            )
            for s in slots
        ]
        total = sum(len(c.token_ids) for c in chunks)
        logits_index = sorted(rng.sample(range(total), rng.randint(1, total)))
        fast = build_forward_batch(chunks, geo, logits_index=logits_index)
        with cpu_kernels.disabled():
            general = build_forward_batch(chunks, geo, logits_index=logits_index)
        shorts += batch._all_short(torch.tensor([len(c.token_ids) for c in chunks]).numpy(), geo)
        got, want = dict(_fields(fast)), dict(_fields(general))
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (key, chunks)
            else:
                assert got[key] == value, (key, chunks)
    assert shorts == 60  # every step took the compiled builder
