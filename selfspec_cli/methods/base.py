"""What every decoding method provides."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..config import GenerationConfig
from ..decoding.loop import DecodeResult
from ..engine import Engine


class Method(ABC):
    """A decoding method bound to one engine. ``generate`` decodes one prompt.

    ``lossless`` methods must return exactly what plain decoding returns (greedy) or
    samples from exactly the target's processed distribution (sampling).
    """

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def __init__(self, engine: Engine, tokenizer: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.offline_parts: list[dict[str, Any]] = []  # what the method's artifacts cost offline

    def offline_info(self) -> dict[str, Any] | None:
        """Offline time behind this method's artifacts (``selfspec bench`` reports it), or None."""
        parts = [p for p in self.offline_parts if p.get("seconds") is not None]
        if not parts:
            return None
        return {"what": " + ".join(p["what"] for p in parts), "seconds": round(sum(p["seconds"] for p in parts), 1),
                "parts": parts}

    @abstractmethod
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        ...
