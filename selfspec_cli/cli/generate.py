"""``selfspec generate``: decode every prompt of a file (or given with ``--prompt``) with one method; JSONL out.

The command parses and prints: its flags are checked before any loading, in one order; the method is opened
(:func:`selfspec_cli.methods.application.open_method`) and decodes the prompts
(:func:`~selfspec_cli.methods.application.decode_prompts`), and this module hears of the run through hooks that
draw the bar, write the records or print the text as it comes."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import IO, Any, Optional

import click
import typer
from rich.progress import Progress, TaskID

from ..artifacts import check_new_artifact
from ..config import check_choice
from ..decoding import cost_store
from ..decoding.output import DecodeResult, OutputRecord
from ..engine.target import TARGET_PRECISIONS
from ..errors import ConfigError, FieldError, count
from ..loading import config_num_layers, resolve_model_path
from ..methods import Method
from ..methods.application import DecodeHooks, Opened, open_method
from ..prompts import PROMPT_FORMATS, Prompt, prompts_from_texts, read_prompts
from ..session import apply_threads, check_device
from . import options as opt
from .method_options import MethodChoice, check_layer_ids, choose_method, flag_error, given_options, with_method_options
from .resume import check_append, prompt_sha, resume as resume_output, run_settings
from .streaming import TextStreamer, write_out
from .common import check_output, log, output_stream, progress, set_exit_note, signals_held, write_record
from .summary import Pace, no_draft_note

LONG_PROMPT = 256  # prompt tokens from which a turn's prefill is said on stderr before it starts (issue 50)


@with_method_options
def generate(
    ctx: typer.Context,
    prompt_file: Optional[str] = opt.prompt_file("Plain text (one prompt per line) or JSONL with 'prompt' or 'turns'; '-' reads stdin. This or --prompt is required."),
    prompt_texts: list[str] = typer.Option([], "--prompt", "-P", help="A prompt given as text (repeatable; the records' ids are 1, 2, ... in order), instead of --prompt-file."),
    prompt_format: str = opt.prompt_format("auto (JSONL when the name ends in .jsonl/.json or the first line starts with '{'), text (one prompt per line) or jsonl."),
    model: Optional[str] = opt.model(),
    method: str = opt.method(),
    max_new_tokens: int = opt.max_new_tokens(128, "Exact upper bound on generated tokens per turn."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    seed: int = opt.seed("Seed for sampling (reproducible)."),
    sampling_rule: str = opt.sampling_rule(),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); the output keeps it."),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
    output: Optional[Path] = opt.output("Write JSONL here instead of stdout: streamed into <output>.<random>.partial beside it, which replaces it at the end (kept, and named, if the run stops early). Never the prompt file."),
    force: bool = opt.force("Replace an existing --output (or --save-layers artifact)."),
    append: bool = typer.Option(False, "--append", help="Add the records to the end of an existing --output instead of refusing."),
    resume: bool = opt.resume("Carry on --output: decode only the prompts whose records it (or the .partial file an interrupted run kept beside it) does not hold yet, and add theirs."),
    threads: Optional[str] = opt.threads(),
    save_layers: Optional[Path] = typer.Option(None, "--save-layers", help="swift: write the skip set found as an artifact that --method self-sd --layers can load."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Print each prompt's text as its tokens come (default: when stdout is a terminal and no --output) instead of JSONL records; --no-stream keeps JSONL on a terminal too."),
    **method_options: Any,
) -> None:
    """Generate a continuation for every prompt; one JSON object per prompt, flushed as it finishes.
    Every method is lossless except specee (LOSSY: its records say lossless false)."""
    _check_prompt_options(ctx, prompt_file, prompt_texts, prompt_format)
    choice = choose_method(method, seed, max_new_tokens, temperature, top_k, top_p, sampling_rule, stop,
                           given=given_options(ctx, method_options))
    _check_output_options(output, force, append, save_layers, method, resume)
    streaming = _streaming(stream, output)  # a conflict is refused before any loading
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    n_threads = apply_threads(threads)
    append = append or resume
    check_output(output, force=force, append=append, inputs=(prompt_file,))  # before any work
    prompts = prompts_from_texts(prompt_texts) if prompt_texts else read_prompts(prompt_file, prompt_format)
    settings = _settings(model, choice, chat_template, dtype, device, target_precision)
    if not (prompts := _to_decode(output, prompts, method, settings, resume, append, bool(prompt_texts))):
        return
    opened = _open(model, choice, prompts, dtype, device, chat_template, target_precision)
    if streaming:
        pace = _stream_all(opened, prompts)
    else:
        with output_stream(output, force=force, append=append, inputs=(prompt_file,)) as out:
            pace = _decode_all(out, opened, prompts, n_threads, settings)
    _log_pace(opened, pace)
    if save_layers is not None:
        _save_layers(opened.method, save_layers)


def _settings(model: str | None, choice: MethodChoice, chat_template: bool, dtype: str, device: str,
              target_precision: str) -> dict[str, Any]:
    """The options checked against the model's config.json (no weights loaded yet), then the run's settings,
    which every record keeps and --resume checks (cli/resume.py)."""
    check_device(dtype, device)  # a bad --dtype or --device before anything is read
    where = resolve_model_path(model, log)  # a GGUF is converted here, once (the first time)
    check_layer_ids(choice.config, config_num_layers(where))
    return run_settings(where, choice.generation, chat_template=chat_template, dtype=dtype, device=device,
                        target_precision=target_precision, lossy_options=None if choice.lossless else choice.given)


def _open(model: str | None, choice: MethodChoice, prompts: list[Prompt], dtype: str, device: str, chat_template: bool,
          target_precision: str) -> Opened:
    """The method opened on the model (a field checked against it, such as a layer id out of range, is one line
    naming its flag); the model, target and method on stderr, and the artifact files the method read."""
    try:
        opened = open_method(model, choice.name, choice.config, cfg=choice.generation, prompts=prompts, dtype=dtype,
                             device=device, chat_template=chat_template, target_precision=target_precision)
    except FieldError as exc:  # a field checked against the model (layer ids out of range, ...)
        raise flag_error(exc) from None
    engine, freed, mdl = opened.engine, opened.freed, opened.session.model
    log(f"[dim]model {mdl.config.model_type} {mdl.config.num_hidden_layers} layers, {engine.dtype}, {engine.device}; "
        f"target {engine.target_precision}{f' ({freed / 2**20:.0f} MB of float matrices freed)' if freed else ''}; "
        f"method {choice.name}; {count(len(prompts), 'prompt')}[/dim]")
    for kind, path in opened.artifacts.items():
        log(f"[dim]using {kind} {path}[/dim]")
    return opened


def _check_prompt_options(ctx: typer.Context, prompt_file: str | None, prompt_texts: list[str], prompt_format: str) -> None:
    if prompt_file is None and not prompt_texts:  # worded as click words a missing option
        raise click.UsageError("Missing option '--prompt-file' / '-p' (a file; '-' reads stdin) or '--prompt' / '-P' "
                               "(text, repeatable)", ctx=ctx)
    if prompt_file is not None and prompt_texts:
        raise ConfigError("--prompt-file and --prompt both give the prompts; pass one of them")
    if prompt_texts and prompt_format != "auto":
        raise ConfigError("--prompt-format is an option of --prompt-file, not of --prompt; drop it")


def _to_decode(output: Path | None, prompts: list[Prompt], method: str, settings: dict[str, Any], resume: bool,
               append: bool, numbered: bool) -> list[Prompt]:
    """The prompts still to decode: --resume's remainder, or with --append the prompts checked against the ids the
    file holds (``numbered``: --prompt texts, numbered after them)."""
    if resume:
        return _resumed(output, prompts, method, settings)
    return check_append(output, prompts, numbered=numbered) if append else prompts


def _resumed(output: Path, prompts: list[Prompt], method: str, settings: dict[str, Any]) -> list[Prompt]:
    """--resume: the prompts still to decode (an interrupted run's kept records moved into --output first)."""
    todo, held = resume_output(output, prompts, method, settings)
    log(f"[dim]--resume: '{output}' holds {held} of {len(prompts)} prompts' records"
        + (f"; decoding the other {len(todo)}[/dim]" if todo else "; nothing to decode[/dim]"))
    return todo


def _check_output_options(output: Path | None, force: bool, append: bool, save_layers: Path | None, method: str,
                          resume: bool = False) -> None:
    if resume and (output is None or str(output) == "-"):
        raise ConfigError("--resume carries on an --output FILE, and without it the records go to stdout; pass --output FILE")
    if resume and (force or append):
        raise ConfigError(f"--resume adds to --output; drop {'--force' if force else '--append'}")
    if save_layers is not None:
        if method != "swift":
            raise ConfigError(f"--save-layers is an option of --method swift, not of '{method}'; drop it or choose swift")
        check_new_artifact(save_layers, force, "--save-layers")
    if output is None or str(output) == "-":  # the records go to stdout: nothing to replace or add to
        for flag, given in (("--append", append), ("--force", force and save_layers is None)):
            if given:
                raise ConfigError(f"{flag} applies to --output FILE, and without it the records go to stdout; "
                                  f"drop {flag} or pass --output FILE")


class _Records(DecodeHooks):
    """generate's records: each written into ``out`` (above the bar on a terminal) with the run's fields, the bar
    moved per round (a long prompt's prefill said first, then counted per chunk), the totals kept in ``pace``."""

    def __init__(self, out: IO[str], bar: Progress, task: TaskID, n_threads: int, used: dict[str, str],
                 settings: dict[str, Any]) -> None:
        self.out, self.bar, self.task, self.n_threads, self.used, self.settings = out, bar, task, n_threads, used, settings
        self.pace = Pace()
        self.made = 0  # this prompt's tokens so far: the bar moves per round, not only per prompt

    def prompt_started(self, index: int, prompt: Prompt) -> None:
        self.made = 0

    def turn_started(self, prompt: Prompt, turn: int, prompt_tokens: int) -> Any:
        if prompt_tokens < LONG_PROMPT:
            return None
        # its prefill takes a while (82 s for 6,034 tokens on a busy 2-core host): said, then counted per chunk
        self.bar.update(self.task, info=f"{prompt.id}: prefilling {prompt_tokens} tokens")
        log(f"[dim]{prompt.id}: prefilling {count(prompt_tokens, 'prompt token')} before the first new token[/dim]")

        def prefilled(done: int, total: int) -> None:
            self.bar.update(self.task, info=f"{prompt.id}: prefilled {done}/{total} prompt tokens")

        return prefilled

    def kept(self, prompt: Prompt, tokens: list[int]) -> None:
        self.made += len(tokens)
        self.bar.update(self.task, info=f"{prompt.id}: {self.made} tokens")

    def record(self, prompt: Prompt, rec: OutputRecord) -> None:
        # prompt_sha256: what --resume matches a record by, beside its id; settings: what it checks the record
        # was made with (cli/resume.py)
        rec = dataclasses.replace(rec, threads=self.n_threads, prompt_sha256=prompt_sha(prompt), settings=self.settings,
                                  artifacts=dict(self.used) if self.used else None)
        pace, out = self.pace, self.out
        with signals_held():  # the record and the note that counts it, together
            write_record(out, rec.to_dict(), self.bar)  # on a terminal: above the bar, never on its line
            pace.add(rec)
            # what an interrupt keeps (cli/exits.py); an --output's partial file says it itself (output_stream)
            where = "stdout" if out is sys.stdout else f"'{getattr(out, 'name', 'the output')}'"
            set_exit_note(f"{count(pace.records, 'finished record')} {'was' if pace.records == 1 else 'were'} "
                          f"written to {where}")
        self.bar.update(self.task, advance=1, info=f"{pace.tokens / max(pace.seconds, 1e-9):.1f} tok/s")


def _decode_all(out: IO[str], opened: Opened, prompts: list[Prompt], n_threads: int, settings: dict[str, Any]) -> Pace:
    """Decode every prompt, one record each into ``out`` (above the bar on a terminal); the totals."""
    with progress() as bar:
        task = bar.add_task("generate", total=len(prompts), info="")
        hooks = _Records(out, bar, task, n_threads, opened.artifacts, settings)
        opened.decode(prompts, hooks)
    return hooks.pace


def _streaming(stream: bool | None, output: Path | None) -> bool:
    """Whether the text is printed as it comes (see --stream) rather than as JSONL records."""
    to_stdout = output is None or str(output) == "-"
    if stream and not to_stdout:
        raise ConfigError("--stream prints text to the terminal and --output writes JSONL records; drop one of them")
    return to_stdout and sys.stdout.isatty() if stream is None else stream


class _Printed(DecodeHooks):
    """--stream: each prompt's text printed to stdout as its tokens come (a header per prompt when there are
    several; turns apart by a blank line); the totals kept in ``pace``."""

    def __init__(self, tokenizer: Any, many: bool) -> None:
        self.tokenizer, self.many = tokenizer, many
        self.pace = Pace()
        self.printer = TextStreamer(tokenizer, write_out)

    def prompt_started(self, index: int, prompt: Prompt) -> None:
        if self.many:
            write_out(("\n" if index else "") + f"--- {prompt.id}\n")
        self.printer = TextStreamer(self.tokenizer, write_out)

    def turn_started(self, prompt: Prompt, turn: int, prompt_tokens: int) -> None:
        if turn:  # a later turn of the conversation
            write_out("\n\n")

    def kept(self, prompt: Prompt, tokens: list[int]) -> None:
        self.printer.push(tokens)

    def turn_ended(self, prompt: Prompt, result: DecodeResult) -> None:
        self.printer.end(torn=result.finish_reason == "length")

    def record(self, prompt: Prompt, rec: OutputRecord) -> None:
        write_out("\n")
        self.pace.add(rec)
        set_exit_note(f"the text of {count(self.pace.records, 'finished prompt')} was printed (--stream keeps no "
                      "records)")


def _stream_all(opened: Opened, prompts: list[Prompt]) -> Pace:
    """Print each prompt's text as its tokens come; no progress bar, the text is the progress. The totals."""
    hooks = _Printed(opened.session.tokenizer, len(prompts) > 1)
    opened.decode(prompts, hooks)
    return hooks.pace


def _log_pace(opened: Opened, pace: Pace) -> None:
    """The summary line (cli/summary.py): measured figures, ar's pace only as a labelled prediction; before it,
    once, the note of a speculative method that drafted in no round."""
    meth, method, engine = opened.method, opened.name, opened.engine
    up = opened.session.startup()
    start = (f"model loaded in {up['model_load_s']:.1f} s (ready {up['model_ready_s']:.1f} s after the process "
             f"started), peak RSS {up['peak_rss_mb']:.0f} MB")
    target = engine.target_precision
    if pace.seconds <= 0:
        log(f"[dim]{method}, target {target}: {start}[/dim]")
        return
    speculative = method != "ar" and meth.lossless
    if speculative and (note := no_draft_note(method, pace, _best_gain(meth, opened.cfg.max_new_tokens),
                                              hasattr(meth.config, "paper_drafting"))):
        log(note)
    # the stored costs, when the method plans with them (its draft policy holds them)
    curve = meth.policy.curve if method != "ar" else None
    store = cost_store.describe(cost_store.engine_key(engine)) if curve is not None else None
    log(f"[dim]{method}, target {target}: {pace.line(curve, store, drafts=speculative)}; {start}[/dim]")


def _best_gain(meth: Method, budget: int) -> float | None:
    """The best expected gain of drafting the method's planner predicts now, at no particular context (None where
    the policy answers only for a decode state: prompt lookup's candidates come from the context)."""
    try:
        return meth.policy.gain(None, budget)
    except AttributeError:  # a source that needs the decode state (pld inside auto)
        return None


def _save_layers(meth: Method, save_layers: Path) -> None:
    if not meth.search_history():  # nothing searched: the file would hold the uniform starting set
        raise ConfigError(f"--save-layers: SWIFT's search evaluated no candidate in this run (too few tokens for its "
                          f"--context-window and --optimize-budget), so '{save_layers}' would hold only the unsearched "
                          "starting set and was not written; decode more (--max-new-tokens, more prompts) or raise "
                          "--optimize-budget")
    log(f"wrote skip-set artifact {meth.save_layers(save_layers)}")
