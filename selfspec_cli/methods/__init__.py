"""The registry of decoding methods: CLI value -> class."""
from __future__ import annotations

from .ar import AR
from .asd import ASD
from .base import Method
from .self_sd import SelfSD
from .swift import Swift

METHODS: dict[str, type[Method]] = {
    AR.name: AR,
    SelfSD.name: SelfSD,
    ASD.name: ASD,
    Swift.name: Swift,
}

__all__ = ["METHODS", "Method", "AR", "SelfSD", "ASD", "Swift"]
