"""The console script: ``selfspec``. Kept free of heavy imports, so that a Ctrl-C while
torch and transformers load (the first second or two) ends with the one interrupt line
and status 130 rather than a traceback; and a signal that arrives after the command
finished (while the interpreter exits) is ignored, since the work is done."""
from __future__ import annotations

import signal
import sys

INTERRUPTED = "selfspec: interrupted; everything finished before the interrupt was kept"


_seen: list[int] = []


def _on_sigint(signum: int, frame: object) -> None:
    _seen.append(signum)  # remembered: some import-time code catches every exception and would lose it
    raise KeyboardInterrupt


def run() -> None:
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
