"""Frozen configuration dataclasses. No I/O here."""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


SAMPLING_RULES = ("gumbel", "speculative")
SEED_MAX = 2**32 - 1  # numpy's and optuna's samplers take 0..2**32-1; torch would wrap anything to 64 bits


def check_seed(seed: int | None, option: str = "--seed") -> None:
    """Refuse a seed outside 0..2**32-1 (one line): the range every seeded part of selfspec takes
    as it is (torch's generators, numpy, optuna), so that no two seeds silently give the same run."""
    if seed is not None and not (0 <= seed <= SEED_MAX):
        raise ConfigError(f"{option} must be in 0..2**32-1 (0..{SEED_MAX}), got {seed}")


def check_choice(value: str, choices: Collection[str], option: str, where: str = "") -> None:
    """Refuse a value of ``option`` that is not one of ``choices``, in one line that lists them."""
    if value not in choices:
        raise ConfigError(f"unknown {option} '{value}'{where}; choose one of: {', '.join(choices)}")


def check_sampling_options(sampling: Any) -> None:
    """Refuse sampling options given with greedy decoding (``--temperature 0``), which would ignore them."""
    if not sampling.greedy:
        return
    for flag, given in (("--top-k", sampling.top_k != 0), ("--top-p", sampling.top_p != 1.0),
                        ("--sampling-rule", sampling.rule != "gumbel")):
        if given:
            raise ConfigError(f"{flag} shapes sampling, and --temperature 0 decodes greedily, which would ignore it; "
                              f"pass --temperature > 0 or drop {flag}")


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How the next token is chosen from the target's logits.

    temperature == 0 means greedy (argmax). Otherwise the processed distribution is
    softmax(logits / temperature) restricted by top-k then top-p, in the same order
    and with the same tie rules as Hugging Face's logits warpers.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    # gumbel: a sample is a function of (seed, position, distribution), so every lossless method gives
    # ar's tokens; speculative: standard speculative sampling (decoding/sampling.py, docs/sampling.md)
    rule: str = "gumbel"

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"--temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if not math.isfinite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 turns it off), got {self.top_k}")
        check_seed(self.seed)
        if self.rule not in SAMPLING_RULES:
            raise ConfigError(f"--sampling-rule must be one of {', '.join(SAMPLING_RULES)}, got '{self.rule}'")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """What to generate: length limit, stopping rules, sampling."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ConfigError("--stop needs a non-empty string (an empty one would end every prompt after one token)")
