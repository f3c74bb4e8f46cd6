"""Self-SD: Draft & Verify (Zhang et al., ACL 2024), arXiv:2309.08168.

Drafts with a fixed set of skipped attention and MLP sublayers (found offline by
Bayesian optimization, ``selfspec calibrate --method self-sd``, or given inline),
stops drafting adaptively on draft confidence, and verifies with the full model.
Lossless: greedy output equals plain greedy decoding; sampling uses standard
speculative sampling with drafts sampled from the draft's processed distribution.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..decoding.speculative import DraftConfig, SelfSpeculative
from ..engine import Engine
from ..errors import ConfigError
from .base import Method


def check_skip_sets(num_layers: int, skip_attn: Iterable[int], skip_mlp: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    a, m = frozenset(int(i) for i in skip_attn), frozenset(int(i) for i in skip_mlp)
    bad = sorted(i for i in a | m if not 0 <= i < num_layers)
    if bad:
        raise ConfigError(f"skip-set layer ids {bad} are out of range for a {num_layers}-layer model (valid: 0..{num_layers - 1})")
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


class SelfSD(SelfSpeculative, Method):
    name = "self-sd"
    lossless = True
    description = "Self-SD / Draft & Verify: offline-calibrated skip set, adaptive draft exit"

    def __init__(self, engine: Engine, tokenizer: Any = None, *, skip_attn: Iterable[int] = (),
                 skip_mlp: Iterable[int] = (), draft: DraftConfig | None = None,
                 artifact: dict[str, Any] | None = None) -> None:
        Method.__init__(self, engine, tokenizer)
        SelfSpeculative.__init__(self, engine, draft or DraftConfig())
        self._skip = check_skip_sets(engine.num_layers, skip_attn, skip_mlp)
        if artifact:
            self.offline_parts.append({"what": "self-sd calibration", "seconds": artifact.get("search_time_s"),
                                       "trials": artifact.get("trials"), "created": artifact.get("created")})

    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        return self._skip
