"""The console script: ``selfspec``. Kept free of heavy imports, so that a Ctrl-C while
torch and transformers load (the first second or two) ends with the one interrupt line
and status 130 rather than a traceback; and a signal that arrives after the command
finished (while the interpreter exits) is ignored, since the work is done."""
from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = "selfspec: interrupted; everything finished before the interrupt was kept"


_seen: list[int] = []


def _on_sigint(signum: int, frame: object) -> None:
    _seen.append(signum)  # remembered: some import-time code catches every exception and would lose it
    raise KeyboardInterrupt


def _spin_for_auto_threads(argv: list[str]) -> None:
    """``--threads auto`` needs waiting threads that spin briefly (engine/threads.py); the wait
    policy is read once, when torch loads, so it is set here, before any heavy import, unless
    the user chose one."""
    auto = any(a == "--threads=auto" or (a == "--threads" and i + 1 < len(argv) and argv[i + 1] == "auto")
               for i, a in enumerate(argv))
    if auto and not _user_wait_policy():
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _user_wait_policy() -> bool:
    from .. import WAIT_POLICY_FROM_USER

    return WAIT_POLICY_FROM_USER


def run() -> None:
    from ..heap import bound_heap

    bound_heap()  # before the first large allocation (selfspec_cli/heap.py)
    _spin_for_auto_threads(sys.argv[1:])
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        from .app import main

        if _seen:  # interrupted while importing, and the interrupt was swallowed on the way
            raise KeyboardInterrupt
    except BaseException:
        if not _seen:
            raise
        print(INTERRUPTED, file=sys.stderr)  # whatever the swallowed interrupt left behind
        sys.exit(130)
    status = main()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the command has finished: exit whatever arrives now
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)
