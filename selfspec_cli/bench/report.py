"""Turn timed passes into the bench's outputs: ``results.json``, Spec-Bench answer files,
the rich table and the one-line headline. The schema is documented in docs/benchmarks.md.

A contender's figures are a :class:`MethodSummary` (its overall and per-category :class:`Block`, its
:class:`CostModelSummary`), serialized once into results.json by :func:`document` (:meth:`MethodSummary.to_dict`:
the keys, order and values results.json always had)."""
from __future__ import annotations

import dataclasses
import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..decoding.planning import predicted_speedup
from ..jsonio import JsonObject
from . import metrics
from .metrics import OutputRecord, Paired, Parity
from .runner import ContenderResult

SCHEMA = "selfspec-bench/1"
Repeats = Sequence[Sequence[OutputRecord]]  # per timed pass: per-prompt records


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


@dataclass(slots=True)
class Block:
    """A contender's metrics over one set of prompts (all, or one category; bench/metrics.py's definitions).
    ``paired_vs_ar`` and ``parity`` are absent from results.json when None (no reference, or no pair)."""

    tokens_per_s: float | None
    tokens_per_s_min: float | None
    tokens_per_s_max: float | None
    tokens_per_s_mean: float | None
    per_repeat_tokens_per_s: list[float | None]
    speedup_vs_ar: float | None
    speedup_vs_hf: float | None
    paired_vs_ar: Paired | None
    decode_tokens_per_s: float | None
    decode_speedup_vs_ar: float | None
    mean_accepted_length: float | None
    acceptance_rate: float | None
    target_forwards: int
    new_tokens: int
    prompts: int
    parity: Parity | None

    def to_dict(self) -> JsonObject:
        out: JsonObject = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("paired_vs_ar", "parity"):
                if v is not None:
                    out[f.name] = v.to_dict()
            else:
                out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: JsonObject) -> Block:
        """A block as results.json holds it (the report read back from disk)."""
        kw = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        kw["paired_vs_ar"] = None if kw["paired_vs_ar"] is None else Paired.from_dict(kw["paired_vs_ar"])
        kw["parity"] = None if kw["parity"] is None else Parity.from_dict(kw["parity"])
        return cls(**kw)


@dataclass(slots=True)
class CostModelSummary:
    """What a planning contender's plans predicted against what it measured (see :func:`_cost_model`);
    ``skip_ratio`` and ``measured_over_predicted`` are absent from results.json when None."""

    predicted_speedup: float | None
    skip_ratio: float | None
    draft_round_share: float | None
    predicted_decode_speedup: float | None = None
    measured_over_predicted: float | None = None

    def to_dict(self) -> JsonObject:
        out: JsonObject = {"predicted_speedup": self.predicted_speedup}
        if self.skip_ratio is not None:
            out["skip_ratio"] = self.skip_ratio
        out.update(draft_round_share=self.draft_round_share, predicted_decode_speedup=self.predicted_decode_speedup)
        if self.measured_over_predicted is not None:
            out["measured_over_predicted"] = self.measured_over_predicted
        return out

    @classmethod
    def from_dict(cls, d: JsonObject) -> CostModelSummary:
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


@dataclass(slots=True)
class MethodSummary:
    """One contender's row of results.json (``methods.<name>``): what it is, its :class:`Block` over every
    prompt (``overall``, flat in the row) and per category, its cost model (planning contenders), memory,
    and the artifact files it read (set by the run; absent when None)."""

    kind: str
    lossless: bool
    description: str | None
    overall: Block
    optimization_s: float | None
    offline: JsonObject | None
    cost_model: CostModelSummary | None
    peak_rss_mb: float | None
    peak_cuda_mb: float | None
    categories: dict[str, Block] = field(default_factory=dict)
    artifacts: dict[str, str] | None = None

    def to_dict(self) -> JsonObject:
        out: JsonObject = {"kind": self.kind, "lossless": self.lossless, "description": self.description,
                           **self.overall.to_dict(), "optimization_s": self.optimization_s, "offline": self.offline}
        if self.cost_model is not None:
            out["cost_model"] = self.cost_model.to_dict()
        out.update(peak_rss_mb=self.peak_rss_mb, peak_cuda_mb=self.peak_cuda_mb,
                   categories={cat: b.to_dict() for cat, b in self.categories.items()})
        if self.artifacts is not None:
            out["artifacts"] = self.artifacts
        return out

    @classmethod
    def from_dict(cls, d: JsonObject) -> MethodSummary:
        """A row of results.json read back from disk (:meth:`to_dict`'s inverse)."""
        cm = d.get("cost_model")
        return cls(d["kind"], d["lossless"], d.get("description"), Block.from_dict(d), d.get("optimization_s"),
                   d.get("offline"), None if cm is None else CostModelSummary.from_dict(cm), d.get("peak_rss_mb"),
                   d.get("peak_cuda_mb"), {c: Block.from_dict(b) for c, b in (d.get("categories") or {}).items()},
                   d.get("artifacts"))


def _block(repeats: Repeats, ref: Repeats | None, base: Repeats | None) -> Block:
    """Metrics of one contender over one set of prompts (all, or one category)."""
    last = list(repeats[-1]) if repeats else []
    tp = metrics.throughput_summary(repeats)
    paired = metrics.paired_speedup(repeats, ref) if ref is not None else None
    if paired is not None:
        paired = Paired(_r(paired.speedup), None if paired.ci95 is None else (_r(paired.ci95[0]), _r(paired.ci95[1])),
                        paired.pairs)
    decode = [d for rs in repeats for r in rs if (d := metrics.decode_tps(r)) is not None]
    # parity of every pass against the reference's first pass (the worst): a flaky method shows up too
    parity = (min((metrics.parity(rs, ref[0]) for rs in repeats), key=lambda p: (p.parity, p.token_parity))
              if ref is not None else None)
    return Block(
        _r(tp.tokens_per_s, 3), _r(tp.tokens_per_s_min, 3), _r(tp.tokens_per_s_max, 3), _r(tp.tokens_per_s_mean, 3),
        [_r(metrics.repeat_tps(rs), 3) for rs in repeats],
        _r(metrics.speedup(repeats, ref)) if ref is not None else None,
        _r(metrics.speedup(repeats, base)) if base is not None else None, paired,
        _r(statistics.fmean(decode), 3) if decode else None,
        _r(metrics.decode_speedup(repeats, ref)) if ref is not None else None,
        _r(metrics.mean_accepted_length(last)), _r(metrics.acceptance_rate(last)),
        len(metrics.step_log(last).accept_lengths), sum(r.new_tokens for r in last), len(last), parity)


def _subset(repeats: Repeats | None, ids: set[Any]) -> Repeats | None:
    return None if repeats is None else [[r for r in rs if r.id in ids] for rs in repeats]


def _cost_model(res: ContenderResult, num_layers: int | None) -> CostModelSummary | None:
    """What the drafting plans predicted (decoding/planning.py: expected tokens over cost in plain
    steps, summed over every round of every prompt), the skip ratio of layer-skipping
    methods; None for methods that do not plan."""
    turn_stats = [st for r in res.records for st in metrics.turn_stats(r)]
    plans = [st.plan for st in turn_stats if st.plan]
    if not plans:
        return None
    last = res.records[-1].stats
    skip_ratio = None
    if num_layers and last.skip_attn is not None:
        skip_ratio = _r((len(last.skip_attn) + len(last.skip_mlp or [])) / (2 * num_layers))
    return CostModelSummary(_r(predicted_speedup([(p.expected_tokens, p.cost_steps) for p in plans])), skip_ratio,
                            _r(statistics.fmean(st.draft_round_share or 0.0 for st in turn_stats)))


def predicted_decode_speedup(repeats: Repeats, ref: Repeats) -> float | None:
    """The plans' prediction of ``decode_speedup_vs_ar``, aggregated as that figure is: it is a ratio of
    mean per-prompt decode rates (:func:`metrics.decode_speedup`), so each prompt weighs as much as the
    reference's rate on it, whatever its number of rounds. Per prompt the predicted gain is its rounds'
    expected tokens over their cost; the prediction is those gains weighted by the reference's decode
    rate on the same prompt (the mean over its passes). Prompts without a plan, or the reference's rate,
    are left out; None when none is left."""
    rates: dict[Any, list[float]] = {}
    for rs in ref:
        for r in rs:
            if (d := metrics.decode_tps(r)) is not None:
                rates.setdefault(r.id, []).append(d)
    num = den = 0.0
    for rs in repeats:
        for r in rs:
            plans = [st.plan for st in metrics.turn_stats(r) if st.plan]
            gain = predicted_speedup([(p.expected_tokens, p.cost_steps) for p in plans])
            if gain is None or r.id not in rates:
                continue
            rate = statistics.fmean(rates[r.id])
            num += rate * gain
            den += rate
    return num / den if den else None


def summarize(results: Mapping[str, ContenderResult], reference: str | None, baseline: str | None,
              descriptions: Mapping[str, str] | None = None,
              offline_cost: Mapping[str, JsonObject | None] | None = None,
              num_layers: int | None = None) -> dict[str, MethodSummary]:
    """Per-method metrics, overall and per category."""
    ref = results[reference].repeats if reference in results else None
    base = results[baseline].repeats if baseline in results else None
    cats = metrics.by_category(next(iter(results.values())).records)
    # record ids per category; no per-category figures when there is only one category
    cat_ids = {cat: {r.id for r in recs} for cat, recs in cats.items()} if len(cats) > 1 else {}
    out: dict[str, MethodSummary] = {}
    for name, res in results.items():
        block = _block(res.repeats, ref, base)
        opt = [metrics.sum_stat(rs, "optimize_s") for rs in res.repeats]
        if (cm := _cost_model(res, num_layers)) is not None:
            # the plans predict decode-only speed: compare like with like (end to end, the prefill dilutes it),
            # aggregated as the measured figure is (per prompt, weighted by the reference's rate)
            like = predicted_decode_speedup(res.repeats, ref) if ref is not None and block.decode_speedup_vs_ar else None
            cm.predicted_decode_speedup = _r(like)
            predicted = like or cm.predicted_speedup
            if predicted and (measured := block.decode_speedup_vs_ar or block.speedup_vs_ar):
                cm.measured_over_predicted = _r(measured / predicted)
        out[name] = MethodSummary(
            res.kind, res.lossless, (descriptions or {}).get(name), block,
            _r(statistics.fmean(opt), 3) if opt and all(v is not None for v in opt) else None,
            dict((offline_cost or {}).get(name) or {}) or None, cm, _r(res.peak_rss_mb, 1), _r(res.peak_cuda_mb, 1),
            {cat: _block(_subset(res.repeats, ids), _subset(ref, ids), _subset(base, ids)) for cat, ids in cat_ids.items()})
    return out


def document(summary: Mapping[str, MethodSummary], *, setup: JsonObject, environment: JsonObject,
             model: JsonObject, reference: str | None, baseline: str | None,
             files: JsonObject | None = None) -> JsonObject:
    """results.json: the run's setup, environment and model (free-form documents) and every contender's
    :class:`MethodSummary`, serialized here."""
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": dict(model),
            "environment": dict(environment), "setup": dict(setup), "reference": reference, "baseline": baseline,
            "methods": {n: m.to_dict() for n, m in summary.items()}, "files": dict(files or {})}


def headline(doc: JsonObject) -> JsonObject:
    """The last stdout line: the figures a script wants, one JSON document (read from results.json's document)."""
    keys = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "mean_accepted_length", "acceptance_rate")
    methods = {name: {**{k: m[k] for k in keys}, "parity": (m.get("parity") or {}).get("parity"), "lossless": m["lossless"]}
               for name, m in doc["methods"].items()}
    setup = doc["setup"]
    return {"schema": SCHEMA, "results": doc.get("files", {}).get("results"), "model": doc["model"].get("name"),
            "device": doc["environment"].get("device"), "suite": setup.get("suite") or setup.get("prompt_file"),
            "prompts": setup.get("prompts"), "max_new_tokens": setup.get("max_new_tokens"), "methods": methods}


def spec_bench_answers(records: Sequence[OutputRecord], model_id: str) -> list[JsonObject]:
    """One Spec-Bench answer line per question (SWIFT's repository reads the same schema), as written."""
    out = []
    for r in records:
        turns = r.all_turns()
        lengths = [t.stats.accept_lengths for t in turns]
        choice = {"index": 0, "turns": [t.text for t in turns], "decoding_steps": [len(a) for a in lengths],
                  "new_tokens": [t.new_tokens for t in turns], "wall_time": [t.wall_time_s for t in turns],
                  "accept_lengths": [x for a in lengths for x in a]}
        out.append({"question_id": r.id, "category": r.category, "answer_id": uuid.uuid4().hex[:22],
                    "model_id": model_id, "tstamp": time.time(), "choices": [choice]})
    return out
