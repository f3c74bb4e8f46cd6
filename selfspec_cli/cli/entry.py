"""The console script: ``selfspec``. Kept free of heavy imports, so that a Ctrl-C (or a SIGTERM)
while torch and transformers load (the first second or two) ends with the one interrupt line
and status 130 (143) rather than a traceback or a silent exit; and a signal that arrives after the command
finished (while the interpreter exits) is ignored, since the work is done."""
from __future__ import annotations

import os
import signal
import sys

from .exits import interrupt_line, interrupt_status


_seen: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM while the command's modules import: unwind (nothing was done yet)."""
    _seen.append(signum)  # remembered: some import-time code catches every exception and would lose it
    raise KeyboardInterrupt


def set_wait_policy(argv: list[str]) -> None:
    """OpenMP threads that wait at a barrier sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``),
    except with ``--threads auto``, whose waiting threads spin briefly (``GOMP_SPINCOUNT``,
    engine/threads.py). libgomp reads the policy once, when torch loads, so it is set here, where
    the command line starts and before any heavy import; a policy already in the environment wins.
    A program that imports selfspec_cli as a library chooses its own (docs/engine.md, "Threads")."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    auto = any(a == "--threads=auto" or (a == "--threads" and i + 1 < len(argv) and argv[i + 1] == "auto")
               for i, a in enumerate(argv))
    if auto:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def run() -> None:
    if sys.argv[1:] in (["--version"], ["-V"]):  # answered before torch loads (4 s on some hosts)
        from .. import __version__

        print(f"selfspec {__version__}")
        sys.exit(0)
    from .helptext import help_request, stored

    if (asked := help_request(sys.argv[1:])) is not None and (text := stored(asked)) is not None:
        print(text, file=sys.stdout if sys.argv[1:] else sys.stderr)  # bare `selfspec`: help on stderr, status 2
        sys.exit(0 if sys.argv[1:] else 2)
    from ..heap import bound_heap

    bound_heap()  # before the first large allocation (selfspec_cli/heap.py)
    set_wait_policy(sys.argv[1:])
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)  # app.main installs its own for the command itself
    try:
        from .app import main

        if _seen:  # interrupted while importing, and the interrupt was swallowed on the way
            raise KeyboardInterrupt
    except BaseException:
        if not _seen:
            raise
        terminated = signal.SIGTERM in _seen
        print(interrupt_line(terminated), file=sys.stderr, flush=True)  # nothing was done yet: nothing kept
        # no interpreter teardown: a KeyboardInterrupt that some half-imported module saw would make CPython end
        # by SIGINT (status -2) instead of this status, which the full test set met on a loaded host
        os._exit(interrupt_status(terminated))
    status = main()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the command has finished: exit whatever arrives now
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)
