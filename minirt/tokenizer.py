"""Text ↔ token ids through a checkpoint's ``tokenizer.json`` (the Hugging Face ``tokenizers`` format)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .errors import CheckpointError


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(checkpoint_dir: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return TextTokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # the tokenizers library raises plain Exceptions on malformed files
        raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from None
