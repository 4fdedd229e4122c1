"""`leanserve make-random`: random-weight DeepSeek-V4 checkpoints that both leanserve and transformers load, in
transformers' layout or in the published one (FP8 / FP4, DeepSeek's names: `--format published`).

Every parameter and buffer gets non-degenerate values. transformers' own init zeroes the mHC bases,
attention sinks, router biases, compressor position biases and hash tables, which would hide bugs in
exactly those paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from leanserve.model.build import build_model
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, RopeConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.layers import RMSNorm
from leanserve.model.loader import save_checkpoint

PRESETS: dict[str, dict[str, Any]] = {
    # As small as possible while keeping every path: all three attention kinds, both MoE kinds, YaRN,
    # windows and compression rates small enough that short prompts cross several boundaries.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        hc_mult=4,
        sliding_window=16,
        compress_rate_csa=4,
        compress_rate_hca=16,
        index_n_heads=16,  # enough heads that the indexer's ReLU scores rarely tie exactly
        index_head_dim=32,
        index_topk=4,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        max_position_embeddings=1024,
        compress_rope=RopeConfig(theta=160000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    ),
    # DeepSeek-V4's real per-head shapes (head_dim 512, 64 rope dims, indexer head 128, compress rates 4 and
    # 128, 64 experts top-6), with few heads, layers and experts: other engines hard-code those shapes.
    "small": dict(
        vocab_size=4096,
        hidden_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=256,
        o_groups=2,
        o_lora_rank=256,
        n_routed_experts=64,
        num_experts_per_tok=6,
        hc_mult=4,
        sliding_window=128,
        compress_rate_csa=4,
        compress_rate_hca=128,
        index_n_heads=8,
        index_head_dim=128,
        index_topk=64,
        layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        max_position_embeddings=65536 * 16,
        compress_rope=RopeConfig(theta=160000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536),
    ),
}


def preset_config(preset: str, **overrides: Any) -> ModelConfig:
    """A preset's config; overrides replace fields (layer_types / mlp_layer_types must match the layer count)."""
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    fields = {**PRESETS[preset], "torch_dtype": "float32", **overrides}
    return ModelConfig(**fields)


@torch.no_grad()
def randomize_(model: DeepseekV4, seed: int, by_slice: bool = False) -> DeepseekV4:
    """by_slice: stacked tensors (the experts) drawn one slice at a time, so that the float32 draws of a bfloat16
    model at real scale fit in memory (other values than the default's, for the same seed)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        if by_slice and t.dim() == 3:
            for part in t:
                part.copy_(torch.randn(part.shape, generator=gen) * std + mean)
            return
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if id(p) in norms:
            normal(p, 0.1, mean=1.0)
        elif leaf.endswith("_scale"):  # mHC scales: positive, around 1
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf.endswith("_fn"):
            normal(p, 1.0 / p.shape[1] ** 0.5)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape"):
            normal(p, 0.5)
        elif name.endswith("gate.bias"):
            normal(p, 0.1)
        elif leaf == "weight" and name.endswith("embed.weight"):
            normal(p, 1.0)
        else:  # projections [out, in] and stacked experts [E, out, in]: unit-variance outputs
            normal(p, 1.0 / p.shape[-1] ** 0.5)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):  # k distinct experts per token id
            num_experts = model.cfg.n_routed_experts
            buf.copy_(torch.rand(buf.shape[0], num_experts, generator=gen).argsort(dim=-1)[:, : buf.shape[1]])
    return model


def make_random(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    format: str = "hf",
    expert_dtype: str = "fp4",
    max_shard_size: str | int | None = None,
    tokenizer: str | Path | None = None,
    chat_tokens: bool = False,
    **overrides,
) -> Path:
    """format "hf": transformers' layout in `dtype`; "published": DeepSeek's (FP8 linears, `expert_dtype` experts,
    see leanserve.quantize), the random float32 weights quantized. `tokenizer`: a model directory whose tokenizer
    files (and generation_config.json) are copied; the vocabulary is the tokenizer's (its size, its bos / eos ids)
    instead of the preset's. `chat_tokens`: DeepSeek-V4's chat tokens added to it (leanserve.chat_tokens)."""
    if chat_tokens and tokenizer is None:
        raise ValueError("chat_tokens needs a tokenizer to add them to; give tokenizer=DIR (--tokenizer DIR).")
    if tokenizer is not None:
        overrides = {**_tokenizer_fields(Path(tokenizer), overrides), **overrides}
    cfg = preset_config(preset, **overrides)
    if format == "published":
        from leanserve.quantize import quantized_config, save_published

        quantized_config(cfg, expert_dtype)  # (dimensions FP4 cannot store: fail before building anything)
    elif format != "hf":
        raise ValueError(f"Unknown checkpoint format {format!r}; choose 'hf' or 'published'.")
    out = Path(out_dir)
    if chat_tokens:  # the plain checkpoint in a scratch directory beside `out`, then grown into `out`
        import shutil
        import tempfile

        from leanserve.chat_tokens import add_chat_tokens

        out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            make_random(scratch, preset, seed, dtype, format, expert_dtype, max_shard_size, tokenizer, **overrides)
            add_chat_tokens(scratch, out, seed=seed, force=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return out
    model = build_model(cfg, max_positions=1, with_mtp=cfg.has_mtp)
    randomize_(model, seed)
    if format == "published":
        save_published(model, out, expert_dtype, max_shard_size)
    else:
        save_checkpoint(model, out, dtype=getattr(torch, dtype) if dtype != "float32" else None)
    if tokenizer is not None:
        _copy_tokenizer(Path(tokenizer), out)
    return out


# What `tokenizer=DIR` copies: the tokenizer's files and the generation config that names its eos ids.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _tokenizer_fields(tok_dir: Path, overrides: dict) -> dict[str, Any]:
    """The config fields a tokenizer decides: vocab_size (its size with added tokens) and the bos / eos / pad ids
    (from tok_dir's generation_config.json or config.json, when it has them)."""
    from leanserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    if tok is None:
        raise ValueError(f"{tok_dir} has no tokenizer.json to copy.")
    if overrides.get("vocab_size", tok.vocab_size) != tok.vocab_size:
        raise ValueError(
            f"vocab_size {overrides['vocab_size']} differs from the {tok.vocab_size} ids of the tokenizer in {tok_dir}."
        )
    fields: dict[str, Any] = {"vocab_size": tok.vocab_size}
    for name in ("config.json", "generation_config.json"):  # (the generation config wins)
        path = tok_dir / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        if isinstance(raw.get("bos_token_id"), int):
            fields["bos_token_id"] = raw["bos_token_id"]
        if isinstance(raw.get("pad_token_id"), int):
            fields["pad_token_id"] = raw["pad_token_id"]
        eos = raw.get("eos_token_id")
        if isinstance(eos, int) or (isinstance(eos, list) and eos):
            fields["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    return fields


def _copy_tokenizer(tok_dir: Path, out: Path) -> None:
    import shutil

    for name in _TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, out / name)
