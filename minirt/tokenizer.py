"""Text ↔ token ids through a checkpoint's ``tokenizer.json`` (the Hugging Face ``tokenizers`` format)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(checkpoint_dir: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    path = Path(checkpoint_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TextTokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # the tokenizers library raises plain Exceptions on malformed files
        raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from None


class IncrementalDecoder:
    """Text of a growing token sequence, handed out piece by piece as soon as it is complete.

    Decoding token by token breaks text that spans tokens (a multi-byte UTF-8 character split over
    byte-level tokens decodes to replacement characters, and some tokenizers add or drop spaces at the
    start of a decode). Instead each ``push`` decodes the sequence from a few tokens back and returns only
    the new suffix, once it no longer ends in an incomplete character (U+FFFD); ``flush`` returns what
    is still held back. The pieces joined equal ``tokenizer.decode(tokens)`` of the tokens pushed.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # decoding starts here: context for tokens whose text depends on the one before
        self._read = 0    # text of ids[_prefix:_read] has been handed out

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]
