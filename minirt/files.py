"""Reading the files of a checkpoint, which is untrusted input: regular files only (a FIFO or a device
would block the read or never end), sizes checked before anything is read, and the file names an index
lists kept inside the checkpoint directory (a symlink in the directory may point anywhere, as Hugging
Face cache snapshots do; a name may not climb out of it)."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import InputError, MinirtError, excerpt

# Bounds on what is read whole, against the largest real files of the family (DeepSeek-V3.2: config.json
# 1.6 kB, model.safetensors.index.json 8.9 MB, tokenizer.json 7.8 MB); a safetensors header is capped
# at 100 MB, as the safetensors library caps it.
MAX_CONFIG_BYTES = 1_000_000
MAX_INDEX_BYTES = 100_000_000
MAX_TOKENIZER_BYTES = 100_000_000
MAX_HEADER_BYTES = 100_000_000

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def shown(path: str | Path) -> str:
    """A path as an error message shows it: whole when short, else its start and end."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:100]}…{text[-100:]} ({len(text):,} characters)"


def as_path(value: str | os.PathLike, what: str) -> Path:
    """``Path(value)``, or InputError for an empty string (which Path would read as the current
    directory) or a value that is no path at all."""
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise InputError(f"{what} must be a path, got {type(value).__name__}")
    if os.fspath(value) == "":
        raise InputError(f"{what} is an empty path")
    return Path(value)


def os_reason(e: OSError, path: str | Path, what: str) -> str:
    """Why the operating system refused ``path``, in words that say what it is."""
    if e.errno == errno.ENOENT:
        return f"{shown(path)}: {what} not found"
    if e.errno == errno.ELOOP:
        return f"{shown(path)}: {what} is a symlink loop"
    if e.errno == errno.ENAMETOOLONG:
        return f"{shown(path)}: {what}: the name is too long ({len(str(path))} characters)"
    return f"{shown(path)}: cannot read {what} ({e.strerror or e})"


def kind_of(mode: int) -> str | None:
    """None for a regular file, else what it is ('a FIFO', 'a directory', ...)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for is_kind, name in _KINDS if is_kind(mode)), "of an unknown kind")


def stat_regular(path: str | Path, what: str, error: type[MinirtError], missing: str | None = None) -> os.stat_result:
    """``os.stat(path)`` (symlinks followed) of a regular file, else ``error`` saying what is there
    (``missing``, when given, is the message for nothing there)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise error(missing if missing and e.errno == errno.ENOENT else os_reason(e, path, what)) from None
    kind = kind_of(st.st_mode)
    if kind is not None:
        raise error(f"{shown(path)}: {what} is {kind}, not a regular file")
    return st


def is_present(path: str | Path) -> bool:
    """Whether anything is at ``path`` (a dangling symlink, a symlink loop or a FIFO count; a name the
    operating system refuses does not)."""
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def open_regular(path: str | Path, what: str, error: type[MinirtError]):
    """``(binary file, its stat)`` of the regular file ``path``, else ``error`` saying what is there.

    Opened non-blocking, so a FIFO is refused (after ``fstat``) instead of waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(os_reason(e, path, what)) from None
    try:
        st = os.fstat(fd)
        kind = kind_of(st.st_mode)
        if kind is not None:
            raise error(f"{shown(path)}: {what} is {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, what: str, limit: int, error: type[MinirtError]) -> bytes:
    """The bytes of the regular file ``path`` (see ``open_regular``) when it holds at most ``limit``,
    else ``error`` giving both sizes."""
    f, st = open_regular(path, what, error)
    with f:
        if st.st_size > limit:
            raise error(f"{shown(path)}: {what} is {st.st_size:,} bytes, more than the {limit:,} allowed")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(os_reason(e, path, what)) from None
    if len(data) > limit:  # it grew after fstat
        raise error(f"{shown(path)}: {what} is more than the {limit:,} bytes allowed")
    return data


def parse_json(data: bytes, where: str, error: type[MinirtError]) -> Any:
    """JSON from bytes, or ``error`` starting with ``where`` (bad JSON, not UTF-8, nested too deep)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None


def read_json(path: str | Path, what: str, limit: int, error: type[MinirtError]) -> Any:
    """``parse_json(read_bytes(path, ...))``."""
    return parse_json(read_bytes(path, what, limit, error), shown(path), error)


NAME_MAX = 255  # bytes of one file name component (Linux, macOS)


def member(directory: Path, name: str, listed_in: str, error: type[MinirtError]) -> Path:
    """``directory / name`` for a file name an index lists, or ``error`` when the name could reach
    outside ``directory`` (absolute, with a ``..`` part, empty, or holding a NUL or a backslash) or
    has a part longer than a file system allows (``NAME_MAX`` bytes)."""
    parts = PurePosixPath(name).parts
    if (not name or "\x00" in name or "\\" in name or name.startswith("/") or ".." in parts
            or Path(name).is_absolute()):
        raise error(f"{listed_in} names file {excerpt(name)}, which is not a file name inside "
                    f"{shown(directory)} (absolute, '..', empty or with a NUL or backslash)")
    if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in parts):
        raise error(f"{listed_in} names file {excerpt(name)}, longer than the {NAME_MAX} bytes a file name may have")
    return directory / name
