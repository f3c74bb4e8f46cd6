"""One ``selfspec profile`` run: the checks before the model loads, the measurements
(:mod:`selfspec_cli.bench.engine_profile`), ``profile.json`` and its plots. The command
(cli/profile.py) parses its options into a :class:`ProfileRequest` and prints the result's
table and headline."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import environment_info, model_name, now_iso, save_json_artifact
from ..config import check_choice
from ..decoding import cost_store
from ..decoding.cost_store import engine_key, measure_fresh
from ..decoding.measure import CURVE_ROWS, VerifyCurve
from ..engine import Engine
from ..engine.target import TARGET_PRECISIONS
from ..engine.threads import set_both
from ..errors import ArtifactError, ConfigError, count
from ..methods import METHODS, fr_spec
from ..methods.self_sd import SkipSet
from ..prompts import PROMPT_FORMATS, Prompt
from ..session import Session, apply_threads
from . import engine_profile as prof
from .suite_loader import load_prompts
from ..jsonio import JsonObject

PROFILE_FILES = ("profile.json", "verify_cost.png", "redundancy.png")
STEP_PARTS_LONG = 1024  # the longer context of the step breakdown: 4x the prompt's, at most this


@dataclass(frozen=True)
class ProfileRequest:
    """The options of one profile run, as parsed."""

    model: str | None
    suite: str | None
    prompt_file: str | None
    prompt_format: str
    output_dir: Path
    force: bool
    rounds: int
    redundancy_prompts: int
    redundancy_tokens: int
    layers: Path | None
    predict: str
    predict_tokens: int
    plots: bool
    remeasure: bool
    threads: str | None
    chat_template: bool
    dtype: str
    target_precision: str
    device: str


@dataclass
class ProfilePlan:
    """What the checks before the model loads settled."""

    predict_methods: list[str]
    threads: int
    prompts: list[Prompt]


def check(req: ProfileRequest) -> ProfilePlan:
    """Every check that needs no model, in the command's order; reads the prompts."""
    for name, val in (("--rounds", req.rounds), ("--predict-tokens", req.predict_tokens)):
        if val < 1:
            raise ConfigError(f"{name} must be >= 1, got {val}")
    predict_methods = [m for m in req.predict.replace(" ", "").split(",") if m]
    if unknown := [m for m in predict_methods if m not in METHODS]:
        raise ConfigError(f"--predict: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if unplanned := [m for m in predict_methods if m not in prof.PREDICT_METHODS]:
        raise ConfigError(f"--predict: {unplanned[0]} does not plan its rounds with the cost model, so there is nothing "
                          f"to predict; choose from {', '.join(prof.PREDICT_METHODS)} (selfspec bench measures it)")
    if req.redundancy_prompts < 0 or req.redundancy_tokens < 1:
        raise ConfigError("--redundancy-prompts must be >= 0 and --redundancy-tokens >= 1")
    check_choice(req.prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(req.target_precision, TARGET_PRECISIONS, "--target-precision")
    out = req.output_dir
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir '{out}' is a file; pass a directory")
    old = [out / n for n in PROFILE_FILES if (out / n).exists()]
    if old and not req.force:
        raise ConfigError(f"{out} already holds a profile ({old[0].name}); pass --force to replace it, "
                          "or choose another --output-dir")
    threads = apply_threads(req.threads)
    prompts, _ = load_prompts(req.prompt_file, req.suite, req.prompt_format)  # never empty: both readers refuse that
    return ProfilePlan(predict_methods, threads, prompts)


def _calibrated(layers: Path | None, model: Any, log: Callable[[str], None]) -> tuple[Any, Any] | None:
    """The skip set of the redundancy map's calibrated row: --layers, else this model's, else none."""
    try:
        skip = SkipSet.load(layers, model)
        return skip.attn, skip.mlp
    except ArtifactError as exc:
        if layers is not None:
            raise
        log(f"[dim]no calibrated skip set for the redundancy map ({str(exc).split(';')[0]})[/dim]")
        return None


def run(req: ProfileRequest, plan: ProfilePlan, *, log: Callable[[str], None],
        progress: Callable[[], Any]) -> JsonObject:
    """Load the model, measure, write profile.json (and the plots); returns what profile.json holds. Under
    ``--force`` an earlier profile's files go first, so no plot of it stays beside the new profile.json."""
    if req.force:
        for name in PROFILE_FILES:
            (req.output_dir / name).unlink(missing_ok=True)
    session = Session.open(req.model, dtype=req.dtype, device=req.device, chat_template=req.chat_template, lite=True)
    mdl = session.model
    engine = session.engine(req.target_precision)
    ids = session.encode_first_turns(plan.prompts)
    calibrated = _calibrated(req.layers, mdl, log)
    log(f"[dim]model {mdl.config.model_type}, {engine.num_layers} layers, {engine.dtype}, {engine.device}, "
        f"{count(plan.threads, 'thread')}; matrix products: {engine.kernel_info['backend']}"
        f"{' (' + engine.kernel_info['reason'] + ')' if engine.kernel_info.get('reason') else ''}[/dim]")
    t_start = time.perf_counter()
    before = cost_store.describe(engine_key(engine))
    if req.remeasure:
        measure_fresh(engine)
    # the store's curve is used when it is a full reading (a short one, or none, is measured in full and stored)
    read = not req.remeasure and before["stored"] and set(CURVE_ROWS) <= set(before["rows"])
    f = _measure(req, plan, session, engine, ids, calibrated, progress)
    costs = f.costs
    verify_cost = costs.curve.verify_cost
    # the typed sections, serialized here, once, where the document is written
    result: dict[str, Any] = {
        "kind": "selfspec-profile", "model": model_name(mdl), "model_fingerprint": session.fingerprint,
        "num_layers": engine.num_layers, **costs.to_json(), "ar_tokens_per_s_upper": round(1e3 / costs.curve.step_ms, 2),
        "target_precision": engine.target_precision, "target_info": engine.target_info,
        "step_parts": None if f.parts is None else f.parts.to_json(),
        "kernel_max_logit_diff": f.diff, "redundancy": None if f.red is None else f.red.to_json(),
        "quantized_drafts": f.quantized.to_json(),
        "draft_verdict": prof.draft_verdict(f.quantized, verify_cost).to_json(),
        "draft_ceilings": prof.draft_ceilings(verify_cost, costs.measured.draft_cost, f.quantized).to_json(),
        "predicted_speedup": None if f.predicted is None else f.predicted.to_json(),
        "cost_store": {**cost_store.describe(engine_key(engine)), "curve": "read" if read else "measured"},
        "environment": environment_info(engine.device, engine.dtype), "created": now_iso(),
        "profile_s": round(time.perf_counter() - t_start, 1)}
    req.output_dir.mkdir(parents=True, exist_ok=True)
    save_json_artifact(req.output_dir / "profile.json", result)
    if req.plots:
        prof.verify_cost_plot(result, req.output_dir / "verify_cost.png")
        if result["redundancy"] is not None:
            prof.redundancy_plot(result["redundancy"], req.output_dir / "redundancy.png", title=Path(model_name(mdl)).name)
    return result


@dataclass(frozen=True)
class _Figures:
    """The timed figures of one profile run, typed (engine_profile.py), before they are written."""

    costs: prof.EngineCosts
    parts: prof.StepParts | None
    diff: float | None
    red: prof.Redundancy | None
    quantized: prof.QuantizedDrafts
    predicted: prof.PredictedSpeedups | None


def _measure(req: ProfileRequest, plan: ProfilePlan, session: Session, engine: Engine, ids: list[list[int]],
             calibrated: tuple[Any, Any] | None, progress: Callable[[], Any]) -> _Figures:
    """The timed figures, under one progress display."""
    ctx_ids = sorted(ids, key=len)[len(ids) // 2]  # the context: the median-length prompt (a typical decode position)
    with progress() as bar:
        task = bar.add_task("timing", total=req.rounds, info="")
        costs = prof.engine_costs(engine, ctx_ids, rounds=req.rounds, on_round=lambda i, n: bar.update(task, completed=i))
        if plan.threads > 1:  # T(1) and v(k) timed afresh at one thread, beside the default's (what threads buy);
            otask = bar.add_task("timing at 1 thread", total=1, info="")  # not stored, not the planners' curve
            set_both(1)
            try:
                one = prof.curve_fields(VerifyCurve.measure(engine, rounds=req.rounds))
                bw1 = prof.read_bandwidth_gbs(device=engine.device)
            finally:
                set_both(plan.threads)
            floor1 = costs.weight_bytes / (bw1 * 1e9) * 1e3
            costs = dataclasses.replace(costs, one_thread=prof.OneThread(
                step_ms=one.step_ms, verify_cost=one.verify_cost, bandwidth_gbs=round(bw1, 2),
                floor_ms=round(floor1, 3), step_over_floor=round(one.step_ms / floor1, 3)))
            bar.update(otask, completed=1)
        ptask = bar.add_task("where a step's time goes", total=1, info="")
        n_ctx = len(ctx_ids)
        parts = prof.step_parts(engine, ctx_ids, sorted({1, plan.threads}),
                                sorted({n_ctx, min(STEP_PARTS_LONG, 4 * n_ctx)}))
        bar.update(ptask, completed=1)
        diff = prof.kernel_logit_diff(engine, ctx_ids)
        # the redundancy map's prompts, evenly spread (at least one, for the predictions)
        n_sample = max(1, req.redundancy_prompts)
        sample = ids[:: max(1, len(ids) // n_sample)][:n_sample]
        red = None
        if req.redundancy_prompts > 0:
            rtask = bar.add_task("redundancy map", total=len(sample) * req.redundancy_tokens, info="")
            red = prof.redundancy_map(engine, sample, req.redundancy_tokens, calibrated,
                                      on_token=lambda i, n: bar.update(rtask, completed=i))
        qtask = bar.add_task("quantized drafts", total=None, info="")
        vocab = fr_spec.resolve("auto", session.model)
        quantized = prof.quantized_drafts(engine, ctx_ids, sample, req.redundancy_tokens, rounds=req.rounds,
                                          draft_vocab=None if vocab is None else vocab.ids)
        bar.update(qtask, total=1, completed=1)
        predicted = None
        if plan.predict_methods:
            ptask = bar.add_task("predicted speedups", total=len(plan.predict_methods), info="")
            predicted = prof.predicted_speedups(
                engine, session.tokenizer, sample, plan.predict_methods, req.predict_tokens, session.eos_token_ids,
                on_method=lambda i, n: bar.update(ptask, completed=i, info=n))
            bar.update(ptask, completed=len(plan.predict_methods), info="")
    return _Figures(costs, parts, diff, red, quantized, predicted)
