"""Strict safetensors loader: checkpoint names -> this stage's parameters.

Accepts DeepSeek's own names (`embed.weight`, `layers.N.attn.wq_a.weight`, `attn.kv_norm`, `hc_head_fn`,
`mtp.0.…`, experts as `ffn.experts.E.w1/w2/w3.weight`) and the ones transformers writes (the same under a
`model.` prefix, plus `model.embed_tokens.weight`, `model.hc_head.hc_fn` and `attn.norm`). A published
checkpoint (config with quantization_config) loads as stored: F8_E4M3 linears with their `.scale` (F8_E8M0 or
U8 bytes), routed experts as I8-packed FP4 (or F8_E4M3) with theirs, the bytes reinterpreted, never converted.
A tensor this stage does not own (another stage's layer, or MTP weights when the MTP layer is not built) is
skipped without being read. Before anything is read, `check_checkpoint` compares the safetensors headers
with the model (which may still be on the meta device): anything unknown, missing, duplicated, of the wrong
shape or stored in the wrong dtype for the config is an error naming the tensor and the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

if TYPE_CHECKING:
    from leanserve.model.deepseek_v4 import DeepseekV4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


class CheckpointError(ValueError):
    pass


_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.kv_norm\.weight$")


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    name = _KV_NORM.sub(r"\1.norm.weight", name)  # DeepSeek's `attn.kv_norm`; transformers writes `attn.norm`
    return _ALIASES.get(name, name)


def checkpoint_files(model_dir: str | Path) -> dict[str, list[str]]:
    """File -> tensor names, from the shard index or the single file's header."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}).") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(str(model_dir / file), []).append(name)
        for file in files:
            if not Path(file).is_file():
                raise CheckpointError(f"{index} lists {Path(file).name}, which is missing.")
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"No {SINGLE_FILE} or {INDEX_FILE} in {model_dir}; leanserve loads safetensors only.")
    with _open(single) as f:
        return {str(single): list(f.keys())}


def has_mtp_weights(model_dir: str | Path) -> bool:
    return any(canonical_name(n).startswith("mtp.") for names in checkpoint_files(model_dir).values() for n in names)


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    for file, names in checkpoint_files(model_dir).items():
        with _open(file) as f:
            for name in names:
                tensor = f.get_slice(name)
                dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(tensor.get_dtype())
                # (the parameters kept in float32 whatever the model's dtype say nothing: norms, mHC, sinks)
                if dtype is not None and not _keeps_fp32(name) and len(tensor.get_shape()) == 2:
                    return dtype
    return torch.float32


# safetensors dtype names: what each kind of model tensor may be stored as.
_FLOATS = ("F32", "BF16", "F16")
_STORED_AS = {
    "float": _FLOATS,
    "fp8": ("F8_E4M3",),
    "fp4": ("I8", "U8"),  # two FP4 e2m1 values per byte (DeepSeek writes I8: the bytes are reinterpreted)
    "scale": ("F8_E8M0", "U8"),  # UE8M0 exponents, one byte each
    "index": ("I64", "I32"),
}
_QUANTIZED_DTYPES = ("F8_E4M3", "F8_E8M0", "I8", "U8")


@dataclass
class _Target:
    tensor: torch.Tensor
    view: Callable[[torch.Tensor], torch.Tensor]  # the part of `tensor` this checkpoint entry fills
    kind: str = "float"  # float | fp8 | fp4 | scale | index: see _STORED_AS

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.view(self.tensor).shape)


def _kind(name: str, tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.float8_e4m3fn:
        return "fp8"
    if tensor.dtype == torch.uint8:
        return "scale" if name.endswith(("scale", "_scale")) else "fp4"
    return "float" if tensor.is_floating_point() else "index"


def _targets(model: DeepseekV4) -> dict[str, _Target]:
    """Checkpoint name -> the model tensor (or the part of it) that it fills. Stacked experts take their
    checkpoint rows: w1 / w3 the halves of w13 (and of w13_scale: rows for FP4, scale grids 0 / 1 for FP8)."""
    targets: dict[str, _Target] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        kind = _kind(name, tensor)
        if name.endswith(".experts.w13") or name.endswith(".experts.w13_scale"):
            prefix, leaf = name.rsplit(".", 1)
            suffix = "scale" if leaf.endswith("_scale") else "weight"
            inter = state[f"{prefix}.w13"].shape[1] // 2
            fp8_grid = suffix == "scale" and tensor.dim() == 4  # FP8 experts: [E, 2, blocks(I), blocks(H)]
            for e in range(tensor.shape[0]):
                if fp8_grid:
                    w1, w3 = (lambda t, e=e: t[e, 0]), (lambda t, e=e: t[e, 1])
                else:
                    w1, w3 = (lambda t, e=e, i=inter: t[e, :i]), (lambda t, e=e, i=inter: t[e, i:])
                targets[f"{prefix}.{e}.w1.{suffix}"] = _Target(tensor, w1, kind)
                targets[f"{prefix}.{e}.w3.{suffix}"] = _Target(tensor, w3, kind)
        elif name.endswith(".experts.w2") or name.endswith(".experts.w2_scale"):
            prefix, leaf = name.rsplit(".", 1)
            suffix = "scale" if leaf.endswith("_scale") else "weight"
            fp8_grid = suffix == "scale" and tensor.dim() == 4  # [E, 1, blocks(H), blocks(I)]
            for e in range(tensor.shape[0]):
                view = (lambda t, e=e: t[e, 0]) if fp8_grid else (lambda t, e=e: t[e])
                targets[f"{prefix}.{e}.w2.{suffix}"] = _Target(tensor, view, kind)
        else:
            targets[name] = _Target(tensor, lambda t: t, kind)
    return targets


_TOP_LEVEL = ("embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


def _owned_elsewhere(name: str, model: DeepseekV4) -> bool:
    """True for a tensor of the architecture that this model does not hold: another stage's layer or
    embedding/head, or the MTP layer when it is not built. Called only for names the model lacks."""
    if name in _TOP_LEVEL:
        return True
    match = re.match(r"^(layers|mtp)\.(\d+)\.", name)
    if not match:
        return False
    index, cfg, stage = int(match.group(2)), model.cfg, model.stage
    if match.group(1) == "layers":
        return index < cfg.num_hidden_layers and not stage.first_layer <= index < stage.end_layer
    return model.mtp is None and index < max(cfg.num_nextn_predict_layers, 1)


@dataclass
class _Entry:
    file: str
    raw_name: str
    name: str
    target: _Target


def check_checkpoint(model: DeepseekV4, model_dir: str | Path) -> list[_Entry]:
    """Checks the checkpoint's safetensors headers (names, dtypes, shapes; no tensor data is read) against
    `model`, which may be on the meta device: every error names the tensor (or field) and the file. Returns
    what to load, file by file."""
    targets = _targets(model)
    files = checkpoint_files(model_dir)
    config = Path(model_dir) / "config.json"
    quant = model.cfg.quantization
    entries: list[_Entry] = []
    headers: list[tuple[str, tuple[int, ...]]] = []  # (safetensors dtype, shape) of each entry
    seen: dict[str, str] = {}
    for file, names in files.items():
        with _open(file) as f:
            for raw_name in names:
                name = canonical_name(raw_name)
                target = targets.get(name)
                if target is None:
                    if _owned_elsewhere(name, model):
                        continue
                    if quant is None and name.endswith(".scale"):
                        raise CheckpointError(
                            f"Tensor {raw_name!r} in {file} is a quantization scale, but {config} has no "
                            "quantization_config (a published checkpoint's config declares its FP8 format)."
                        )
                    raise CheckpointError(f"Unexpected tensor {raw_name!r} in {file}: it is not part of the model.")
                if name in seen:
                    raise CheckpointError(f"Tensor {raw_name!r} appears twice in the checkpoint ({file}).")
                seen[name] = raw_name
                try:
                    header = f.get_slice(raw_name)
                    stored, shape = header.get_dtype(), tuple(header.get_shape())
                except (SafetensorError, RuntimeError, OSError) as e:
                    raise CheckpointError(f"Cannot read tensor {raw_name!r} from {file}: {e}.") from None
                headers.append((stored, shape))
                entries.append(_Entry(file, raw_name, name, target))
    # Dtypes first (a format that does not match the config), then shapes.
    for entry, (stored, _) in zip(entries, headers, strict=True):
        _check_dtype(entry.raw_name, entry.file, stored, entry.target.kind, model.cfg, config)
    for entry, (_, shape) in zip(entries, headers, strict=True):
        if shape != entry.target.shape:
            raise CheckpointError(
                f"Tensor {entry.raw_name!r} in {entry.file} has shape {shape}, expected {entry.target.shape}"
                f"{_shape_hint(entry.target)}."
            )
    missing = sorted(set(targets) - set(seen))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(
            f"Missing tensor {', '.join(map(repr, missing[:3]))}{more} in the checkpoint at {model_dir}."
        )
    return entries


def _check_dtype(raw_name: str, file: str, stored: str, kind: str, cfg, config: Path) -> None:
    if stored in _STORED_AS[kind]:
        return
    what = f"Tensor {raw_name!r} in {file} is stored as {stored}"
    quant = cfg.quantization
    if kind == "float" and stored in _QUANTIZED_DTYPES:
        if quant is None:
            raise CheckpointError(
                f"{what} (a quantized format), but {config} has no quantization_config; a published checkpoint's "
                "config declares it."
            )
        raise CheckpointError(f"{what}, but this tensor is never quantized: it must be F32, BF16 or F16.")
    if kind == "fp8":
        expert = ".experts." in raw_name
        field = "expert_dtype 'fp8'" if expert else "quantization_config (fp8)"
        hint = " (I8 is packed FP4: expert_dtype 'fp4')" if stored in ("I8", "U8") else ""
        raise CheckpointError(f"{what}, but the config's {field} says F8_E4M3{hint} ({config}).")
    if kind == "fp4":
        raise CheckpointError(
            f"{what}, but the config's expert_dtype 'fp4' says I8 (two FP4 values per byte) ({config})."
        )
    if kind == "scale":
        raise CheckpointError(f"{what}; a UE8M0 scale must be F8_E8M0 (or its bytes as U8).")
    expected = " or ".join(_STORED_AS[kind])
    raise CheckpointError(f"{what}, expected {expected}.")


def _shape_hint(target: _Target) -> str:
    if target.kind == "fp4":
        return " (FP4 packs two values per byte: the inner dimension is half the config's input size)"
    if target.kind == "scale":
        per_row = target.tensor.dim() == 3  # FP4 experts' scales [E, out, in / 32]
        return f" (one UE8M0 scale per {'32 inputs of a row' if per_row else '128x128 block'})"
    return ""


def load_weights(model: DeepseekV4, model_dir: str | Path, progress: bool = True) -> None:
    """Fills every parameter and persistent buffer of `model` from the checkpoint; the headers are checked
    first (check_checkpoint), so a bad checkpoint fails before any tensor is read."""
    entries = check_checkpoint(model, model_dir)
    with tqdm(
        total=len(entries), desc="Loading weights", unit="tensor", disable=None if progress else True, leave=False
    ) as bar:
        by_file: dict[str, list[_Entry]] = {}
        for entry in entries:
            by_file.setdefault(entry.file, []).append(entry)
        for file, file_entries in by_file.items():
            with _open(file) as f:
                for entry in file_entries:
                    bar.update(1)
                    tensor = _read(f, entry.raw_name, file)
                    target = entry.target
                    if target.kind in ("fp4", "scale"):  # bytes as they are: never convert the values
                        tensor = tensor.view(torch.uint8)
                    target.view(target.tensor).copy_(tensor)


def _read(f, name: str, file: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except (SafetensorError, RuntimeError, OSError) as e:
        raise CheckpointError(f"Cannot read tensor {name!r} from {file}: {e}. The file may be truncated.") from None


class _open:
    # safe_open with the errors of a corrupt or truncated file turned into one clear message.
    def __init__(self, file: str | Path) -> None:
        self.file = str(file)

    def __enter__(self):
        try:
            self.handle = safe_open(self.file, framework="pt")
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{self.file} is not a readable safetensors file ({e}).") from None
        return self.handle.__enter__()

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)


def iter_state_for_save(model: DeepseekV4, prefix: str = "model.") -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under the names transformers writes (so both engines load the file):
    trunk under `model.`, experts unstacked, `head.weight` and `mtp.*` without the prefix."""
    for name, tensor in model.state_dict().items():
        if name.endswith(".experts.w13"):
            base, inter = name.removesuffix(".w13"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield _saved_name(f"{base}.{e}.w1.weight", prefix), tensor[e, :inter]
                yield _saved_name(f"{base}.{e}.w3.weight", prefix), tensor[e, inter:]
        elif name.endswith(".experts.w2"):
            base = name.removesuffix(".w2")
            for e in range(tensor.shape[0]):
                yield _saved_name(f"{base}.{e}.w2.weight", prefix), tensor[e]
        else:
            yield _saved_name(name, prefix), tensor


def _saved_name(name: str, prefix: str) -> str:
    if name == "embed.weight":
        return f"{prefix}embed_tokens.weight"
    if name.startswith("hc_head_"):
        return f"{prefix}hc_head.hc_{name.removeprefix('hc_head_')}"
    if name == "head.weight" or name.startswith("mtp."):
        return name
    return prefix + name


def save_checkpoint(
    model: DeepseekV4, out_dir: str | Path, dtype: torch.dtype | None = None, max_shard_size: int | None = None
) -> None:
    """Writes config.json and the weights in the layout transformers reads: model.safetensors, or shards of at
    most `max_shard_size` bytes with an index (write_safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_state_for_save(model):
            if dtype is not None and tensor.is_floating_point() and not _keeps_fp32(name):
                tensor = tensor.to(dtype)
            yield name, tensor

    hf = model.cfg.to_hf_dict()
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_safetensors(out, tensors(), max_shard_size)


def write_safetensors(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_size: int | None) -> None:
    """Writes (name, tensor) pairs into `out` as model.safetensors, or, with `max_shard_size` bytes, as shards
    model-0000i-of-0000n.safetensors with model.safetensors.index.json (one shard in memory at a time: safetensors
    copies what it writes). Removes the weight files of an earlier write."""
    from safetensors.torch import save_file

    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shard: dict[str, torch.Tensor] = {}
    files: list[tuple[str, list[str]]] = []
    size = total = 0

    def flush() -> None:
        file = f"part-{len(files):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        files.append((file, list(shard)))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_size is not None and shard and size + nbytes > max_shard_size:
            flush()
            size = 0
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (out / files[0][0]).rename(out / SINGLE_FILE)
        return
    weight_map = {}
    for i, (file, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / file).rename(out / final)
        weight_map |= dict.fromkeys(names, final)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _keeps_fp32(saved_name: str) -> bool:
    leaf = saved_name.rsplit(".", 1)[-1]
    return (
        leaf.startswith("hc_")
        or saved_name.endswith(("attn_sink", "ape", "gate.bias"))
        or "norm" in saved_name.rsplit(".", 2)[-2]
    )
