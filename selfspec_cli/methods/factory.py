"""Build a method from user options (CLI flags or library callers)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..decoding.speculative import DraftConfig
from ..engine import Engine
from ..errors import ConfigError
from . import METHODS
from .base import Method


@dataclass(frozen=True, slots=True)
class MethodOptions:
    layers: Path | None = None  # self-sd: skip-set artifact
    skip_attn: tuple[int, ...] | None = None  # self-sd: inline skip sets (override the artifact)
    skip_mlp: tuple[int, ...] | None = None
    max_draft: int | None = None
    draft_threshold: float | None = None
    skip_ratio: float | None = None  # swift
    context_window: int | None = None  # swift
    tree_nodes: int | None = None  # swift: cap on the candidate nodes of one verification tree
    seed: int = 0
    asd_alpha: float = 0.985
    asd_m: int = 3
    asd_n: int = 2
    heads: Path | None = None  # adadecode, specee: AdaDecode heads artifact (specee drafts with the shallowest)
    adadecode_threshold: float | None = None
    adadecode_layers: tuple[int, ...] | None = None
    adadecode_max_pending: int | None = None
    exit_mlps: Path | None = None  # specee: exit-predictor artifact
    specee_schedule: Path | None = None  # specee: offline schedule artifact
    specee_kv_mode: str | None = None  # specee: "empty" (paper) or "deferred" (KV-preserving)
    specee_threshold: float | None = None
    specee_eval: bool = False


def _training_cost(what: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Seconds a trained artifact cost (data collection + training), from its manifest."""
    tr = manifest.get("training") or {}
    parts = [tr.get("collect_seconds"), tr.get("train_seconds")]
    secs = sum(float(x) for x in parts if x is not None) if any(x is not None for x in parts) else None
    return {"what": what, "seconds": None if secs is None else round(secs, 1), "created": manifest.get("created")}


def parse_layer_list(text: str | None, what: str) -> tuple[int, ...] | None:
    """'1,3,5' -> (1, 3, 5); '' -> (); None -> None."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated layer ids such as 1,3,5; got '{text}'") from None


def _draft(base: DraftConfig, opts: MethodOptions) -> DraftConfig:
    if opts.max_draft is not None:
        if opts.max_draft < 1:
            raise ConfigError(f"--max-draft must be >= 1, got {opts.max_draft}")
        base = replace(base, max_draft=opts.max_draft)
    if opts.draft_threshold is not None:
        if not 0 <= opts.draft_threshold <= 1:
            raise ConfigError(f"--draft-threshold must be in [0, 1], got {opts.draft_threshold}")
        base = replace(base, threshold=opts.draft_threshold)
    return base


def build_method(name: str, engine: Engine, tokenizer: Any, opts: MethodOptions | None = None) -> Method:
    opts = opts or MethodOptions()
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    if name == "ar":
        return METHODS["ar"](engine, tokenizer)
    if name == "self-sd":
        from .self_sd import SelfSD

        if opts.skip_attn is not None or opts.skip_mlp is not None:
            attn, mlp = opts.skip_attn or (), opts.skip_mlp or ()
            manifest = None
        else:
            from ..artifacts import load_skip_artifact

            attn, mlp, manifest = load_skip_artifact(opts.layers, engine.model)
        return SelfSD(engine, tokenizer, skip_attn=attn, skip_mlp=mlp,
                      draft=_draft(DraftConfig(), opts), artifact=manifest)
    if name == "asd":
        from .asd import ASD

        return ASD(engine, tokenizer, alpha=opts.asd_alpha, m=opts.asd_m, n=opts.asd_n,
                   draft=_draft(DraftConfig(), opts))
    if name == "swift":
        from .swift import Swift, SwiftConfig

        base = SwiftConfig()
        cfg = replace(base, seed=opts.seed, draft=_draft(base.draft, opts))
        if opts.skip_ratio is not None:
            cfg = replace(cfg, skip_ratio=opts.skip_ratio)
        if opts.context_window is not None:
            cfg = replace(cfg, context_window=opts.context_window)
        if opts.tree_nodes is not None:
            if opts.tree_nodes < 1:
                raise ConfigError(f"--tree-nodes must be >= 1, got {opts.tree_nodes}")
            cfg = replace(cfg, draft=replace(cfg.draft, tree_max_nodes=opts.tree_nodes))
        return Swift(engine, tokenizer, config=cfg)
    if name == "adadecode":
        from ..heads.store import load_heads
        from .adadecode import AdaDecode, AdaDecodeConfig

        heads, hman = load_heads(opts.heads, engine.model)
        acfg = AdaDecodeConfig()
        if opts.adadecode_threshold is not None:
            acfg = replace(acfg, threshold=opts.adadecode_threshold)
        if opts.adadecode_max_pending is not None:
            acfg = replace(acfg, max_pending=opts.adadecode_max_pending)
        if opts.adadecode_layers is not None:
            acfg = replace(acfg, layers=opts.adadecode_layers)
        method = AdaDecode(engine, tokenizer, heads=heads, config=acfg)
        method.offline_parts.append(_training_cost("lm-heads training", hman))
        return method
    if name == "specee":
        from ..heads.store import load_exit_mlps, load_heads, load_schedule
        from .specee import SpecEE, SpecEEConfig

        from ..errors import ArtifactError

        loaded: list[Any] = []
        problems: list[str] = []
        for load, path in ((load_heads, opts.heads), (load_exit_mlps, opts.exit_mlps), (load_schedule, opts.specee_schedule)):
            try:
                loaded.append(load(path, engine.model))
            except ArtifactError as exc:  # report every missing or unusable artifact at once, in the order to make them
                problems.append(str(exc))
                loaded.append(None)
        if len(problems) == 1:
            raise ArtifactError(problems[0])
        if problems:
            raise ArtifactError(f"specee needs {len(problems)} artifacts that are missing or unusable (make them in this order): "
                                + " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
        (heads, hman), (predictors, pman), (schedule, sman) = loaded
        drafter = int(pman.get("drafter", {}).get("layer", min(heads)))
        if drafter not in heads:
            raise ArtifactError(f"the exit predictors draft with a head after layer {drafter}, which the heads artifact lacks; "
                                "retrain them with `selfspec train-heads --kind exit-mlp`")
        scfg = SpecEEConfig(evaluate=opts.specee_eval)
        if opts.specee_kv_mode is not None:
            scfg = replace(scfg, kv_mode=opts.specee_kv_mode)
        if opts.specee_threshold is not None:
            scfg = replace(scfg, threshold=opts.specee_threshold)
        thresholds = {int(k): float(v) for k, v in (pman.get("thresholds") or {}).items()}
        method = SpecEE(engine, tokenizer, drafter_layer=drafter, drafter=heads[drafter], predictors=predictors,
                        offline_layers=schedule, config=scfg, thresholds=thresholds)
        method.offline_parts += [_training_cost("drafter-head training", hman), _training_cost("exit-mlp training", pman),
                                 {"what": "specee calibration", "seconds": sman.get("search_time_s")}]
        return method
    raise ConfigError(f"method '{name}' has no builder")  # pragma: no cover
