"""Self-SD: Draft & Verify (Zhang et al., ACL 2024), arXiv:2309.08168.

Drafts with a fixed set of skipped attention and MLP sublayers (found offline by
Bayesian optimization, ``selfspec calibrate --method self-sd``, or given inline),
stops drafting adaptively on draft confidence, and verifies with the full model.
Lossless: greedy output equals plain greedy decoding; sampling uses standard
speculative sampling with drafts sampled from the draft's processed distribution.

The package is the whole method: this module holds the method and its artifact (the skip
set, :data:`SKIP_SET`: one JSON manifest, ``kind: "self-sd-layers"``, with ``skip_attn``,
``skip_mlp``, ``draft_precision``, the objective, the search and the environment);
:mod:`.calibrate` is its offline step, around the Bayesian search that :mod:`.study` runs (over the
settings of :mod:`.search`), which decodes and scores the candidate sets with :mod:`.measure` and
keeps its trials in an Optuna study shared between processes and machines.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...artifacts import ArtifactSpec, now_iso
from ...decoding.layer_skip import DraftSettings, FixedSkips, SkipSource
from ...engine import Engine
from ...errors import FieldError
from ..base import DraftInputs, LayerSkipMethod, LayerSkipOptions, Method, OfflinePart, layer_list, option
from ..offline import OfflineStep
from ...jsonio import JsonObject

DEFAULT_HEARTBEAT_S = 10  # seconds between a running calibration trial's heartbeats (methods/self_sd/study.py)


SKIP_SET = ArtifactSpec(
    kind="self-sd-layers", folder="self-sd", suffix=".json", what="Self-SD skip-set artifact",
    make="selfspec calibrate --method self-sd", args=" --prompt-file <prompts>",
    alternative=", or pass --layers FILE or --skip-attn/--skip-mlp")


@dataclass(frozen=True)
class CalibrateOptions:
    """The options only ``selfspec calibrate --method self-sd`` takes (None: not given, its default)."""

    trials: int | None = option(None, "complete trials wanted in the study (default 100); a resumed study runs only the rest")
    seed: int | None = option(None, "sampler seed (default 0)")
    sampler: str | None = option(None, "Optuna sampler (default tpe): tpe, gp, random (see docs/calibrate.md)")
    objective: str | None = option(None, "proxy (default): the predicted speedup from measured acceptance and draft "
                                         "lengths, draft cost from weight bytes and the engine's measured verify curve; no "
                                         "per-trial timing, so machine load cannot reorder candidates (docs/calibrate.md). "
                                         "throughput: measured tokens/s")
    repeats: int | None = option(None, "decode the prompts this many times per trial; per prompt the fastest pass counts "
                                       "(default 3 with --objective throughput, 1 with proxy)")
    study_path: Path | None = option(None, "Optuna SQLite study (resumable). Default: <output stem>.optuna.db beside "
                                           "--output")
    storage: str | None = option(None, "the study in any storage Optuna shares between processes and machines, instead "
                                       "of --study-path: a database URL (sqlite:///study.db, postgresql://user@host/db, "
                                       "mysql://...) or a journal file on a disk every worker sees (journal:PATH, or a "
                                       "path ending in .journal). Another machine joins by running the same command with "
                                       "the same --storage (docs/calibrate.md)")
    workers: int | None = option(None, "processes working on the study at once on this machine (default 1; each loads "
                                       "the model; one thread each unless --threads)")
    heartbeat: int | None = option(None, f"seconds between a running trial's heartbeats (default {DEFAULT_HEARTBEAT_S}); "
                                         "a worker silent for 3 of them is taken as dead and its trial is run again")
    worker_index: int | None = field(default=None, metadata={"help": "set by --workers for the helper processes it "
                                                                     "starts", "hidden": True})
    worker_group: str | None = field(default=None, metadata={"help": "set by --workers: the first process's worker name",
                                                             "hidden": True})
    draft_precision: str | None = option(None, "draft weights searched together with the skip set: auto (the target's "
                                               "own and the copy generate's --draft-precision auto picks), target (the "
                                               "target's only), int8, int8-g32, gguf or w4a8 (that one only)")


CALIBRATE = OfflineStep("calibrate", "self-sd", SKIP_SET, "selfspec_cli.methods.self_sd.calibrate",
                        Options=CalibrateOptions)


@dataclass(frozen=True)
class SkipSet:
    """A layer-skip set (0-based attention and MLP sublayers to skip) and its one on-disk
    schema (:data:`SKIP_SET`, see the module docstring). ``manifest`` keeps the
    file's other fields (objective, search, environment) when it was loaded."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()
    manifest: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn", frozenset(int(i) for i in self.attn))
        object.__setattr__(self, "mlp", frozenset(int(i) for i in self.mlp))

    @classmethod
    def load(cls, path: str | os.PathLike | None, model: torch.nn.Module) -> SkipSet:
        """The skip set for ``model`` at ``path``; None means the default: the user's
        fingerprint-keyed artifact, else the shipped one (:meth:`ArtifactSpec.resolve`).
        Raises :class:`ArtifactError` when the file is missing, malformed, of another
        kind, or made for another model."""
        p, manifest, _ = SKIP_SET.load(path, model)
        num_layers = int(model.config.num_hidden_layers)
        sets = []
        for key in ("skip_attn", "skip_mlp"):
            ids = manifest.get(key)
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise SKIP_SET.error(p, model, f"field '{key}' must be a list of layer ids")
            if bad := sorted(i for i in ids if not 0 <= i < num_layers):
                raise SKIP_SET.error(p, model, f"{key} ids {bad} are out of range for a {num_layers}-layer model")
            sets.append(frozenset(ids))
        return cls(sets[0], sets[1], manifest)

    @property
    def draft_precision(self) -> str | None:
        """The draft weights the set was calibrated with (``draft_precision`` in the file: target,
        int8, int8-g32 or gguf). None in files from before quantized drafts (calibrated on the
        target's weights): methods then follow their own ``--draft-precision`` (``auto``: the
        quantized copy, the skip set on top, weighed against full depth each round)."""
        value = self.manifest.get("draft_precision")
        return str(value) if value else None

    def to_manifest(self, model: torch.nn.Module, *, objective: JsonObject, trials: int,
                    search: JsonObject, environment: JsonObject, **extra: Any) -> JsonObject:
        """The artifact's JSON object: the one schema every writer (calibration, SWIFT) uses."""
        return {**SKIP_SET.header(model), "skip_attn": sorted(self.attn), "skip_mlp": sorted(self.mlp),
                "objective": dict(objective), "trials": trials, **extra, "search": dict(search),
                "environment": dict(environment), "created": now_iso()}


@dataclass(frozen=True)
class SelfSDConfig(LayerSkipOptions):
    layers: Path | None = option(None, "skip-set artifact (default: this model's calibrated one, the user's under "
                                       "$SELFSPEC_HOME first, then the shipped one)")
    skip_attn: tuple[int, ...] | None = option(None, "inline attention sublayers to skip, e.g. 1,3,5 (0-based; "
                                                     "overrides the artifact)")
    skip_mlp: tuple[int, ...] | None = option(None, "inline MLP sublayers to skip, e.g. 2,4 (0-based)")

    def __post_init__(self) -> None:
        LayerSkipOptions.__post_init__(self)
        object.__setattr__(self, "skip_attn", layer_list(self.skip_attn, "skip_attn"))
        object.__setattr__(self, "skip_mlp", layer_list(self.skip_mlp, "skip_mlp"))


class SelfSD(LayerSkipMethod):
    name = "self-sd"
    lossless = True
    description = "Self-SD / Draft & Verify: offline-calibrated skip set, adaptive draft exit"
    Config = SelfSDConfig

    def __init__(self, engine: Engine, tokenizer: Any = None, config: SelfSDConfig | None = None,
                 skip: SkipSet = SkipSet(), draft: DraftSettings | None = None, *, inputs: DraftInputs = DraftInputs(),
                 weigh_full_depth: bool = True) -> None:
        """``draft`` overrides the config's draft settings (e.g. tree verification); ``inputs``: the
        draft's weights, vocabulary and n-gram branch (:meth:`LayerSkipMethod.draft_inputs`)."""
        n = engine.num_layers
        if bad := sorted(i for i in skip.attn | skip.mlp if not 0 <= i < n):
            raise FieldError("skip_attn/skip_mlp",
                             f"layer ids {bad} are out of range for a {n}-layer model (valid: 0..{n - 1})")
        self.skip = skip
        super().__init__(engine, tokenizer, config or SelfSDConfig(), draft, inputs=inputs,
                         weigh_full_depth=weigh_full_depth)
        self.artifact_precision = skip.draft_precision  # the precision the set was calibrated with, if any
        if m := skip.manifest:
            self.offline_parts.append(OfflinePart("self-sd calibration", m.get("search_time_s"), "calibration",
                                                  trials=m.get("trials"), created=m.get("created")))

    def skip_source(self) -> SkipSource:
        return FixedSkips(self.skip.attn, self.skip.mlp)

    @classmethod
    def build(cls, engine: Engine, tokenizer: Any = None, config: SelfSDConfig | None = None) -> Method:
        config = config or SelfSDConfig()
        if config.skip_attn is None and config.skip_mlp is None:
            skip = SkipSet.load(config.layers, engine.model)
        else:
            skip = SkipSet(config.skip_attn or (), config.skip_mlp or ())
        return cls(engine, tokenizer, config, skip, inputs=cls.draft_inputs(engine, tokenizer, config, skip.draft_precision))
