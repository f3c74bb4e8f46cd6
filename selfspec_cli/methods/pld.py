"""Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) as a
selfspec method: n-gram drafts from the context so far (prompt and output), free to make. The
lookup, its drafter and its policy are decoding/ngram.py's, composed here from the config.

Each round, the longest suffix of the committed tokens of ``pld_max_ngram`` down to
``pld_min_ngram`` tokens that occurred earlier in the context is looked up (the most
recent earlier occurrence wins), and the tokens that followed it are the draft. The
draft is deterministic, so the driver verifies it exactly: greedy by prefix match,
sampling by speculative sampling with a point-mass draft law (accept ``d`` with
probability ``p(d)``, else resample from ``p`` without ``d``), which emits exactly the
target's distribution.

Cost-aware (default): drafting a lookup costs no model forward, but verifying ``k``
drafts costs ``v(k + 1)`` plain steps; the policy keeps a :class:`~selfspec_cli.decoding.planning.Planner`
per n-gram length, which tracks acceptance by depth and chooses how many of the looked-up
tokens to verify (none when they do not pay).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoding.ngram import MAX_DRAFT, MAX_NGRAM, MIN_NGRAM, NgramDrafter, NgramLookup, NgramPolicy, lookup
from ..engine import Engine
from ..errors import FieldError
from .base import Method, option, require

__all__ = ["PLDConfig", "PromptLookup", "lookup"]


@dataclass(frozen=True)
class PLDConfig:
    pld_max_ngram: int = option(MAX_NGRAM, "longest suffix n-gram looked up in the context")
    pld_min_ngram: int = option(MIN_NGRAM, "shortest suffix n-gram looked up")
    max_draft: int = option(MAX_DRAFT, "most draft tokens per round")
    paper_drafting: bool = option(False, "verify every looked-up token, as transformers' prompt lookup does, "
                                         "without planning from measured costs (can be slower than ar)")

    def __post_init__(self) -> None:
        if not 1 <= self.pld_min_ngram <= self.pld_max_ngram:
            raise FieldError("pld_min_ngram/pld_max_ngram", f"need 1 <= min <= max, got {self.pld_min_ngram}, {self.pld_max_ngram}")
        require(self.max_draft >= 1, "max_draft", ">= 1", self.max_draft)


class PromptLookup(Method):
    """Prompt lookup: an :class:`~selfspec_cli.decoding.ngram.NgramDrafter` over the config's
    lookup, planned by an :class:`~selfspec_cli.decoding.ngram.NgramPolicy` (unplanned with
    ``paper_drafting``)."""

    name = "pld"
    lossless = True
    description = "prompt lookup: n-gram drafts from the prompt and the output so far, cost-aware"
    Config = PLDConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: PLDConfig | None = None) -> None:
        super().__init__(engine, tokenizer, config)
        c = self.config
        self.lookup = NgramLookup(c.pld_max_ngram, c.pld_min_ngram, c.max_draft)
        self.policy = NgramPolicy(engine, self.lookup, c.max_draft, planned=not c.paper_drafting)
        self.drafter = NgramDrafter(self.lookup, self.policy)
