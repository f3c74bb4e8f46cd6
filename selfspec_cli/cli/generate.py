"""``selfspec generate``: decode every prompt of a file (or given with ``--prompt``) with one method; JSONL out."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import click
import typer

from ..artifacts import check_new_artifact, recording_loads
from ..config import GenerationConfig, check_seed
from ..decoding import cost_store
from ..decoding.state import PREFILL_PROGRESS
from ..engine.target import TARGET_PRECISIONS
from ..errors import ConfigError, FieldError, count
from ..loading import config_num_layers, resolve_model_path
from ..methods import METHODS, Method, build
from ..prompts import PROMPT_FORMATS, Prompt, prompts_from_texts, read_prompts
from ..runtime import run_prompt
from ..session import Session, apply_threads, check_device
from . import options as opt
from .method_options import check_layer_ids, flag_error, generation_config, given_options, method_config, with_method_options
from ..config import check_choice
from .resume import check_append, prompt_sha, resume as resume_output, run_settings
from .streaming import TextStreamer, write_out
from .common import OutputClosed, check_output, log, output_stream, progress, set_exit_note, signals_held, write_record
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
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Exact upper bound on generated tokens per turn."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p(),
    top_k: int = opt.top_k(),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling (reproducible)."),
    sampling_rule: str = opt.sampling_rule(),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); the output keeps it."),
    chat_template: bool = opt.chat_template(),
    dtype: str = opt.dtype(),
    target_precision: str = opt.target_precision(),
    device: str = opt.device(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write JSONL here instead of stdout: streamed into <output>.<random>.partial beside it, which replaces it at the end (kept, and named, if the run stops early). Never the prompt file."),
    force: bool = opt.force("Replace an existing --output (or --save-layers artifact)."),
    append: bool = typer.Option(False, "--append", help="Add the records to the end of an existing --output instead of refusing."),
    resume: bool = typer.Option(False, "--resume", help="Carry on --output: decode only the prompts whose records it (or the .partial file an interrupted run kept beside it) does not hold yet, and add theirs."),
    threads: Optional[str] = opt.threads(),
    save_layers: Optional[Path] = typer.Option(None, "--save-layers", help="swift: write the skip set found as an artifact that --method self-sd --layers can load."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Print each prompt's text as its tokens come (default: when stdout is a terminal and no --output) instead of JSONL records; --no-stream keeps JSONL on a terminal too."),
    **method_options: Any,
) -> None:
    """Generate a continuation for every prompt; one JSON object per prompt, flushed as it finishes.
    Every method is lossless except specee (LOSSY: its records say lossless false)."""
    _check_prompt_options(ctx, prompt_file, prompt_texts, prompt_format)
    check_choice(method, METHODS, "--method")
    check_seed(seed)  # before the methods' configs take it
    given = given_options(ctx, method_options)
    method_cfg = method_config(method, given, seed=seed)  # validates before any loading
    cfg = generation_config(method, max_new_tokens, temperature, top_k, top_p, seed, sampling_rule, stop)
    _check_output_options(output, force, append, save_layers, method, resume)
    _streaming(stream, output)  # a conflict is refused before any loading
    check_choice(prompt_format, PROMPT_FORMATS, "--prompt-format")
    check_choice(target_precision, TARGET_PRECISIONS, "--target-precision")
    n_threads = apply_threads(threads)
    append = append or resume
    check_output(output, force=force, append=append, inputs=(prompt_file,))  # before any work
    prompts = prompts_from_texts(prompt_texts) if prompt_texts else read_prompts(prompt_file, prompt_format)
    settings = _settings(model, method, method_cfg, given, cfg, chat_template, dtype, device, target_precision)
    if not (prompts := _to_decode(output, prompts, method, settings, resume, append, bool(prompt_texts))):
        return
    session = Session.open(model, dtype=dtype, device=device, chat_template=chat_template, lite=True)
    cfg = session.generation(cfg)
    session.check_fits(prompts, cfg)
    engine = session.engine(target_precision)
    meth, used = _build(method, engine, session, method_cfg, len(prompts))
    if _streaming(stream, output):
        pace = _stream_all(session, meth, method, prompts, cfg, engine.device)
    else:
        with output_stream(output, force=force, append=append, inputs=(prompt_file,)) as out:
            pace = _decode_all(out, session, meth, method, prompts, cfg, engine.device, n_threads, used, settings)
    _log_pace(meth, method, engine, pace, session, cfg.max_new_tokens)
    if save_layers is not None:
        _save_layers(meth, save_layers)


def _settings(model: str | None, method: str, method_cfg: Any, given: dict[str, Any], cfg: GenerationConfig,
              chat_template: bool, dtype: str, device: str, target_precision: str) -> dict[str, Any]:
    """The options checked against the model's config.json (no weights loaded yet), then the run's settings,
    which every record keeps and --resume checks (cli/resume.py)."""
    check_device(dtype, device)  # a bad --dtype or --device before anything is read
    where = resolve_model_path(model, log)  # a GGUF is converted here, once (the first time)
    check_layer_ids(method_cfg, config_num_layers(where))
    return run_settings(where, cfg, chat_template=chat_template, dtype=dtype, device=device,
                        target_precision=target_precision, lossy_options=None if METHODS[method].lossless else given)


def _build(method: str, engine: Any, session: Session, method_cfg: Any, n_prompts: int) -> tuple[Method, dict[str, str]]:
    """The method on the engine, and the artifact files it read (named on stderr and in each record)."""
    try:
        with recording_loads() as used:
            meth = build(method, engine, session.tokenizer, method_cfg)
    except FieldError as exc:  # a field checked against the model (layer ids out of range, ...)
        raise flag_error(exc) from None
    # every draft is built: the float matrices a block or packed-panel target no longer reads go (docs/engine.md, Memory)
    freed = engine.release_float_weights(panels=True)
    mdl = session.model
    log(f"[dim]model {mdl.config.model_type} {mdl.config.num_hidden_layers} layers, {engine.dtype}, {engine.device}; "
        f"target {engine.target_precision}{f' ({freed / 2**20:.0f} MB of float matrices freed)' if freed else ''}; "
        f"method {method}; {count(n_prompts, 'prompt')}[/dim]")
    for kind, path in used.items():
        log(f"[dim]using {kind} {path}[/dim]")
    return meth, dict(used)


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


def _decode_all(out: Any, session: Session, meth: Method, method: str, prompts: list[Prompt], cfg: GenerationConfig,
                device: Any, n_threads: int, used: dict[str, str], settings: dict[str, Any]) -> Pace:
    """Decode every prompt, one record each into ``out`` (above the bar on a terminal); the totals."""
    pace = Pace()
    with progress() as bar:
        task = bar.add_task("generate", total=len(prompts), info="")
        for p in prompts:
            made = [0]  # this prompt's tokens so far: the bar moves per round, not only per prompt

            def generate(ids: list[int], c: GenerationConfig) -> Any:
                def kept(tokens: list[int]) -> None:
                    made[0] += len(tokens)
                    bar.update(task, info=f"{p.id}: {made[0]} tokens")

                if len(ids) < LONG_PROMPT:
                    return meth.generate(ids, c, kept)
                # its prefill takes a while (82 s for 6,034 tokens on a busy 2-core host): said, then counted per chunk
                bar.update(task, info=f"{p.id}: prefilling {len(ids)} tokens")
                log(f"[dim]{p.id}: prefilling {count(len(ids), 'prompt token')} before the first new token[/dim]")

                def prefilled(done: int, total: int) -> None:
                    bar.update(task, info=f"{p.id}: prefilled {done}/{total} prompt tokens")

                token = PREFILL_PROGRESS.set(prefilled)
                try:
                    return meth.generate(ids, c, kept)
                finally:
                    PREFILL_PROGRESS.reset(token)

            rec = run_prompt(generate, session.tokenizer, p, cfg, device, method, session.chat_template, meth.lossless)
            rec["threads"] = n_threads
            rec["prompt_sha256"] = prompt_sha(p)  # what --resume matches a record by, beside its id
            rec["settings"] = settings  # and what it checks the record was made with (cli/resume.py)
            if used:
                rec["artifacts"] = dict(used)
            with signals_held():  # the record and the note that counts it, together
                write_record(out, rec, bar)  # on a terminal: above the bar, never on its line
                pace.add(rec)
                # what an interrupt keeps (cli/exits.py); an --output's partial file says it itself (output_stream)
                where = "stdout" if out is sys.stdout else f"'{getattr(out, 'name', 'the output')}'"
                set_exit_note(f"{count(pace.records, 'finished record')} {'was' if pace.records == 1 else 'were'} "
                              f"written to {where}")
            bar.update(task, advance=1, info=f"{pace.tokens / max(pace.seconds, 1e-9):.1f} tok/s")
    return pace


def _streaming(stream: bool | None, output: Path | None) -> bool:
    """Whether the text is printed as it comes (see --stream) rather than as JSONL records."""
    to_stdout = output is None or str(output) == "-"
    if stream and not to_stdout:
        raise ConfigError("--stream prints text to the terminal and --output writes JSONL records; drop one of them")
    return to_stdout and sys.stdout.isatty() if stream is None else stream


def _stream_all(session: Session, meth: Method, method: str, prompts: list[Prompt], cfg: GenerationConfig,
                device: Any) -> Pace:
    """Print each prompt's text to stdout as its tokens come (a header per prompt when there are several;
    turns apart by a blank line); no progress bar, the text is the progress. The totals."""
    pace = Pace()
    tok = session.tokenizer
    for i, p in enumerate(prompts):
        if len(prompts) > 1:
            write_out(("\n" if i else "") + f"--- {p.id}\n")
        printer = TextStreamer(tok, write_out)

        def generate(ids: list[int], c: GenerationConfig, pr: TextStreamer = printer) -> Any:
            if pr.turns:  # a later turn of the conversation
                write_out("\n\n")
            res = meth.generate(ids, c, on_tokens=pr.push)
            pr.end(torn=res.finish_reason == "length")
            return res

        rec = run_prompt(generate, tok, p, cfg, device, method, session.chat_template, meth.lossless)
        write_out("\n")
        pace.add(rec)
        set_exit_note(f"the text of {count(pace.records, 'finished prompt')} was printed (--stream keeps no records)")
    return pace


def _log_pace(meth: Method, method: str, engine: Any, pace: Pace, session: Session, budget: int) -> None:
    """The summary line (cli/summary.py): measured figures, ar's pace only as a labelled prediction; before it,
    once, the note of a speculative method that drafted in no round."""
    up = session.startup()
    start = (f"model loaded in {up['model_load_s']:.1f} s (ready {up['model_ready_s']:.1f} s after the process "
             f"started), peak RSS {up['peak_rss_mb']:.0f} MB")
    target = engine.target_precision
    if pace.seconds <= 0:
        log(f"[dim]{method}, target {target}: {start}[/dim]")
        return
    speculative = method != "ar" and meth.lossless
    if speculative and (note := no_draft_note(method, pace, _best_gain(meth, budget),
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
