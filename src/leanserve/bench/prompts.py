"""Prompts from held-out code: the `.py` files of a corpus (by default this Python's standard library) split into
train / held-out BY FILE, by a hash of each file's path. The shipped models trained only on the train files, so
the benchmarks prompt with held-out ones; train.data reads its corpus with the same functions."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_PER_MILLE = 30  # ~3% of the files, chosen by a hash of their relative path
# Directories never read: the stdlib's own test suites and anything installed on top of the stdlib.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})


class CorpusError(ValueError):
    """The corpus cannot be used (missing, empty, too small); the message says why."""


def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Deterministic, independent of the machine: the first bytes of sha256(relative path)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def find_py_files(root: str | Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every `.py` file under `root`, test and site-packages directories
    excluded, sorted. Raises CorpusError for a missing directory or one without any usable file."""
    root = Path(root)
    if not root.exists():
        raise CorpusError(f"Corpus directory {root} does not exist.")
    if not root.is_dir():
        raise CorpusError(f"Corpus {root} is not a directory.")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        found.append((rel.as_posix(), path))
    if not found:
        raise CorpusError(
            f"Corpus directory {root} holds no .py files (outside test and site-packages directories); "
            "nothing to train on."
        )
    return sorted(found)


def code_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts from held-out code (the Python standard library's held-out files, which the shipped model
    never trained on): each starts at a top-level `def` line and is cut to `prompt_tokens` tokens."""
    prompts = []
    for rel, path in find_py_files(default_corpus_dir()):
        if not is_heldout(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        start = text.find("\ndef ")
        while start >= 0:  # every top-level function of the file, in order
            ids = tokenizer.encode(text[start + 1 : start + 1 + 40 * prompt_tokens])[:prompt_tokens]
            if len(ids) == prompt_tokens:
                prompts.append(ids)
            if len(prompts) == count:
                return prompts
            start = text.find("\ndef ", start + 1)
    raise ValueError(f"found only {len(prompts)} held-out code prompts of {prompt_tokens} tokens")
