"""Artifacts of trained heads and predictors: safetensors + JSON manifest (through
:func:`selfspec_cli.artifacts.save_tensors_artifact`, atomic, with the model
fingerprint), and their default locations. Written by default to the user's data
directory (``<selfspec home>/artifacts/<kind>/<model name>-<fingerprint>...``, see
:mod:`selfspec_cli.paths`); loaded from there first, then from the shipped
``artifacts/<kind>/<model name>...`` (read-only):

* ``adadecode/<model>/`` — AdaDecode heads (kind ``adadecode-heads``),
  tensors ``layer{k}.a``, ``layer{k}.b``, ``layer{k}.g`` for each head layer ``k``
  (0-based id of the layer after which the head reads the residual stream);
* ``specee/<model>/`` — SpecEE exit predictors (kind ``specee-exit-mlp``),
  tensors ``layer{k}.w1`` ... ``layer{k}.b2``; the manifest names the drafter
  (the AdaDecode head it takes its 4 speculative tokens from);
* ``specee/<model>.schedule.json`` — SpecEE's offline schedule (kind
  ``specee-schedule``), made by ``selfspec calibrate --method specee``.

A missing or foreign artifact is a one-line :class:`ArtifactError` naming the
command that makes it.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from .. import artifacts, loading
from ..artifacts import model_flag, resolve_artifact
from ..errors import ArtifactError
from .exit_heads import ExitPredictor, LowRankHead

HEADS_KIND = "adadecode-heads"
EXIT_KIND = "specee-exit-mlp"
SCHEDULE_KIND = "specee-schedule"


def default_heads_path(model: Any) -> Path:
    """Where ``train-heads --kind lm-heads`` writes by default (fingerprint-keyed, user data directory)."""
    return artifacts.user_artifact_path("adadecode", model)


def default_exit_path(model: Any) -> Path:
    return artifacts.user_artifact_path("specee", model)


def default_schedule_path(model: Any) -> Path:
    return artifacts.user_artifact_path("specee", model, ".schedule.json")


def _command(cmd: str, model: Any, path: Path | None, folder: str, suffix: str = "") -> str:
    """``cmd``, and for a loaded model where to write the artifact so that it is found."""
    return cmd + artifacts.output_advice(path, model, folder, suffix) if isinstance(model, torch.nn.Module) else cmd


def train_command(kind: str, model: Any, path: Path | None = None) -> str:
    return _command(f"selfspec train-heads --kind {kind}{model_flag(model)}", model, path,
                    "adadecode" if kind == "lm-heads" else "specee")


def schedule_command(model: Any, path: Path | None = None) -> str:
    return _command(f"selfspec calibrate --method specee{model_flag(model)} --prompt-file "
                    f"{loading.EXAMPLES_DIR / 'calibration.jsonl'}",
                    model, path, "specee", ".schedule.json")


def _save_per_layer(path: Path, kind: str, items: dict[int, Any], manifest: dict[str, Any]) -> Path:
    """Tensors ``layer<k>.<field>`` of each layer's dataclass (float32), the layers in the manifest."""
    tensors = {f"layer{k}.{f.name}": getattr(v, f.name).float() for k, v in items.items() for f in fields(v)}
    return artifacts.save_tensors_artifact(path, tensors, {"kind": kind, **manifest, "layers": sorted(items)})


def _load_per_layer(path: Path | None, model: Any, kind: str, train_kind: str, folder: str, what: str,
                    build: Any) -> tuple[dict[int, Any], dict[str, Any]]:
    """Load a per-layer tensors artifact: the dataclass ``build`` from tensors ``layer<k>.<field>``, per layer."""
    label = {"lm-heads": "AdaDecode heads artifact", "exit-mlp": "SpecEE exit-predictor artifact"}[train_kind]
    p = resolve_artifact(path, model, folder, "", label, f"create it with `{train_command(train_kind, model)}`",
                         lambda q: artifacts.tensors_artifact_paths(q)[1].exists())
    hint = f"create it with `{train_command(train_kind, model, p)}`"
    tensors, manifest = artifacts.load_tensors_artifact(p, model, kind=kind, create_hint=hint)
    out: dict[int, Any] = {}
    L = int(model.config.num_hidden_layers)
    for k in manifest.get("layers", []):
        if not 0 <= int(k) < L - 1:
            raise ArtifactError(f"'{p}': {what} layer {k} is out of range for a {L}-layer model; {hint}")
        try:
            out[int(k)] = build(*(tensors[f"layer{k}.{f.name}"] for f in fields(build)))
        except KeyError:
            raise ArtifactError(f"'{p}' lacks the tensors of {what} layer {k}; {hint}") from None
    if not out:
        raise ArtifactError(f"'{p}' holds no {what}s; {hint}")
    return out, manifest


def save_heads(path: Path, heads: dict[int, LowRankHead], manifest: dict[str, Any]) -> Path:
    return _save_per_layer(path, HEADS_KIND, heads, manifest)


def load_heads(path: Path | None, model: Any) -> tuple[dict[int, LowRankHead], dict[str, Any]]:
    return _load_per_layer(path, model, HEADS_KIND, "lm-heads", "adadecode", "head", LowRankHead)


def save_exit_mlps(path: Path, predictors: dict[int, ExitPredictor], manifest: dict[str, Any]) -> Path:
    return _save_per_layer(path, EXIT_KIND, predictors, manifest)


def load_exit_mlps(path: Path | None, model: Any) -> tuple[dict[int, ExitPredictor], dict[str, Any]]:
    return _load_per_layer(path, model, EXIT_KIND, "exit-mlp", "specee", "predictor", ExitPredictor)


def load_schedule(path: Path | None, model: Any) -> tuple[list[int], dict[str, Any]]:
    p = resolve_artifact(path, model, "specee", ".schedule.json", "SpecEE schedule artifact",
                         f"create it with `{schedule_command(model)}`")
    hint = f"create it with `{schedule_command(model, p)}`"
    manifest = artifacts.read_json_artifact(p, "SpecEE schedule artifact", hint)
    if manifest.get("kind") != SCHEDULE_KIND:
        raise ArtifactError(f"'{p}' is a {manifest.get('kind')!r} artifact, not {SCHEDULE_KIND!r}; {hint}")
    artifacts.check_fingerprint(manifest, model, p, f"recalibrate: {hint}")
    layers = manifest.get("selected_layers")
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ArtifactError(f"'{p}': field 'selected_layers' must be a list of layer ids; {hint}")
    return layers, manifest
