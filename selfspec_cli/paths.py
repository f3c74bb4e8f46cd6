"""Where selfspec reads and writes its files.

* Shipped artifacts (the repository's ``artifacts/`` tree, :data:`selfspec_cli.loading.ARTIFACTS_DIR`)
  are read-only package data: selfspec reads them, and never writes there by default.
* User artifacts live in the per-user data directory :func:`user_home`:
  ``$SELFSPEC_HOME`` when set, else ``${XDG_DATA_HOME:-~/.local/share}/selfspec``.
  Default artifact names carry the model fingerprint
  (``<home>/artifacts/self-sd/<model name>-<fingerprint>.json``), so an artifact made
  for one model can never land on another model's file.
* Everything selfspec can rebuild (converted GGUF models, the compiled kernel, quantized
  drafts, on-policy training data, the machine's measured costs) lives in the one cache directory :func:`cache_root`:
  ``$SELFSPEC_CACHE`` when set, else ``$SELFSPEC_HOME/cache`` when ``SELFSPEC_HOME`` is
  set, else ``${XDG_CACHE_HOME:-~/.cache}/selfspec``.
* Work whose result goes into one of these directories first checks that it can write there
  (:func:`check_cache_writable`, :func:`check_home_writable`): an unwritable one is one line,
  naming it and the variable that chose it, before the work, not after.
* Artifacts, caches, the bench's ``results.json`` and plots, and the ``--output`` of
  ``generate`` are written through :func:`atomic_open` / :func:`atomic_write`: a temporary
  file in the destination directory, flushed and fsynced, then ``os.replace``; a crash or
  Ctrl-C leaves the old file or the new one, never a torn one. A destination that is a
  symbolic link is followed: the file it points to is replaced, the link is kept.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import ArtifactError, ConfigError, SelfSpecError


def user_home() -> Path:
    """The per-user data directory (read from the environment at every call)."""
    xdg = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(os.environ.get("SELFSPEC_HOME") or Path(xdg) / "selfspec").expanduser()


def user_artifacts_dir() -> Path:
    return user_home() / "artifacts"


def cache_root() -> Path:
    """selfspec's one cache directory (read from the environment at every call):
    ``$SELFSPEC_CACHE``, else ``$SELFSPEC_HOME/cache``, else ``${XDG_CACHE_HOME:-~/.cache}/selfspec``.
    Converted GGUF models live in ``models/``, the compiled kernel in ``kernels/``, quantized
    drafts in ``drafts/``, on-policy training data in ``onpolicy/`` and the engine's measured costs
    in ``costs/`` (decoding/cost_store.py)."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"]).expanduser()
    if os.environ.get("SELFSPEC_HOME"):
        return Path(os.environ["SELFSPEC_HOME"]).expanduser() / "cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "selfspec"


def _origin(default: str, *variables: tuple[str, str]) -> tuple[str | None, str]:
    """The environment variable that chose a directory, and how (``$SELFSPEC_HOME/cache``)."""
    for var, shown in variables:
        if os.environ.get(var):
            return var, shown
    return None, default


def _probe(directory: Path) -> str | None:
    """Create ``directory`` if needed and write a file in it; None when that works, else the reason."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_cache_writable(sub: str = "") -> Path:
    """Make sure selfspec can write ``sub`` of the cache (:func:`cache_root`), creating it, before
    work whose result goes there (converting a GGUF model); else a one-line :class:`ConfigError`
    naming the directory and the environment variable that chose it. Returns the directory."""
    root = cache_root()
    var, shown = _origin("the default, with no variable set", ("SELFSPEC_CACHE", "$SELFSPEC_CACHE"),
                         ("SELFSPEC_HOME", "$SELFSPEC_HOME/cache"), ("XDG_CACHE_HOME", "$XDG_CACHE_HOME/selfspec"))
    reason = _probe(root / sub)
    if reason is not None:
        fix = ("set SELFSPEC_HOME (or SELFSPEC_CACHE, for the cache alone) to a writable directory"
               if var == "SELFSPEC_HOME" else "set SELFSPEC_CACHE to a writable directory")
        raise ConfigError(f"cannot write selfspec's cache directory '{root}' ({shown}): {reason}; {fix}")
    return root / sub


def check_home_writable() -> Path:
    """Make sure selfspec can write its user artifacts (:func:`user_artifacts_dir`), creating the
    directory, before work whose artifact goes there; else a one-line :class:`ConfigError` naming the
    directory and the environment variable that chose it. Returns the artifacts directory."""
    home = user_home()
    _, shown = _origin("the default, with no variable set", ("SELFSPEC_HOME", "$SELFSPEC_HOME"),
                       ("XDG_DATA_HOME", "$XDG_DATA_HOME/selfspec"))
    reason = _probe(user_artifacts_dir())
    if reason is not None:
        raise ConfigError(f"cannot write selfspec's home directory '{home}' ({shown}): {reason}; set SELFSPEC_HOME to "
                          "a writable directory, or pass --output")
    return user_artifacts_dir()


def is_inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether ``path`` (existing or not) lies in ``directory``, after resolving both."""
    try:
        return Path(path).expanduser().resolve().is_relative_to(Path(directory).expanduser().resolve())
    except (OSError, RuntimeError):
        return False


# ---------------------------------------------------------------- atomic writes


def _write_error(path: Path) -> Callable[[OSError], SelfSpecError]:
    return lambda exc: ArtifactError(f"cannot write '{path}' ({exc.strerror or exc}); choose a writable location")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None,
                keep: Callable[[Path], bool] | None = None,
                error: Callable[[OSError], SelfSpecError] | None = None) -> Iterator[IO[Any]]:
    """A file that replaces ``path`` when the block ends without an exception.

    It is a temporary file in the same directory (``.<name>.<random>.tmp``), with the mode a
    plain ``open()`` would give (or the old file's), flushed and fsynced, then renamed over
    ``path`` (and the directory fsynced). Missing parent directories are created. The file's
    ``name`` is the temporary file's path, for writers that take a path (safetensors'
    ``save_file``). A symbolic link is followed: the file it points to is replaced (the
    temporary file lies in that file's directory), and the link stays a link. On an
    exception the temporary file is removed, unless ``keep`` is given: the file is then a
    visible ``<name>.<random>.partial`` and is left in place when ``keep(partial)``
    returns True. An OSError of these steps (not of the block's own code) is raised as
    ``error(exc)``, by default an :class:`ArtifactError` naming ``path``.
    """
    path = Path(path)
    error = error or _write_error(path)  # named as the caller named it
    if path.is_symlink():  # replace the file the link points to (as `>` would), never the link itself
        path = Path(os.path.realpath(path))
    prefix, suffix = (f"{path.name}.", ".partial") if keep is not None else (f".{path.name}.", ".tmp")
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask())
        f = open(tmp, mode, encoding=encoding)  # noqa: SIM115 - closed below, whatever happens
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise error(exc) from None
    in_block = True
    try:
        try:
            yield f
        except BaseException:
            with contextlib.suppress(OSError):  # after a failed write (disk full) closing fails the same way again
                f.close()
            raise
        in_block = False
        with f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # also Ctrl-C: never leave the temporary file behind (unless kept)
        with contextlib.suppress(OSError):
            if keep is None or not keep(tmp):
                tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not in_block:
            raise error(exc) from None
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any],
                 error: Callable[[OSError], SelfSpecError] | None = None) -> Path:
    """Write ``path`` atomically (:func:`atomic_open`): ``write(f)`` fills the temporary
    binary file; an OSError, also one of ``write``, is raised as ``error(exc)`` (by
    default an :class:`ArtifactError` naming ``path``)."""
    path = Path(path)
    error = error or _write_error(path)
    with atomic_open(path, error=error) as f:
        try:
            write(f)
        except OSError as exc:
            raise error(exc) from None
    return path


def umask() -> int:
    """The process's umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); harmless where unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_not_input(path: Path, inputs: tuple[str | None, ...], option: str = "--output") -> None:
    """Refuse an output path that is one of the input files (it would be destroyed)."""
    for src in (s for s in inputs if s not in (None, "-")):
        try:
            same = os.path.samefile(src, path)  # hard links too
        except OSError:  # one of them does not exist
            same = False
        if same or Path(src).expanduser().resolve() == path.expanduser().resolve():
            raise ConfigError(f"{option} '{path}' is the input file '{src}'; writing it would destroy the input; "
                              f"choose another {option}")


def cut_to_last_line(path: Path) -> int:
    """Drop a torn last line (an interrupted write); returns the number of complete lines."""
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        os.truncate(path, len(keep))
    return keep.count(b"\n")
