"""User-facing errors. The CLI turns every SelfSpecError into one line on stderr and exit status 2."""
from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's first message line (its type's name when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SelfSpecError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ModelLoadError(SelfSpecError):
    """A model or tokenizer cannot be found, converted or read."""


class UnsupportedModelError(SelfSpecError):
    """The model's architecture (or one of its settings) is one selfspec does not run."""


class PromptFileError(SelfSpecError):
    """A prompt file is missing, unreadable or malformed."""


class ConfigError(SelfSpecError):
    """An option or configuration value is invalid."""


class ArtifactError(SelfSpecError):
    """A saved artifact (skip set, trained heads, ...) is missing, corrupt, or made for another model."""


class FieldError(ConfigError):
    """A configuration field has a bad value. The message names the field (``field``), so
    a front end can name its own option instead (the CLI names the flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.detail = message


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number it takes: ``1 prompt``, ``2 prompts``, ``0 threads``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
