"""Text <-> token ids, through the model directory's `tokenizer.json` (the `tokenizers` library).

One idea: a thin wrapper with the few methods the engine needs, and the special token ids in one place.

Invariant: `encode(text)` is exactly what transformers' tokenizer for this directory returns
(`add_special_tokens=True` applies the tokenizer's post-processor, e.g. Llama's leading <s>).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, bos_token_id: int | None, eos_token_id: int | None):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`path/tokenizer.json`, with bos/eos from tokenizer_config.json's tokens (else config.json's ids)."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in model directory {path}")
    tok = HFTokenizer.from_file(str(file))
    special = _read_json(path / "tokenizer_config.json")
    config = _read_json(path / "config.json")

    def special_id(key: str) -> int | None:
        token = special.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token  # older configs wrap it in a dict
        found = tok.token_to_id(token) if token else None
        fallback = config.get(f"{key}_token_id")
        return found if found is not None else (fallback if isinstance(fallback, int) else None)

    return Tokenizer(tok, special_id("bos"), special_id("eos"))


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}
