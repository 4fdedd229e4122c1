"""Thin wrapper over a `tokenizer.json` (HuggingFace `tokenizers`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, inner: _HFTokenizer) -> None:
        self._inner = inner

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return cls(_HFTokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise ValueError(f"{path} is not a valid tokenizer file ({e}).") from None

    @property
    def vocab_size(self) -> int:
        return self._inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._inner.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._inner.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar engines such as llguidance build their token tables from)."""
        return self._inner.to_str()


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...] | None:
    """eos ids from generation_config.json, when the model dir has one."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{path} is not a valid JSON object.") from None
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
