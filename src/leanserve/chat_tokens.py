"""`leanserve add-chat-tokens`: a copy of a checkpoint whose tokenizer has DeepSeek-V4's chat tokens.

The tokens are added beyond the vocabulary (ids vocab_size, vocab_size + 1, ... in DSV4_CHAT_TOKENS order): BOS and
EOS as special tokens, the others as plain added tokens, as in DeepSeek's tokenizers. Every vocabulary-sized tensor
grows by as many rows: the embedding and the output head (which the MTP layer shares) and the hash-routed layers'
token -> experts tables. The new rows are seeded random draws:

* embedding rows: the old rows' per-dimension mean plus noise of their per-dimension standard deviation, so that a
  new token enters the model like a typical token;
* head rows: the old rows' mean plus a tenth of their per-dimension standard deviation, so that a new token's logit
  is about the mean of the old ones (the model samples it now and then) and stays far below the largest (greedy
  decoding of old tokens is unchanged in practice: a new row's noise moves its logit by about a tenth of the
  logits' spread, the top logit stands several spreads above their mean);
* hash tables: k distinct random experts per new token.

config.json's vocab_size, bos_token_id and eos_token_id and generation_config.json's ids point at the new tokens;
generation_config.json keeps the old eos ids after the new one, so a plain completion still stops where the original
model stops. The tokenizer's post-processor is kept (a plain prompt starts with the original BOS, as the model was
trained); a chat prompt writes the new BOS itself. Unquantized and published (FP8 / FP4) checkpoints are both
handled: the embedding, head and hash tables are never quantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

DSV4_CHAT_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)
_SPECIAL = frozenset(DSV4_CHAT_TOKENS[:2])  # BOS and EOS
HEAD_NOISE = 0.1  # new head rows: the old rows' mean + HEAD_NOISE x their per-dimension std x N(0, 1)

# Files written here rather than copied.
_WRITTEN = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def add_chat_tokens(src: str | Path, dst: str | Path, *, seed: int = 0, force: bool = False) -> list[int]:
    """Writes to `dst` a copy of the checkpoint in `src` with DeepSeek-V4's chat tokens added; returns their ids in
    DSV4_CHAT_TOKENS order."""
    from tokenizers import Tokenizer

    from leanserve.model.loader import INDEX_FILE, SINGLE_FILE, checkpoint_files

    src, dst = Path(src), Path(dst)
    tokenizer_file = src / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{src} has no tokenizer.json, so there is no tokenizer to add the chat tokens to.")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"The output directory {dst} is the source directory; write the copy somewhere else.")
    if dst.exists() and not force:
        raise ValueError(f"{dst} already exists; pass --force (force=True) to write into it.")
    config = json.loads((src / "config.json").read_text())
    vocab = config.get("vocab_size")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    present = [t for t in DSV4_CHAT_TOKENS if tokenizer.token_to_id(t) is not None]
    if present:
        more = f" and {len(present) - 2} more" if len(present) > 2 else ""
        raise ValueError(f"{tokenizer_file} already has DeepSeek-V4 chat tokens ({', '.join(present[:2])}{more}).")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab:
        raise ValueError(
            f"{tokenizer_file} has {size} ids but {src / 'config.json'} a vocab_size of {vocab}; the chat tokens go "
            "right after the vocabulary, so the two must agree."
        )
    ids = _add_to_tokenizer(tokenizer, vocab)
    new_vocab = vocab + len(DSV4_CHAT_TOKENS)
    bos, eos = ids[0], ids[1]

    tensors_by_file = _grown_files(src, config, vocab, new_vocab, seed)
    if dst.exists():  # (force) the weights of an earlier checkpoint in dst must not mix with these
        for stale in [dst / SINGLE_FILE, dst / INDEX_FILE, *dst.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)
    weight_files = {Path(f).name for f in checkpoint_files(src)} | {INDEX_FILE}
    for item in sorted(src.iterdir()):
        if item.name in _WRITTEN or item.name in weight_files:
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dst / item.name)
    _write_weights(src, dst, tensors_by_file)

    old_eos = config.get("eos_token_id")
    config |= {"vocab_size": new_vocab, "bos_token_id": bos, "eos_token_id": eos}
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    gen_file = src / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    old_eos = generation.get("eos_token_id", old_eos)
    old_eos = [] if old_eos is None else (old_eos if isinstance(old_eos, list) else [old_eos])
    generation |= {"bos_token_id": bos, "eos_token_id": [eos, *(t for t in old_eos if t != eos)]}
    if "pad_token_id" not in generation and config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(src, tokenizer, config), indent=2, ensure_ascii=False) + "\n"
    )
    _check_loadable(dst)
    return ids


def _add_to_tokenizer(tokenizer, vocab: int) -> list[int]:
    """Adds the tokens one at a time (ids in order) and checks that each encodes to its single id and that a text
    with all of them decodes back unchanged."""
    from tokenizers import AddedToken

    for token in DSV4_CHAT_TOKENS:
        tokenizer.add_tokens([AddedToken(token, special=token in _SPECIAL, normalized=False)])
    ids = [tokenizer.token_to_id(t) for t in DSV4_CHAT_TOKENS]
    if ids != list(range(vocab, vocab + len(DSV4_CHAT_TOKENS))):
        raise ValueError(f"The tokenizer gave the chat tokens the ids {ids}, not the ids after its vocabulary.")
    text = "".join(f"{token}x " for token in DSV4_CHAT_TOKENS)
    encoded = tokenizer.encode(text, add_special_tokens=False).ids
    if [t for t in encoded if t >= vocab] != ids or tokenizer.decode(encoded, skip_special_tokens=False) != text:
        raise ValueError("The tokenizer does not encode the chat tokens to their single ids and back.")
    return ids


def _is_vocab_tensor(name: str) -> bool:
    """The embedding (model.embed_tokens / embed), the head (lm_head / head) and hash tables (ffn.gate.tid2eid)."""
    from leanserve.model.loader import canonical_name

    canonical = canonical_name(name)
    leaf = canonical.rsplit(".", 2)[-2:]
    return canonical.endswith("tid2eid") or (leaf[-1] == "weight" and leaf[0] in ("embed", "head"))


def _grown_files(src: Path, config: dict, vocab: int, new_vocab: int, seed: int) -> dict[str, dict]:
    """File name -> all its tensors, for the files that hold a vocabulary-sized tensor (those grown)."""
    from safetensors import safe_open

    from leanserve.model.loader import checkpoint_files

    gen = torch.Generator().manual_seed(seed)
    grown: dict[str, dict] = {}
    files = checkpoint_files(src)
    found = 0
    for file in sorted(files):
        names = files[file]
        vocab_names = [n for n in names if _is_vocab_tensor(n)]
        if not vocab_names:
            continue
        with safe_open(file, framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in names}
        for name in sorted(vocab_names):
            tensor = tensors[name]
            if tensor.shape[0] != vocab:
                raise ValueError(f"Tensor {name!r} in {file} has {tensor.shape[0]} rows, not vocab_size {vocab}.")
            if f"{name.removesuffix('.weight')}.scale" in tensors or tensor.element_size() == 1:
                raise ValueError(
                    f"Tensor {name!r} in {file} is quantized; add-chat-tokens grows only bf16 / fp32 ones."
                )
            tensors[name] = torch.cat([tensor, _new_rows(name, tensor, new_vocab - vocab, config, gen)])
            found += 1
        grown[Path(file).name] = tensors
    if not found:
        raise ValueError(f"The checkpoint in {src} has no embedding or head to grow.")
    return grown


def _new_rows(name: str, tensor: torch.Tensor, n: int, config: dict, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("tid2eid"):  # k distinct experts per new token
        experts = int(config.get("n_routed_experts") or int(tensor.max()) + 1)
        rows = torch.rand(n, experts, generator=gen).argsort(dim=-1)[:, : tensor.shape[1]]
        return rows.to(tensor.dtype)
    old = tensor.float()
    scale = HEAD_NOISE if name.endswith("head.weight") else 1.0
    noise = torch.randn(n, old.shape[1], generator=gen)
    return (old.mean(0) + scale * old.std(0) * noise).to(tensor.dtype)


def _write_weights(src: Path, dst: Path, grown: dict[str, dict]) -> None:
    """The grown files written whole, the other shards copied, the index's total size updated."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from leanserve.model.loader import INDEX_FILE, checkpoint_files

    added = 0
    for file in checkpoint_files(src):
        name = Path(file).name
        if name not in grown:
            shutil.copy2(file, dst / name)
            continue
        with safe_open(file, framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            added -= sum(f.get_tensor(n).nbytes for n in grown[name] if _is_vocab_tensor(n))
        added += sum(t.nbytes for n, t in grown[name].items() if _is_vocab_tensor(n))
        save_file({k: v.contiguous() for k, v in grown[name].items()}, str(dst / name), metadata=metadata)
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        metadata = index.setdefault("metadata", {})
        if "total_size" in metadata:
            metadata["total_size"] += added
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _tokenizer_config(src: Path, tokenizer, config: dict) -> dict:
    """src's tokenizer_config.json (if any) with the new BOS / EOS; a minimal one otherwise."""
    path = src / "tokenizer_config.json"
    out = json.loads(path.read_text()) if path.is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"}
    out["bos_token"], out["eos_token"] = DSV4_CHAT_TOKENS[0], DSV4_CHAT_TOKENS[1]
    pad = config.get("pad_token_id")
    if "pad_token" not in out and isinstance(pad, int) and tokenizer.id_to_token(pad) is not None:
        out["pad_token"] = tokenizer.id_to_token(pad)
    return out


def _check_loadable(dst: Path) -> None:
    """leanserve's loader accepts the result (headers only, on the meta device): every tensor fits the new config."""
    from leanserve.model.config import ModelConfig
    from leanserve.model.deepseek_v4 import DeepseekV4
    from leanserve.model.loader import check_checkpoint, has_mtp_weights

    cfg = ModelConfig.from_hf(dst)
    with torch.device("meta"):
        model = DeepseekV4(cfg, 1, with_mtp=has_mtp_weights(dst))
    check_checkpoint(model, dst)
