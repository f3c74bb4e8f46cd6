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
    seed: int = 0
    asd_alpha: float = 0.985
    asd_m: int = 3
    asd_n: int = 2


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
        else:
            from ..artifacts import default_skip_artifact_path, load_skip_artifact

            path = opts.layers or default_skip_artifact_path(engine.model)
            attn, mlp, _ = load_skip_artifact(path, engine.model)
        return SelfSD(engine, tokenizer, skip_attn=attn, skip_mlp=mlp,
                      draft=_draft(DraftConfig(), opts))
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
        return Swift(engine, tokenizer, config=cfg)
    raise ConfigError(f"method '{name}' has no builder")  # pragma: no cover
