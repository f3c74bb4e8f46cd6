"""``selfspec --help`` without torch: the help texts, rendered once from the real commands and kept in
``help.json`` beside this module (package data), are what the console script prints for a plain help
request, before anything heavy is imported (torch alone takes 4 s on some hosts; issue 50).

Invariants:

* this module imports nothing heavy (cli/entry.py calls it before torch loads); only :func:`render`
  imports the command frame (app.py), to render the texts;
* a request is served from the file only when it is exactly a help request (``selfspec``,
  ``selfspec -h|--help``, ``selfspec <command> -h|--help``), the file was rendered for this version,
  and the terminal is at least :data:`WIDTH` columns wide (click wraps help at ``min(columns, 80) - 2``,
  so every such terminal gets the same text); anything else goes through the commands as before;
* the file is what the commands render: ``tests/test_startup.py`` renders them and compares, and
  ``python -m selfspec_cli.cli.helptext`` writes the file again after an option changes.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from .. import __version__

HELP_FILE = Path(__file__).with_name("help.json")
WIDTH = 80  # the terminal width the texts are rendered at (click's max_content_width default)
HELP_FLAGS = ("-h", "--help")


def help_request(argv: list[str]) -> str | None:
    """The command whose help ``argv`` asks for (``""``: the root's), or None when it asks for anything else."""
    if not argv or (len(argv) == 1 and argv[0] in HELP_FLAGS):
        return ""
    if len(argv) == 2 and argv[1] in HELP_FLAGS and not argv[0].startswith("-"):
        return argv[0]
    return None


def stored(command: str) -> str | None:
    """The kept help of ``command`` (``""``: the root), or None when the file lacks it, is of another version,
    or the terminal is narrower than :data:`WIDTH`."""
    if shutil.get_terminal_size((WIDTH, 24)).columns < WIDTH:
        return None
    try:
        doc = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("version") != __version__ or doc.get("width") != WIDTH:
        return None
    text = (doc.get("texts") or {}).get(command)
    return text if isinstance(text, str) else None


def render() -> dict[str, str]:
    """Every command's help (and the root's, key ``""``) as ``selfspec <command> --help`` prints it at
    :data:`WIDTH` columns: imports the commands (and torch)."""
    import os

    from .app import cli_command

    command = cli_command()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # what click reads the terminal's width from, as a help request does
    try:
        root = command.make_context("selfspec", [], resilient_parsing=True)
        texts = {"": root.get_help()}
        for name in command.list_commands(root):
            sub = command.get_command(root, name)
            texts[name] = sub.make_context(name, [], parent=root, resilient_parsing=True).get_help()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return texts


def write() -> Path:
    """Render the texts and keep them in :data:`HELP_FILE`."""
    doc = {"version": __version__, "width": WIDTH, "texts": render()}
    HELP_FILE.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return HELP_FILE


if __name__ == "__main__":
    print(f"wrote {write()}", file=sys.stderr)
