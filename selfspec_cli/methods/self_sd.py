"""Self-SD: Draft & Verify (Zhang et al., ACL 2024), arXiv:2309.08168.

Drafts with a fixed set of skipped attention and MLP sublayers (found offline by
Bayesian optimization, ``selfspec calibrate --method self-sd``, or given inline),
stops drafting adaptively on draft confidence, and verifies with the full model.
Lossless: greedy output equals plain greedy decoding; sampling uses standard
speculative sampling with drafts sampled from the draft's processed distribution.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import SkipSet
from ..decoding.layer_skip import DraftConfig, LayerSkipProposer
from ..engine import Engine
from ..errors import FieldError
from .base import DraftOptions, Method, layer_list, option


def check_skip_sets(num_layers: int, skip_attn: Iterable[int], skip_mlp: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    a, m = frozenset(int(i) for i in skip_attn), frozenset(int(i) for i in skip_mlp)
    if bad := sorted(i for i in a | m if not 0 <= i < num_layers):
        raise FieldError("skip_attn/skip_mlp", f"layer ids {bad} are out of range for a {num_layers}-layer model (valid: 0..{num_layers - 1})")
    return a, m


def uniform_layers(num_layers: int, ratio: float) -> frozenset[int]:
    """About ``ratio * L`` layers spread evenly over the interior layers ``1..L-2``
    (SWIFT's uniform start: never the first or last layer). Skipping both sublayers
    of those layers skips a ``ratio`` share of the 2L sublayers."""
    interior = list(range(1, num_layers - 1))
    if not interior:
        return frozenset()
    n = min(len(interior), max(1, round(ratio * num_layers)))
    return frozenset(interior[round((i + 0.5) * len(interior) / n - 0.5)] for i in range(n))


@dataclass(frozen=True)
class SelfSDConfig(DraftOptions):
    layers: Path | None = option(None, "skip-set artifact (default: this model's calibrated one, the user's under "
                                       "$SELFSPEC_HOME first, then the shipped one)")
    skip_attn: tuple[int, ...] | None = option(None, "inline attention sublayers to skip, e.g. 1,3,5 (0-based; "
                                                     "overrides the artifact)")
    skip_mlp: tuple[int, ...] | None = option(None, "inline MLP sublayers to skip, e.g. 2,4 (0-based)")

    def __post_init__(self) -> None:
        DraftOptions.__post_init__(self)
        object.__setattr__(self, "skip_attn", layer_list(self.skip_attn, "skip_attn"))
        object.__setattr__(self, "skip_mlp", layer_list(self.skip_mlp, "skip_mlp"))


class SelfSD(LayerSkipProposer, Method):
    name = "self-sd"
    lossless = True
    description = "Self-SD / Draft & Verify: offline-calibrated skip set, adaptive draft exit"
    Config = SelfSDConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: SelfSDConfig | None = None,
                 skip: SkipSet = SkipSet(), draft: DraftConfig | None = None) -> None:
        """``draft`` overrides the config's draft options (e.g. tree verification)."""
        config = config or SelfSDConfig()
        LayerSkipProposer.__init__(self, engine, tokenizer, draft or config.draft())
        self.bind_config(config)
        self._skip = check_skip_sets(engine.num_layers, skip.attn, skip.mlp)
        self.artifact_precision = skip.draft_precision  # the precision the set was calibrated with, if any
        if m := skip.manifest:
            self.offline_parts.append({"what": "self-sd calibration", "seconds": m.get("search_time_s"),
                                       "trials": m.get("trials"), "created": m.get("created")})

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: SelfSDConfig | None = None) -> SelfSD:
        config = config or SelfSDConfig()
        if config.skip_attn is not None or config.skip_mlp is not None:
            skip = SkipSet(frozenset(config.skip_attn or ()), frozenset(config.skip_mlp or ()))
        else:
            skip = SkipSet.load(config.layers, engine.model)
        return cls(engine, tokenizer, config, skip)

    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        return self._skip
