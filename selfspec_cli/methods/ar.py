"""Plain autoregressive decoding: the baseline every speedup is measured against.

The proposer that never drafts: each driver round is one full-depth forward of the
pending token over the preallocated cache, and the next token is its argmax (or a
sample of the processed distribution).
"""
from __future__ import annotations

from .base import SelfProposing


class AR(SelfProposing):
    name = "ar"
    lossless = True
    description = "plain autoregressive decoding (the baseline)"
