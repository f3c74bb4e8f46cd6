"""Benchmark prompt suites: JSONL files shipped in ``selfspec_cli/bench/suites/``,
read with ``datasets`` (a local file, no network).

A suite line is ``{"id": ..., "category": ..., "turns": [prompt, ...]}`` (or ``prompt``
instead of ``turns``), the format :mod:`selfspec_cli.prompts` reads; other fields
(``source``) are kept in the file for provenance and ignored here. The built-in
suites are made by ``scripts/make_suites.py`` from the shipped model's held-out
files (docs/log.md, "benchmark suites").
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PromptFileError
from ..prompts import Prompt

SUITES_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_SUITE = "pystdlib"


def list_suites() -> list[str]:
    """Names of the built-in suites (file stems in ``SUITES_DIR``), sorted."""
    return sorted(p.stem for p in SUITES_DIR.glob("*.jsonl"))


def suite_path(name_or_path: str) -> Path:
    """The file of a built-in suite name, or an existing local JSONL file.

    A built-in name wins over a file of the same name in the working directory."""
    name = str(name_or_path)
    available = list_suites()
    if name in available:
        return SUITES_DIR / f"{name}.jsonl"
    path = Path(name)
    if path.is_file():
        return path
    shown = ", ".join(available) or "none installed"
    if path.suffix.lower() in (".jsonl", ".json") or "/" in name or "\\" in name:
        raise PromptFileError(f"suite file '{name}' does not exist; pass an existing .jsonl file or a built-in suite ({shown})")
    raise ConfigError(f"unknown suite '{name}'; use one of: {shown}, or the path of a .jsonl file")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` with no progress bars and only errors logged, restored afterwards."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars = datasets.is_progress_bar_enabled()
    level = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        yield datasets
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _read_rows(path: Path, label: str) -> tuple[list[str], list[dict]]:
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as exc:  # datasets raises many types for unreadable files  # noqa: BLE001
            text = str(exc).strip()
            first = text.splitlines()[0][:200] if text else type(exc).__name__
            raise PromptFileError(
                f"cannot read suite '{label}' ({first}); each line must be a JSON object with 'id', 'category' and 'turns'"
            ) from None
    return list(ds.column_names), ds.to_list()


def _turns(row: dict, where: str) -> tuple[str, ...]:
    turns = row.get("turns")
    if turns is None and row.get("prompt") is not None:
        turns = [row["prompt"]]
    if turns is None:
        raise PromptFileError(f"{where} has neither 'turns' nor 'prompt'; add 'turns': [prompt]")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise PromptFileError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    return tuple(turns)


def load_suite(name_or_path: str = DEFAULT_SUITE) -> list[Prompt]:
    """The prompts of a built-in suite (see :func:`list_suites`) or of a local JSONL file,
    in file order, each with its ``id`` and ``category``."""
    path = suite_path(name_or_path)
    label = str(name_or_path)
    columns, rows = _read_rows(path, label)
    if not rows:
        raise PromptFileError(f"suite '{label}' is empty; give at least one prompt")
    for field in ("id", "category"):
        if field not in columns:
            raise PromptFileError(f"suite '{label}' has no '{field}' field (fields: {', '.join(columns)}); give every line one")
    if "turns" not in columns and "prompt" not in columns:
        raise PromptFileError(f"suite '{label}' has neither a 'turns' nor a 'prompt' field; give every line 'turns': [prompt]")
    prompts: list[Prompt] = []
    seen: set[str | int] = set()
    for line_no, row in enumerate(rows, start=1):
        where = f"suite '{label}': line {line_no}"
        pid, cat = row.get("id"), row.get("category")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
            raise PromptFileError(f"{where}: 'id' must be a non-empty string or an integer")
        if pid in seen:
            raise PromptFileError(f"{where}: id {pid!r} is used twice; give every prompt a unique id")
        seen.add(pid)
        if not isinstance(cat, str) or not cat:
            raise PromptFileError(f"{where}: 'category' must be a non-empty string")
        prompts.append(Prompt(id=pid, turns=_turns(row, where), category=cat))
    return prompts
