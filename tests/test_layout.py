"""Import direction: cli -> {calibrate, training, bench, methods} -> decoding -> engine.
The engine and decoding layers never import the CLI stack or the optimizers."""
from __future__ import annotations

import ast
from pathlib import Path

import selfspec_cli

PKG = Path(selfspec_cli.__file__).parent
FORBIDDEN = {"typer", "rich", "optuna", "click"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
            names.add("." + node.module.split(".")[0])
    return names


def test_engine_and_decoding_stay_independent():
    for sub in ("engine", "decoding", "methods"):
        for f in (PKG / sub).glob("*.py"):
            bad = _imports(f) & FORBIDDEN
            assert not bad, f"{f.relative_to(PKG)} imports {bad}"
    for f in (PKG / "engine").glob("*.py"):
        rel = {n for n in _imports(f) if n.startswith(".")}
        assert not rel & {".decoding", ".methods", ".cli", ".bench", ".calibrate"}, f
