"""The published DeepSeek-V4 checkpoint format, written: `leanserve quantize` and `make-random --format published`.

Layout (as DeepSeek publishes it, see docs CHECKPOINTS.md): DeepSeek's names without a `model.` prefix (`embed.weight`,
`head.weight`, `layers.N.attn.kv_norm.weight`, `hc_head_fn`, `mtp.0.*`); the attention, indexer-query, shared-expert
and MTP projection linears F8_E4M3 with a `.scale` F8_E8M0 per 128x128 block; routed experts unstacked
(`ffn.experts.E.w1/w2/w3.weight`) as I8 holding two FP4 e2m1 values per byte with a `.scale` F8_E8M0 per 32 inputs
(or, with expert_dtype fp8, F8_E4M3 with block scales); mHC, sinks, compressor position biases and router biases F32;
tid2eid I64; everything else (norms, embedding, head, router, compressors) BF16. config.json carries DeepSeek's
legacy field names plus `quantization_config` and the top-level `expert_dtype`. Quantizing uses power-of-two scales
and rounds to nearest (quant.quantize_fp8 / quantize_fp4).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from leanserve.model.build import build_model
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig, Quantization
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.loader import checkpoint_dtype, has_mtp_weights, load_weights, write_safetensors
from leanserve.model.quant import FP4_GROUP, quantize_fp4, quantize_fp8

EXPERT_DTYPES = ("fp4", "fp8")
_E8M0 = torch.float8_e8m0fnu
_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")
# Besides the weights and config.json, what `quantize` copies from the source directory.
_COPIED = ("generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
_COPIED_PREFIXES = ("tokenizer", "chat_template")


def quantized_config(cfg: ModelConfig, expert_dtype: str = "fp4") -> ModelConfig:
    """`cfg` as a published checkpoint's: FP8 linears, `expert_dtype` routed experts, bfloat16 elsewhere."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype {expert_dtype!r} is not supported; use 'fp4' or 'fp8'.")
    if expert_dtype == "fp4":
        for field in ("hidden_size", "moe_intermediate_size"):
            value = getattr(cfg, field)
            if value % FP4_GROUP:
                raise ConfigError(
                    f"{field} {value} is not a multiple of {FP4_GROUP}, which FP4 experts need; use expert_dtype 'fp8'."
                )
    return dataclasses.replace(cfg, quantization=Quantization(experts=expert_dtype), torch_dtype="bfloat16")


def published_config(cfg: ModelConfig) -> dict:
    """config.json in DeepSeek's legacy field names (`compress_ratios` with the MTP layer's entry,
    `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, ...) plus the quantization fields. transformers 5.24
    maps only the ratios 0 / 4 / 128 from `compress_ratios`, so other rates also write `layer_types`."""
    assert cfg.quantization is not None
    hf = cfg.to_hf_dict()
    drop = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor", "dtype")
    out = {k: v for k, v in hf.items() if k not in drop}
    rate = {SLIDING: 0, CSA: cfg.compress_rate_csa, HCA: cfg.compress_rate_hca}
    out["compress_ratios"] = [rate[t] for t in cfg.layer_types] + [0] * cfg.num_nextn_predict_layers
    if (cfg.compress_rate_csa, cfg.compress_rate_hca) != (4, 128):
        out["compress_rate_csa"], out["compress_rate_hca"] = cfg.compress_rate_csa, cfg.compress_rate_hca
        out["layer_types"] = list(cfg.layer_types)
    n_hash = cfg.mlp_layer_types.count(HASH_MOE)
    if list(cfg.mlp_layer_types) == [HASH_MOE] * n_hash + [MOE] * (cfg.num_hidden_layers - n_hash):
        out["num_hash_layers"] = n_hash
    else:
        out["mlp_layer_types"] = list(cfg.mlp_layer_types)
    out["qk_rope_head_dim"] = cfg.qk_rope_head_dim
    out["rope_theta"], out["compress_rope_theta"] = cfg.main_rope.theta, cfg.compress_rope.theta
    rope = cfg.compress_rope
    if rope.rope_type == "yarn":
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
        }
        if rope.attention_factor != 1.0:
            out["rope_scaling"]["attention_factor"] = rope.attention_factor
    out["torch_dtype"] = "bfloat16"
    return out


def _float_dtype(name: str) -> torch.dtype:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("hc_") or name.endswith(("attn_sink", "ape", "gate.bias")):
        return torch.float32
    return torch.bfloat16


def _fp8(name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    q = quantize_fp8(w)
    yield f"{name}.weight", q.q
    yield f"{name}.scale", q.scale.view(_E8M0)


def _expert(name: str, w: torch.Tensor, expert_dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    if expert_dtype == "fp8":
        yield from _fp8(name, w)
        return
    q = quantize_fp4(w)
    yield f"{name}.weight", q.packed.view(torch.int8)  # (DeepSeek stores the packed bytes as I8)
    yield f"{name}.scale", q.scale.view(_E8M0)


def iter_published(model: DeepseekV4, expert_dtype: str = "fp4") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of an unquantized `model` in the published layout (names, dtypes, quantized as published)."""
    if model.cfg.quantization is not None:
        raise ValueError("iter_published quantizes a model with plain weights; this one is quantized already.")
    qcfg = quantized_config(model.cfg, expert_dtype)
    with torch.device("meta"):  # which tensors the published format stores in FP8: the quantized model's own
        meta = DeepseekV4(qcfg, 1, model.stage, with_mtp=model.mtp is not None)
    fp8 = {n for n, t in meta.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    for name, tensor in model.state_dict().items():
        if name.endswith(".experts.w13"):
            base, inter = name.removesuffix(".w13"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield from _expert(f"{base}.{e}.w1", tensor[e, :inter], expert_dtype)
                yield from _expert(f"{base}.{e}.w3", tensor[e, inter:], expert_dtype)
        elif name.endswith(".experts.w2"):
            base = name.removesuffix(".w2")
            for e in range(tensor.shape[0]):
                yield from _expert(f"{base}.{e}.w2", tensor[e], expert_dtype)
        elif name in fp8:
            yield from _fp8(name.removesuffix(".weight"), tensor)
        elif tensor.is_floating_point():
            yield _KV_NORM.sub(r"\1.kv_norm.weight", name), tensor.to(_float_dtype(name))
        else:  # tid2eid
            yield name, tensor.to(torch.int64)


def parse_size(value: str | int | None) -> int | None:
    """ "500MB", "2GB", "1048576" -> bytes."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", value, re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {value!r} is not a size such as 500MB, 2GB or a number of bytes.")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def save_published(
    model: DeepseekV4, out_dir: str | Path, expert_dtype: str = "fp4", max_shard_size: str | int | None = None
) -> Path:
    """Writes config.json and the weights of an unquantized `model` in the published format: one
    model.safetensors, or shards of at most `max_shard_size` bytes with model.safetensors.index.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = published_config(quantized_config(model.cfg, expert_dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out, iter_published(model, expert_dtype), parse_size(max_shard_size))
    return out


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    expert_dtype: str = "fp4",
    force: bool = False,
    max_shard_size: str | int | None = None,
) -> Path:
    """`leanserve quantize`: a bf16 or float32 checkpoint (any layout the loader reads) -> the published format
    in `dst`, with the source's tokenizer files and generation_config.json."""
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_hf(src)
    if cfg.quantization is not None:
        raise ConfigError(
            f"{src} is already quantized (its config.json has a quantization_config); leanserve quantize reads "
            "bf16 or float32 checkpoints."
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not force:
        raise ValueError(f"{dst} exists and is not empty; pass --force to write into it.")
    quantized_config(cfg, expert_dtype)  # (FP4 needs its dimensions: fail before loading anything)
    # (in the source's dtype: the quantizers compute in float32 either way, and bf16 halves the memory)
    model = build_model(cfg, 1, checkpoint_dtype(src), with_mtp=cfg.has_mtp and has_mtp_weights(src), checkpoint=src)
    load_weights(model, src, progress=False)
    save_published(model, dst, expert_dtype, max_shard_size)
    for path in src.iterdir():
        if path.is_file() and (path.name in _COPIED or path.name.startswith(_COPIED_PREFIXES)):
            shutil.copy(path, dst / path.name)
    return dst
