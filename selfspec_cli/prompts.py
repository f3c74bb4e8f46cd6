"""Read prompt files: plain text (one prompt per line) or JSONL (``prompt`` or
Spec-Bench-style ``turns``), from a path or ``-`` for stdin.

:func:`prompt_from_row` is the one reading of a prompt record, with its one-line errors:
every JSONL line of a prompt file, and every row of a benchmark suite
(:mod:`selfspec_cli.bench.suite_loader`), goes through it."""
from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PromptFileError


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str | int
    turns: tuple[str, ...]
    category: str | None = None


def _read_text(source: str) -> tuple[str, str]:
    if source == "-":
        return sys.stdin.read(), "stdin"
    path = Path(source)
    if not path.exists():
        raise PromptFileError(f"prompt file '{source}' does not exist; pass --prompt-file an existing file or - for stdin")
    if path.is_dir():
        raise PromptFileError(f"prompt file '{source}' is a directory; pass a file")
    try:
        return path.read_text(encoding="utf-8"), source
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file '{source}' ({exc.__class__.__name__}); check permissions and UTF-8 encoding") from None


PROMPT_FORMATS = ("auto", "text", "jsonl")


def _is_jsonl(source: str, text: str) -> bool:
    """``auto``: JSONL when the name ends in .jsonl/.json or the first non-blank line starts with '{'."""
    return source.endswith((".jsonl", ".json")) or text.lstrip().startswith("{")


def prompt_from_row(row: Mapping[str, Any], where: str, default_id: str | int) -> Prompt:
    """A prompt record: ``turns`` (a non-empty list of strings, none blank) or ``prompt`` (a
    string, not blank); the id is ``id``, else ``question_id``, else ``default_id``; ``category``
    when it is a string. A null field counts as absent (``datasets`` gives a row the fields of
    every other row, as nulls). ``where`` (e.g. ``p.jsonl: line 3``) begins every error."""
    if row.get("turns") is not None:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
    elif row.get("prompt") is not None:
        if not isinstance(row["prompt"], str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
        turns = [row["prompt"]]
    else:
        raise PromptFileError(f"{where} has neither a 'prompt' nor a 'turns' field; add one")
    empty = [i + 1 for i, t in enumerate(turns) if not t.strip()]
    if empty:
        which = "the prompt" if row.get("turns") is None else f"turn {empty[0]}"
        raise PromptFileError(f"{where}: {which} is empty; give it some text or remove the line")
    pid = next((row[k] for k in ("id", "question_id") if row.get(k) is not None), default_id)
    cat = row.get("category")
    return Prompt(id=pid, turns=tuple(turns), category=cat if isinstance(cat, str) else None)


def parse_prompts(text: str, name: str = "<prompts>", jsonl: bool | None = None) -> list[Prompt]:
    jsonl = _is_jsonl(name, text) if jsonl is None else jsonl
    prompts: list[Prompt] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(Prompt(id=line_no, turns=(line,)))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = " (a plain-text prompt file? pass --prompt-format text)" if line_no == 1 else ""
            raise PromptFileError(f"{name}: line {line_no} is not valid JSON ({exc.msg}){hint}; fix or remove that line") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{name}: line {line_no} is not a JSON object; each line needs a 'prompt' or 'turns' field")
        prompts.append(prompt_from_row(obj, f"{name}: line {line_no}", line_no))
    if not prompts:
        raise PromptFileError(f"prompt file '{name}' is empty; give at least one prompt")
    return prompts


def read_prompts(source: str, fmt: str = "auto") -> list[Prompt]:
    """Prompts of a file (or ``-``, stdin). ``fmt``: ``auto`` (JSONL when the name ends in
    .jsonl/.json or the first non-blank line starts with '{', else text), ``text`` or ``jsonl``."""
    if fmt not in PROMPT_FORMATS:
        raise PromptFileError(f"unknown --prompt-format '{fmt}'; choose one of: {', '.join(PROMPT_FORMATS)}")
    return parse_prompts(*_read_text(source), None if fmt == "auto" else fmt == "jsonl")
