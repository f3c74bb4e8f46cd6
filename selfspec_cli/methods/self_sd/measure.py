"""What Self-SD's calibration measures: the calibration prompts decoded by one candidate skip set.

A candidate is a skip set over some draft weights (``precision``: the target's own, or a
quantized copy). :class:`Candidates` holds what every candidate of one study is decoded and
scored with: the engine, the prompts, the generation settings, the draft settings, the passes
per measurement, each precision's draft vocabulary, and the proxy's measured inputs (the
verify curve and a quantized draft's full-depth cost, measured once per study and kept in
it: :meth:`Candidates.inputs`). The offline step builds it and hands it to the search as its
:class:`~.study.Scorer`, which scores its trials with :meth:`Candidates.measure` (one worker's
loop: :func:`~.study.run_search`); after it, :meth:`Candidates.confirm` re-measures the best set,
the starting points and plain autoregressive decoding back to back; it never calls the search
back. Invariants:

* every measurement is one or more greedy passes over all prompts (a sampling configuration
  is refused) with a fresh decoder per pass (the adaptive draft threshold starts from the same
  value for every candidate); per prompt the fastest pass counts (:func:`measure`);
* the proxy score (:func:`proxy_speedup`) times nothing per trial: acceptance and draft
  lengths come from decoding, a draft step's cost ``c`` from weight bytes
  (:func:`draft_cost_from_bytes`), a round's verification ``v`` from the study's verify curve,
  so that machine load cannot reorder candidates and trials from different machines compare.

No typer, rich or optuna here (the study object is only read and written through its user
attributes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import GenerationConfig
from ...decoding.cost_store import curve_for
from ...decoding.measure import VerifyCurve, draft_step_cost, prior_draft_cost, timed
from ...decoding.planning import round_cost
from ...decoding.layer_skip import DraftSettings
from ...decoding.output import DecodeResult
from ...engine import Engine
from ...errors import ConfigError
from ..ar import AR
from ..base import DraftInputs
from . import SelfSD, SelfSDConfig, SkipSet
from ...jsonio import JsonObject

DEFAULT_DRAFT = DraftSettings(cost_aware=False)  # the paper's drafting: every candidate drafts (the proxy scores its rounds)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One pass of a decoder over all calibration prompts."""

    tokens: int  # tokens actually produced (EOS ends a prompt early)
    wall_s: float  # decode calls only
    target_forwards: int
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_lengths: tuple[int, ...] = ()  # every round's draft depth, over all prompts (0: no draft)
    proxy: float | None = None  # the hardware-aware proxy: predicted speedup over ar (see proxy_speedup)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """M: tokens per full-depth target forward (prefill included), as in DecodeStats."""
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_draft_tokens / self.drafted_tokens if self.drafted_tokens else None

    def as_dict(self) -> JsonObject:
        return {
            "tokens_per_s": round(self.tokens_per_s, 3), "tokens": self.tokens, "wall_s": round(self.wall_s, 6),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            "proxy_speedup": None if self.proxy is None else round(self.proxy, 4),
        }


def measure(make_generate: Callable[[], Callable[[list[int], GenerationConfig], DecodeResult]],
            prompt_ids: Sequence[list[int]], cfg: GenerationConfig, device: torch.device, repeats: int = 1) -> Measurement:
    """Decode every prompt ``repeats`` times (a fresh decoder from ``make_generate()`` per
    pass) and keep, per prompt, the fastest pass. Load from other processes only ever
    slows a decode down, so the minimum is the least noisy estimate. Greedy decoding
    is deterministic: every pass produces the same tokens and statistics."""
    best_wall = [float("inf")] * len(prompt_ids)
    first: list[DecodeResult] = []  # the first pass's results (every pass has the same tokens and statistics)
    for r in range(repeats):
        generate = make_generate()
        for i, ids in enumerate(prompt_ids):
            res, dt = timed(lambda: generate(ids, cfg), device)
            best_wall[i] = min(best_wall[i], dt)
            if r == 0:
                first.append(res)
    st = [res.stats for res in first]
    return Measurement(sum(len(res.token_ids) for res in first), sum(best_wall), sum(s.target_forwards for s in st),
                       sum(s.drafted_tokens for s in st), sum(s.accepted_draft_tokens for s in st),
                       tuple(k for s in st for k in s.draft_lengths))


def draft_cost_from_bytes(engine: Engine, skip_attn: frozenset[int], skip_mlp: frozenset[int],
                          full_depth_c: float | None = None, vocab: torch.Tensor | None = None) -> float:
    """c(S) without a per-trial timer: the one prior for c (:func:`prior_draft_cost`): the skip
    set's share of the bytes of a full-depth draft step over the draft's vocabulary (``vocab``
    token ids, FR-Spec; None: all), times ``full_depth_c``, that full-depth step's cost (None: its
    bytes, the target's own weights; for a quantized copy measured once per study,
    :func:`full_depth_costs`)."""
    return prior_draft_cost(engine, skip_attn, skip_mlp, full_depth_c, None if vocab is None else int(vocab.numel()))


def full_depth_costs(engine: Engine, precisions: Sequence[str],
                     vocabs: dict[str, torch.Tensor | None] | None = None) -> dict[str, float]:
    """c of a full-depth draft step per precision, over its draft vocabulary (``vocabs``: per
    precision, the token ids its head scores; None: all): a draft forward over a target forward
    timed beside it (:func:`draft_step_cost`); ``target``: its bytes (1 with the whole vocabulary)."""
    vocabs = vocabs or {}
    return {p: round(draft_cost_from_bytes(engine, frozenset(), frozenset(), vocab=vocabs.get(p)), 4) if p == "target"
            else round(draft_step_cost(engine, p, vocab=vocabs.get(p)), 4) for p in precisions}


def draft_vocabs(engine: Engine, precisions: Sequence[str]) -> dict[str, torch.Tensor | None]:
    """Per precision, the draft vocabulary Self-SD drafts with at run time (its default
    ``draft_vocab auto``: methods/fr_spec/), so that the search weighs the drafts the method runs:
    on Gemma 3's 262k vocabulary the LM head is over half a step."""
    from .. import fr_spec

    return {p: fr_spec.draft_vocab(engine, None if p == "target" else p, "auto") for p in precisions}


def proxy_speedup(m: Measurement, c: float, curve: VerifyCurve, prompts: int) -> float:
    """The hardware-aware proxy objective: tokens after each prompt's prefill over the cost of
    the rounds that made them, in plain steps (a round drafting ``k`` tokens costs
    ``k c + v(k + 1)``; plain decoding costs 1 a token). ``c`` from weight bytes and ``v``
    from the engine's verify curve (measured once): no per-trial timing, so machine load
    cannot reorder the candidates; the acceptance behind it is measured, by decoding."""
    cost = sum(round_cost(curve, k, c, k, 0.0) for k in m.draft_lengths)
    return (m.tokens - prompts) / cost if cost > 0 else 1.0


def measure_self_sd(engine: Engine, tokenizer: Any, prompt_ids: Sequence[list[int]], cfg: GenerationConfig,
                    skip_attn: frozenset[int], skip_mlp: frozenset[int], draft: DraftSettings = DEFAULT_DRAFT,
                    repeats: int = 1, precision: str = "target", full_depth_c: float | None = None,
                    curve: VerifyCurve | None = None, vocab: torch.Tensor | None = None) -> Measurement:
    """Throughput of Self-SD with this skip set over the draft weights ``precision`` and the
    draft vocabulary ``vocab`` (None: all). A fresh method per pass, so the adaptive draft
    threshold starts from the same value for every candidate. ``curve``: the verify curve the
    proxy uses (default: the engine's own)."""
    def make() -> Any:
        return SelfSD(engine, tokenizer, SelfSDConfig(), SkipSet(skip_attn, skip_mlp), draft=draft,
                      inputs=DraftInputs(None if precision == "target" else precision, vocab)).generate

    m = measure(make, prompt_ids, cfg, torch.device(engine.device), repeats)
    c = draft_cost_from_bytes(engine, skip_attn, skip_mlp, full_depth_c, vocab)
    return dataclasses.replace(m, proxy=proxy_speedup(m, c, curve or curve_for(engine), len(prompt_ids)))


def measure_ar(engine: Engine, tokenizer: Any, prompt_ids: Sequence[list[int]], cfg: GenerationConfig,
               repeats: int = 1) -> Measurement:
    """Plain autoregressive decoding of the prompts: what the speedups are over."""
    return measure(lambda: AR(engine, tokenizer).generate, prompt_ids, cfg, torch.device(engine.device), repeats)


class Candidates:
    """The candidates of one study, decoded alike: the prompts, the generation and draft settings,
    the passes per measurement and each precision's draft vocabulary (:func:`draft_vocabs`) are
    fixed here, and so are the proxy's inputs once :meth:`inputs` has read or measured them."""

    def __init__(self, engine: Engine, tokenizer: Any, prompt_ids: Sequence[list[int]], cfg: GenerationConfig,
                 precisions: Sequence[str], *, draft: DraftSettings = DEFAULT_DRAFT, repeats: int = 1,
                 proxy: bool = True) -> None:
        if not cfg.sampling.greedy:
            raise ConfigError("Self-SD calibration decodes greedily; pass a greedy GenerationConfig")
        self.engine, self.tokenizer, self.prompt_ids, self.cfg = engine, tokenizer, prompt_ids, cfg
        self.precisions, self.draft, self.repeats, self.proxy = tuple(precisions), draft, repeats, proxy
        self.vocabs = draft_vocabs(engine, self.precisions)
        # per precision, how many tokens its drafts score (``full``: all)
        self.vocab_sizes: dict[str, int | str] = {p: "full" if v is None else int(v.numel()) for p, v in self.vocabs.items()}
        # the precisions whose drafts score a draft vocabulary (their full-depth draft is cheaper than a step)
        self.cheap_heads: list[str] = [p for p, v in self.vocabs.items() if v is not None]
        self.full_c: dict[str, float] = {}  # precision -> c of its full-depth draft step (inputs)
        self.curve: VerifyCurve | None = None  # the study's verify curve (inputs; None: the engine's own)

    def inputs(self, study: Any) -> None:
        """The proxy's measured inputs, measured once per study by the first worker and kept in it, so that
        every worker (and a resumed run) scores its trials with the same numbers (no per-trial timing)."""
        full_c = self.full_c
        full_c.update({p: float(v) for p, v in (study.user_attrs.get("full_depth_c") or {}).items()})
        if missing := [p for p in self.precisions if p not in full_c]:
            full_c.update(full_depth_costs(self.engine, missing, self.vocabs))
            study.set_user_attr("full_depth_c", full_c)
        if self.proxy:  # the proxy reads v(k) only; a worker that finds it stored measures nothing
            if (saved := study.user_attrs.get("verify_curve")) is None:
                own = curve_for(self.engine, full=True)  # a full reading for the study (stored or taken now)
                saved = {"t1_s": own.t1_s, "ratios": {str(k): v for k, v in own.ratios.items()}}
                study.set_user_attr("verify_curve", saved)
            self.curve = VerifyCurve(float(saved["t1_s"]), {int(k): float(v) for k, v in saved["ratios"].items()})

    def warm_up(self, skip_attn: frozenset[int], skip_mlp: frozenset[int]) -> None:
        """Untimed, one prompt at every precision: first-call allocations must not favour later trials."""
        for p in self.precisions:
            measure_self_sd(self.engine, self.tokenizer, self.prompt_ids[:1], self.cfg, skip_attn, skip_mlp, self.draft,
                            precision=p, vocab=self.vocabs[p])

    def measure(self, skip_attn: frozenset[int], skip_mlp: frozenset[int], precision: str) -> Measurement:
        """One candidate over all prompts, ``repeats`` passes, scored with the study's inputs."""
        return measure_self_sd(self.engine, self.tokenizer, self.prompt_ids, self.cfg, skip_attn, skip_mlp, self.draft,
                               self.repeats, precision, self.full_c.get(precision), self.curve, self.vocabs[precision])

    def confirm(self, best: tuple[frozenset[int], frozenset[int], str], points: Sequence[Any]) -> dict[str, JsonObject]:
        """Plain decoding, the best set and every starting point (each with ``name``, ``skip_attn``,
        ``skip_mlp`` and ``precision``) measured again back to back, in that order, as ``name ->
        as_dict()``: the numbers compared are taken under the same machine load. A starting point
        that is the best set is not measured twice."""
        sets = {"best": best, **{p.name: (p.skip_attn, p.skip_mlp, p.precision) for p in points}}
        out = {"ar": measure_ar(self.engine, self.tokenizer, self.prompt_ids, self.cfg, self.repeats).as_dict()}
        for name, (attn, mlp, precision) in sets.items():
            same = name != "best" and (attn, mlp, precision) == best
            out[name] = out["best"] if same else self.measure(attn, mlp, precision).as_dict()
        return out
