"""The memory ledger: every persistent tensor a stage allocates besides its weights, with the feature
that needs it, and the weights' bytes by stored format.

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
PENALTIES = "penalties"  # per-slot token counts, only while a running request has presence/frequency/repetition
PREFIX_CACHE = "prefix_cache"  # the window state at the prefix cache's cut points (engine/prefix_cache.py)


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


# Weight formats, as `weights_by_format` names them. A quantized weight's scales count with it: "fp8" is the
# e4m3 values plus their UE8M0 block scales, "fp4" the packed e2m1 values plus their UE8M0 group scales.
# Anything else is named by its dtype.
FORMAT_OF_DTYPE = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
}
FORMAT_ORDER = ("fp4", "fp8", "bf16", "fp16", "fp32")  # the order tables print them in (others after)


@dataclass
class StageMemory:
    """One stage's weights (bytes per stored format) and ledger."""

    stage: int
    weights_by_format: dict[str, int] = field(default_factory=dict)
    buffers: list[LedgerEntry] = field(default_factory=list)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_format.values())

    def add_weights(self, by_format: dict[str, int]) -> None:
        for fmt, n in by_format.items():
            self.weights_by_format[fmt] = self.weights_by_format.get(fmt, 0) + n

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
            "weights_by_format": dict(sorted_formats(self.weights_by_format)),
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

    def release(self, name: str) -> None:
        """Drops the entry of a tensor its owner no longer holds (a buffer that exists only while used)."""
        entry = self.memory.find(name)
        if entry is None:
            raise ValueError(f"ledger entry {name!r} is not registered")
        self.memory.buffers.remove(entry)


def weights_by_format(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of the parameters and persistent buffers (what a checkpoint fills), by stored format. The tensors
    of a quantized module (one with `quant` set: an FP8 Linear, FP4 or FP8 experts) are its format's, scale
    buffers included; the others are named by dtype (FORMAT_OF_DTYPE)."""
    quant_of = {name: m.quant for name, m in module.named_modules() if getattr(m, "quant", None) is not None}
    out: dict[str, int] = {}
    for key, t in module.state_dict().items():
        fmt = quant_of.get(key.rpartition(".")[0]) or FORMAT_OF_DTYPE.get(t.dtype, str(t.dtype).removeprefix("torch."))
        out[fmt] = out.get(fmt, 0) + t.numel() * t.element_size()
    return out


def weights_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters and persistent buffers, all formats together."""
    return sum(weights_by_format(module).values())


def sorted_formats(by_format: dict[str, int]) -> list[tuple[str, int]]:
    rank = {f: i for i, f in enumerate(FORMAT_ORDER)}
    return sorted(by_format.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))


def format_gb(n: int) -> str:
    """Decimal gigabytes, as checkpoint sizes are published (159.6 GB = 148.6 GiB)."""
    return f"{n / 1e9:.2f} GB"


def format_weights(by_format: dict[str, int]) -> str:
    """'fp4 74.00 GiB, fp8 …' (scales counted with their format)."""
    return ", ".join(f"{fmt} {format_bytes(n)}" for fmt, n in sorted_formats(by_format) if n) or "none"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | str, name: str) -> int:
    """A size in bytes from an int or a string such as "20GiB", "512 MiB", "1.5GB" or "4096"; ValueError naming
    `name` when it is not one, or is negative."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be a size in bytes such as 20GiB, got {value!r}.")
    if isinstance(value, int):
        n = value
    else:
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("kmgtib")
        unit = text[len(digits) :]
        try:
            number = float(digits)
        except ValueError:
            number = None
        if number is None or unit not in _UNITS or number != number:
            raise ValueError(f"{name} must be a size in bytes such as 20GiB, got {value!r}.")
        n = int(number * _UNITS[unit])
    if n < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}.")
    return n


def format_table(stages: list[StageMemory]) -> str:
    """A readable table: per stage, its weights (in total, then by format: scales counted with their fp8 / fp4
    values), then one row per buffer, then a per-feature summary; with more than one stage, the total."""
    lines = []
    header = f"{'name':<34} {'owner':<22} {'feature':<18} {'dtype':<10} {'shape':<20} {'bytes':>12}"
    for s in stages:
        lines.append(
            f"stage {s.stage}: weights {format_bytes(s.weights_bytes)} ({format_gb(s.weights_bytes)}), "
            f"buffers {format_bytes(s.buffers_bytes)}"
        )
        lines.append(f"  weights by format: {format_weights(s.weights_by_format)}")
        lines.append("  " + header)
        for e in s.buffers:
            shape = "x".join(map(str, e.shape))
            lines.append(
                f"  {e.name:<34} {e.owner:<22} {e.feature:<18} {e.dtype:<10} {shape:<20} {format_bytes(e.bytes):>12}"
            )
        summary = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(s.by_feature().items()))
        lines.append(f"  by feature: {summary or 'none'}")
    if len(stages) > 1:
        total: dict[str, int] = {}
        for s in stages:
            for fmt, n in s.weights_by_format.items():
                total[fmt] = total.get(fmt, 0) + n
        weights, buffers = sum(total.values()), sum(s.buffers_bytes for s in stages)
        lines.append(
            f"all stages: weights {format_bytes(weights)} ({format_gb(weights)}; {format_weights(total)}), "
            f"buffers {format_bytes(buffers)}"
        )
    return "\n".join(lines)
