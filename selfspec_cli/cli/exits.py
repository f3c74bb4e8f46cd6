"""The words and statuses of an interrupted run, shared by the console script (entry.py, which
must stay free of heavy imports) and the command frame (app.py)."""
from __future__ import annotations

import signal

INTERRUPTED = "selfspec: interrupted; everything finished before the interrupt was kept"
TERMINATED = "selfspec: terminated (SIGTERM); everything finished before it was kept"
SIGTERM_STATUS = 128 + signal.SIGTERM  # 143, as a shell reports a process ended by SIGTERM
