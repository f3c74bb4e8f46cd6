"""Tables on stderr fit the console without repeated captions (issue 50, point 8; cli/common.py): at 80 columns a
bench table's title is said once, as a line of its own, and its columns split over narrow parts; with stderr
redirected and no COLUMNS the console is 100 columns wide; profile's cost file path is a line of its own."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from selfspec_cli.cli.common import PIPED_WIDTH, FigureTable

ROOT = Path(__file__).resolve().parents[1]


def _bench_like() -> FigureTable:
    """A table of the bench's main table's shape and words."""
    t = FigureTable("bench: SmolLM2-135M-Instruct, 12 prompts x 64 tokens, greedy; vs ar/hf: ratio of mean tok/s, "
                    "paired: geometric mean of per-prompt ratios",
                    ["method", "tok/s", "min-max", "vs ar", "paired vs ar [95 %]", "decode tok/s", "M", "alpha",
                     "parity", "differs (first token)", "optim s", "peak MB"],
                    left=("method", "differs (first token)"), wrap=("differs (first token)",))
    for name in ("ar", "auto", "pld", "self-sd", "specee (lossy)"):
        t.add_row(name, "98.1", "97.0-99.9", "1.00x", "1.000x [0.98-1.02]", "120.3", "1.00", "0.91", "100% (100.0% tok)",
                  "3@12, 5@40", "0.0", "421")
    return t


def _render(renderable, width: int) -> list[str]:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue().splitlines()


def test_a_split_table_states_its_caption_once_and_fits_80_columns():
    lines = _render(_bench_like(), 80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert text.count("bench: SmolLM2") == 1  # once, not above every part
    assert text.count("method") >= 2  # split into parts, each led by the row names
    caption = [i for i, line in enumerate(lines) if "│" in line or "┃" in line or "┏" in line][0]
    assert caption <= 3  # the caption wraps at the console's width (two lines), not a narrow part's (ten)
    assert "peak MB" in text and "421" in text  # no column lost


def test_a_wide_console_gets_one_table():
    lines = _render(_bench_like(), 400)
    assert "\n".join(lines).count("method") == 1 and "parts" not in lines[0]


def test_redirected_stderr_without_columns_is_100_wide():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", "from selfspec_cli.cli.common import err_console; print(err_console.width)"],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.strip() == str(PIPED_WIDTH) == "100", out.stderr
