"""Training data: a corpus of `.py` files (by default the running interpreter's standard library), split
into train / held-out BY FILE, a byte-level BPE tokenizer trained on the train files, and the packed token
stream the trainer samples fixed-length windows from.

Every document is encoded as `<bos>` + text + `<eos>`; documents are concatenated (in an order fixed by the
seed) into one stream, and a training sequence is any window of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from leanserve.bench.prompts import (  # the held-out split: the benchmarks prompt with the same files
    CorpusError,
    default_corpus_dir,
    find_py_files,
    is_heldout,
)

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


CORPUS_HELP = f"directory of .py files, or several joined by {os.pathsep!r} (default: this Python's standard library)"


@dataclass(frozen=True)
class Document:
    relpath: str  # posix path relative to the corpus root: the split and the order are functions of it
    text: str


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Document, ...]
    heldout: tuple[Document, ...]
    skipped: int  # files that are not valid UTF-8

    @property
    def num_files(self) -> int:
        return len(self.train) + len(self.heldout)

    def summary(self) -> str:
        chars = sum(len(d.text) for d in self.train)
        return (
            f"{self.root}: {len(self.train)} train files ({chars / 1e6:.1f}M chars), "
            f"{len(self.heldout)} held-out files" + (f", {self.skipped} skipped (not UTF-8)" if self.skipped else "")
        )


def corpus_roots(spec: str | Path | None) -> list[Path]:
    """The directories of a corpus: `spec` is one directory, or several joined by os.pathsep (the first one's
    files keep their paths relative to it, each further one's are prefixed with its directory name); None is
    the running interpreter's standard library."""
    if spec is None:
        return [default_corpus_dir()]
    parts = [p for p in str(spec).split(os.pathsep) if p] if isinstance(spec, str) else [spec]
    if not parts:
        raise CorpusError("The corpus names no directory.")
    roots = [Path(p) for p in parts]
    names = [r.name for r in roots[1:]]
    if len(set(names)) != len(names):
        raise CorpusError(f"The corpus directories after the first must have distinct names, got {names}.")
    return roots


def load_corpus(root: str | Path | None = None) -> Corpus:
    """The `.py` files of the corpus `root` (see corpus_roots), split into train and held-out by their paths."""
    roots = corpus_roots(root)
    train, heldout, skipped = [], [], 0
    for i, base in enumerate(roots):
        prefix = "" if i == 0 else f"{base.name}/"
        for rel, path in find_py_files(base):
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if not text.strip():
                continue
            rel = prefix + rel
            (heldout if is_heldout(rel) else train).append(Document(rel, text))
    shown = os.pathsep.join(str(r) for r in roots)
    if not train:
        what = "all of them are empty, unreadable or held out" if heldout or skipped else "all of them are empty"
        raise CorpusError(f"Corpus directory {shown} has no usable training files ({what}).")
    return Corpus(roots[0] if len(roots) == 1 else Path(shown), tuple(train), tuple(heldout), skipped)


# --- tokenizer -----------------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """Byte-level BPE with `<bos>`=0, `<eos>`=1, `<pad>`=2. Encoding text adds `<bos>` in front (as the model
    saw every document start during training); decoding drops the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} (256 bytes + 3 special tokens), got {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"special token {name} did not get id {i}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def save_tokenizer_files(tok, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"No tokenizer.json in {model_dir}.")
    return Tokenizer.from_file(str(path))


def encode_documents(tok, docs: Sequence[Document], seed: int | None = None) -> torch.Tensor:
    """One flat int64 stream: `<bos>` text `<eos>` per document, documents in relpath order, or shuffled by
    `seed` when given."""
    order = list(range(len(docs)))
    if seed is not None:
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    encodings = tok.encode_batch([docs[i].text for i in order], add_special_tokens=False)
    parts = [torch.tensor([BOS_ID, *enc.ids, EOS_ID], dtype=torch.long) for enc in encodings]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class WindowSampler:
    """Batches of `batch_size` windows of `length` tokens at uniformly random offsets of the stream; a pure
    function of (seed, number of batches drawn)."""

    def __init__(self, stream: torch.Tensor, length: int, batch_size: int, seed: int) -> None:
        if stream.numel() < length:
            raise CorpusError(
                f"The training corpus encodes to {stream.numel()} tokens, fewer than one training sequence "
                f"({length} tokens); give a larger corpus or a smaller --seq-len."
            )
        self.stream, self.length, self.batch_size = stream, length, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.length + 1, (self.batch_size,), generator=self.gen)
        return self.stream[starts[:, None] + torch.arange(self.length)]  # [B, length]
