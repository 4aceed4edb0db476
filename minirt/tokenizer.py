"""Text ↔ token ids through a checkpoint's ``tokenizer.json`` (the Hugging Face ``tokenizers`` format)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .errors import CheckpointError, InputError
from .files import MAX_TOKENIZER_BYTES, is_present, read_bytes

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A checkpoint's tokenizer; what it cannot encode or decode is a MinirtError, not the library's own."""

    def __init__(self, tokenizer: Tokenizer, path: Path | str = TOKENIZER_FILE):
        self._tok, self._path = tokenizer, path

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; InputError for text that is not valid Unicode (lone surrogates: what
        Python makes of command-line bytes that are not UTF-8), CheckpointError when the tokenizer fails."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"the prompt is not valid UTF-8 (undecodable byte at character {e.start} of "
                             f"{len(text)})") from None
        try:
            return self._tok.encode(text).ids
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise CheckpointError(f"{self._path}: the tokenizer cannot encode the prompt ({str(e)[:200]})") from None

    def decode(self, ids: list[int]) -> str:
        try:
            return self._tok.decode(ids)
        except Exception as e:
            raise CheckpointError(f"{self._path}: the tokenizer cannot decode token ids ({str(e)[:200]})") from None


def load_tokenizer(checkpoint_dir: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json. CheckpointError for a
    tokenizer.json that is not a regular file, is larger than ``files.MAX_TOKENIZER_BYTES`` or is
    malformed."""
    path = Path(checkpoint_dir) / TOKENIZER_FILE
    if not is_present(path):
        return None
    data = read_bytes(path, TOKENIZER_FILE, MAX_TOKENIZER_BYTES, CheckpointError)
    try:
        return TextTokenizer(Tokenizer.from_str(data.decode("utf-8")), path)
    except Exception as e:  # the tokenizers library raises plain Exceptions on malformed files
        raise CheckpointError(f"{path}: cannot read tokenizer ({str(e)[:200]})") from None


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
