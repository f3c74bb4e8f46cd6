"""Calibration prompts: a selfspec prompt file, or a local dataset read with ``datasets``.

Calibration is one-shot: a multi-turn prompt contributes its first turn. Prompts
are taken in file order, at most ``num_prompts`` of them, so a calibration is
reproducible from its manifest.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import ConfigError, PromptFileError, first_line
from ..prompts import read_prompts

# file suffix -> datasets packaged builder
DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def prompts_from_dataset(path: str, field: str = "prompt", num_prompts: int = 8) -> list[str]:
    """The ``field`` column of a local JSON/JSONL/CSV/Parquet file, through
    ``datasets.load_dataset(builder, data_files=path, split="train")``. A list value
    (Spec-Bench ``turns``) contributes its first element."""
    p = Path(path)
    if not p.is_file():
        raise PromptFileError(f"dataset file '{path}' does not exist; pass --dataset a local .jsonl, .json, .csv or .parquet file")
    builder = DATASET_BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise PromptFileError(f"dataset file '{path}' has an unknown type; use .jsonl, .json, .csv or .parquet")
    import datasets

    datasets.disable_progress_bars()  # stderr is for selfspec's own progress
    try:
        ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as exc:  # datasets raises many types for unreadable files  # noqa: BLE001
        raise PromptFileError(f"cannot read dataset '{path}' ({first_line(exc)}); check that it is valid {builder.upper()}") from None
    if field not in ds.column_names:
        raise PromptFileError(
            f"dataset '{path}' has no column '{field}' (columns: {', '.join(ds.column_names)}); pass --dataset-field"
        )
    texts: list[str] = []
    for i, value in enumerate(ds.select(range(min(num_prompts, len(ds))))[field]):
        if isinstance(value, list) and value:
            value = value[0]
        if not isinstance(value, str) or not value.strip():
            raise PromptFileError(f"dataset '{path}': row {i + 1}, column '{field}' is not a non-empty string")
        texts.append(value)
    if not texts:
        raise PromptFileError(f"dataset '{path}' is empty; give at least one prompt")
    return texts


def load_calibration_prompts(prompt_file: str | None, dataset: str | None, field: str, num_prompts: int,
                             fmt: str = "auto") -> list[str]:
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {num_prompts}")
    if (prompt_file is None) == (dataset is None):
        raise ConfigError("pass exactly one of --prompt-file and --dataset")
    if prompt_file is not None:  # first turns of the first num_prompts prompts
        return [p.turns[0] for p in read_prompts(prompt_file, fmt)[:num_prompts]]
    return prompts_from_dataset(dataset, field, num_prompts)


def prompts_digest(prompt_ids: list[list[int]]) -> str:
    """A short hash of the tokenized calibration prompts (a resumed study must use the same ones)."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]
