"""User-facing errors. The CLI turns every SelfSpecError into one line on stderr and exit status 2."""
from __future__ import annotations


class SelfSpecError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ModelLoadError(SelfSpecError):
    pass


class UnsupportedModelError(SelfSpecError):
    pass


class PromptFileError(SelfSpecError):
    pass


class ConfigError(SelfSpecError):
    pass


class ArtifactError(SelfSpecError):
    """A saved artifact (skip set, trained heads, ...) is missing, corrupt, or made for another model."""
