"""SpecEE's offline scheduling (paper §5.3): decode calibration prompts with every
exit predictor enabled, histogram the layers where tokens exit, and keep the
layers whose exit probability is at least the mean (1 / number of predictor
layers). The paper observes that the layers below the mean (about half of them)
account for at most ~20% of exits, so dropping their predictors costs little
while saving their overhead. The online window (the last 5 exits +-2 layers) is
added at decode time. :func:`run` is the offline step (``selfspec calibrate --method specee``).

A run in which no token exited early is **too little data**: the schedule would rest on no exit at
all (it keeps every predictor), so it is written beside the default path as
``<default>.too-little-data.json`` and never becomes the default unless ``--force`` (methods/offline.py:
the one rule).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ...config import GenerationConfig
from ...errors import count
from ...jsonio import JsonObject
from ..offline import OfflineJob
from . import SCHEDULE, SpecEE, SpecEEReport, load_exit_mlps, load_heads


@dataclass(frozen=True, slots=True)
class ExitStatistics:
    predictor_layers: list[int]
    exits: dict[int, int]  # layer -> early exits there
    full_depth_tokens: int
    tokens: int
    selected_layers: list[int]

    @property
    def exit_probability(self) -> dict[int, float]:
        total = sum(self.exits.values())
        return {l: (self.exits.get(l, 0) / total if total else 0.0) for l in self.predictor_layers}

    def as_dict(self) -> JsonObject:
        total = sum(self.exits.values())
        selected_share = sum(self.exits.get(l, 0) for l in self.selected_layers) / total if total else 0.0
        return {"predictor_layers": self.predictor_layers, "exits_per_layer": {str(k): v for k, v in sorted(self.exits.items())},
                "exit_probability": {str(k): v for k, v in self.exit_probability.items()},
                "full_depth_tokens": self.full_depth_tokens, "tokens": self.tokens,
                "exit_rate": total / self.tokens if self.tokens else 0.0,
                "selected_layers": self.selected_layers, "selected_exit_share": selected_share,
                "rule": "keep layers whose exit probability >= mean (1 / number of predictor layers)"}


def select_layers(exits: dict[int, int], predictor_layers: list[int]) -> list[int]:
    total = sum(exits.values())
    if not total:
        return list(predictor_layers)  # nothing exited: keep every predictor (no evidence to drop any)
    return sorted(l for l in predictor_layers if exits.get(l, 0) / total >= 1.0 / len(predictor_layers))  # >= the mean


def exit_statistics(method: SpecEE, prompt_ids: list[list[int]], cfg: GenerationConfig,
                    on_prompt: Callable[[int, int], None] = lambda i, n: None) -> ExitStatistics:
    """Decode with ``method`` (every predictor active: its offline set is all layers) and count exits."""
    layers = sorted(method.drafter.predictors)
    exits = {l: 0 for l in layers}
    tokens = full_depth = 0
    for i, ids in enumerate(prompt_ids, 1):
        res = method.generate(ids, cfg)
        steps = len(res.token_ids) - 1  # the first token comes from the prefill
        report = res.stats.report
        assert isinstance(report, SpecEEReport)  # SpecEE's drafter reports its exits
        for k, v in report.early_exits.items():
            exits[int(k)] += v
        tokens += steps
        full_depth += steps - sum(report.early_exits.values())
        on_prompt(i, len(prompt_ids))
    return ExitStatistics(layers, exits, full_depth, tokens, select_layers(exits, layers))


def run(job: OfflineJob) -> JsonObject:
    """SpecEE's offline schedule: decode with every exit predictor on, count exits per layer, keep the frequent layers."""
    mdl = job.model
    heads, heads_manifest = load_heads(None, mdl)
    predictors, pman = load_exit_mlps(None, mdl)
    drafter = int(pman.get("drafter", {}).get("layer", min(heads)))
    thresholds = {int(k): float(v) for k, v in (pman.get("thresholds") or {}).items()}
    method = SpecEE(job.engine, job.tokenizer, drafter_layer=drafter, drafter=heads[drafter], predictors=predictors,
                    offline_layers=list(predictors), thresholds=thresholds)  # every predictor on
    job.log(f"[dim]SpecEE exit statistics: {count(len(job.prompt_ids), 'prompt')} x {count(job.gen.max_new_tokens, 'token')}, every "
            f"predictor on (layers {min(predictors)}..{max(predictors)}), kv mode {method.config.specee_kv_mode}[/dim]")
    t0 = time.perf_counter()
    with job.progress() as bar:
        task = bar.add_task("calibrate specee", total=len(job.prompt_ids), info="")
        st = exit_statistics(method, job.prompt_ids, job.gen, on_prompt=lambda i, n: bar.update(task, completed=i))
    stats = st.as_dict()
    none = (f"no token of {count(st.tokens, 'token')} exited early at the exit predictors' thresholds, so the schedule "
            "rests on no exit (specee with it decodes as ar does, plus the predictors' cost, unless --specee-threshold "
            "is lower)" if stats["exit_rate"] == 0 else None)
    out = job.destination(SCHEDULE, none, "too-little-data")
    SCHEDULE.save(out, mdl, {**stats, "drafter_layer": drafter, "exit_mlps_artifact_id": pman.get("artifact_id"),
                                    "heads_artifact_id": heads_manifest.get("artifact_id"),
                                    "prompts": {**job.prompts, "max_new_tokens": job.gen.max_new_tokens},
                                    "environment": job.environment(), "search_time_s": round(time.perf_counter() - t0, 3)})
    job.log(f"exit probability per layer: {', '.join(f'{k}: {v:.2f}' for k, v in st.exit_probability.items())}; "
            f"exit rate {stats['exit_rate']:.3f}")
    job.log(f"[bold]selected predictor layers {st.selected_layers} ({stats['selected_exit_share']:.0%} of exits)[/bold]")
    job.log(f"wrote {out}")
    if none:  # still written, beside the default: a --specee-schedule with a lower --specee-threshold may exit with it
        job.warn_throwaway(out, none, "calibrate on more prompts and tokens, or retrain the exit predictors")
    return {"method": "specee", "artifact": str(out), "too_little_data": none is not None, **stats}
