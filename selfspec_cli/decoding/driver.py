"""The decode driver: one loop for every method, with pluggable proposers.

:func:`decode` owns prefill, the stopping rules (:class:`~.loop.TokenSink`),
statistics with one definition (:class:`~.loop.DecodeStats`), cache capacity (in
:class:`~.state.DecodeState`), timing and streaming. Each round:

1. ``draft = proposer.propose(state, budget)`` where ``budget`` is the most draft
   tokens the round could still emit (``remaining - 1``: a round emits drafts + 1);
   the draft is one of the typed values of :mod:`.drafts`;
2. the driver verifies it with the shared exact rules of :mod:`.verify` (under the
   sampling rule ``gumbel``, the greedy rules applied to the rows' processed scores
   plus their positions' noise, :mod:`.sampling`), by its type:

   * :class:`~.drafts.Chain` or :class:`~.drafts.Tree`: one full-depth forward of the
     pending token and the drafts, then the chain or tree rule;
   * :class:`~.drafts.Deferred`: the proposer already ran the rows to full depth
     (AdaDecode); only the chain rule is applied;
   * :class:`~.drafts.Decided`: a lossy proposer's own tokens (SpecEE), committed unverified;
   * :class:`~.drafts.NoDraft`: one plain step;

3. the state keeps the accepted K/V and commits the tokens, the sink applies the
   stopping rules, and ``proposer.update(state, round)`` learns what was accepted and
   what the round cost (:class:`~.drafts.Round`; as transformers separates
   ``get_candidates`` from ``update_candidate_strategy``). Time is measured with one
   :class:`~.planning.RoundClock` per decode; nothing is written into the proposer. The
   seconds of each chain's (or plain step's) verify forward go to the store of the
   machine's costs (:func:`~.cost_store.observe_forward`, decoding/cost_store.py), which the
   next process reads; they change nothing in this decode.

An empty draft makes the round a plain decoding step, so ``ar`` is the proposer
that never drafts. Every lossless proposer gets exact greedy output and the
target's exact sampling law from the rules, whatever it drafts.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..config import GenerationConfig
from ..engine import Engine, ForwardOutput
from .cost_store import observe_forward
from .planning import RoundClock, round_gain
from .drafts import Chain, Decided, Deferred, Draft, NoDraft, Round, Tree, depth as draft_depth
from .output import DecodeResult, DecodeStats, TokenSink
from .sampling import PositionNoise, gumbel_scores, make_generator, select_token
from .state import DecodeState
from .verify import GREEDY, Verdict, verify_chain_greedy, verify_chain_sampling, verify_tree


class Proposer:
    """A drafting source bound to one engine. Subclasses override the hooks; the
    base class never drafts, which is plain autoregressive decoding.

    What the driver asks of every proposer, and nothing else: ``lookahead``, the most cache
    slots a round writes past the pending token (for the cache's capacity); the hooks below
    (:meth:`prefill_options`: what the prefill must report, such as the per-layer attention
    cosines ASD's skip source reads, a stack passing its parts' answer up); ``curve``, the
    engine's verify curve when the proposer plans with measured costs (the driver's unit of a
    round's cost, :class:`~.planning.RoundClock`, and its realized gain need it); None otherwise.
    """

    lookahead: int = 0
    curve: Any = None

    def __init__(self, engine: Engine, tokenizer: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        """After the prompt is cached and the first token committed."""

    def propose(self, state: DecodeState, budget: int) -> Draft:
        return NoDraft()

    def verify_options(self) -> dict[str, Any]:
        """Extra engine options for verification forwards (e.g. ``output_hidden``)."""
        return {}

    def prefill_options(self) -> dict[str, Any]:
        """Extra options of the prefill only (e.g. ``attn_cosine``), beside :meth:`verify_options`."""
        return {}

    def update(self, state: DecodeState, rnd: Round) -> None:
        """After each round, with what was accepted and what it cost (``state`` already committed it)."""

    def describe(self) -> dict[str, Any]:
        """Proposer state reported in each prompt's ``stats``."""
        return {}

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig,
                 on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
        return decode(self, prompt_ids, cfg, on_tokens)



class Delegating(Proposer):
    """A proposer around another (``inner``) that drafts for it: the same engine, tokenizer,
    lookahead, verify curve and expected gain; a subclass adds what it does around the rounds."""

    def __init__(self, inner: Proposer) -> None:
        super().__init__(inner.engine, inner.tokenizer)
        self.inner = inner
        self.lookahead = inner.lookahead

    @property
    def curve(self) -> Any:  # type: ignore[override]
        return self.inner.curve

    def expected_gain(self, state: DecodeState | None, budget: int) -> float | None:
        return self.inner.expected_gain(state, budget)

    def prefill_options(self) -> dict[str, Any]:
        return self.inner.prefill_options()


def decode(proposer: Proposer, prompt_ids: list[int], cfg: GenerationConfig,
           on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Decode one prompt with ``proposer``; ``on_tokens`` streams each round's kept tokens."""
    eng = proposer.engine
    sink = TokenSink(cfg, proposer.tokenizer)
    stats = DecodeStats()
    gen = make_generator(cfg.sampling, eng.device)
    # rule gumbel: a sample is a function of (seed, position, law)
    noise = (PositionNoise(gen.initial_seed(), eng.vocab_size, eng.device)
             if gen is not None and cfg.sampling.rule == "gumbel" else None)
    state = DecodeState(eng, prompt_ids, max_new_tokens=cfg.max_new_tokens, lookahead=proposer.lookahead,
                        sampling=cfg.sampling, generator=gen, eos=sink.eos, noise=noise)
    # expected, cost: the planners' predictions, summed over rounds; plain_equiv: what plain decoding
    # would have spent on the tokens emitted, at their contexts
    expected = cost = plain_equiv = 0.0
    clock = RoundClock(proposer.curve)
    # the rounds that drafted nothing: how many, their verify seconds (the forward, the sampling and the commit:
    # what an ar step does, without the method's own propose and update) and the stored T(1) at their contexts,
    # from which cli/summary.py scales ar's predicted pace to this process (issue 50)
    plain_n, plain_s, plain_t1 = 0, 0.0, 0.0
    unplanned = False  # a round drafted without a plan: no prediction to report
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = state.prefill(**{**proposer.verify_options(), **proposer.prefill_options()})
        first = select_token(out.logits[-1], cfg.sampling, gen, noise(state.pos + 1) if noise is not None else None)
        state.commit_decided([first])
        _record(stats, sink, [first], 0, on_tokens)
        stats.target_forwards += 1
        timings = {"prefill_s": time.perf_counter() - t0, "draft_s": 0.0, "verify_s": 0.0, "update_s": 0.0}
        proposer.begin(state, out)
        while not sink.done:
            t1 = time.perf_counter()
            draft = proposer.propose(state, sink.remaining - 1)
            t2 = time.perf_counter()
            pos = state.pos
            verdict, out, forward_s = _verify(state, draft, proposer)
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
            proposer.update(state, Round(draft, verdict, out, steps))
            timings["update_s"] += time.perf_counter() - t4
    stats.extra.update({k: round(v, 6) for k, v in timings.items()})
    if plain_n:
        stats.extra["plain_rounds"] = {"count": plain_n, "verify_s": round(plain_s, 6), "stored_t1_s": round(plain_t1, 6)}
    decode_s = timings["draft_s"] + timings["verify_s"] + timings["update_s"]  # a proposer's own work counts
    curve = proposer.curve
    if curve is not None and curve.t1_s and decode_s > 0:  # plain steps' time over the time taken: the gain realized
        stats.extra["realized_gain"] = round(plain_equiv / decode_s, 4)
        if cost > 0 and not unplanned:
            stats.extra["predicted_gain"] = round(round_gain(expected, cost), 4)
            stats.extra["plan"] = {"expected_tokens": round(expected, 4), "cost_steps": round(cost, 4)}
    stats.extra.update(proposer.describe())
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


def _verify(state: DecodeState, draft: Draft, proposer: Proposer) -> tuple[Verdict, ForwardOutput | None, float | None]:
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
        out = state.verify_forward(tokens, parents, **proposer.verify_options())
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
