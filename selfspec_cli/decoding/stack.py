"""The one assembly of a layer-skip stack from a method's declared parts: its drafter and its policy.

Every layer-skip method (Self-SD, SWIFT, ASD, SpecQD) and ``auto``'s layer-skip and quantized
sources are built here from the same :class:`DraftParts`: a skip source, the draft weights, the
draft vocabulary, the draft settings, an optional n-gram branch and whether full depth on the
same quantized weights is weighed against the skip set each round. SpecQD is the parts "no
skips, quantized weights"; nothing here knows a method by name.

The stack, inside out: a :class:`~.layer_skip.LayerSkipDrafter` (one configuration, its
:class:`~.layer_skip.DraftModel` and its :class:`~.policy.LengthPolicy`); with quantized weights,
cost-aware drafting and a skip set that may skip, a :class:`~.layer_skip.SkipOrFullDepth` choice
beside the same weights at full depth; with an n-gram source, a :class:`~.hybrid.Hybrid`; with
a skip source that adapts, :class:`~.layer_skip.Adapting`. The stack's policy is the
configuration's, or the choice's (:class:`~.choose.BestOf`). Everything measured (the prior
acceptance of a quantized copy, the verify curve, a quantized draft's cost) is measured here,
in the order the drafters once measured it, before a decode starts.

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
from .driver import Drafter, DraftPolicy
from .hybrid import Hybrid, NgramSource
from .layer_skip import (Adapting, DraftModel, DraftSettings, FixedSkips, LayerSkipDrafter, SkipOrFullDepth,
                         SkipSource)
from .policy import LengthPolicy, agreement_prior

__all__ = ["DraftParts", "NgramSource", "Stack", "assemble", "configuration"]


@dataclass(frozen=True)
class DraftParts:
    """What a layer-skip method declares (see the module docstring)."""

    settings: DraftSettings
    skips: SkipSource = FixedSkips()
    weights: str | None = None  # None: the target's own
    vocab: torch.Tensor | None = None  # the draft vocabulary's token ids (None: the whole vocabulary)
    ngram: NgramSource | None = None  # hybrid drafts: the n-gram branch's source
    weigh_full_depth: bool = True  # with quantized weights, weigh full depth against the skip set each round


@dataclass(frozen=True, eq=False)
class Stack:
    """An assembled stack: the drafter the driver runs, its policy, and the configuration of the
    declared skip set (its :class:`~.layer_skip.LayerSkipDrafter`, whose skip source is the method's)."""

    drafter: Drafter
    policy: DraftPolicy
    configuration: LayerSkipDrafter


def configuration(engine: Engine, settings: DraftSettings, skips: SkipSource, weights: str | None,
                  vocab: torch.Tensor | None, prior: float) -> LayerSkipDrafter:
    """One configuration's drafter and its policy, set up: the verify curve measured, the draft
    model built (quantized copy, subset head), then the draft cost measured (no forward is timed by
    the drafter)."""
    LengthPolicy.measure_curve(engine, settings)
    model = DraftModel.build(engine, skips, weights, vocab)
    policy = LengthPolicy(engine, settings, model, prior).setup()
    return LayerSkipDrafter(engine, settings, model, policy)


def assemble(engine: Engine, tokenizer: Any, parts: DraftParts) -> Stack:
    """The stack ``parts`` declare (see the module docstring)."""
    if not engine.exact_trees and (parts.settings.tree or parts.ngram is not None):
        # trees are not bit-exact on this engine (Engine.exact_trees): chains only, no n-gram branch
        parts = dataclasses.replace(parts, settings=dataclasses.replace(parts.settings, tree=False), ngram=None)
    s, weights = parts.settings, parts.weights
    # a full-depth quantized draft starts from its measured agreement with the target, not from 0.5
    q0 = agreement_prior(engine, tokenizer, weights) if weights is not None and s.cost_aware else 0.5
    drafter = configuration(engine, s, parts.skips, weights, parts.vocab, q0 if parts.skips.never_skips() else 0.5)
    stack: Drafter = drafter
    policy: DraftPolicy = drafter.policy
    chain: LayerSkipDrafter | SkipOrFullDepth = drafter
    if parts.weigh_full_depth and weights is not None and s.cost_aware and not parts.skips.never_skips():
        # the quantized full-depth configuration drafts as specqd does: a chain, no confidence exit
        full = configuration(engine, dataclasses.replace(s, tree=False, threshold=0.0, adaptive=False), FixedSkips(),
                             weights, parts.vocab, q0)
        chain = SkipOrFullDepth(drafter, full)
        stack, policy = chain, chain.policy
    if parts.ngram is not None:
        stack = Hybrid(chain, parts.ngram, s)
    if parts.skips.adapts:
        stack = Adapting(stack, parts.skips, drafter)
    return Stack(stack, policy, drafter)
