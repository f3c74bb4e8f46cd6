"""Plain autoregressive decoding: the baseline every speedup is measured against.

The method whose drafter never drafts (:class:`~selfspec_cli.decoding.driver.Plain`, the base
method's default, with no policy): each driver round is one full-depth forward of the pending
token over the preallocated cache, and the next token is its argmax (or a sample of the
processed distribution).
"""
from __future__ import annotations

from .base import Method


class AR(Method):
    name = "ar"
    lossless = True
    description = "plain autoregressive decoding (the baseline)"
