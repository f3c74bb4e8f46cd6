"""The one frame of ``selfspec calibrate`` and ``selfspec train-heads``: a thin dispatcher over
the methods' offline steps (:mod:`selfspec_cli.methods.offline`).

In order, so that a mistake costs no model load: the step named by ``--method``/``--kind``,
the options only other steps take refused with one line, ``--seed``'s range checked, the
step's own options checked (``prepare``), the prompts read and counted (a step's ``min_prompts``),
an explicit ``--output`` checked (without one: that the user directory the default path lies in can
be written); then the application layer (:func:`selfspec_cli.methods.application.run_offline`) loads the
model, checks the default output path (the artifact spec's, fingerprint-keyed), encodes the prompts and checks
them against the context, and the step's ``run`` does the work. Its summary is printed as one JSON object on stdout; no manifest is written here.

The options only some steps take are each step's typed ``Options`` dataclass (fields made with
:func:`selfspec_cli.methods.base.option`, as a method's ``Config``); :func:`with_step_options`
turns them into the command's flags, one per field name over the command's steps.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from ..config import GenerationConfig, check_seed
from ..engine.target import TARGET_PRECISIONS
from ..errors import ConfigError
from ..methods import OFFLINE
from ..methods.application import OfflineInputs, run_offline
from ..methods.offline import OfflineStep
from ..paths import check_home_writable
from ..prompts import PROMPT_FORMATS, load_calibration_prompts
from ..session import apply_threads
from ..config import check_choice
from .common import invocation_args, log, print_json, progress, set_exit_note


def step_option_fields(command: str) -> dict[str, tuple[Any, str, bool]]:
    """Option name -> (type, help, hidden) over the ``Options`` of ``command``'s steps: a name several
    steps take is one flag, its help naming the steps (one text, or each step's own)."""
    found: dict[str, tuple[Any, dict[str, str], bool]] = {}
    for (c, name), step in OFFLINE.items():
        if c != command or step.Options is None:
            continue
        hints = typing.get_type_hints(step.Options)
        for f in dataclasses.fields(step.Options):
            kind = next(a for a in typing.get_args(hints[f.name]) if a is not type(None))
            entry = found.setdefault(f.name, (kind, {}, bool(f.metadata.get("hidden"))))
            entry[1][name] = f.metadata["help"]
    out: dict[str, tuple[Any, str, bool]] = {}
    for field_name, (kind, helps, hidden) in found.items():
        texts = set(helps.values())
        text = (f"{', '.join(helps)}: {texts.pop()}" if len(texts) == 1
                else "; ".join(f"{n}: {h}" for n, h in helps.items()))
        out[field_name] = (kind, text + ".", hidden)
    return out


def with_step_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one keyword parameter (``--flag``, default None: not given) per option of ``command``'s
    steps to the decorated command, which takes them as ``**step_options``."""
    def add(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        annotations = dict(typing.get_type_hints(func))
        for name, (kind, help, hidden) in step_option_fields(command).items():
            annotations[name] = Optional[kind]
            default = typer.Option(None, "--" + name.replace("_", "-"), help=help, hidden=hidden, show_default=False)
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotations[name]))
        func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        func.__annotations__ = annotations
        return func
    return add


def step_for(command: str, flag: str, name: str | None) -> OfflineStep:
    """The offline step ``selfspec <command> <flag> <name>`` runs; one line when there is none."""
    names = [n for c, n in OFFLINE if c == command]
    if name is None:  # checked here, not by click: a missing option must also be a one-line error
        raise ConfigError(f"{command} needs {flag}; choose one of: {', '.join(names)}")
    check_choice(name, names, flag, f" for {command}")
    return OFFLINE[(command, name)]


def _own_options(step: OfflineStep, options: dict[str, Any]) -> dict[str, Any]:
    """The options given (not None); one that belongs to another step is refused."""
    given = {k: v for k, v in options.items() if v is not None}
    if foreign := sorted(set(given) - set(step.options)):
        owners = sorted({n for (c, n), s in OFFLINE.items() if c == step.command and foreign[0] in s.options})
        flag = "--method" if step.command == "calibrate" else "--kind"
        raise ConfigError(f"--{foreign[0].replace('_', '-')} is an option of {flag} {', '.join(owners) or 'no step'}, "
                          f"not of {step.name}; drop it")
    return given


def _prompts(step: OfflineStep, prompt_file: str | None, prompt_format: str, dataset: str | None, dataset_field: str,
             num_prompts: int | None) -> list[str]:
    texts = load_calibration_prompts(prompt_file, dataset, dataset_field, step.num_prompts if num_prompts is None
                                     else num_prompts, prompt_format)
    if len(texts) < step.min_prompts:
        raise ConfigError(f"{step.command} {'--method' if step.command == 'calibrate' else '--kind'} {step.name} needs at "
                          f"least {step.min_prompts} prompts, got {len(texts)}; " + (
                              f"pass --num-prompts {step.min_prompts} or more" if num_prompts is not None and num_prompts < step.min_prompts
                              else "pass a prompt file or dataset with more prompts"))
    return texts


def run_step(step: OfflineStep, options: dict[str, Any], *, model: str | None, prompt_file: str | None,
             prompt_format: str, dataset: str | None, dataset_field: str, num_prompts: int | None,
             max_new_tokens: int | None, output: Path | None, force: bool, threads: str | None,
             chat_template: bool, dtype: str, device: str, target_precision: str = "auto") -> None:
    """Run ``step`` with the command's common options and ``options``: its own (parameter name ->
    value; None: not given). One given that belongs to another step is refused."""
    given = _own_options(step, options)
    check_seed(given.get("seed"))
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    setting = step.prepare(given)
    writes = getattr(setting, "writes", True)  # False: a --workers helper, which never writes
    apply_threads(threads)
    new_tokens = step.max_new_tokens if max_new_tokens is None else max_new_tokens
    GenerationConfig(max_new_tokens=new_tokens)  # validates before any loading
    texts = _prompts(step, prompt_file, prompt_format, dataset, dataset_field, num_prompts)
    if output is not None and writes:
        step.artifact.check_output(output, force)
    elif writes:  # the default path lies in the user's home: an unwritable one fails now, not after the work
        check_home_writable()
    inputs = OfflineInputs(model, texts, prompt_file if prompt_file is not None else dataset,
                           dataset_field if dataset is not None else None, new_tokens, output, force, chat_template,
                           dtype, device, target_precision)
    summary = run_offline(step, setting, inputs, log=log, progress=progress, argv=invocation_args(),
                          exit_note=set_exit_note)
    if summary is not None:
        print_json(summary)
