"""SpecQD: the model's own weights at low precision as the draft, at full depth.

After ML-SpecQD (Georganas et al., arXiv:2503.13565), which drafts with a quantized
(MXFP4) copy of the same model on CPUs. Here the draft copy is int8 per channel, or the
GGUF file's own blocks (Q4_0, Q4_1, Q8_0) when the model was converted from a GGUF
(engine/quant.py): every layer runs, every matrix product reads the codes. The draft
shares the target's KV cache for the verified prefix; its own K/V rows are dropped before
verification, which runs at the target's precision. A chain per round, its length planned
from the measured draft cost and acceptance (decoding/planning.py), with the adaptive
confidence exit of the layer-skip methods.

Lossless: greedy output equals plain greedy decoding; sampled drafts are drawn from the
quantized draft's own processed law and handed to the driver with it, so speculative
sampling reproduces the target's law exactly (tests/test_quant.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine import Engine
from ..engine.target import QUANT_TARGETS
from ..errors import ConfigError
from .base import LayerSkipMethod, LayerSkipOptions, Method, option, require


@dataclass(frozen=True)
class SpecQDConfig(LayerSkipOptions):
    # no confidence exit by default: the chain's length is planned from the measured per-depth acceptance
    # (a draft that agrees with the target 0.97 of the time is often right when unsure; docs/engine.md, "Quantized drafts")
    draft_threshold: float = option(0.0, "draft-exit confidence threshold (initial value when adaptive)")
    # a cap the planner should not hit when the draft agrees: SWIFT's 25 (its paper's default), not 12
    max_draft: int = option(25, "most draft tokens per round")

    def __post_init__(self) -> None:
        LayerSkipOptions.__post_init__(self)
        require(self.draft_precision != "target", "draft_precision", "a quantized precision (auto, int8, int8-g32, "
                "gguf or w4a8): a full-depth draft at the target's own precision is the target", self.draft_precision)


class SpecQD(LayerSkipMethod):
    """All layers (the default skip source skips none), quantized weights."""

    name = "specqd"
    lossless = True
    description = "SpecQD: the model's own weights quantized (int8, or the GGUF's own blocks) as a full-depth draft"
    Config = SpecQDConfig

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: SpecQDConfig | None = None) -> Method:
        config = config or SpecQDConfig()
        inputs = cls.draft_inputs(engine, tokenizer, config)
        if inputs.weights is None and engine.target_precision in QUANT_TARGETS:
            raise ConfigError(f"specqd has no draft on the {engine.target_precision} target: no quantized copy is cheaper "
                              "than the file's own blocks the target reads; use --method auto, self-sd or pld, or "
                              "--target-precision fp32")
        if inputs.weights is None:
            raise ConfigError("specqd drafts with quantized weights, which need the CPU kernel "
                              f"({engine.kernel_info.get('reason') or 'unavailable'}); use --method ar or pld here")
        return cls(engine, tokenizer, config, inputs=inputs)
