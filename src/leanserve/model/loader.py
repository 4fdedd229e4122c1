"""Strict safetensors loader: checkpoint names -> this stage's parameters.

Accepts DeepSeek's own names (`embed.weight`, `layers.N.attn.wq_a.weight`, `hc_head_fn`, `mtp.0.…`,
experts as `ffn.experts.E.w1/w2/w3.weight`) and the ones transformers writes (the same under a `model.`
prefix, plus `model.embed_tokens.weight` and `model.hc_head.hc_fn`). A tensor this stage does not own
(another stage's layer, or MTP weights when the MTP layer is not built) is skipped without being read;
anything else unknown, missing, or of the wrong shape is an error naming the tensor and the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

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


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
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
                if dtype is not None and "norm" not in name and len(tensor.get_shape()) == 2:
                    return dtype
    return torch.float32


@dataclass
class _Target:
    tensor: torch.Tensor
    view: Callable[[torch.Tensor], torch.Tensor]  # the part of `tensor` this checkpoint entry fills

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.view(self.tensor).shape)


def _targets(model: DeepseekV4) -> dict[str, _Target]:
    targets: dict[str, _Target] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(".experts.w13"):
            prefix, inter = name.removesuffix(".w13"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                targets[f"{prefix}.{e}.w1.weight"] = _Target(tensor, lambda t, e=e, i=inter: t[e, :i])
                targets[f"{prefix}.{e}.w3.weight"] = _Target(tensor, lambda t, e=e, i=inter: t[e, i:])
        elif name.endswith(".experts.w2"):
            prefix = name.removesuffix(".w2")
            for e in range(tensor.shape[0]):
                targets[f"{prefix}.{e}.w2.weight"] = _Target(tensor, lambda t, e=e: t[e])
        else:
            targets[name] = _Target(tensor, lambda t: t)
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


def load_weights(model: DeepseekV4, model_dir: str | Path, progress: bool = True) -> None:
    targets = _targets(model)
    files = checkpoint_files(model_dir)
    loaded: set[str] = set()
    total = sum(len(v) for v in files.values())
    with tqdm(
        total=total, desc="Loading weights", unit="tensor", disable=None if progress else True, leave=False
    ) as bar:
        for file, names in files.items():
            with _open(file) as f:
                for raw_name in names:
                    bar.update(1)
                    name = canonical_name(raw_name)
                    target = targets.get(name)
                    if target is None:
                        if _owned_elsewhere(name, model):
                            continue
                        raise CheckpointError(f"Unexpected tensor {raw_name!r} in {file}: it is not part of the model.")
                    if name in loaded:
                        raise CheckpointError(f"Tensor {raw_name!r} appears twice in the checkpoint ({file}).")
                    tensor = _read(f, raw_name, file)
                    if tuple(tensor.shape) != target.shape:
                        raise CheckpointError(
                            f"Tensor {raw_name!r} in {file} has shape {tuple(tensor.shape)}, expected {target.shape}."
                        )
                    target.view(target.tensor).copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(
            f"Missing tensor {', '.join(map(repr, missing[:3]))}{more} in the checkpoint at {model_dir}."
        )


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


def save_checkpoint(model: DeepseekV4, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
    """Writes config.json and model.safetensors in the layout transformers reads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in iter_state_for_save(model):
        if dtype is not None and tensor.is_floating_point() and not _keeps_fp32(name):
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous()
    hf = model.cfg.to_hf_dict()
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})


def _keeps_fp32(saved_name: str) -> bool:
    leaf = saved_name.rsplit(".", 1)[-1]
    return (
        leaf.startswith("hc_")
        or saved_name.endswith(("attn_sink", "ape", "gate.bias"))
        or "norm" in saved_name.rsplit(".", 2)[-2]
    )
