"""The one assembly of a layer-skip stack from a method's declared parts.

Every layer-skip method (Self-SD, SWIFT, ASD, SpecQD) and ``auto``'s layer-skip and quantized
sources are built here from the same :class:`DraftParts`: a skip source, the draft weights, the
draft vocabulary, the draft settings, an optional n-gram branch and whether full depth on the
same quantized weights is weighed against the skip set each round. SpecQD is the parts "no
skips, quantized weights"; nothing here knows a method by name.

The stack, inside out: a :class:`~.layer_skip.LayerSkipDrafter` (one configuration); with
quantized weights, cost-aware drafting and a skip set that may skip, a
:class:`~.layer_skip.SkipOrFullDepth` choice beside the same weights at full depth; with an
n-gram source, a :class:`~.hybrid.Hybrid`; with a skip source that adapts, :class:`~.layer_skip.Adapting`.

On an engine whose tree rows are not bit-exact (``Engine.exact_trees``: a GPU's fixed-shape
forwards, or matrix-product attention), trees and the n-gram branch (a second branch of a tree)
are dropped: drafts are verified as chains, so the output stays the target's exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..engine import Engine
from .driver import Proposer
from .hybrid import Hybrid, NgramSource
from .layer_skip import (DraftSettings, Adapting, FixedSkips, LayerSkipDrafter, SkipOrFullDepth, SkipSource,
                         agreement_prior)

__all__ = ["DraftParts", "NgramSource", "assemble"]


@dataclass(frozen=True)
class DraftParts:
    """What a layer-skip method declares (see the module docstring)."""

    settings: DraftSettings
    skips: SkipSource = FixedSkips()
    weights: str | None = None  # None: the target's own
    vocab: torch.Tensor | None = None  # the draft vocabulary's token ids (None: the whole vocabulary)
    ngram: NgramSource | None = None  # hybrid drafts: the n-gram branch's source
    weigh_full_depth: bool = True  # with quantized weights, weigh full depth against the skip set each round


def assemble(engine: Engine, tokenizer: Any, parts: DraftParts) -> tuple[Proposer, LayerSkipDrafter]:
    """The proposer stack ``parts`` declare, and its drafter of the declared skip set."""
    if not engine.exact_trees and (parts.settings.tree or parts.ngram is not None):
        # trees are not bit-exact on this engine (Engine.exact_trees): chains only, no n-gram branch
        parts = dataclasses.replace(parts, settings=dataclasses.replace(parts.settings, tree=False), ngram=None)
    s, weights = parts.settings, parts.weights
    # a full-depth quantized draft starts from its measured agreement with the target, not from 0.5
    q0 = agreement_prior(engine, tokenizer, weights) if weights is not None and s.cost_aware else 0.5
    drafter = LayerSkipDrafter(engine, tokenizer, s, parts.skips, weights, parts.vocab,
                               prior=q0 if parts.skips.never_skips() else 0.5)
    stack: Proposer = drafter
    if parts.weigh_full_depth and weights is not None and s.cost_aware and not parts.skips.never_skips():
        # the quantized full-depth configuration drafts as specqd does: a chain, no confidence exit
        full = LayerSkipDrafter(engine, tokenizer, dataclasses.replace(s, tree=False, threshold=0.0, adaptive=False),
                                FixedSkips(), weights, parts.vocab, prior=q0)
        stack = SkipOrFullDepth(drafter, full)
    if parts.ngram is not None:
        stack = Hybrid(stack, parts.ngram, s)
    if parts.skips.adapts:
        stack = Adapting(stack, parts.skips, drafter)
    return stack, drafter
