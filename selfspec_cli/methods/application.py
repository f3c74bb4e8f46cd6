"""The application layer (docs/design.md, "Layers and import direction"): open a method on a model, and
decode prompts with it. ``generate`` and ``chat`` open their method with :func:`open_method`; ``generate``,
``chat`` and ``bench`` decode with :func:`decode_prompts`; ``calibrate`` and ``train-heads`` run their offline
step with :func:`run_offline`. The commands only parse and print.

:func:`open_method` does, in this order, what every command that decodes with one method did on its own:
load the model (:meth:`Session.open <selfspec_cli.session.Session.open>`, without transformers where it can:
``lite``), give the generation config the model's end-of-sequence ids, refuse a prompt that does not fit the
context (before anything is built), make the engine on its target, build the method (recording the artifact
files it reads), and then, once, free the float matrices the target no longer reads
(:meth:`Engine.release_float_weights <selfspec_cli.engine.Engine.release_float_weights>`; docs/engine.md,
"Memory").

:func:`decode_prompts` decodes each prompt's turns with one ``generate`` callable (a method's, or a bench
contender's) into one record each (:func:`selfspec_cli.runtime.run_prompt`: the record's fields and its timing),
telling the caller's :class:`DecodeHooks` as it goes: a prompt starts, a turn starts, a long prefill's chunks, the
tokens each round keeps, a turn ends, a record is finished.

:func:`run_offline` opens the model for an offline step (methods/offline.py) once the command has checked its
options: the artifact's default path checked before the slow part, the prompts checked against the context and
encoded (their provenance kept for the manifest), then the step's ``run`` on an :class:`OfflineJob`.

Invariants: the tokens are the method's own (this module only calls ``generate`` with the config it is given);
the float weights are released only after the method is built, never before a draft has read them; nothing here
prints (a command hears of the run through its hooks, so rich stays in cli/).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import recording_loads
from ..config import GenerationConfig
from ..decoding.output import DecodeResult, OutputRecord
from ..decoding.state import PREFILL_PROGRESS
from ..engine import Engine
from ..prompts import Prompt, prompts_digest
from ..runtime import run_prompt
from ..session import Session
from . import build
from .base import Method
from .offline import OfflineJob, OfflineStep

Generate = Callable[..., DecodeResult]  # generate(prompt_ids, cfg[, on_tokens=...]) -> DecodeResult
Progress = Callable[[int, int], None]  # a prefill's progress: (prompt tokens done, total)


@dataclass
class Opened:
    """A method opened on a model: its session and engine, the generation config with the model's
    end-of-sequence ids, the artifact files the build read (kind -> path) and the bytes of float
    matrices released after it."""

    session: Session
    engine: Engine
    method: Method
    name: str
    cfg: GenerationConfig
    artifacts: dict[str, str] = field(default_factory=dict)
    freed: int = 0

    def decode(self, prompts: Iterable[Prompt], hooks: DecodeHooks | None = None,
               history: list[dict[str, str]] | None = None) -> list[OutputRecord]:
        """:func:`decode_prompts` with this method, on its session's tokenizer, chat template and device."""
        return decode_prompts(self.method.generate, prompts, self.session.tokenizer, self.cfg, self.engine.device,
                              self.name, chat_template=self.session.chat_template, lossless=self.method.lossless,
                              hooks=hooks, history=history)


def open_method(model: str | None, name: str, config: Any = None, *, cfg: GenerationConfig,
                prompts: Sequence[Prompt] = (), dtype: str = "auto", device: str = "auto", chat_template: bool = True,
                target_precision: str = "auto",
                check: Callable[[Session, GenerationConfig], None] | None = None) -> Opened:
    """Method ``name`` (built from ``config``; None: its defaults) on ``model`` (a name, directory, hub id or
    .gguf; None: the default), with ``cfg`` given the model's end-of-sequence ids. ``prompts`` are checked
    against the context and ``check(session, cfg)`` runs (a command's own refusal) after the model loads and
    before the engine is made; then the method is built and the float weights are released once."""
    session = Session.open(model, dtype=dtype, device=device, chat_template=chat_template, lite=True)
    cfg = session.generation(cfg)
    session.check_fits(prompts, cfg)
    if check is not None:
        check(session, cfg)
    engine = session.engine(target_precision)
    with recording_loads() as used:
        meth = build(name, engine, session.tokenizer, config)
    # every draft is built: the float matrices a block or packed-panel target no longer reads go (docs/engine.md, Memory)
    freed = engine.release_float_weights(panels=True)
    return Opened(session, engine, meth, name, cfg, dict(used), freed)


class DecodeHooks:
    """What a caller hears while :func:`decode_prompts` runs; every hook does nothing here (a caller
    overrides the ones it needs). With hooks, ``generate`` is called with ``on_tokens``."""

    def prompt_started(self, index: int, prompt: Prompt) -> None:
        """Prompt number ``index`` (from 0) starts."""

    def turn_started(self, prompt: Prompt, turn: int, prompt_tokens: int) -> Progress | None:
        """Turn ``turn`` (from 0) of ``prompt`` starts with ``prompt_tokens`` to prefill; a callable returned
        hears of each prefill chunk (decoding/state.py, PREFILL_PROGRESS)."""
        return None

    def kept(self, prompt: Prompt, tokens: list[int]) -> None:
        """A round kept ``tokens``."""

    def turn_ended(self, prompt: Prompt, result: DecodeResult) -> None:
        """The turn is decoded (inside its timed span, as the tokens' printing is)."""

    def record(self, prompt: Prompt, record: OutputRecord) -> None:
        """The prompt's record is finished (a caller that writes it adds its own fields to the copy it writes)."""


def decode_prompts(generate: Generate, prompts: Iterable[Prompt], tokenizer: Any, cfg: GenerationConfig, device: Any,
                   name: str, *, chat_template: bool = True, lossless: bool = True, hooks: DecodeHooks | None = None,
                   history: list[dict[str, str]] | None = None) -> list[OutputRecord]:
    """Decode every prompt in order with ``generate``, one record each (returned in order, and each handed
    to ``hooks.record`` as it finishes). ``history``: the conversation before each prompt's first turn, which
    its turns extend (chat); None: every prompt starts a conversation of its own."""
    records = []
    for i, prompt in enumerate(prompts):
        call = generate
        if hooks is not None:
            hooks.prompt_started(i, prompt)
            call = _heard(generate, prompt, hooks)
        rec = run_prompt(call, tokenizer, prompt, cfg, device, name, chat_template, lossless, history)
        if hooks is not None:
            hooks.record(prompt, rec)
        records.append(rec)
    return records


def _heard(generate: Generate, prompt: Prompt, hooks: DecodeHooks) -> Generate:
    """``generate`` for ``prompt``'s turns, telling ``hooks`` as it goes."""
    turns = [0]

    def kept(tokens: list[int]) -> None:
        hooks.kept(prompt, tokens)

    def call(ids: list[int], c: GenerationConfig) -> DecodeResult:
        progress = hooks.turn_started(prompt, turns[0], len(ids))
        token = PREFILL_PROGRESS.set(progress) if progress is not None else None
        try:
            res = generate(ids, c, on_tokens=kept)
        finally:
            if token is not None:
                PREFILL_PROGRESS.reset(token)
        turns[0] += 1
        hooks.turn_ended(prompt, res)
        return res

    return call


@dataclass(frozen=True)
class OfflineInputs:
    """What an offline step runs on, as its command checked it: the model and how it is read, the prompt texts
    and where they came from (``dataset_field``: set when they came from a dataset), the tokens generated per
    prompt, the artifact path asked (None: the artifact's default) and whether an existing one is replaced."""

    model: str | None
    texts: list[str]
    source: str | None
    dataset_field: str | None
    max_new_tokens: int
    output: Path | None
    force: bool
    chat_template: bool = True
    dtype: str = "auto"
    device: str = "auto"
    target_precision: str = "auto"


def run_offline(step: OfflineStep, setting: Any, inputs: OfflineInputs, *, log: Callable[[str], None],
                progress: Callable[[], Any], argv: list[str], exit_note: Callable[[str], None]) -> Any:
    """Open the model and run ``step`` (with ``setting``, what its ``prepare`` returned) on ``inputs``; its
    summary (None: it has none to print). ``log``, ``progress`` and ``exit_note`` are the command's console."""
    writes = getattr(setting, "writes", True)  # False: a --workers helper, which never writes
    # lite: a GGUF's matrices stay in its blocks, as for generate (the 1.5B model's calibration held 8.5 GB
    # of float32 weights through transformers' loader); every step reads the model through the engine
    session = Session.open(inputs.model, dtype=inputs.dtype, device=inputs.device, chat_template=inputs.chat_template,
                           lite=True)
    out_path = inputs.output or step.artifact.default_path(session.model)
    if writes:
        step.artifact.check_output(out_path, inputs.force)  # before the slow part
    gen = session.generation(GenerationConfig(max_new_tokens=inputs.max_new_tokens))
    turns = [Prompt(id=i + 1, turns=(t,)) for i, t in enumerate(inputs.texts)]
    session.check_fits(turns, gen)
    prompt_ids = session.encode_first_turns(turns)
    prompts = {"source": inputs.source, "num_prompts": len(prompt_ids), "sha256": prompts_digest(prompt_ids),
               "chat_template": inputs.chat_template,
               **({"dataset_field": inputs.dataset_field} if inputs.dataset_field is not None else {})}
    job = OfflineJob(session.engine(inputs.target_precision), session.tokenizer, prompt_ids, gen, out_path,
                     inputs.output is not None, inputs.force, prompts, setting, log, progress, argv, exit_note)
    return step.load().run(job)
