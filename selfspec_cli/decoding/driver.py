"""The decode driver: one loop for every method, and the contract of what it runs.

A method hands the driver a :class:`Drafter` (four verbs: ``begin``, ``draft``, ``accept``,
``end``; two declared fields: ``lookahead``, ``taps``) and that drafter's :class:`DraftPolicy`
(how long to draft and whether to, fed by the cost model; the driver reads only its verify
curve). :func:`decode` owns prefill, the stopping rules (:class:`~.output.TokenSink`),
statistics with one definition (:class:`~.output.DecodeStats`), cache capacity (in
:class:`~.state.DecodeState`), timing and streaming. Each round:

1. ``draft = drafter.draft(state, budget)`` where ``budget`` is the most draft
   tokens the round could still emit (``remaining - 1``: a round emits drafts + 1);
   the draft is one of the typed values of :mod:`.drafts`;
2. the driver verifies it with the shared exact rules of :mod:`.verify` (under the
   sampling rule ``gumbel``, the greedy rules applied to the rows' processed scores
   plus their positions' noise, :mod:`.sampling`), by its type:

   * :class:`~.drafts.Chain` or :class:`~.drafts.Tree`: one full-depth forward of the
     pending token and the drafts, then the chain or tree rule;
   * :class:`~.drafts.Deferred`: the drafter already ran the rows to full depth
     (AdaDecode); only the chain rule is applied;
   * :class:`~.drafts.Decided`: a lossy drafter's own tokens (SpecEE), committed unverified;
   * :class:`~.drafts.NoDraft`: one plain step;

3. the state keeps the accepted K/V and commits the tokens, the sink applies the
   stopping rules, and ``drafter.accept(state, round)`` learns what was accepted and
   what the round cost (:class:`~.drafts.Round`; as transformers separates
   ``get_candidates`` from ``update_candidate_strategy``). Time is measured with one
   :class:`~.planning.RoundClock` per decode; nothing is written into the drafter. The
   seconds of each chain's (or plain step's) verify forward go to the store of the
   machine's costs (:func:`~.cost_store.observe_forward`, decoding/cost_store.py), which the
   next process reads; they change nothing in this decode.

An empty draft makes the round a plain decoding step, so ``ar`` is the drafter that never
drafts (:class:`Plain`). Every lossless drafter gets exact greedy output and the target's
exact sampling law from the rules, whatever it drafts. Invariant: the driver calls a drafter's
four verbs and reads its two fields, nothing else; it reads a policy's ``curve`` only.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..config import GenerationConfig
from ..engine import NO_TAPS, Engine, ForwardOutput, ForwardTaps
from .cost_store import observe_forward
from .measure import VerifyCurve
from .planning import RoundClock, round_gain
from .drafts import Chain, Decided, Deferred, Draft, NoDraft, Round, Tree, depth as draft_depth
from .output import NO_REPORT, DecodeResult, DecodeStats, DraftReport, PlainRounds, PlanTotals, TokenSink
from .sampling import PositionNoise, gumbel_scores, make_generator, select_token
from .state import DecodeState
from .verify import GREEDY, Verdict, verify_chain_greedy, verify_chain_sampling, verify_tree


@dataclass(frozen=True, slots=True)
class Taps:
    """What a drafter needs the driver's forwards to report beside the logits (the driver passes
    them on as the engine's :class:`~selfspec_cli.engine.route.ForwardTaps`; nothing else about a
    drafter reaches a driver's forward): ``attn_cosine``, the prefill's
    per-layer attention cosines (ASD's skip source); ``hidden``, the hidden states after these
    layers in the prefill and every verify forward (the on-policy recorder of methods/onpolicy.py)."""

    attn_cosine: bool = False
    hidden: tuple[int, ...] = ()

    def __or__(self, other: Taps) -> Taps:
        """What either needs (the drafters of a composite)."""
        return Taps(self.attn_cosine or other.attn_cosine, tuple(dict.fromkeys((*self.hidden, *other.hidden))))

    def verify_taps(self) -> ForwardTaps:
        """What every verify forward reports (engine/route.py)."""
        return ForwardTaps(hidden_at=self.hidden) if self.hidden else NO_TAPS

    def prefill_taps(self) -> ForwardTaps:
        """What the prefill reports (the verify forwards' taps too)."""
        return ForwardTaps(hidden_at=self.hidden, attn_cosine=self.attn_cosine)


@runtime_checkable
class Drafter(Protocol):
    """The contract between the driver and every drafting source: four verbs and two declared fields.

    ``lookahead``: the most cache slots a round writes past the pending token (the cache's capacity);
    ``taps``: what the forwards must report (:class:`Taps`). Per decode the driver calls
    :meth:`begin` once (the prompt cached, the first token committed), then per round :meth:`draft`
    (``budget``: the most draft tokens the round may still emit) and, once the round is verified and
    committed, :meth:`accept` with what was accepted and what the round cost (:class:`~.drafts.Round`),
    and finally :meth:`end`, whose answer (the drafter's description of itself, a typed
    :class:`~.output.DraftReport`) goes into
    the prompt's ``stats`` beside the driver's counters and timings (:class:`~.output.DecodeStats`). How long to draft, and
    whether to draft at all, is the drafter's :class:`DraftPolicy`'s, a separate object the drafter
    asks (docs/design.md, "Drafters and policies")."""

    lookahead: int
    taps: Taps

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None: ...

    def draft(self, state: DecodeState, budget: int) -> Draft: ...

    def accept(self, state: DecodeState, rnd: Round) -> None: ...

    def end(self) -> DraftReport: ...


@runtime_checkable
class DraftPolicy(Protocol):
    """How long a drafter drafts, in what shape, and whether at all: fed by the cost model
    (the planners of decoding/planning.py, the verify curve and draft costs of decoding/measure.py and cost_store.py). Measuring happens
    when a policy is set up, never inside a drafter. What every policy answers: ``curve``, the
    engine's verify curve when the policy plans with measured costs (the driver's unit of a round's
    cost, :class:`~.planning.RoundClock`, and its realized gain need it; None otherwise), and
    :meth:`gain`, the best expected gain of drafting this round (None: it cannot draft; 1.0: drafting
    does not pay), by which a choice among sources picks (:mod:`.choose`)."""

    @property
    def curve(self) -> VerifyCurve | None: ...

    def gain(self, state: DecodeState | None, budget: int) -> float | None: ...


class Plain:
    """The drafter that never drafts: every round is one plain decoding step (``ar``)."""

    lookahead = 0
    taps = Taps()

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        pass

    def draft(self, state: DecodeState, budget: int) -> Draft:
        return NoDraft()

    def accept(self, state: DecodeState, rnd: Round) -> None:
        pass

    def end(self) -> DraftReport:
        return NO_REPORT


class Unplanned:
    """The policy of a drafter that plans nothing from measured costs (``ar``, SpecEE, paper-style drafting)."""

    curve: VerifyCurve | None = None

    def gain(self, state: DecodeState | None, budget: int) -> float | None:
        return None


UNPLANNED = Unplanned()


class Delegating:
    """A drafter around another (``inner``) that drafts for it: the same lookahead and taps; a
    subclass adds what it does around the rounds."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.lookahead = inner.lookahead
        self.taps = inner.taps

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.inner.begin(state, prefill)

    def draft(self, state: DecodeState, budget: int) -> Draft:
        return self.inner.draft(state, budget)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        self.inner.accept(state, rnd)

    def end(self) -> DraftReport:
        return self.inner.end()


def decode(eng: Engine, tokenizer: Any, drafter: Drafter, prompt_ids: list[int], cfg: GenerationConfig,
           on_tokens: Callable[[list[int]], None] | None = None, *, policy: DraftPolicy = UNPLANNED) -> DecodeResult:
    """Decode one prompt on ``eng`` with ``drafter`` (its ``policy``: the verify curve the rounds are
    timed against); ``on_tokens`` streams each round's kept tokens."""
    sink = TokenSink(cfg, tokenizer)
    stats = DecodeStats()
    gen = make_generator(cfg.sampling, eng.device)
    # rule gumbel: a sample is a function of (seed, position, law)
    noise = (PositionNoise(gen.initial_seed(), eng.vocab_size, eng.device)
             if gen is not None and cfg.sampling.rule == "gumbel" else None)
    state = DecodeState(eng, prompt_ids, max_new_tokens=cfg.max_new_tokens, lookahead=drafter.lookahead,
                        sampling=cfg.sampling, generator=gen, eos=sink.eos, noise=noise)
    # expected, cost: the planners' predictions, summed over rounds; plain_equiv: what plain decoding
    # would have spent on the tokens emitted, at their contexts
    expected = cost = plain_equiv = 0.0
    clock = RoundClock(policy.curve)
    # the rounds that drafted nothing: how many, their verify seconds (the forward, the sampling and the commit:
    # what an ar step does, without the drafter's own draft and accept) and the stored T(1) at their contexts,
    # from which cli/summary.py scales ar's predicted pace to this process (issue 50)
    plain_n, plain_s, plain_t1 = 0, 0.0, 0.0
    unplanned = False  # a round drafted without a plan: no prediction to report
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = state.prefill(drafter.taps.prefill_taps())
        first = select_token(out.logits[-1], cfg.sampling, gen, noise(state.pos + 1) if noise is not None else None)
        state.commit_decided([first])
        _record(stats, sink, [first], 0, on_tokens)
        stats.target_forwards += 1
        timings = {"prefill_s": time.perf_counter() - t0, "draft_s": 0.0, "verify_s": 0.0, "update_s": 0.0}
        drafter.begin(state, out)
        while not sink.done:
            t1 = time.perf_counter()
            draft = drafter.draft(state, sink.remaining - 1)
            t2 = time.perf_counter()
            pos = state.pos
            verdict, out, forward_s = _verify(state, draft, drafter.taps)
            t3 = time.perf_counter()
            timings["draft_s"] += t2 - t1
            timings["verify_s"] += t3 - t2
            depth = draft_depth(draft)
            decided = isinstance(draft, Decided)
            steps = None
            if isinstance(draft, NoDraft) or (not depth and isinstance(draft, Chain)):  # a plain round: the unit
                clock.plain_round(t3 - t1)
                plain_n, plain_s, plain_t1 = plain_n + 1, plain_s + (t3 - t2), plain_t1 + (clock.t1_at(pos) or 0.0)
            elif depth:
                steps = clock.steps(t3 - t1, state.pos)
            e, c = draft.plan if draft.plan is not None else (1.0, 1.0)
            expected, cost = expected + e, cost + c
            unplanned |= bool(depth) and draft.plan is None
            if not decided or draft.full_depth:  # a decided round's forward counts only when it ran every layer
                stats.target_forwards += 1
            stats.draft_lengths.append(0 if decided else depth)
            if depth and not decided:
                stats.draft_rounds += 1
                stats.drafted_tokens += depth
            _record(stats, sink, verdict.tokens, len(verdict.accepted), on_tokens)
            plain_equiv += stats.accept_lengths[-1] * (clock.t1_at(state.pos) or 0.0)
            t4 = time.perf_counter()
            if forward_s is not None:  # the store's online refresh of the verify curve (decoding/cost_store.py)
                observe_forward(eng, verdict_rows(draft), forward_s, pos)
            drafter.accept(state, Round(draft, verdict, out, steps))
            timings["update_s"] += time.perf_counter() - t4
    stats.prefill_s, stats.draft_s, stats.verify_s, stats.update_s = (
        round(timings[k], 6) for k in ("prefill_s", "draft_s", "verify_s", "update_s"))
    if plain_n:
        stats.plain_rounds = PlainRounds(plain_n, round(plain_s, 6), round(plain_t1, 6))
    decode_s = timings["draft_s"] + timings["verify_s"] + timings["update_s"]  # a drafter's own work counts
    curve = policy.curve
    if curve is not None and curve.t1_s and decode_s > 0:  # plain steps' time over the time taken: the gain realized
        stats.realized_gain = round(plain_equiv / decode_s, 4)
        if cost > 0 and not unplanned:
            stats.predicted_gain = round(round_gain(expected, cost), 4)
            stats.plan = PlanTotals(round(expected, 4), round(cost, 4))
    stats.report = drafter.end()
    return sink.result(stats)


def _record(stats: DecodeStats, sink: TokenSink, tokens: list[int], accepted: int,
            on_tokens: Callable[[list[int]], None] | None) -> None:
    kept = sink.push(tokens)
    stats.accept_lengths.append(kept)
    stats.accepted_draft_tokens += min(accepted, kept)
    if on_tokens is not None and kept:
        on_tokens(tokens[:kept])



def verdict_rows(draft: Draft) -> int:
    """Rows of a chain's (or a plain round's) verify forward: the pending token and the drafts."""
    return 1 + (0 if isinstance(draft, NoDraft) else len(draft.tokens))


def _verify(state: DecodeState, draft: Draft, taps: Taps) -> tuple[Verdict, ForwardOutput | None, float | None]:
    """Apply the shared exact rule to a draft and commit the result in ``state``; also the seconds of
    the verify forward when it was a chain's (or a plain step), the forward the verify curve times."""
    if isinstance(draft, Decided):
        state.commit_decided(draft.tokens)
        return Verdict([], list(draft.tokens)), None, None
    tokens: list[int] = [] if isinstance(draft, NoDraft) else draft.tokens
    parents = draft.parents if isinstance(draft, Tree) else None
    forward_s = None
    if isinstance(draft, Deferred):
        out = None
    else:
        t0 = time.perf_counter()
        out = state.verify_forward(tokens, parents, taps.verify_taps())
        forward_s = time.perf_counter() - t0 if parents is None else None
    logits = draft.logits if out is None else out.logits
    sampling = state.sampling
    if state.noise is not None:  # rule gumbel: the greedy rules on the rows' perturbed scores
        logits = gumbel_scores(logits, sampling, state.noise.rows(state.row_positions(logits.shape[0], parents)))
        sampling = GREEDY
    if parents is not None:
        verdict = verify_tree(tokens, parents, logits, sampling, state.generator)
    elif sampling.greedy:
        verdict = verify_chain_greedy(tokens, logits)
    else:
        q = None if isinstance(draft, NoDraft) else draft.q
        if q is None:  # deterministic drafts: a point mass at each drafted token
            q = F.one_hot(state.ids(tokens), logits.shape[-1]).to(logits.dtype)
        verdict = verify_chain_sampling(tokens, q, logits, sampling, state.generator)
    state.commit(verdict.tokens, verdict.accepted, tree=parents is not None)
    return verdict, out, forward_s
