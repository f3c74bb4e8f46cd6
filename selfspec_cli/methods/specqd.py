"""SpecQD: the model's own weights at low precision as the draft, at full depth.

After ML-SpecQD (Georganas et al., arXiv:2503.13565), which drafts with a quantized
(MXFP4) copy of the same model on CPUs. Here the draft copy is int8 per channel, or the
GGUF file's own blocks (Q4_0, Q4_1, Q8_0) when the model was converted from a GGUF
(engine/quant.py): every layer runs, every matrix product reads the codes. The draft
shares the target's KV cache for the verified prefix; its own K/V rows are dropped before
verification, which runs at the target's precision. A chain per round, its length planned
from the measured draft cost and acceptance (decoding/cost.py), with the adaptive
confidence exit of the layer-skip methods.

Lossless: greedy output equals plain greedy decoding; sampled drafts are drawn from the
quantized draft's own processed law and handed to the driver with it, so speculative
sampling reproduces the target's law exactly (tests/test_quant.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoding.layer_skip import DraftConfig, LayerSkipProposer
from ..engine import Engine
from .base import DraftOptions, Method, option, require


@dataclass(frozen=True)
class SpecQDConfig(DraftOptions):
    # no confidence exit by default: the chain's length is planned from the measured per-depth acceptance
    # (a draft that agrees with the target 0.97 of the time is often right when unsure; docs/engine.md, "Quantized drafts")
    draft_threshold: float = option(0.0, "draft-exit confidence threshold (initial value when adaptive)")
    # a cap the planner should not hit when the draft agrees: SWIFT's 25 (its paper's default), not 12
    max_draft: int = option(25, "most draft tokens per round")

    def __post_init__(self) -> None:
        DraftOptions.__post_init__(self)
        require(self.draft_precision != "target", "draft_precision", "a quantized precision (auto, int8, int8-g32 or "
                "gguf): a full-depth draft at the target's own precision is the target", self.draft_precision)


class SpecQD(LayerSkipProposer, Method):
    name = "specqd"
    lossless = True
    description = "SpecQD: the model's own weights quantized (int8, or the GGUF's own blocks) as a full-depth draft"
    Config = SpecQDConfig
    never_skips = True

    def __init__(self, engine: Engine, tokenizer: Any = None, config: SpecQDConfig | None = None,
                 draft: DraftConfig | None = None) -> None:
        config = config or SpecQDConfig()
        LayerSkipProposer.__init__(self, engine, tokenizer, draft or config.draft())
        self.bind_config(config)

    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        return frozenset(), frozenset()
