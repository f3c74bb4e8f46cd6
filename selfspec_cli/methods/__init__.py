"""The registry of decoding methods: CLI value -> class."""
from __future__ import annotations

from .ar import AR
from .base import Method

METHODS: dict[str, type[Method]] = {
    AR.name: AR,
}

__all__ = ["METHODS", "Method", "AR"]
