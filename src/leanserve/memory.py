"""The memory ledger: every persistent tensor a stage allocates besides its weights, with the feature
that needs it.

Caches, derived tables, the target-hidden buffer and pipeline staging buffers are all allocated through
`MemoryLedger.empty/zeros` (or adopted with `register`), so the ledger is the list of what exists, not a
separate estimate of it. A feature that is off allocates nothing and therefore has no entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

# Features named in the ledger.
KV_CACHE = "kv_cache"  # attention caches of the trunk's layers
ROPE = "rope"  # rotary tables
PIPELINE = "pipeline_parallel"  # staging for streams received from the previous stage
SPEC_MTP = "spec_decode:mtp"  # the MTP drafter: its layer cache, the target-hidden buffer, draft probabilities
SPEC_DRAFT = "spec_decode:draft_model"  # a draft model's caches, tables and draft probabilities


@dataclass(frozen=True)
class LedgerEntry:
    name: str
    owner: str  # the module or component that holds the tensor
    feature: str  # what it is for; one of the feature names above
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    stage: int

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}


@dataclass
class StageMemory:
    """One stage's weights and ledger."""

    stage: int
    weights_bytes: int = 0
    buffers: list[LedgerEntry] = field(default_factory=list)

    @property
    def buffers_bytes(self) -> int:
        return sum(e.bytes for e in self.buffers)

    def by_feature(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.buffers:
            out[e.feature] = out.get(e.feature, 0) + e.bytes
        return out

    def find(self, name: str) -> LedgerEntry | None:
        return next((e for e in self.buffers if e.name == name), None)

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "weights_bytes": self.weights_bytes,
            "buffers": [{k: v for k, v in e.to_dict().items() if k != "stage"} for e in self.buffers],
        }


class MemoryLedger:
    """Allocates and records one stage's persistent non-weight tensors."""

    def __init__(self, stage: int, device: torch.device | str = "cpu") -> None:
        self.stage, self.device = stage, torch.device(device)
        self.memory = StageMemory(stage)

    def register(self, name: str, owner: str, feature: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.memory.find(name) is not None:
            raise ValueError(f"ledger entry {name!r} registered twice")
        self.memory.buffers.append(
            LedgerEntry(
                name=name,
                owner=owner,
                feature=feature,
                bytes=tensor.numel() * tensor.element_size(),
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                device=str(tensor.device),
                stage=self.stage,
            )
        )
        return tensor

    def zeros(self, name: str, owner: str, feature: str, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        return self.register(name, owner, feature, torch.zeros(tuple(shape), dtype=dtype, device=self.device))

    def empty(self, name: str, owner: str, feature: str, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        return self.register(name, owner, feature, torch.empty(tuple(shape), dtype=dtype, device=self.device))


def weights_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters and persistent buffers (what a checkpoint fills)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_table(stages: list[StageMemory]) -> str:
    """A readable table: per stage, its weights, then one row per buffer, then a per-feature summary."""
    lines = []
    header = f"{'name':<34} {'owner':<22} {'feature':<18} {'dtype':<10} {'shape':<20} {'bytes':>12}"
    for s in stages:
        lines.append(
            f"stage {s.stage}: weights {format_bytes(s.weights_bytes)}, buffers {format_bytes(s.buffers_bytes)}"
        )
        lines.append("  " + header)
        for e in s.buffers:
            shape = "x".join(map(str, e.shape))
            lines.append(
                f"  {e.name:<34} {e.owner:<22} {e.feature:<18} {e.dtype:<10} {shape:<20} {format_bytes(e.bytes):>12}"
            )
        summary = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(s.by_feature().items()))
        lines.append(f"  by feature: {summary or 'none'}")
    return "\n".join(lines)
