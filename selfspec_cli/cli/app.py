"""Entry point: ``selfspec <command>``. User errors become one line and exit status 2."""
from __future__ import annotations

import sys

import click
import typer

from ..errors import SelfSpecError
from .bench import bench
from .calibrate import calibrate
from .generate import generate

app = typer.Typer(
    name="selfspec",
    help="Lossless self-speculative decoding for Hugging Face causal LMs (no draft model, no weight changes).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("generate")(generate)
app.command("bench")(bench)
app.command("calibrate")(calibrate)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (also used by tests)."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="selfspec", standalone_mode=False)
        if rv == 130:  # typer turns KeyboardInterrupt into Exit(130) and returns it silently
            print("selfspec: interrupted; finished prompts were written", file=sys.stderr)
        return rv if isinstance(rv, int) else 0
    except SelfSpecError as exc:
        print(f"selfspec: error: {exc}", file=sys.stderr)
        return 2
    except click.exceptions.Abort:
        print("selfspec: interrupted; finished prompts were written", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("selfspec: interrupted; finished prompts were written", file=sys.stderr)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except BrokenPipeError:
        return 0


def run() -> None:
    sys.exit(main())
