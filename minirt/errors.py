"""One small exception hierarchy: the CLI turns any MinirtError into one line on stderr, exit 2."""
from __future__ import annotations


class MinirtError(Exception):
    """Base class of every error minirt raises on bad input."""


class ConfigError(MinirtError):
    """config.json is missing a key, names an unknown model type, or has inconsistent dims."""


class CheckpointError(MinirtError):
    """A safetensors file, the shard index or a tensor in it is unusable (names file/tensor)."""


class InputError(MinirtError, ValueError):
    """Bad arguments to a public function: token ids, prompt lengths, kernel tensors."""


class DeviceError(MinirtError):
    """The requested device is not available."""


class NumericalError(MinirtError):
    """A forward pass produced a non-finite logit (names the first module whose output was non-finite)."""

    @classmethod
    def in_logits(cls, stage: str, first: str | None) -> "NumericalError":
        """The error for ``stage`` ("prefill", "decode") whose first non-finite output came from ``first``
        ("layer 1 (model.layers.1)", ...; None: not found)."""
        where = f"the first non-finite output is that of {first}" if first else "no module's output was non-finite on a rerun"
        return cls(f"{stage} produced non-finite logits (NaN or Inf): {where}; the checkpoint's weights or config.json "
                   "values are out of range")


class WriteError(MinirtError):
    """A file or directory could not be written (names the path and the operating system's reason)."""


def excerpt(text, limit: int = 60) -> str:
    """``repr(text)`` when short, else its start and end around ``…`` with the length: what an error
    message echoes of an argument or a name read from a file, so one bad value cannot flood the line."""
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r}…{text[-half:]!r} ({len(text):,} characters)"
