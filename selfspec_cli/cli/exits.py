"""The words and statuses of an interrupted run, shared by the console script (entry.py, which
must stay free of heavy imports) and the command frame (app.py).

One line per signal, the same in every command and at every stage (issue 50): ``selfspec:
interrupted (SIGINT); <what was kept>`` with status 130, or ``selfspec: terminated (SIGTERM); <what
was kept>`` with status 143. What was kept is the command's exit note (``common.set_exit_note``: the
partial file and its records, the records written to stdout, a bench's records directory and how to
resume, a study's trials) or, when the command set none, :data:`NOTHING_KEPT`: no command claims to
have kept what it never finished."""
from __future__ import annotations

import signal

SIGTERM_STATUS = 128 + signal.SIGTERM  # 143, as a shell reports a process ended by SIGTERM
SIGINT_STATUS = 128 + signal.SIGINT  # 130
NOTHING_KEPT = "it had finished nothing, so nothing was kept"


def interrupt_line(terminated: bool, note: str | None = None) -> str:
    """The one line an interrupted run ends with (see the module docstring)."""
    head = "selfspec: terminated (SIGTERM)" if terminated else "selfspec: interrupted (SIGINT)"
    return f"{head}; {note or NOTHING_KEPT}"


def interrupt_status(terminated: bool) -> int:
    return SIGTERM_STATUS if terminated else SIGINT_STATUS
