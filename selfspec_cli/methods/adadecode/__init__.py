"""AdaDecode: adaptive layer parallelism with early predictions at intermediate heads
(Wei et al., ICML 2025, Algorithm 1), lossless.

Per input token ``x`` at position ``p`` the layers run in *segments* that end at head
layers. After a segment that ends at head layer ``k``, the head predicts the next
token; if its confidence exceeds ``threshold`` (and fewer than ``max_pending``
early tokens are unverified), the token is *predicted early*: ``x``'s residual rows
wait before layer ``k+1`` and the early token starts at layer 0 right away. Rows
that wait before a layer run it together with the next token that reaches it (one
batched call: the rows are always a contiguous suffix of the sequence, so a causal
block at the layer's own cache length is the right mask). When a token reaches the
last layer, every unverified early token is in its batch; the final logits of all
rows verify them in order:

* greedy: accept while the early token equals the final argmax; the first mismatch
  is replaced by the argmax, everything after it is dropped (caches cropped);
* sampling: the early token is a *deterministic* proposal (the head's top token of
  its processed distribution, taken when that probability exceeds the threshold),
  so it is accepted with probability ``p*(x0)`` and on rejection the replacement is
  drawn from ``p*`` without ``x0``, renormalised — speculative sampling with a
  one-hot draft. This is exactly the target's law. The paper's rule (accept with
  ``min(1, p*/p_i)``, resample from ``norm(max(0, p* - p_i))``) treats the gated
  proposal as if it were a sample of ``p_i`` and is biased; the sampling test runs
  it as a control and rejects it.
  That is the sampling rule ``speculative``; under ``gumbel`` (the default) the early
  token is the head's pick with the position's Gumbel noise, accepted when it equals
  the target's (decoding/sampling.py).
* if all are accepted the last row's final distribution gives one more token.

A head may score a draft vocabulary only (FR-Spec's, methods/fr_spec/: on Gemma 3's 262k
tokens a check over the whole vocabulary is over half a step): its early token is then a
token id of that vocabulary, its point-mass law is placed at that id in the whole vocabulary
and the Gumbel noise is read at the vocabulary's ids, so both arguments above hold unchanged
(a token outside the vocabulary is never proposed and comes only from the target).

As the drafter of the shared driver (:class:`HeadsDrafter`; which heads to check is its policy's,
:class:`HeadsPolicy`), one round is the run of the pending token (and
the early tokens it triggers) until a token reaches the last layer; the round's
draft is the early tokens with the final logits of all their rows (deferred rows),
and the driver applies the chain rule and keeps the accepted prefix. Invariant
(checked by the cache): the rows that enter a segment are the newest tokens fed,
a contiguous suffix of the sequence.

The package is the whole method: this module holds the method, its drafter and policy, and its artifact
(:data:`HEADS`: per head layer ``k``, tensors ``layer{k}.a``, ``layer{k}.b``, ``layer{k}.g``,
``k`` the 0-based layer after which the head reads, and ``layer{k}.vocab`` for a head over a
draft vocabulary: the token ids it scores); :mod:`.heads` is the head's computation
and :mod:`.train` the offline step that trains them (``selfspec train-heads --kind lm-heads``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...artifacts import ArtifactSpec, load_layers
from ...decoding.cost_store import curve_for
from ...decoding.measure import VerifyCurve, timed
from ...decoding.planning import ProbeBudget
from ...decoding.drafts import Deferred, Draft, HeadsNote, NoDraft, Round
from ...decoding.output import DraftReport, flat
from ...decoding.driver import Taps
from ...decoding.sampling import processed_probs
from ...decoding.state import DecodeState
from ...engine import Engine, ForwardOutput
from ...engine.runner import ALL_ROWS
from ...errors import FieldError
from ..base import Method, layer_list, option, require, training_cost
from ..offline import OfflineStep
from .heads import LowRankHead, head_logits
from ...jsonio import JsonObject

HEADS = ArtifactSpec(kind="adadecode-heads", folder="adadecode", what="AdaDecode heads artifact",
                     make="selfspec train-heads --kind lm-heads")


@dataclass(frozen=True)
class TrainOptions:
    """The options only ``selfspec train-heads --kind lm-heads`` takes (None: not given, its default)."""

    layers: str | None = option(None, "0-based layers after which heads sit (default: after L/4, L/2, 3L/4 layers)")
    rank: int | None = option(None, "rank r (default 64) of each head's correction (identity + B A)")
    epochs: int | None = option(None, "training epochs (default 30)")
    lr: float | None = option(None, "Adam learning rate (default 5e-3)")
    batch_size: int | None = option(None, "rows per step (default 128)")
    seed: int | None = option(None, "seed of initialisation and shuffling (default 0)")
    draft_vocab: str | None = option(None, "the tokens the heads score: auto (default: this model's FR-Spec draft "
                                           "vocabulary when it has one, else all), full, or an FR-Spec artifact path")
    cache_dir: Path | None = option(None, "on-disk cache of the on-policy data (default <selfspec cache>/onpolicy; "
                                          "cache: $SELFSPEC_CACHE, else $SELFSPEC_HOME/cache, else ~/.cache/selfspec)")


TRAIN = OfflineStep("train-heads", "lm-heads", HEADS, "selfspec_cli.methods.adadecode.train", num_prompts=1000,
                    max_new_tokens=256, min_prompts=3, Options=TrainOptions)


def load_heads(path: Path | None, model: Any) -> tuple[dict[int, LowRankHead], JsonObject]:
    """The heads (layer -> :class:`~.heads.LowRankHead`) of :data:`HEADS` at ``path`` (None: this model's default)."""
    return load_layers(HEADS, path, model, LowRankHead, "head")


@dataclass(frozen=True)
class AdaDecodeConfig:
    heads: Path | None = option(None, "trained heads artifact (default: this model's, made by `selfspec train-heads "
                                      "--kind lm-heads`; the user's first, then the shipped one)")
    adadecode_threshold: float = option(0.5, "early-prediction confidence gamma (the paper uses 0.75; see docs/early-exit.md)")
    adadecode_max_pending: int = option(5, "most unverified early predictions (paper App. D)")
    adadecode_layers: tuple[int, ...] | None = option(None, "use only these head layers, e.g. 2,5 (default: every trained head)")
    paper_drafting: bool = option(False, "check every head for every token, as the paper does, instead of only the heads "
                                         "whose measured exits pay for their check (can be slower than ar)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "adadecode_layers", layer_list(self.adadecode_layers, "adadecode_layers"))
        require(0.0 <= self.adadecode_threshold <= 1.0, "adadecode_threshold", "in [0, 1]",
                self.adadecode_threshold)
        require(self.adadecode_max_pending >= 1, "adadecode_max_pending", ">= 1", self.adadecode_max_pending)


def proposal_law(head_probs: torch.Tensor, token: int) -> torch.Tensor:
    """The law the early token was drawn from, for speculative verification: a point
    mass, because the token is the head's top token taken when it passes the gate.
    (The paper uses ``head_probs`` here, which is biased; the sampling test's control
    patches this function to do that.)"""
    q = torch.zeros_like(head_probs)
    q[token] = 1.0
    return q


class HeadsPolicy:
    """Which heads are worth checking for a token (cost-aware head use), fed by the measured cost of
    a head check over a plain step (:meth:`setup`, before any decode) and each head's checks, exits
    and accepted exits over the run (Beta-style priors); ``paper``: every head for every token,
    nothing measured. AdaDecode's draft length is the heads' exits, so this is its draft policy."""

    def __init__(self, engine: Engine, layers: list[int], paper: bool) -> None:
        self.engine, self.paper = engine, paper
        self.curve: VerifyCurve | None = None
        # cost-aware head use: per head, checks, exits and accepted exits over the run (Beta-style priors)
        self.head_stats = {k: [2.0, 1.0, 0.5] for k in layers}
        self.probes = {k: ProbeBudget() for k in layers}  # probes per head (decoding/planning.py)
        self.head_cost = 0.0

    def setup(self, check: Callable[[], Any]) -> HeadsPolicy:
        """Measure one head check (``check``: the low-rank correction and the LM head on one row) over
        a plain step, unless ``paper``."""
        if not self.paper:
            self.curve = curve_for(self.engine)
            check()  # warm-up: the first call allocates
            self.head_cost = min(timed(check, self.engine.device)[1] for _ in range(3)) / self.curve.t1_s
        return self

    def gain(self, state: DecodeState | None, budget: int) -> float | None:
        """None: the heads' gain is known only token by token."""
        return None

    def worth_checking(self, k: int) -> bool:
        """Check head ``k`` when its expected saving beats the check's cost: an accepted exit
        lets the deeper layers ride along with the next token (saving their share of a step),
        a rejected one wastes the guess's shallow layers. When it does not pay, probe now and
        then, paid from a budget of 1 % of a step per skipped check (as the drafting planner)."""
        if self.paper:
            return True
        checks, exits, accepted = self.head_stats[k]
        L = self.engine.num_layers
        value = accepted / checks * (L - k - 1) / L - (exits - accepted) / checks * (k + 1) / L - self.head_cost
        if value > 0:
            self.probes[k].paying()
            return True
        return self.probes[k].probe(-value)

    def report(self) -> HeadsPolicyReport:
        return HeadsPolicyReport({str(k): int(v[0] - 2) for k, v in self.head_stats.items()}, round(self.head_cost, 4))


@dataclass(frozen=True, slots=True)
class HeadsPolicyReport(DraftReport):
    """AdaDecode's policy in the prompt's ``stats``: the checks of each head, and a check's cost in plain steps."""

    head_checks: dict[str, int]
    head_cost: float


@dataclass(frozen=True, slots=True)
class HeadsReport(DraftReport):
    """AdaDecode's drafter's report: early exits per head layer, the heads' vocabulary size(s) (``"full"``: all
    rows), its policy's report (written flat), the threshold and the head layers used."""

    early_exits: dict[str, int]
    head_vocab: int | str | list[int | str]
    policy: HeadsPolicyReport = flat()
    adadecode_threshold: float
    head_layers: list[int]


class HeadsDrafter:
    """AdaDecode's drafter: one round is the run of the pending token down the segments (see the
    module docstring), checking the heads its policy (:class:`HeadsPolicy`) says are worth it."""

    taps = Taps()

    def __init__(self, engine: Engine, config: AdaDecodeConfig, heads: dict[int, LowRankHead], policy: HeadsPolicy) -> None:
        self.engine, self.config, self.policy = engine, config, policy
        L = engine.num_layers
        use = sorted(heads)
        self.lookahead = config.adadecode_max_pending
        self.heads = {k: heads[k].to(engine.device, engine.dtype) for k in use}
        self.head_lm = self._head_lms()  # per head, the LM head over its vocabulary (FR-Spec heads: their rows)
        # segments [s, e): each ends after a head layer (e - 1) or at the last layer
        bounds = [0, *[k + 1 for k in use], L]
        self.segments = list(zip(bounds[:-1], bounds[1:]))
        self.exits: dict[int, int] = {}

    def check_once(self) -> Callable[[], Any]:
        """One check of the shallowest head on a zero row: what the policy times."""
        k = min(self.heads)
        row = torch.zeros(1, self.engine.adapter.hidden_size, dtype=self.engine.dtype, device=self.engine.device)
        return lambda: self._head(k, row)

    def _head_lms(self) -> dict[int, Any]:
        """The engine's LM head for heads over the whole vocabulary; for a head over a draft
        vocabulary, the prepacked rows of those tokens (built once per distinct vocabulary)."""
        built: list[tuple[torch.Tensor, Any]] = []
        out: dict[int, Any] = {}
        for k, h in self.heads.items():
            if h.vocab is None:
                out[k] = self.engine.lm_head
                continue
            lm = next((m for v, m in built if v.shape == h.vocab.shape and torch.equal(v, h.vocab)), None)
            if lm is None:
                lm = self.engine.subset_head(h.vocab)
                built.append((h.vocab, lm))
            out[k] = lm
        return out

    def _head(self, layer: int, row: torch.Tensor) -> torch.Tensor:
        """The head's logits (N,) over its vocabulary (column i: token ``heads[layer].tokens(i)``)."""
        return head_logits(row, self.heads[layer], self.head_lm[layer], self.engine.adapter.rms_eps)[0].float()

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.exits = {k: 0 for k in self.heads}

    def draft(self, state: DecodeState, budget: int) -> Draft:
        """Run the pending token down the segments, predicting early where a head is
        confident; ends when a token reaches the last layer, whose batch then holds every
        early token's rows, and returns them with their final logits (deferred rows).
        When no head is worth checking for the pending token, the round is a plain step
        (an empty draft: one full forward instead of one call per segment)."""
        c, L, sampling = self.config, self.engine.num_layers, state.sampling
        waiting: dict[int, torch.Tensor] = {}  # segment start -> residual rows waiting to enter it
        early: list[int] = []  # unverified early tokens, in order (each is fed as an input)
        early_q: list[torch.Tensor] = []  # sampling: their proposal laws
        made_by: list[int] = []  # the head layer of each early token
        token = state.pending
        while True:
            can_exit = len(early) < min(c.adadecode_max_pending, budget) and token not in state.eos
            check = {k for k in self.heads if self.policy.worth_checking(k)} if can_exit else set()
            if not early and not check:  # no head pays for this token: a plain step, one forward by the driver
                return NoDraft()
            h = self.engine.embed(state.ids([token]))
            for s, e in self.segments:
                if s in waiting:
                    h = torch.cat([waiting.pop(s), h])
                out = state.run(hidden=h, start=s, end=e, logits_rows=ALL_ROWS if e == L else None)
                h = out.hidden
                if e == L or e - 1 not in check:
                    continue
                self.policy.head_stats[e - 1][0] += 1
                hd = self.heads[e - 1]
                head = self._head(e - 1, h[-1:])  # early prediction at head layer e - 1, over the head's vocabulary
                q = head.softmax(-1) if sampling.greedy else processed_probs(head, sampling)
                conf, guess = q.max(-1)
                if float(conf) > c.adadecode_threshold:
                    if state.noise is not None:  # rule gumbel: the position's perturbed pick, which the target's may equal
                        noise = state.noise(state.next_position)
                        guess = (q.log() + (noise if hd.vocab is None else noise[hd.vocab])).argmax()
                    token = int(hd.tokens(guess))
                    waiting[e] = torch.cat([waiting[e], h]) if e in waiting else h
                    early.append(token)
                    if not sampling.greedy and state.noise is None:
                        full = q if hd.vocab is None else q.new_zeros(self.engine.vocab_size).index_copy_(0, hd.vocab, q)
                        early_q.append(proposal_law(full, token))
                    state.feed(token)
                    self.exits[e - 1] += 1
                    self.policy.head_stats[e - 1][1] += 1
                    made_by.append(e - 1)
                    break  # the early token starts at layer 0
            else:  # no early prediction: this token reached the last layer
                break
        assert out.logits.shape[0] == len(early) + 1 and not waiting, (out.logits.shape, len(early), list(waiting))
        return Deferred(early, out.logits, q=torch.stack(early_q) if early_q else None,
                        note=HeadsNote(made_by))

    def accept(self, state: DecodeState, rnd: Round) -> None:
        note = rnd.draft.note if isinstance(rnd.draft, Deferred) else None
        made_by = note.layers if isinstance(note, HeadsNote) else []  # the head layer of each early token
        for k in made_by[: len(rnd.verdict.accepted)]:
            self.policy.head_stats[k][2] += 1

    def end(self) -> HeadsReport:
        sizes = sorted({"full" if h.vocab is None else h.vocab.numel() for h in self.heads.values()}, key=str)
        return HeadsReport({str(k): v for k, v in self.exits.items()},
                           sizes[0] if len(sizes) == 1 else sizes,  # the tokens the heads score
                           self.policy.report(), self.config.adadecode_threshold, sorted(self.heads))


class AdaDecode(Method):
    """Has a :class:`HeadsDrafter` over the trained heads it uses and a :class:`HeadsPolicy`."""

    name = "adadecode"
    lossless = True
    description = "AdaDecode: early predictions at trained intermediate heads, deferred deep layers, verification"
    Config = AdaDecodeConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: AdaDecodeConfig | None = None, *,
                 heads: dict[int, LowRankHead]) -> None:
        super().__init__(engine, tokenizer, config)
        config = self.config
        L = engine.num_layers
        use = sorted(heads) if config.adadecode_layers is None else sorted(config.adadecode_layers)
        if missing := [k for k in use if k not in heads]:
            raise FieldError("adadecode_layers", f"{missing} have no trained head (heads at {sorted(heads)})")
        if bad := [k for k in use if not 0 <= k < L - 1]:
            raise FieldError("adadecode_layers", f"{bad} are out of range for a {L}-layer model")
        self.policy = policy = HeadsPolicy(engine, use, config.paper_drafting)
        self.drafter = drafter = HeadsDrafter(engine, config, {k: heads[k] for k in use}, policy)
        policy.setup(drafter.check_once())

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: AdaDecodeConfig | None = None) -> AdaDecode:
        config = config or AdaDecodeConfig()
        heads, manifest = load_heads(config.heads, engine.model)
        method = cls(engine, tokenizer, config, heads=heads)
        method.offline_parts.append(training_cost("lm-heads training", manifest))
        return method
