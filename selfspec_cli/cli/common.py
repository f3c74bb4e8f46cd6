"""Helpers shared by the subcommands: stderr console, output streams, option parsing."""
from __future__ import annotations

import os
import stat
import shlex
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, Collection, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..errors import ConfigError, SelfSpecError
from ..jsonio import dumps
from ..paths import atomic_open
from ..paths import check_not_input, cut_to_last_line

# piped stderr (CI logs, `2> file`) gets PIPED_WIDTH columns instead of rich's 80-column default, unless COLUMNS says
# otherwise: wide enough for a profile's rows, narrow enough to read in a log (a new user's 200 made ~200-column tables)
PIPED_WIDTH = 100
err_console = Console(stderr=True, width=None if sys.stderr.isatty() or os.environ.get("COLUMNS", "").isdigit()
                      else PIPED_WIDTH)


_INVOCATION: list[str] | None = None


def set_invocation(argv: list[str]) -> None:
    """Remember the arguments this CLI run was given (``main(argv)`` or the shell's)."""
    global _INVOCATION
    _INVOCATION = list(argv)


def invocation() -> str:
    """The command line of this run, as a user would retype it."""
    return "selfspec " + shlex.join(invocation_args())


def invocation_args() -> list[str]:
    """The arguments of this run (after ``selfspec``)."""
    return list(_INVOCATION if _INVOCATION is not None else sys.argv[1:])


def log(msg: str) -> None:
    """One message line on stderr (rich markup allowed); never broken by rich at the console's width,
    so a path in it stays whole for copying."""
    err_console.print(msg, highlight=False, soft_wrap=True)


def progress(disable: bool = False) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=err_console, transient=False,
                    disable=disable)


def table(title: str, columns: Collection[str], left: Collection[str] = ("method",)) -> Table:
    """A rich table titled at the left: the ``left`` columns left-aligned, the figures right-aligned; a cell too long
    for its column wraps at spaces and folds a longer word, never cut with an ellipsis."""
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="left" if c in left else "right", overflow="fold")
    return t


class FigureTable:
    """A table of figures that no width cuts: rendered (it is a rich renderable) as its title, once, and one
    table when it fits the console, else with its columns split over as many tables as the width needs,
    each repeating the first column (the row's name). Cells of the ``wrap`` columns (text) wrap at
    spaces; every other cell is kept whole on one line."""

    def __init__(self, title: str, columns: Sequence[str], left: Collection[str] = ("method",),
                 wrap: Collection[str] = ()) -> None:
        self.title, self.columns, self.left, self.wrap = title, list(columns), set(left), set(wrap)
        self.rows: list[list[str]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append([str(c) for c in cells])

    def _width(self, i: int) -> int:
        """The narrowest column ``i`` can be: its longest cell or header, or in a ``wrap`` column its longest word."""
        cells = [Text.from_markup(c).plain for c in (self.columns[i], *(r[i] for r in self.rows))]
        if self.columns[i] in self.wrap:
            return max((len(w) for c in cells for w in c.split()), default=1)
        return max(len(c) for c in cells)

    def groups(self, width: int) -> list[list[int]]:
        """The columns of each table printed at ``width``: after the first, as many as fit (at least one)."""
        edge = self._width(0) + 4  # a column's cells are padded by one space each side, plus a border each side
        out: list[list[int]] = [[]]
        used = edge
        for i in range(1, len(self.columns)):
            w = self._width(i) + 3
            if out[-1] and used + w > width:
                out.append([])
                used = edge
            out[-1].append(i)
            used += w
        return out

    def __rich_console__(self, console: Console, options: Any) -> Iterator[Text | Table]:
        """The title once, as a line of its own that wraps at the console's width (as a table's caption it wrapped
        at the table's, 20 characters for a one-column part), then the parts, untitled."""
        groups = self.groups(options.max_width)
        yield Text.from_markup(self.title + (f" ({len(groups)} parts, each led by its first column)"
                                             if len(groups) > 1 else ""), style="italic")
        for cols in groups:
            t = Table()
            for i in (0, *cols):
                c = self.columns[i]
                t.add_column(c, justify="left" if c in self.left else "right", no_wrap=c not in self.wrap)
            for row in self.rows:
                t.add_row(*(row[i] for i in (0, *cols)))
            yield t


# ---------------------------------------------------------------- threads



# ---------------------------------------------------------------- exit notes


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive in the block are handled when it ends (by the handlers they had): a record's
    write and the exit note that counts it happen together, so an interrupt never names one record too few. (Python
    runs signal handlers in the main thread; blocking the signal there would not do: the kernel hands it to
    another thread, a progress bar's or torch's, and Python still raises it in the main one.)"""
    import signal

    arrived: list[int] = []

    def later(signum: int, frame: object) -> None:
        arrived.append(signum)

    try:
        old = {s: signal.signal(s, later) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: nothing to hold
        yield
        return
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in arrived[:1]:  # one is enough: the first unwinds the command
            if callable(handler := old[s]):
                handler(s, None)
            else:
                signal.raise_signal(s)


_EXIT_NOTE: list[str] = []


def set_exit_note(note: str) -> None:
    """A clause the interrupt / error message of this run should carry (e.g. where partial output is)."""
    _EXIT_NOTE[:] = [note]


def pop_exit_note() -> str | None:
    return _EXIT_NOTE.pop() if _EXIT_NOTE else None  # it holds one note at the most


# ---------------------------------------------------------------- output files


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _is_stream(path: Path) -> bool:
    """A pipe, a character device (/dev/stdout, /dev/null, a terminal) or a socket: written in
    place, never replaced (a reader waits on it), and never 'already existing' output."""
    if str(path).startswith(("/dev/", "/proc/self/fd/")):  # /dev/stdout may point at a redirected file
        return True
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def check_output(path: Path | None, *, force: bool = False, append: bool = False,
                 inputs: tuple[str | None, ...] = ()) -> None:
    """Refuse, before any work, an --output that would destroy something (see :func:`output_stream`)."""
    if path is None or str(path) == "-" or _is_stream(path):
        return
    if force and append:
        raise ConfigError("--force replaces --output and --append adds to it; pass one of them")
    if path.parent and not path.parent.exists():
        raise ConfigError(f"output directory '{path.parent}' does not exist; create it or choose another --output")
    if path.is_dir():
        raise ConfigError(f"--output '{path}' is a directory; pass a file path")
    check_not_input(path, inputs)
    if path.exists() and not (force or append):
        raise ConfigError(f"--output '{path}' already exists; pass --force to replace it, --append to add to it, "
                          "or choose another --output")
    _probe_writable(path, append)


def _probe_writable(path: Path, append: bool) -> None:
    """Refuse, before the model loads, an --output that cannot be written: a file is made and removed beside it
    (permission bits do not tell: root may write anywhere but /sys, /proc or a read-only mount), and a file to
    append to is opened for appending."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.",
                                         suffix=".probe"):
            pass
        if append and path.is_file():
            with path.open("a", encoding="utf-8"):
                pass
    except OSError as exc:
        raise ConfigError(f"cannot write --output '{path}' ({exc.strerror or exc}); choose a writable path") from None


@contextmanager
def output_stream(path: Path | None, *, force: bool = False, append: bool = False,
                  inputs: tuple[str | None, ...] = ()) -> Iterator[IO[str]]:
    """stdout, or an output file; each record is flushed as it is written.

    A file output is written to ``<name>.<random>.partial`` beside it, which replaces it
    only when the run finishes; on an interrupt or error the partial file is kept (with
    every finished record, whole lines only) and named in the exit message, and the
    target is left untouched. An existing target needs ``force`` (replace) or ``append``
    (records are added to its end, in place, after a newline if its last line lacks one).
    A pipe, character device or socket (``-o /dev/stdout``, ``-o >(cmd)``, a named pipe) is
    written in place and never replaced. The output may never be an input file.
    """
    if path is None or str(path) == "-":
        yield sys.stdout  # a failed write is write_record's one line about stdout
        return
    stream = _is_stream(path)  # a pipe, >(cmd), /dev/stdout: written in place, as a shell redirection would
    check_output(path, force=force, append=append, inputs=inputs)  # nothing to check for a stream
    with (_in_place(path, append, stream) if stream or append else _replacing(path)) as f:
        yield f


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"cannot write --output '{path}' ({exc.strerror}); choose a writable path")


def _failed(path: Path, exc: OutputWriteError) -> OutputWriteError:
    """A record's write failed (disk full, /dev/full): worded for the --output file."""
    return OutputWriteError(f"cannot write --output '{path}' ({exc.reason}); {_write_fix(exc.errno, '--output')}")


@contextmanager
def _replacing(path: Path) -> Iterator[IO[str]]:
    """``<path>.<random>.partial``, which replaces ``path`` when the block ends; on an interrupt or error it is
    kept (whole lines only) and named in the exit note (:func:`output_stream`)."""
    def keep(partial: Path) -> bool:  # whole lines only; named in the exit message
        n = cut_to_last_line(partial)
        if n:
            set_exit_note(f"{n} finished record{'s are' if n != 1 else ' is'} in {partial} ('{path}' is unchanged)")
        return n > 0

    try:
        with atomic_open(path, "w", encoding="utf-8", keep=keep, error=lambda exc: _unwritable(path, exc)) as f:
            yield f
    except OutputWriteError as exc:  # keep() has named the partial file in the exit note
        raise _failed(path, exc) from None


@contextmanager
def _in_place(path: Path, append: bool, stream: bool) -> Iterator[IO[str]]:
    """``path`` written in place: a stream (pipe, character device, socket), or a file appended to (after a
    newline when its last line lacks one)."""
    try:
        f = path.open("a" if append else "w", encoding="utf-8")
        if append and not stream and path.stat().st_size and not _ends_with_newline(path):  # a last record without its newline
            f.write("\n")
    except OSError as exc:
        raise _unwritable(path, exc) from None
    try:
        yield f
    except BaseException as exc:
        with suppress(OSError):  # a failed write leaves its bytes buffered: closing would fail again
            f.close()
        if isinstance(exc, OutputWriteError):
            raise _failed(path, exc) from None
        raise
    try:
        f.close()
    except OSError as exc:
        raise _unwritable(path, exc) from None


class OutputClosed(Exception):
    """The reader of stdout or of an --output pipe went away (``| head -n1``). Not an OSError,
    so that click does not turn it into exit status 1; the entry point ends quietly."""


class OutputWriteError(SelfSpecError):
    """A record could not be written (disk full, ``> /dev/full``, a quota): one line and status 2,
    like every user error. ``stdout``: the failed stream was stdout, whose buffered bytes the
    entry point then drops (so that the interpreter's last flush neither fails nor prints)."""

    def __init__(self, message: str, *, reason: str = "", errno: int | None = None, stdout: bool = False) -> None:
        super().__init__(message)
        self.reason, self.errno, self.stdout = reason, errno, stdout


def _write_fix(errno: int | None, where: str) -> str:
    import errno as e

    if errno in (e.ENOSPC, e.EDQUOT, e.EFBIG):
        return f"free some space, or choose another {where}"
    return f"choose another {where}"


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _write_line(stream: IO[str], line: str, bar: Progress | None) -> None:
    """``line`` into ``stream``, flushed. While ``bar`` is drawn on a terminal and ``stream`` is one
    too (a terminal shows both), the bar is erased first, so the line begins where the bar was
    and the bar is drawn again under it: a record never shares a line with the bar."""
    live = bar.live if bar is not None else None
    render = getattr(live, "_live_render", None)  # rich's Live: the bar's last drawing (its height)
    if live is None or render is None or not live.is_started or not live.console.is_terminal or not _is_tty(stream):
        stream.write(line)
        stream.flush()
        return
    with live._lock:  # the bar's refresh thread waits
        live.console.control(render.position_cursor())  # to the bar's first line, erased (on stderr)
        render._shape = None  # the bar is gone: the next drawing starts where the cursor is, under the line
        stream.write(line)
        stream.flush()
    live.refresh()


def write_record(stream: IO[str], record: dict[str, Any], bar: Progress | None = None) -> None:
    """One record as a line of JSON, flushed (above ``bar``, a progress bar on the same terminal:
    :func:`_write_line`). A reader that went away is :class:`OutputClosed`; any other failed
    write is :class:`OutputWriteError`, worded here for stdout (the caller that opened a file
    words it for the file: :func:`output_stream`)."""
    try:
        _write_line(stream, dumps(record, ensure_ascii=False) + "\n", bar)
    except BrokenPipeError:
        raise OutputClosed from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if stream is sys.stdout or stream is sys.__stdout__:
            raise OutputWriteError(f"cannot write stdout ({reason}); {_write_fix(exc.errno, 'place to send stdout')}",
                                   reason=reason, errno=exc.errno, stdout=True) from None
        where = getattr(stream, "name", "the output")
        raise OutputWriteError(f"cannot write '{where}' ({reason}); {_write_fix(exc.errno, 'location')}",
                               reason=reason, errno=exc.errno) from None


def print_json(obj: Any) -> None:
    """A command's one-line JSON summary on stdout."""
    write_record(sys.stdout, obj)




