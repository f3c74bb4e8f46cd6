"""A method's offline step: what ``selfspec calibrate --method X`` and ``selfspec train-heads
--kind X`` run, declared in the method's own package (docs/design.md, "A method is one package").

An :class:`OfflineStep` names its command, its artifact (an
:class:`~selfspec_cli.artifacts.ArtifactSpec`) and the module that does the work; the module
is imported only when the step runs (Self-SD's search needs optuna, which ``generate`` never
loads). That module has two functions:

* ``prepare(options) -> setting`` (optional: a step without options of its own has none):
  checks the step's own options before anything slow is loaded (one
  :class:`~selfspec_cli.errors.ConfigError` line for a bad one); a setting whose ``writes``
  is False (a ``--workers`` helper) makes the command skip the output checks;
* ``run(job) -> summary``: does the work on a loaded model, writes the artifact atomically
  through the spec, logs to stderr through ``job.log`` and returns the JSON object the
  command prints on stdout.

The commands are thin: they read prompts, load the model, check the output path, build the
:class:`OfflineJob` and print what ``run`` returns; no manifest is written there.

**Throwaway results never become the default** (:meth:`OfflineJob.destination`, the one rule every
step follows; README, "Artifacts"). A result made from too little data, or one that does not beat
``ar`` where the step can measure that, is written beside the default path and named so
(:meth:`~selfspec_cli.artifacts.ArtifactSpec.set_aside`: ``*.below-ar.json``, ``*.unusable``,
``*.too-little-data``), where no loader looks, with one warning line; ``--force`` makes it the
default on purpose, and an explicit ``--output`` is written as asked (the warning still says what it
is). The same command run again replaces its own set-aside file.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Any

from ..artifacts import ArtifactSpec, environment_info
from ..config import GenerationConfig
from ..engine import Engine
from ..jsonio import JsonObject


@dataclass(frozen=True)
class OfflineStep:
    command: str  # "calibrate" or "train-heads"
    name: str  # the value of --method (calibrate) or --kind (train-heads)
    artifact: ArtifactSpec
    module: str  # absolute module name: its prepare(options) and run(job)
    num_prompts: int = 8  # defaults of --num-prompts and --max-new-tokens for this step
    max_new_tokens: int = 32
    min_prompts: int = 1  # fewer prompts are refused before the model loads (a trainer's three disjoint splits: 3)
    Options: type | None = None  # a frozen dataclass: the options only this step takes, each field an option()
    #   (help metadata, default None: not given); the command's flags are made from it (cli/offline.py)

    @property
    def options(self) -> tuple[str, ...]:
        """The names of the options only this step takes."""
        return tuple(f.name for f in fields(self.Options)) if self.Options is not None else ()

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def prepare(self, options: JsonObject) -> Any:
        return getattr(self.load(), "prepare", lambda _o: None)(options)


@dataclass
class OfflineJob:
    """Everything an offline step's ``run`` gets from its command."""

    engine: Engine
    tokenizer: Any
    prompt_ids: list[list[int]]
    gen: GenerationConfig  # max_new_tokens and the model's end-of-sequence tokens
    output: Path  # checked already (unless the setting does not write)
    explicit_output: bool  # --output was given (a Self-SD set below ar then keeps that path)
    force: bool
    prompts: JsonObject  # provenance recorded in the manifest: source, count, sha256, ...
    setting: Any  # what prepare() returned
    log: Callable[[str], None]  # stderr, rich markup allowed
    progress: Callable[[], Any]  # a context manager giving a bar with add_task/update (rich's Progress)
    argv: list[str] = field(default_factory=list)  # this command line (Self-SD's --workers start helpers with it)
    exit_note: Callable[[str], None] = lambda _m: None  # said on stderr when the command is interrupted

    @property
    def model(self) -> Any:
        return self.engine.model

    def destination(self, spec: ArtifactSpec, throwaway: str | None, tag: str) -> Path:
        """Where this step's result goes (the module docstring's rule). ``throwaway``: why the result may not
        become the default (None: it may); ``tag``: its name beside the default path."""
        if throwaway is None or self.explicit_output or self.force:
            return self.output
        return spec.check_output(spec.set_aside(self.output, tag), True)  # its own earlier result is replaced

    def warn_throwaway(self, out: Path, throwaway: str, advice: str) -> None:
        """The one warning line of a throwaway result written to ``out`` (by :meth:`destination`)."""
        where = (f"'{out}' is of no use as a default; it was written where --output asked" if self.explicit_output else
                 "it was made this model's default because of --force" if self.force else
                 "it was not made this model's default (generate keeps the previous one)")
        rm = f"rm -r '{out}'" if out.is_dir() else f"rm '{out}'"
        self.log(f"[bold yellow]warning: {throwaway}, so {where}; {advice}"
                 + ("" if self.explicit_output or self.force else ", or pass --force to make it the default anyway")
                 + f"; delete it with {rm}[/bold yellow]")

    def publish(self, spec: ArtifactSpec, manifest: JsonObject, throwaway: str | None, tag: str,
                advice: Callable[[Path], str], said: Sequence[str] = ()) -> Path:
        """Write ``manifest`` for this job's model through ``spec`` where :meth:`destination` says, log ``said``
        and the path written, then the throwaway warning (:meth:`warn_throwaway`, with ``advice(path)``) when there
        is one. The path written."""
        out = self.destination(spec, throwaway, tag)
        spec.save(out, self.model, manifest)
        for line in said:
            self.log(line)
        self.log(f"wrote {out}")
        if throwaway is not None:
            self.warn_throwaway(out, throwaway, advice(out))
        return out

    def environment(self) -> JsonObject:
        return environment_info(self.engine.device, self.engine.dtype)

