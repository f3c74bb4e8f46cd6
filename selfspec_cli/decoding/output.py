"""What a decode outputs: the tokens kept under the stopping rules, and the statistics.

A prompt's output record is an :class:`OutputRecord` (its turns :class:`TurnRecord`): what
:func:`~selfspec_cli.runtime.run_prompt` returns and every reader takes, serialized once at I/O
(:meth:`OutputRecord.to_dict` where a line is written, :meth:`OutputRecord.from_dict` where a file is
read back: the same keys, values and order on disk as ever). A decode's statistics are counted in
:class:`DecodeStats` (the driver's counters and timings as typed fields; ``extra``: what the drafter
reports of itself, a typed :class:`DraftReport`) and kept, in every output record, as :class:`TurnStats`
serialized flat (:meth:`TurnStats.to_dict`: the same keys as ever; the report through
:meth:`DraftReport.to_json`, once, where the statistics are summarized); :meth:`TurnStats.from_dict` takes
older records that lack newer fields, and keeps the keys it does not type as read (``extra``: JSON from a file).

Methods produce tokens in bursts (one per step for plain decoding, several per
verification for speculative methods). :class:`TokenSink` takes each burst and
keeps exactly the tokens up to the first stopping event, so ``max_new_tokens`` is
never exceeded and nothing after EOS or a stop string is kept, whatever method
produced the burst.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import GenerationConfig
from ..jsonio import JsonObject


class DraftReport:
    """What a drafter, a policy or a skip source reports of itself (a drafter's ``end()``, decoding/driver.py;
    a policy's ``report()``; a skip source's ``describe()``): a frozen dataclass per kind, with typed fields,
    serialized once, by :meth:`to_json`, where a decode's statistics are summarized (:meth:`DecodeStats.summary`).

    :meth:`to_json` writes the fields in their declared order under their own names (so the JSON keys, their
    order and values are what the reports always wrote); a nested report, a list or a dict of them is written
    as JSON too. A field's metadata may say ``omit`` (absent when None, :func:`optional`) or ``flat`` (its
    own keys written in its place, :func:`flat`)."""

    __slots__ = ()

    def to_json(self) -> JsonObject:
        out: JsonObject = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and f.metadata.get("omit"):
                continue
            if f.metadata.get("flat"):
                for part in v if isinstance(v, (list, tuple)) else (v,):
                    out.update(_json(part) if part is not None else {})
            else:
                out[f.name] = _json(v)
        return out


def _json(v: Any) -> Any:
    if isinstance(v, DraftReport):
        return v.to_json()
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    return v


def optional(**kw: Any) -> Any:
    """A report's field absent from its JSON when None (default None)."""
    return field(default=None, metadata={"omit": True}, **kw)


def flat(*, omit: bool = False, **kw: Any) -> Any:
    """A report's field (a report or a dict) whose keys are written in its place, not under its name."""
    return field(metadata={"flat": True, "omit": omit}, **kw)


@dataclass(frozen=True, slots=True)
class NoReport(DraftReport):
    """A drafter or a skip source with nothing to report (``ar``; a fixed skip set)."""


NO_REPORT = NoReport()


@dataclass(frozen=True, slots=True)
class Merged(DraftReport):
    """Several reports written as one (their keys in turn; a later one's win)."""

    parts: tuple[DraftReport, ...] = flat()


@dataclass(frozen=True, slots=True)
class ByName(DraftReport):
    """One report per named source (a choice among drafters, decoding/choose.py), each under its name."""

    sources: dict[str, DraftReport] = flat()


@dataclass(frozen=True, slots=True)
class PlanTotals:
    """What a decode's drafting plans predicted, summed over its rounds (decoding/planning.py)."""

    expected_tokens: float
    cost_steps: float  # in plain steps


@dataclass(frozen=True, slots=True)
class PlainRounds:
    """The rounds of a decode that drafted nothing (each one an ``ar`` step): how many, their verify
    seconds and the stored T(1) at their contexts (cli/summary.py scales ``ar``'s estimate by them)."""

    count: int
    verify_s: float
    stored_t1_s: float


@dataclass(slots=True)
class DecodeStats:
    """Per-prompt counters, with one definition for every method (the driver fills them).

    * a *round* is one draft of the drafter and its verification (the prefill is
      round 0); ``accept_lengths[i]`` is the number of tokens round ``i`` added to
      the output, so their mean is M, tokens per round;
    * ``target_forwards``: full-depth forwards of the target (prefill, verification
      forwards, and rounds a lossy drafter ran at full depth);
    * ``drafted_tokens``: draft positions proposed (a chain's length, a tree's depth);
      ``accepted_draft_tokens``: drafted tokens that were accepted and kept;
    * ``draft_rounds``: rounds that proposed at least one draft token;
    * the driver's timings (seconds, None where no driver ran: an outside peer), the plain rounds, the
      gain realized against plain steps and the one its plans predicted (with the plans' totals);
    * ``report``: what the drafter reports of itself (its ``end()``: its settings, skip sets, cost model);
    * ``drafts_counted``: the draft counts are written even when nothing was drafted (an assisted outside peer).
    """

    target_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_rounds: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # per round after the prefill: draft depth (0: none)
    prefill_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    update_s: float | None = None
    plain_rounds: PlainRounds | None = None
    realized_gain: float | None = None
    predicted_gain: float | None = None
    plan: PlanTotals | None = None
    report: DraftReport = NO_REPORT
    drafts_counted: bool = False

    def summary(self) -> TurnStats:
        """The counters and their derived figures, with the driver's timings and what the drafter reported."""
        n = len(self.accept_lengths)
        out: JsonObject = {"target_forwards": self.target_forwards, "accept_lengths": self.accept_lengths,
                           "mean_accepted_length": (sum(self.accept_lengths) / n) if n else 0.0}
        out["draft_round_share"] = self.draft_rounds / max(1, n - 1)  # 0.0 also for a planner that never drafted
        if self.drafted_tokens:
            out.update(drafted_tokens=self.drafted_tokens, accepted_draft_tokens=self.accepted_draft_tokens,
                       acceptance_rate=self.accepted_draft_tokens / self.drafted_tokens)
        elif self.drafts_counted:
            out.update(drafted_tokens=0, accepted_draft_tokens=0)
        driver = {k: getattr(self, k) for k in _DRIVER_FIELDS}
        return TurnStats.from_dict({**out, **{k: v for k, v in driver.items() if v is not None},
                                    **self.report.to_json()})

    def as_dict(self) -> JsonObject:
        """:meth:`summary` as a record keeps it."""
        return self.summary().to_dict()


_DRIVER_FIELDS = ("prefill_s", "draft_s", "verify_s", "update_s", "plain_rounds", "realized_gain", "predicted_gain",
                  "plan")


@dataclass(slots=True)
class TurnStats:
    """One decode's statistics as an output record keeps them (a turn's ``stats``). A field that is
    None is absent from the record (older records, a method that does not draft or plan, an outside
    peer, a multi-turn record's totals); ``extra`` holds the other keys (the drafter's description of
    itself), kept flat after the fields on disk."""

    target_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    mean_accepted_length: float = 0.0
    draft_round_share: float | None = None  # rounds after the prefill that drafted
    drafted_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    acceptance_rate: float | None = None
    plan: PlanTotals | None = None
    skip_attn: list[int] | None = None  # a layer-skipping drafter's skip set
    skip_mlp: list[int] | None = None
    prefill_s: float | None = None  # the driver's timings (seconds)
    draft_s: float | None = None
    verify_s: float | None = None
    update_s: float | None = None
    plain_rounds: PlainRounds | None = None
    realized_gain: float | None = None
    predicted_gain: float | None = None
    extra: JsonObject = field(default_factory=dict)

    def to_dict(self) -> JsonObject:
        out = dataclasses.asdict(self)
        extra = out.pop("extra")
        return {**{k: v for k, v in out.items() if v is not None}, **extra}

    @classmethod
    def from_dict(cls, d: JsonObject) -> TurnStats:
        typed = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in typed}
        for key, kind in (("plan", PlanTotals), ("plain_rounds", PlainRounds)):
            if isinstance(kw.get(key), Mapping):
                kw[key] = kind(**kw[key])
        return cls(**kw, extra={k: v for k, v in d.items() if k not in typed})


TURN_SEPARATOR = "\n\n"  # between a multi-turn record's turns in its top-level ``text``
_TURN_KEYS = ("text", "token_ids", "new_tokens", "accept_lengths", "prompt_tokens", "wall_time_s", "tokens_per_s",
              "finish_reason", "stats")
_RECORD_KEYS = ("id", "method", "lossless", "text", "token_ids", "new_tokens", "prompt_tokens", "wall_time_s",
                "tokens_per_s", "finish_reason", "stats", "category", "num_turns", "turns", "repeat", "rank", "threads",
                "prompt_sha256", "settings", "artifacts")
_LATE_KEYS = _RECORD_KEYS[14:]  # written after the turns, each only when set


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One decoded turn as an output record keeps it (a multi-turn record's ``turns[i]``)."""

    text: str
    token_ids: list[int]
    new_tokens: int
    accept_lengths: list[int]
    prompt_tokens: int
    wall_time_s: float
    tokens_per_s: float | None
    finish_reason: str
    stats: TurnStats

    def to_dict(self) -> JsonObject:
        """The turn as JSONL holds it (the keys in this order; ``stats`` flat, :meth:`TurnStats.to_dict`)."""
        return {k: getattr(self, k) for k in _TURN_KEYS[:-1]} | {"stats": self.stats.to_dict()}

    @classmethod
    def from_dict(cls, d: JsonObject) -> TurnRecord:
        return cls(**{k: d.get(k) for k in _TURN_KEYS[:-1]}, stats=TurnStats.from_dict(d.get("stats") or {}))


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """One prompt's output record, what ``generate`` prints and the bench keeps in records/<method>.jsonl
    (docs/benchmarks.md): the fields cover the whole prompt (a multi-turn prompt's totals, its last turn's
    ``finish_reason``; ``turns``: each turn, multi-turn records only); ``repeat`` and ``rank``: the bench's
    pass and torchrun rank (absent elsewhere); ``threads``, ``prompt_sha256``, ``settings`` (the run's settings,
    cli/resume.py) and ``artifacts`` (kind -> path): what ``generate`` adds (absent elsewhere); ``extra``: keys
    this version does not know (an outside peer's, a newer file's), kept as read. Serialized once at I/O: :meth:`to_dict` writes exactly the keys
    and values records always had, in the same order, and :meth:`from_dict` reads any record back."""

    id: Any
    method: str
    lossless: bool
    text: str
    token_ids: list[int]
    new_tokens: int
    prompt_tokens: int
    wall_time_s: float
    tokens_per_s: float | None
    finish_reason: str
    stats: TurnStats
    category: str | None = None
    turns: tuple[TurnRecord, ...] | None = None
    repeat: int | None = None
    rank: int | None = None
    threads: int | None = None
    prompt_sha256: str | None = None
    settings: JsonObject | None = None
    artifacts: dict[str, str] | None = None
    extra: JsonObject = field(default_factory=dict)

    def all_turns(self) -> tuple[TurnRecord, ...]:
        """Its turns (a one-turn record is its own turn)."""
        if self.turns is not None:
            return self.turns
        return (TurnRecord(self.text, self.token_ids, self.new_tokens, list(self.stats.accept_lengths),
                           self.prompt_tokens, self.wall_time_s, self.tokens_per_s, self.finish_reason, self.stats),)

    def to_dict(self) -> JsonObject:
        out = {k: getattr(self, k) for k in _RECORD_KEYS[:10]}
        out["stats"] = self.stats.to_dict()
        if self.category is not None:
            out["category"] = self.category
        if self.turns is not None:
            out.update(num_turns=len(self.turns), turns=[t.to_dict() for t in self.turns])
        out.update({k: v for k in _LATE_KEYS if (v := getattr(self, k)) is not None})
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, d: JsonObject) -> OutputRecord:
        turns = d.get("turns")
        return cls(**{k: d.get(k) for k in _RECORD_KEYS[:10]}, stats=TurnStats.from_dict(d.get("stats") or {}),
                   category=d.get("category"), turns=None if turns is None else tuple(TurnRecord.from_dict(t) for t in turns),
                   **{k: d.get(k) for k in _LATE_KEYS}, extra={k: v for k, v in d.items() if k not in _RECORD_KEYS})


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop_string"
    stats: DecodeStats


class TokenSink:
    """Accumulates generated tokens and decides when generation ends."""

    def __init__(self, cfg: GenerationConfig, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.eos = frozenset() if cfg.ignore_eos else frozenset(cfg.eos_token_ids)
        self._stops = cfg.stop_strings
        if self._stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._tok = tokenizer
        # a token decodes to at least one character, so this many tokens cover any stop string
        self._stop_window = max((len(s) for s in self._stops), default=0) + 2

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - len(self.tokens)

    def push(self, tokens: Iterable[int]) -> int:
        """Append a burst; returns how many of its tokens were kept."""
        kept = 0
        for t in tokens:
            if self.done:
                break
            self.tokens.append(int(t))
            kept += 1
            if t in self.eos:
                self.finish_reason = "eos"
            elif self._stops and self._hit_stop():
                self.finish_reason = "stop_string"
            elif len(self.tokens) >= self.cfg.max_new_tokens:
                self.finish_reason = "length"
        return kept

    def _hit_stop(self) -> bool:
        tail = self._tok.decode(self.tokens[-self._stop_window :], skip_special_tokens=False)
        return any(s in tail for s in self._stops)

    def result(self, stats: DecodeStats) -> DecodeResult:
        return DecodeResult(self.tokens, self.finish_reason or "length", stats)
