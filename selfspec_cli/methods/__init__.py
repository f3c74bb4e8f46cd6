"""The registry of decoding methods: CLI value -> class."""
from __future__ import annotations

from .adadecode import AdaDecode
from .ar import AR
from .asd import ASD
from .base import Method
from .self_sd import SelfSD
from .specee import SpecEE
from .swift import Swift

METHODS: dict[str, type[Method]] = {
    AR.name: AR,
    SelfSD.name: SelfSD,
    ASD.name: ASD,
    Swift.name: Swift,
    AdaDecode.name: AdaDecode,
    SpecEE.name: SpecEE,
}

__all__ = ["METHODS", "Method", "AR", "SelfSD", "ASD", "Swift", "AdaDecode", "SpecEE"]
