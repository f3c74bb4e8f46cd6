"""Entry point: ``selfspec <command>``. User errors, a failed write of the output among them,
become one line and exit status 2."""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click
import typer

from .. import __version__
from ..errors import SelfSpecError
from .bench import bench
from .exits import interrupt_line, interrupt_status
from .common import OutputClosed, OutputWriteError, invocation_args, pop_exit_note, set_invocation
from .calibrate import calibrate
from .chat import chat
from .generate import generate
from .profile import profile
from .train_heads import train_heads

app = typer.Typer(
    name="selfspec", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: wraps at any width where rich cuts option names ("--draft-thresho…")
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Lossless self-speculative decoding for Hugging Face causal LMs (no draft model, no weight changes).")


def _version(value: bool) -> None:
    if value:
        print(f"selfspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                       help="Print the version and exit.")) -> None:
    """Lossless self-speculative decoding for Hugging Face causal LMs (no draft model, no weight changes)."""
for _name, _command in (("generate", generate), ("bench", bench), ("calibrate", calibrate),
                        ("train-heads", train_heads), ("profile", profile), ("chat", chat)):
    app.command(_name)(_command)

# typer >= 0.20 ships its own copy of click, whose exceptions derive from the public
# typer.exceptions.TyperException (older typer raises click's own): catch both families
_CLICK_ERRORS: tuple[type[BaseException], ...] = (click.ClickException,) + tuple(
    c for c in (getattr(getattr(typer, "exceptions", None), "TyperException", None),) if c is not None)

_signals: list[int] = []


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM is handled like Ctrl-C: unwind (finished output is kept), one message, exit 143."""
    _signals.append(signum)
    raise KeyboardInterrupt


def _interrupted() -> int:
    print(interrupt_line(bool(_signals), pop_exit_note()), file=sys.stderr)
    return interrupt_status(bool(_signals))


def _rank_prefix() -> str:
    """Under torchrun every rank prints its own errors: each says which rank it is."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"rank {rank} of {world}: " if world.isdigit() and int(world) > 1 else ""


def _choices() -> dict[Any, tuple[str, ...]]:
    """Option (parameter name, or (command, name)) -> the values its help shows as its metavar."""
    from ..config import SAMPLING_RULES
    from ..engine.target import TARGET_PRECISIONS
    from ..methods import METHODS
    from ..methods.base import DRAFT_PRECISIONS
    from ..methods.self_sd.search import OBJECTIVES, SAMPLERS
    from ..methods.specee import KV_MODES
    from ..prompts import PROMPT_FORMATS
    from .calibrate import CALIBRATE_METHODS

    return {"prompt_format": PROMPT_FORMATS, "sampling_rule": SAMPLING_RULES, "target_precision": TARGET_PRECISIONS,
            "dtype": ("auto", "float32", "float16", "bfloat16"), "draft_precision": DRAFT_PRECISIONS,
            "objective": OBJECTIVES, "sampler": SAMPLERS, "specee_kv_mode": KV_MODES, "kind": ("lm-heads", "exit-mlp"),
            ("generate", "method"): tuple(METHODS), ("calibrate", "method"): tuple(CALIBRATE_METHODS)}


def _metavars(group: Any) -> None:
    """Help names each option's value by its choices where it has a few, else N, X, PATH or TEXT
    (rather than typer's type names, ``<str>``, ``<list[str]>``)."""
    choices = _choices()
    for cname, cmd in group.commands.items():
        for p in cmd.params:
            if p.param_type_name != "option" or getattr(p, "is_flag", False) or p.metavar is not None:
                continue
            values = choices.get((cname, p.name)) or choices.get(p.name)
            # typer's own (<int>, <float>, <path>, <str>, <list[str]>); before typer 0.16, click's type name
            shown = str(p.display_type(None) if hasattr(p, "display_type") else getattr(getattr(p, "type", None), "name", ""))
            p.metavar = "|".join(values) if values else next(
                (m for t, m in (("int", "N"), ("float", "X"), ("path", "PATH")) if t in shown), "TEXT")


def cli_command() -> Any:
    """The app's click command with its help's metavars (:func:`main`, and the kept help texts: cli/helptext.py)."""
    command = typer.main.get_command(app)
    _metavars(command)
    return command


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (also used by tests)."""
    command = cli_command()
    set_invocation(sys.argv[1:] if argv is None else argv)
    _signals.clear()
    pop_exit_note()
    try:
        old = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        old = None
    try:
        if not invocation_args():  # bare `selfspec`: the help on stderr, status 2 (as click's no_args_is_help)
            with command.make_context("selfspec", [], resilient_parsing=True) as ctx:
                print(ctx.get_help(), file=sys.stderr)
            return 2
        rv = command.main(args=argv, prog_name="selfspec", standalone_mode=False)
        if rv == 130:  # typer turns KeyboardInterrupt into Exit(130) and returns it silently
            return _interrupted()
        return rv if isinstance(rv, int) else 0
    except SelfSpecError as exc:
        note = pop_exit_note()
        print(f"selfspec: error: {_rank_prefix()}{exc}" + (f" ({note})" if note else ""), file=sys.stderr)
        if isinstance(exc, OutputWriteError) and exc.stdout:  # `> /dev/full`: drop what stdout still holds
            _quiet_stdout()
        return 2
    except (KeyboardInterrupt, click.exceptions.Abort, typer.Abort):
        return _interrupted()
    except _CLICK_ERRORS as exc:  # usage errors (missing or unknown option, bad type): one line, as every error
        ctx = getattr(exc, "ctx", None)
        where = f"'{ctx.command_path} --help'" if ctx is not None else "'selfspec --help'"
        print(f"selfspec: error: {' '.join(exc.format_message().split())} (see {where})", file=sys.stderr)
        return 2
    except (BrokenPipeError, OutputClosed):  # the reader closed the pipe (`| head -n1`): what it wanted was written
        _quiet_stdout()
        return 0
    except BaseException:
        note = pop_exit_note()
        if note:
            print(f"selfspec: {note}", file=sys.stderr)
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush into a closed pipe
    neither fails nor prints 'Exception ignored'."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
