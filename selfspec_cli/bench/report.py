"""Turn timed passes into the bench's outputs: ``results.json``, Spec-Bench answer files,
the rich table and the one-line headline. The schema is documented in docs/benchmarks.md."""
from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..decoding.output import TurnStats
from ..decoding.planning import predicted_speedup
from . import metrics
from .runner import ContenderResult

SCHEMA = "selfspec-bench/1"
Repeats = Sequence[Sequence[Mapping[str, Any]]]  # per timed pass: per-prompt records


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def _block(repeats: Repeats, ref: Repeats | None, base: Repeats | None) -> dict[str, Any]:
    """Metrics of one contender over one set of prompts (all, or one category)."""
    last = list(repeats[-1]) if repeats else []
    out: dict[str, Any] = {k: _r(v, 3) for k, v in metrics.throughput_summary(repeats).items()}
    out["per_repeat_tokens_per_s"] = [_r(metrics.repeat_tps(rs), 3) for rs in repeats]
    out["speedup_vs_ar"] = _r(metrics.speedup(repeats, ref)) if ref is not None else None
    out["speedup_vs_hf"] = _r(metrics.speedup(repeats, base)) if base is not None else None
    if ref is not None and (paired := metrics.paired_speedup(repeats, ref)) is not None:
        paired["speedup"] = _r(paired["speedup"])
        paired["ci95"] = [_r(x) for x in paired["ci95"]] if paired["ci95"] else None
        out["paired_vs_ar"] = paired
    decode = [d for rs in repeats for r in rs if (d := metrics.decode_tps(r)) is not None]
    out["decode_tokens_per_s"] = _r(statistics.fmean(decode), 3) if decode else None
    out["decode_speedup_vs_ar"] = _r(metrics.decode_speedup(repeats, ref)) if ref is not None else None
    out["mean_accepted_length"] = _r(metrics.mean_accepted_length(last))
    out["acceptance_rate"] = _r(metrics.acceptance_rate(last))
    out["target_forwards"] = len(metrics.step_log(last)["accept_lengths"])
    out["new_tokens"] = sum(r["new_tokens"] for r in last)
    out["prompts"] = len(last)
    if ref is not None:
        # parity of every pass against the reference's first pass (the worst): a flaky method shows up too
        out["parity"] = min((metrics.parity(rs, ref[0]) for rs in repeats), key=lambda p: (p["parity"], p["token_parity"]))
    return out


def _subset(repeats: Repeats | None, ids: set[Any]) -> Repeats | None:
    return None if repeats is None else [[r for r in rs if r["id"] in ids] for rs in repeats]


def _cost_model(res: ContenderResult, num_layers: int | None) -> dict[str, Any] | None:
    """What the drafting plans predicted (decoding/planning.py: expected tokens over cost in plain
    steps, summed over every round of every prompt), the skip ratio of layer-skipping
    methods; None for methods that do not plan."""
    turn_stats = [TurnStats.from_dict(t.get("stats", {})) for r in res.records for t in (r.get("turns") or [r])]
    plans = [st.plan for st in turn_stats if st.plan]
    if not plans:
        return None
    out: dict[str, Any] = {"predicted_speedup": _r(predicted_speedup([(p.expected_tokens, p.cost_steps) for p in plans]))}
    last = TurnStats.from_dict(res.records[-1]["stats"])
    if num_layers and last.skip_attn is not None:
        out["skip_ratio"] = _r((len(last.skip_attn) + len(last.skip_mlp or [])) / (2 * num_layers))
    out["draft_round_share"] = _r(statistics.fmean(st.draft_round_share or 0.0 for st in turn_stats))
    return out


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
                rates.setdefault(r["id"], []).append(d)
    num = den = 0.0
    for rs in repeats:
        for r in rs:
            plans = [st.plan for t in (r.get("turns") or [r]) if (st := TurnStats.from_dict(t.get("stats", {}))).plan]
            gain = predicted_speedup([(p.expected_tokens, p.cost_steps) for p in plans])
            if gain is None or r["id"] not in rates:
                continue
            rate = statistics.fmean(rates[r["id"]])
            num += rate * gain
            den += rate
    return num / den if den else None


def summarize(results: Mapping[str, ContenderResult], reference: str | None, baseline: str | None,
              descriptions: Mapping[str, str] | None = None,
              offline_cost: Mapping[str, Mapping[str, Any]] | None = None,
              num_layers: int | None = None) -> dict[str, dict[str, Any]]:
    """Per-method metrics, overall and per category."""
    ref = results[reference].repeats if reference in results else None
    base = results[baseline].repeats if baseline in results else None
    cats = metrics.by_category(next(iter(results.values())).records)
    # record ids per category; no per-category figures when there is only one category
    cat_ids = {cat: {r["id"] for r in recs} for cat, recs in cats.items()} if len(cats) > 1 else {}
    out: dict[str, dict[str, Any]] = {}
    for name, res in results.items():
        m = {"kind": res.kind, "lossless": res.lossless, "description": (descriptions or {}).get(name),
             **_block(res.repeats, ref, base)}
        opt = [metrics.sum_stat(rs, "optimize_s") for rs in res.repeats]
        m["optimization_s"] = _r(statistics.fmean(opt), 3) if opt and all(v is not None for v in opt) else None
        m["offline"] = dict((offline_cost or {}).get(name) or {}) or None
        if (cm := _cost_model(res, num_layers)) is not None:
            # the plans predict decode-only speed: compare like with like (end to end, the prefill dilutes it),
            # aggregated as the measured figure is (per prompt, weighted by the reference's rate)
            like = predicted_decode_speedup(res.repeats, ref) if ref is not None and m.get("decode_speedup_vs_ar") else None
            cm["predicted_decode_speedup"] = _r(like)
            predicted = like or cm["predicted_speedup"]
            if predicted and (measured := m.get("decode_speedup_vs_ar") or m.get("speedup_vs_ar")):
                cm["measured_over_predicted"] = _r(measured / predicted)
            m["cost_model"] = cm
        m["peak_rss_mb"] = _r(res.peak_rss_mb, 1)
        m["peak_cuda_mb"] = _r(res.peak_cuda_mb, 1)
        m["categories"] = {cat: _block(_subset(res.repeats, ids), _subset(ref, ids), _subset(base, ids))
                           for cat, ids in cat_ids.items()}
        out[name] = m
    return out


def document(summary: Mapping[str, Any], *, setup: Mapping[str, Any], environment: Mapping[str, Any],
             model: Mapping[str, Any], reference: str | None, baseline: str | None,
             files: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": dict(model),
            "environment": dict(environment), "setup": dict(setup), "reference": reference, "baseline": baseline,
            "methods": dict(summary), "files": dict(files or {})}


def headline(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The last stdout line: the figures a script wants, one JSON document."""
    keys = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "mean_accepted_length", "acceptance_rate")
    methods = {name: {**{k: m[k] for k in keys}, "parity": (m.get("parity") or {}).get("parity"), "lossless": m["lossless"]}
               for name, m in doc["methods"].items()}
    setup = doc["setup"]
    return {"schema": SCHEMA, "results": doc.get("files", {}).get("results"), "model": doc["model"].get("name"),
            "device": doc["environment"].get("device"), "suite": setup.get("suite") or setup.get("prompt_file"),
            "prompts": setup.get("prompts"), "max_new_tokens": setup.get("max_new_tokens"), "methods": methods}


def spec_bench_answers(records: Sequence[Mapping[str, Any]], model_id: str) -> list[dict[str, Any]]:
    """One Spec-Bench answer line per question (SWIFT's repository reads the same schema)."""
    out = []
    for r in records:
        turns = r.get("turns") or [r]
        lengths = [TurnStats.from_dict(t["stats"]).accept_lengths for t in turns]
        choice = {"index": 0, "turns": [t["text"] for t in turns], "decoding_steps": [len(a) for a in lengths],
                  "new_tokens": [t["new_tokens"] for t in turns], "wall_time": [t["wall_time_s"] for t in turns],
                  "accept_lengths": [x for a in lengths for x in a]}
        out.append({"question_id": r["id"], "category": r.get("category"), "answer_id": uuid.uuid4().hex[:22],
                    "model_id": model_id, "tstamp": time.time(), "choices": [choice]})
    return out
