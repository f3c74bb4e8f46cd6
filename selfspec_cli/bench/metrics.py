"""Benchmark arithmetic, kept apart from timing so it can be tested on hand-built logs: it reads output
records (:class:`~selfspec_cli.decoding.output.OutputRecord`) and answers in dataclasses, which the bench's
report serializes once into results.json.

Definitions (the same for every contender, selfspec's methods and outside peers):

* **tokens** are counted from generated token ids (``new_tokens`` of a record), never by
  re-tokenizing text;
* **tokens/s of a prompt** = its new tokens / its wall time (all turns summed);
* **tokens/s of a repeat** = the mean of its prompts' tokens/s (Spec-Bench's per-question
  average); a method's figure is the **median over repeats**, with the min-max;
* **speedup** of A over B = mean tokens/s of A / mean tokens/s of B, each mean taken over
  every (repeat, prompt) pair (Spec-Bench's ratio of mean throughputs);
* **paired speedup** of A over B = geometric mean over (repeat, prompt) pairs of A's tokens/s
  over B's on the same prompt in the same pass, with a 95 % interval (Student's t on the log
  ratios). The contenders decode a prompt seconds apart (prompt-major order), so a slowdown
  of the machine that spans both cancels in the pair; the interval says how far a figure,
  above all a group of a few prompts, can be trusted;
* **decode-only** tokens/s and speedup: the same with each turn's prefill (and the token it
  makes) left out, for contenders that report ``prefill_s`` (selfspec's methods); the
  drafting plans' predictions are decode-only, so they are checked against this;
* a **step** is one full-depth target forward, prefill included; ``accept_lengths[i]`` is
  the number of tokens step ``i`` added. **M** (mean accepted length) = mean of
  ``accept_lengths`` over all steps of all prompts = tokens / steps;
* **alpha** (acceptance rate) = accepted draft tokens / drafted tokens over all rounds
  (a bonus token is not a draft); ``None`` for a method that drafts nothing;
* **parity** against the reference (``ar``): a prompt is identical when its generated ids
  equal the reference's; ``token_parity`` is the share of reference tokens reproduced
  before the first divergence, summed over prompts.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..decoding.output import OutputRecord, TurnStats
from ..jsonio import JsonObject

Record = OutputRecord


@dataclass(frozen=True, slots=True)
class Throughput:
    """A contender's tokens/s over its passes: the median over passes of each pass's mean per-prompt
    tokens/s, the passes' min and max, and the mean over every (pass, prompt)."""

    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    tokens_per_s_mean: float


@dataclass(frozen=True, slots=True)
class Paired:
    """A paired speedup: the geometric mean of the per-(pass, prompt) ratios, its 95 % interval (None
    from a single pair) and the number of pairs."""

    speedup: float
    ci95: tuple[float, float] | None
    pairs: int

    def to_dict(self) -> JsonObject:
        return {"speedup": self.speedup, "ci95": None if self.ci95 is None else list(self.ci95), "pairs": self.pairs}

    @classmethod
    def from_dict(cls, d: JsonObject) -> Paired:
        return cls(d["speedup"], None if d.get("ci95") is None else tuple(d["ci95"]), d["pairs"])


@dataclass(frozen=True, slots=True)
class StepLog:
    """Accepted lengths pooled over records, with the drafted and accepted tokens (None until a record
    reports drafts)."""

    accept_lengths: list[int]
    drafted: int | None
    accepted: int | None


@dataclass(frozen=True, slots=True)
class Divergence:
    """A prompt whose ids differ from the reference's: where first (0 and ``missing``: no record of it)."""

    id: Any
    first_divergence: int
    missing: bool = False

    def to_dict(self) -> JsonObject:
        return {"id": self.id, "first_divergence": self.first_divergence, **({"missing": True} if self.missing else {})}


@dataclass(frozen=True, slots=True)
class Parity:
    """Token-level comparison with the reference, prompt by prompt (see the module docstring)."""

    prompts_identical: int
    prompts: int
    parity: float
    token_parity: float
    differing: list[Divergence]

    def to_dict(self) -> JsonObject:
        return {"prompts_identical": self.prompts_identical, "prompts": self.prompts, "parity": self.parity,
                "token_parity": self.token_parity, "differing": [d.to_dict() for d in self.differing]}

    @classmethod
    def from_dict(cls, d: JsonObject) -> Parity:
        return cls(d["prompts_identical"], d["prompts"], d["parity"], d["token_parity"],
                   [Divergence(x["id"], x["first_divergence"], bool(x.get("missing"))) for x in d["differing"]])


def prompt_tps(rec: Record) -> float:
    wall = float(rec.wall_time_s)
    return rec.new_tokens / wall if wall > 0 else 0.0


def repeat_tps(records: Sequence[Record]) -> float:
    """Spec-Bench throughput of one pass over the prompts: mean of per-prompt tokens/s."""
    return statistics.fmean(prompt_tps(r) for r in records) if records else 0.0


def throughput_summary(repeats: Sequence[Sequence[Record]]) -> Throughput:
    per_repeat = [repeat_tps(rs) for rs in repeats if rs]
    if not per_repeat:
        return Throughput(0.0, 0.0, 0.0, 0.0)
    return Throughput(statistics.median(per_repeat), min(per_repeat), max(per_repeat),
                      statistics.fmean(prompt_tps(r) for rs in repeats for r in rs))


def speedup(method_repeats: Sequence[Sequence[Record]], base_repeats: Sequence[Sequence[Record]]) -> float | None:
    """Ratio of mean tokens/s (over all repeat x prompt pairs)."""
    a = [prompt_tps(r) for rs in method_repeats for r in rs]
    b = [prompt_tps(r) for rs in base_repeats for r in rs]
    mb = statistics.fmean(b) if b else 0.0
    return statistics.fmean(a) / mb if a and mb > 0 else None


def paired_speedup(method_repeats: Sequence[Sequence[Record]], base_repeats: Sequence[Sequence[Record]]) -> Paired | None:
    """Geometric mean of the per-(repeat, prompt) tokens/s ratios, with a 95 % interval
    (None without a pair; no interval from a single pair)."""
    base = {(i, r.id): prompt_tps(r) for i, rs in enumerate(base_repeats) for r in rs}
    logs = [math.log(prompt_tps(r) / base[(i, r.id)]) for i, rs in enumerate(method_repeats) for r in rs
            if base.get((i, r.id), 0.0) > 0 and prompt_tps(r) > 0]
    if not logs:
        return None
    mean, n = statistics.fmean(logs), len(logs)
    if n < 2:
        return Paired(math.exp(mean), None, n)
    from scipy.stats import t  # imported here: only the bench's summary needs it

    half = float(t.ppf(0.975, n - 1)) * statistics.stdev(logs) / math.sqrt(n)
    return Paired(math.exp(mean), (math.exp(mean - half), math.exp(mean + half)), n)


def decode_tps(rec: Record) -> float | None:
    """Decode-only tokens/s of a prompt: the tokens after each turn's first (which the prefill
    makes) over the turn's wall time less its prefill; None when a turn does not report its
    prefill (outside peers)."""
    turns = rec.all_turns()
    if not all(t.stats.prefill_s is not None for t in turns):
        return None
    secs = sum(t.wall_time_s - t.stats.prefill_s for t in turns)
    return sum(t.new_tokens - 1 for t in turns) / secs if secs > 0 else None


def decode_speedup(method_repeats: Sequence[Sequence[Record]], base_repeats: Sequence[Sequence[Record]]) -> float | None:
    """Ratio of mean decode-only tokens/s (None unless both sides report their prefill)."""
    a = [decode_tps(r) for rs in method_repeats for r in rs]
    b = [decode_tps(r) for rs in base_repeats for r in rs]
    if not a or not b or None in a or None in b:
        return None
    return statistics.fmean(a) / statistics.fmean(b)


def turn_stats(rec: Record) -> list[TurnStats]:
    """Per-turn stats of a record (multi-turn records keep them under ``turns``)."""
    return [t.stats for t in rec.all_turns()]


def step_log(records: Iterable[Record]) -> StepLog:
    """Accepted lengths, steps and draft counts pooled over records."""
    lengths: list[int] = []
    drafted = accepted = None  # None until a record reports drafts
    for st in (st for rec in records for st in turn_stats(rec)):
        lengths.extend(int(x) for x in st.accept_lengths or [])
        if st.drafted_tokens is not None:
            drafted = (drafted or 0) + int(st.drafted_tokens)
            accepted = (accepted or 0) + int(st.accepted_draft_tokens)
    return StepLog(lengths, drafted, accepted)


def mean_accepted_length(records: Iterable[Record]) -> float | None:
    lengths = step_log(records).accept_lengths
    return sum(lengths) / len(lengths) if lengths else None


def acceptance_rate(records: Iterable[Record]) -> float | None:
    log = step_log(records)
    return log.accepted / log.drafted if log.drafted else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def parity(records: Sequence[Record], reference: Sequence[Record]) -> Parity:
    """Token-level comparison prompt by prompt against the reference's records."""
    ref = {r.id: list(r.token_ids) for r in reference}
    mine = {r.id: list(r.token_ids) for r in records}
    differing: list[Divergence] = []
    matched = total = 0
    for pid, ref_ids in ref.items():
        total += len(ref_ids)
        if (ids := mine.get(pid)) is None:
            differing.append(Divergence(pid, 0, missing=True))
            continue
        d = first_divergence(ids, ref_ids)
        matched += len(ref_ids) if d is None else min(d, len(ref_ids))
        if d is not None:
            differing.append(Divergence(pid, d))
    n = len(ref)
    return Parity(n - len(differing), n, (n - len(differing)) / n if n else 1.0, matched / total if total else 1.0,
                  differing)


def sum_stat(records: Iterable[Record], key: str) -> float | None:
    """Sum of a timing the drafter reports (``optimize_s``, ...) over records; None if never reported."""
    vals = [float(st.extra[key]) for rec in records for st in turn_stats(rec) if key in st.extra]
    return sum(vals) if vals else None


def by_category(records: Sequence[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(r.category or "all", []).append(r)
    return out
