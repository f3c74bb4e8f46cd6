"""``selfspec generate --resume``: carry on an output file instead of starting over.

The records an earlier run finished are in ``--output`` (a finished run, or one run with
``--append``) and in the ``<output>.<random>.partial`` file an interrupted run keeps beside
it (whole lines only: :func:`~selfspec_cli.cli.common.output_stream`). :func:`resume` moves the
newest kept partial's records into the output (the records the output does not hold yet, in
their order; the partial is then removed) and returns the prompts still to decode; the
caller appends their records. Invariants: no finished record is lost or written twice (a
record is matched by its prompt ``id``; a torn last line of the output, a record an interrupted
``--append`` run was writing, is dropped and its prompt decoded again), and a record made for another prompt
text, by another method or with other settings (the ``settings`` every record keeps: the model, the length
limit, sampling, stop strings, chat template, dtype, device, target precision, and a lossy method's options)
is refused with one line before any weights are loaded, since the file would then mix two runs. Records
written before ``settings`` existed are matched by id, method and text only.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
from pathlib import Path
from typing import Any

from ..config import GenerationConfig
from ..decoding.output import OutputRecord
from ..errors import ConfigError
from ..paths import cut_to_last_line
from ..prompts import Prompt


# a settings key -> the flag that sets it (how a refusal names it)
SETTING_FLAGS = {"model": "--model", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                 "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "sampling_rule": "--sampling-rule",
                 "stop": "--stop", "chat_template": "--chat-template", "dtype": "--dtype", "device": "--device",
                 "target_precision": "--target-precision", "method_options": "the method's options"}


def run_settings(model: str, cfg: GenerationConfig, *, chat_template: bool, dtype: str, device: str,
                 target_precision: str, lossy_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What decides a record's tokens besides its prompt and method: ``model`` as resolved (a converted
    GGUF's directory is named by the file's hash), the generation config, and how the weights are read;
    sampling's seed and rule only when sampling; a lossy method's options (``lossy_options``) too, since
    its output depends on them (a lossless method's options change its speed, not its tokens)."""
    s = cfg.sampling
    out: dict[str, Any] = {"model": model, "max_new_tokens": cfg.max_new_tokens, "temperature": s.temperature,
                           "stop": list(cfg.stop_strings), "chat_template": chat_template, "dtype": dtype,
                           "device": device, "target_precision": target_precision}
    if not s.greedy:
        out.update(top_k=s.top_k, top_p=s.top_p, seed=s.seed, sampling_rule=s.rule)
    if lossy_options is not None:
        out["method_options"] = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                                 for k, v in sorted(lossy_options.items())}
    return out


def prompt_sha(prompt: Prompt) -> str:
    """A short digest of a prompt's turns, kept in each record (``prompt_sha256``) to match it on resume."""
    return hashlib.sha256("\x1e".join(prompt.turns).encode("utf-8")).hexdigest()[:16]


def _records(path: Path) -> list[tuple[OutputRecord, str]]:
    """The whole-line JSON records of ``path``, read back (:meth:`OutputRecord.from_dict`), with their lines as
    written (an unreadable line is left out)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
            if isinstance(d, dict) and "id" in d:
                out.append((OutputRecord.from_dict(d), line))
        except (json.JSONDecodeError, AttributeError, TypeError):
            continue
    return out


def check_append(path: Path | None, prompts: list[Prompt], numbered: bool = False) -> list[Prompt]:
    """--append: refuse prompt ids the file already holds (a file with an id twice can never be resumed).
    ``numbered``: the prompts' ids are only their places (``--prompt`` texts, 1, 2, ...): they continue after
    the file's largest integer id instead."""
    if path is None or str(path) == "-" or not path.is_file():
        return prompts
    held = {rec.id for rec, _ in _records(path)}
    if numbered:
        start = max([i for i in held if isinstance(i, int) and not isinstance(i, bool)], default=0)
        return [dataclasses.replace(p, id=start + k) for k, p in enumerate(prompts, start=1)]
    again = [p.id for p in prompts if p.id in held]
    if again:
        more = f" and {len(again) - 1} more" if len(again) > 1 else ""
        raise ConfigError(f"--append: '{path}' already holds a record of prompt id {again[0]!r}{more}; --resume "
                          "finishes an interrupted run, or give the new prompts other ids")
    return prompts


def kept_partials(path: Path) -> list[Path]:
    """The ``.partial`` files interrupted runs kept beside ``path``, newest last."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.*.partial"), key=lambda p: p.stat().st_mtime)


def resume(path: Path, prompts: list[Prompt], method: str, settings: dict[str, Any]) -> tuple[list[Prompt], int]:
    """Move the newest kept partial's new records into ``path`` and return the prompts whose
    records ``path`` does not hold yet, with the number of records it holds (each checked against
    ``method`` and :func:`run_settings`' ``settings``)."""
    by_id = {str(p.id): p for p in prompts}
    if path.exists():
        cut_to_last_line(path)  # a record torn by an interrupted --append run: decoded again, not kept half
    done = [rec for rec, _ in _records(path)] if path.exists() else []
    partials = kept_partials(path)
    have = {str(r.id) for r in done}
    carried = [(rec, line) for rec, line in (_records(partials[-1]) if partials else []) if str(rec.id) not in have]
    for rec in done:
        _check(rec, by_id, method, settings, path)
    for rec, _ in carried:
        _check(rec, by_id, method, settings, partials[-1])
    if partials:  # its records, as written, move into the output; then it has nothing the output lacks
        with path.open("a", encoding="utf-8") as f:
            for _, line in carried:
                f.write(line + "\n")
            f.flush()
        partials[-1].unlink()
    have |= {str(rec.id) for rec, _ in carried}
    return [p for p in prompts if str(p.id) not in have], len(have)


def _check(rec: OutputRecord, by_id: dict[str, Prompt], method: str, settings: dict[str, Any], where: Path) -> None:
    p = by_id.get(str(rec.id))
    fix = "pass --force to start over, or another --output"
    if p is None:
        raise ConfigError(f"--resume: '{where}' holds a record for prompt id {rec.id}, which the prompts do not have; {fix}")
    if rec.method != method:
        raise ConfigError(f"--resume: '{where}' holds records of --method {rec.method}, not {method}; {fix}")
    if rec.prompt_sha256 is not None and rec.prompt_sha256 != prompt_sha(p):
        raise ConfigError(f"--resume: '{where}' holds a record for another text of prompt id {rec.id}; {fix}")
    held = rec.settings
    if isinstance(held, dict) and held != settings:
        keys = [*SETTING_FLAGS, *sorted((set(held) | set(settings)) - set(SETTING_FLAGS))]  # flags first, then any other
        diff = [k for k in keys if held.get(k) != settings.get(k)]
        said = "; ".join(f"{SETTING_FLAGS.get(k, k)} {_shown(held.get(k))} there, {_shown(settings.get(k))} now"
                         for k in diff[:3])
        raise ConfigError(f"--resume: '{where}' holds records made with other settings ({said}); "
                          f"rerun with the settings it was made with, or {fix}")


def _shown(value: Any) -> str:
    return "(not set)" if value is None else json.dumps(value, ensure_ascii=False)
