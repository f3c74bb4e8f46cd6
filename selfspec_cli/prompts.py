"""Read prompt files: plain text (one prompt per line) or JSONL (``prompt`` or
Spec-Bench-style ``turns``), from a path or ``-`` for stdin (UTF-8, a leading byte order
mark dropped), and prompts given on the command line (``generate --prompt``).

:func:`prompt_from_row` is the one reading of a prompt record, with its one-line errors:
every JSONL line of a prompt file, and every row of a benchmark suite
(:mod:`selfspec_cli.bench.suite_loader`), goes through it. :func:`load_calibration_prompts`
reads the prompts of the offline steps (``calibrate``, ``train-heads``): a prompt file's first
turns, or a column of a local dataset read with ``datasets``."""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, PromptFileError, first_line


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str | int
    turns: tuple[str, ...]
    category: str | None = None


def _read_text(source: str) -> tuple[str, str]:
    """The text of a prompt file (or of stdin, ``-``), without a leading UTF-8 byte order mark (the
    BOM Windows editors put first: it would make a JSONL file's first line invalid JSON, and be
    sent to the model as the first prompt's first character)."""
    if source == "-":  # bytes, decoded as a file's are: strict UTF-8, a leading BOM dropped, CRLF and CR as newlines
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"stdin is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                                  "convert it first, e.g. with iconv -t UTF-8") from None
        return text.replace("\r\n", "\n").replace("\r", "\n"), "stdin"
    path = Path(source)
    if not path.exists():
        raise PromptFileError(f"prompt file '{source}' does not exist; pass --prompt-file an existing file or - for stdin")
    if path.is_dir():
        raise PromptFileError(f"prompt file '{source}' is a directory; pass a file")
    try:
        return path.read_text(encoding="utf-8-sig"), source
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file '{source}' ({exc.__class__.__name__}); check permissions and UTF-8 encoding") from None


PROMPT_FORMATS = ("auto", "text", "jsonl")


def prompt_from_row(row: Mapping[str, Any], where: str, default_id: str | int) -> Prompt:
    """A prompt record: ``turns`` (a non-empty list of strings, none blank) or ``prompt`` (a
    string, not blank); the id is ``id``, else ``question_id``, else ``default_id``; ``category``
    when it is a string. A null field counts as absent (``datasets`` gives a row the fields of
    every other row, as nulls). ``where`` (e.g. ``p.jsonl: line 3``) begins every error."""
    if row.get("turns") is not None and row.get("prompt") is not None:
        raise PromptFileError(f"{where} has both a 'prompt' and a 'turns' field; keep one of them")
    if row.get("turns") is not None:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
    elif row.get("prompt") is not None:
        if not isinstance(row["prompt"], str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
        turns = [row["prompt"]]
    else:
        null = [k for k in ("prompt", "turns") if k in row]
        raise PromptFileError(f"{where}: its '{null[0]}' is null; give it the prompt's text" if null
                              else f"{where} has neither a 'prompt' nor a 'turns' field; add one")
    empty = [i + 1 for i, t in enumerate(turns) if not t.strip()]
    if empty:
        which = "the prompt" if row.get("turns") is None else f"turn {empty[0]}"
        raise PromptFileError(f"{where}: {which} is empty; give it some text or remove the line")
    pid = next((row[k] for k in ("id", "question_id") if row.get(k) is not None), default_id)
    cat = row.get("category")
    return Prompt(id=pid, turns=tuple(turns), category=cat if isinstance(cat, str) else None)


def parse_prompts(text: str, name: str = "<prompts>", jsonl: bool | None = None) -> list[Prompt]:
    if jsonl is None:  # auto: JSONL when the name ends in .jsonl/.json or the first non-blank line starts with '{'
        jsonl = name.endswith((".jsonl", ".json")) or text.lstrip().startswith("{")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}  # id -> its line: records are matched to prompts by id (--resume, the bench's passes)
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
            raise PromptFileError(f"{name}: line {line_no} is not valid JSON ({exc.msg}: column {exc.colno}){hint}; fix or remove that line") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{name}: line {line_no} is not a JSON object; each line needs a 'prompt' or 'turns' field")
        prompts.append(prompt_from_row(obj, f"{name}: line {line_no}", line_no))
        first = seen.setdefault(str(prompts[-1].id), line_no)
        if first != line_no:
            raise PromptFileError(f"{name}: line {line_no} repeats the id {prompts[-1].id} of line {first}; "
                                  "give each prompt its own id")
    if not prompts:
        raise PromptFileError("stdin holds no prompt; pipe at least one" if name == "stdin"
                              else f"prompt file '{name}' is empty; give at least one prompt")
    return prompts


def read_prompts(source: str, fmt: str = "auto") -> list[Prompt]:
    """Prompts of a file (or ``-``, stdin). ``fmt``: ``auto`` (JSONL when the name ends in
    .jsonl/.json or the first non-blank line starts with '{', else text), ``text`` or ``jsonl``."""
    if fmt not in PROMPT_FORMATS:
        raise PromptFileError(f"unknown --prompt-format '{fmt}'; choose one of: {', '.join(PROMPT_FORMATS)}")
    return parse_prompts(*_read_text(source), None if fmt == "auto" else fmt == "jsonl")


def prompts_from_texts(texts: list[str] | tuple[str, ...], option: str = "--prompt") -> list[Prompt]:
    """Prompts given as text on the command line (``--prompt``, repeatable): ids 1..n, in order;
    an empty or blank one is refused (one line)."""
    if not texts:
        raise PromptFileError(f"no {option} given; pass at least one")
    for i, t in enumerate(texts, start=1):
        if not t.strip():
            raise PromptFileError(f"{option} number {i} is empty; give it some text")
    return [Prompt(id=i, turns=(t,)) for i, t in enumerate(texts, start=1)]


# ---------------------------------------------------------------- offline steps' prompts
# Calibration and training are one-shot: a multi-turn prompt contributes its first turn.
# Prompts are taken in file order, at most ``num_prompts`` of them, so an artifact is
# reproducible from its manifest.

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


def uses_chat_template(tokenizer: Any, use_chat_template: bool) -> bool:
    """Whether prompts are wrapped in the tokenizer's chat template: asked for and the tokenizer has one
    (a base model's, such as Gemma 3 270M's, has none: its prompts are raw text, as ``--no-chat-template``)."""
    return bool(use_chat_template and getattr(tokenizer, "chat_template", None))


_RECENT: dict[tuple, tuple[Any, tuple[int, ...]]] = {}  # the last few conversations encoded (encode_turn)
_RECENT_MAX = 8


def encode_turn(tokenizer: Any, history: list[dict[str, str]], use_chat_template: bool) -> list[int]:
    """Token ids of a conversation so far (ending with a user turn), ready to continue; raw text
    (turns joined by blank lines, the tokenizer's special tokens) where no chat template applies.

    The last few conversations encoded are kept (keyed by the tokenizer object, its chat template and the turns),
    so a caller that checks a conversation's length and then decodes it (``chat``, ``generate``'s context check)
    tokenizes it once: a long conversation's template and tokenization run once a turn, not twice."""
    key = (id(tokenizer), str(getattr(tokenizer, "chat_template", None)), use_chat_template,  # a template may be a dict
           tuple((m["role"], m["content"]) for m in history))
    hit = _RECENT.get(key)
    if hit is not None and hit[0] is tokenizer:
        return list(hit[1])
    ids = _encode(tokenizer, history, use_chat_template)
    _RECENT[key] = (tokenizer, tuple(ids))
    while len(_RECENT) > _RECENT_MAX:
        _RECENT.pop(next(iter(_RECENT)))
    return ids


def _encode(tokenizer: Any, history: list[dict[str, str]], use_chat_template: bool) -> list[int]:
    if uses_chat_template(tokenizer, use_chat_template):
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer("\n\n".join(m["content"] for m in history), add_special_tokens=True)["input_ids"]
