"""Where selfspec reads and writes its files.

* Shipped artifacts (the repository's ``artifacts/`` tree, :data:`selfspec_cli.loading.ARTIFACTS_DIR`)
  are read-only package data: selfspec reads them, and never writes there by default.
* User artifacts and caches live in the per-user data directory :func:`user_home`:
  ``$SELFSPEC_HOME`` when set, else ``${XDG_DATA_HOME:-~/.local/share}/selfspec``.
  Default artifact names carry the model fingerprint
  (``<home>/artifacts/self-sd/<model name>-<fingerprint>.json``), so an artifact made
  for one model can never land on another model's file.
"""
from __future__ import annotations

import os
from pathlib import Path


def user_home() -> Path:
    """The per-user data directory (read from the environment at every call)."""
    xdg = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(os.environ.get("SELFSPEC_HOME") or Path(xdg) / "selfspec").expanduser()


def user_artifacts_dir() -> Path:
    return user_home() / "artifacts"


def user_cache_dir() -> Path:
    return user_home() / "cache"


def is_inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether ``path`` (existing or not) lies in ``directory``, after resolving both."""
    try:
        return Path(path).expanduser().resolve().is_relative_to(Path(directory).expanduser().resolve())
    except (OSError, RuntimeError):
        return False
