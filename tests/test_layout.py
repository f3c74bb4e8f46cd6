"""Import direction, for every package of selfspec_cli:

    cli -> bench -> methods -> decoding -> engine

A package may import itself and the packages to its right, never one to its left. A
method with an offline step is one package, ``methods/<name>/`` (its proposer, its
artifact spec, its calibrate or train module: docs/design.md, "A method is one
package"), so the offline steps sit on the methods floor and the commands that run them
(cli/calibrate.py, cli/train_heads.py) dispatch to them. The top-level modules (config,
errors, paths, artifacts, loading, prompts, runtime, jsonio, and session: the setup every
command shares) are shared: anything may import
them, but they import none of cli/bench/methods. optuna is imported only in
methods/self_sd/ (the one search that uses it) and cli/; typer, rich and click only in cli/.

Every import counts: module level or inside a function, absolute or relative (level
1 and 2). The checker is a plain function of (path, source), and a self-check runs
it on synthetic sources so that a broken checker cannot pass silently.

The repository holds code, docs and the artifacts the tool ships: no library file cites the
lab notebook (docs/log.md), and the files git tracks outside artifacts/models/ stay under
10 MB (skipped outside a git checkout).

No two units import each other, directly or around a longer loop (:func:`unit_cycles`):
a unit is a package, or a top-level module on its own (runtime, artifacts, loading, ...),
so a top-level module that imports a package which imports it back is a loop too.

No module takes a private name (``_x``) from another selfspec module, neither as
``from m import _x`` nor as ``m._x`` on a module or name it imported: what two modules
share is public (:func:`private_uses`, with its own self-check).

No two files of one package import each other, directly or around a longer loop
(:func:`file_cycles`; issue 36: cli/app.py and cli/entry.py did). An import under ``if
TYPE_CHECKING:`` never runs and does not count; ``from . import x`` counts as an import of
the submodule ``x``, not of the package's ``__init__``.

No public function or method of decoding/, methods/ or bench/ takes or returns a ``dict[str, Any]``,
``Dict[str, Any]`` or ``Mapping[str, Any]`` (:func:`untyped_json`, issue 49): records, results and statistics
are dataclasses; a JSON object with genuinely free-form keys is named ``JsonObject`` (jsonio.py, the one
alias), and no module of those packages defines another alias of those types. ``JsonObject`` itself appears
in a public signature of those packages only at the I/O point (a typed value's ``to_json``/``from_json``/``to_dict``/
``from_dict``/``as_dict``) or in :data:`JSON_OBJECT_EXCEPTIONS`, documents written to or read from JSON, each
with its reason (:func:`json_object_signatures`).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

import selfspec_cli

PKG = Path(selfspec_cli.__file__).parent
ROOT = "selfspec_cli"

# rank: a package may import packages of strictly lower rank (and itself)
RANK = {"cli": 4, "bench": 3, "methods": 2, "decoding": 1, "engine": 0}
SHARED = {"config", "errors", "paths", "artifacts", "loading", "lite", "prompts", "runtime", "jsonio", "heap", "session"}
ENTRY = {"__main__"}  # `python -m selfspec_cli`: the command line's entry point, may import cli
NOT_FROM_SHARED = {"cli", "bench", "methods"}
# third-party module -> the packages (or folders) allowed to import it
THIRD_PARTY_ONLY_IN = {"optuna": {"methods/self_sd", "cli"}, "typer": {"cli"}, "rich": {"cli"}, "click": {"cli"}}


def _unit(rel: str) -> str:
    """'methods/swift.py' -> 'methods'; 'config.py' -> 'config'; '__init__.py' -> '__init__'."""
    parts = Path(rel).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def _package_of(rel: str) -> list[str]:
    """Dotted package (as a list) that a relative import in ``rel`` is resolved against."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    else:
        parts = parts[:-1]
    return [ROOT, *parts]


def _from_base(rel: str, node: ast.ImportFrom) -> str:
    """The absolute dotted module of ``from <base> import ...`` in the file ``rel``."""
    if node.level == 0:
        return node.module or ""
    pkg = _package_of(rel)
    up = node.level - 1
    if up > len(pkg) - 1:
        raise AssertionError(f"{rel}:{node.lineno}: relative import beyond the package root")
    return ".".join(pkg[: len(pkg) - up] + ([node.module] if node.module else []))


def imported_modules(rel: str, source: str) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in ``source`` (the file ``rel``,
    relative to the package root), resolving relative imports. For ``from X import a``
    both ``X`` and ``X.a`` are listed (``a`` may be a submodule)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(rel, node)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def _module_of(rel: str) -> str:
    """'bench/plots.py' -> 'selfspec_cli.bench.plots'; 'bench/__init__.py' -> 'selfspec_cli.bench'."""
    parts = list(Path(rel).with_suffix("").parts)
    return ".".join([ROOT, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ['a', 'b', 'c']; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) is not None:
        return [*head, node.attr]
    return None


def private_uses(rel: str, source: str) -> list[str]:
    """Private names that the file ``rel`` takes from another selfspec module: ``from m
    import _x``, and ``n._x`` where ``n`` (or ``n.sub``) is bound by an import from
    selfspec (a module, or a class or function of one)."""
    me = _module_of(rel)
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the selfspec module or object it stands for
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(rel, node)
            if base.split(".")[0] != ROOT:
                continue
            for a in node.names:
                if _private(a.name) and base != me:
                    bad.append(f"{rel}:{node.lineno} imports the private name {a.name} from {base}")
                bound[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == ROOT:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else ROOT
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _dotted(node.value)
            if chain and chain[0] in bound:
                owner = ".".join([bound[chain[0]], *chain[1:]])
                if owner != me:
                    bad.append(f"{rel}:{node.lineno} uses the private name {'.'.join(chain)}.{node.attr} of {owner}")
    return bad


def violations(rel: str, source: str) -> list[str]:
    """Rule violations of the file ``rel`` (e.g. 'methods/swift.py') with ``source``."""
    me = _unit(rel)
    bad: list[str] = []
    for line, mod in imported_modules(rel, source):
        parts = mod.split(".")
        where = f"{rel}:{line} imports {mod}"
        if parts[0] != ROOT:
            allowed = THIRD_PARTY_ONLY_IN.get(parts[0])
            if allowed is not None and me not in allowed and not any(rel.startswith(a + "/") for a in allowed):
                bad.append(f"{where}: {parts[0]} may only be imported in {sorted(allowed)}")
            continue
        if len(parts) == 1:
            continue  # `from selfspec_cli import x` is listed again as selfspec_cli.x
        target = parts[1]
        if target == me or target in SHARED:
            continue
        if me in ENTRY:
            continue
        if me in SHARED or me == "__init__":
            if target in NOT_FROM_SHARED:
                bad.append(f"{where}: a shared top-level module must not import {target}")
            continue
        if target not in RANK:
            if target in ENTRY:
                bad.append(f"{where}: nothing imports the entry point")
            continue  # a top-level name that is neither a package nor a module (none today)
        if me not in RANK:
            bad.append(f"{where}: unknown unit {me}")
        elif RANK[target] >= RANK[me]:
            side = "sideways" if RANK[target] == RANK[me] else "against the direction"
            bad.append(f"{where}: {me} -> {target} goes {side} "
                       "(cli -> bench -> methods -> decoding -> engine)")
    return bad


def unit_edges(sources: list[tuple[str, str]]) -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> ['file:line', ...]: the import graph between units (packages
    and top-level modules), every import counted; a name of the root package that is no
    unit (``__version__``) is the root's ``__init__``."""
    units = {_unit(rel) for rel, _ in sources} | set(RANK) | SHARED | ENTRY
    edges: dict[str, dict[str, list[str]]] = {}
    for rel, source in sources:
        me = _unit(rel)
        for line, mod in imported_modules(rel, source):
            parts = mod.split(".")
            if parts[0] != ROOT or len(parts) == 1:
                continue
            target = parts[1] if parts[1] in units else "__init__"
            if target != me:
                edges.setdefault(me, {}).setdefault(target, []).append(f"{rel}:{line}")
    return edges


def unit_cycles(sources: list[tuple[str, str]]) -> list[str]:
    """Every import loop between units: each strongly connected component of more than one
    unit, with the imports that close it."""
    return _loops(unit_edges(sources))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def file_edges(sources: list[tuple[str, str]]) -> dict[str, dict[str, list[str]]]:
    """module -> imported module of the same unit -> ['file:line', ...]: the import graph between
    the files of each package (imports under ``if TYPE_CHECKING:`` left out). ``from X import a``
    is an import of ``X.a`` when that is a file of the package, else of ``X``."""
    modules = {_module_of(rel): rel for rel, _ in sources}

    def known(name: str) -> str | None:  # the longest prefix of a dotted name that is a file here
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    edges: dict[str, dict[str, list[str]]] = {}
    for rel, source in sources:
        me, tree = _module_of(rel), ast.parse(source)
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(rel, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names]
            else:
                continue
            for t in targets:
                if t is not None and t != me and _unit(modules[t]) == _unit(rel):
                    edges.setdefault(me, {}).setdefault(t, []).append(f"{rel}:{node.lineno}")
    return edges


def _loops(edges: dict[str, dict[str, list[str]]]) -> list[str]:
    """Each strongly connected component of more than one node of ``edges``, with the imports that close it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(edges) | {w for t in edges.values() for w in t}):
        if v not in index:
            visit(v)
    return [f"import loop {' <-> '.join(comp)}: " + "; ".join(
        f"{a} -> {b} ({', '.join(sorted(set(edges[a][b]))[:3])})" for a in comp for b in comp if b in edges.get(a, {}))
        for comp in found]


def file_cycles(sources: list[tuple[str, str]]) -> list[str]:
    """Every import loop between the files of one package."""
    return _loops(file_edges(sources))


def _sources() -> list[tuple[str, str]]:
    return [(p.relative_to(PKG).as_posix(), p.read_text()) for p in sorted(PKG.rglob("*.py"))]


# -- the checker itself ----------------------------------------------------

@pytest.mark.parametrize("rel,source", [
    ("methods/x.py", "from ..bench.runner import run_bench\n"),
    ("methods/x.py", "def f():\n    from ..bench import metrics\n"),
    ("methods/x.py", "def f():\n    import selfspec_cli.bench.report\n"),
    ("methods/x.py", "from .. import bench\n"),
    ("methods/x.py", "from ..cli.common import log\n"),
    ("decoding/x.py", "from ..methods.ar import AR\n"),
    ("decoding/x.py", "from selfspec_cli.methods import build\n"),
    ("engine/x.py", "from ..decoding.state import DecodeState\n"),
    ("engine/sub/x.py", "def f():\n    from ...decoding import loop\n"),
    ("bench/x.py", "from ..cli.common import log\n"),
    ("methods/self_sd/x.py", "from ...bench import metrics\n"),
    ("methods/specee/x.py", "from ...cli.offline import run_step\n"),
    ("decoding/x.py", "from ..methods.self_sd import SkipSet\n"),
    ("config.py", "from .methods import METHODS\n"),
    ("runtime.py", "def f():\n    from .bench.runner import run_bench\n"),
    ("methods/x.py", "def f():\n    import optuna\n"),
    ("bench/x.py", "import optuna.trial\n"),
    ("artifacts.py", "def f():\n    import optuna\n"),
    ("bench/x.py", "from rich.table import Table\n"),
    ("methods/self_sd/x.py", "import typer\n"),
    ("methods/specee/x.py", "import optuna\n"),
    ("engine/x.py", "import click\n"),
])
def test_checker_catches(rel, source):
    assert violations(rel, source), (rel, source)


@pytest.mark.parametrize("rel,source", [
    ("cli/x.py", "from ..methods.self_sd import calibrate\nfrom ..bench import z\nimport typer, rich, click, optuna\n"),
    ("methods/self_sd/x.py", "import optuna\nfrom ..ar import AR\nfrom ...decoding import output\nfrom ...engine import Engine\n"),
    ("methods/specee/x.py", "from ..adadecode.heads import x\nfrom .predictor import y\nfrom . import train\n"),
    ("bench/x.py", "from ..methods.self_sd import uniform_layers\nfrom ..runtime import run_prompt\n"),
    ("methods/x.py", "from ..decoding.driver import Draft\nfrom ..engine import Engine\nfrom .. import artifacts, loading\n"),
    ("decoding/x.py", "from ..engine.runner import ALL_ROWS\nfrom ..config import GenerationConfig\n"),
    ("engine/x.py", "from . import kernels\nfrom ..errors import UnsupportedModelError\n"),
    ("loading.py", "from .engine.adapter import SUPPORTED_MODEL_TYPES\nfrom .errors import ConfigError\n"),
    ("runtime.py", "from .decoding.output import DecodeResult\nfrom .prompts import Prompt\n"),
    ("__main__.py", "from .cli.app import run\n"),
])
def test_checker_allows(rel, source):
    assert violations(rel, source) == [], (rel, source)


def test_relative_imports_resolve():
    assert (1, "selfspec_cli.engine") in imported_modules("methods/ar.py", "from ..engine import Engine\n")
    assert (1, "selfspec_cli.methods.base") in imported_modules("methods/ar.py", "from .base import Method\n")
    assert (1, "selfspec_cli.bench.metrics") in imported_modules("bench/report.py", "from . import metrics\n")
    assert (1, "selfspec_cli.bench.metrics") in imported_modules("bench/__init__.py", "from . import metrics\n")
    assert (1, "selfspec_cli.cli.app") in imported_modules("__main__.py", "from .cli.app import run\n")
    assert (2, "selfspec_cli.artifacts") in imported_modules("methods/x.py", "\nfrom .. import artifacts\n")
    assert (1, "selfspec_cli.engine") in imported_modules("methods/self_sd/calibrate.py", "from ...engine import Engine\n")
    assert (1, "selfspec_cli.methods.ar") in imported_modules("methods/self_sd/calibrate.py", "from ..ar import AR\n")


@pytest.mark.parametrize("rel,source", [
    ("methods/x.py", "from ..artifacts import _read_json\n"),
    ("cli/x.py", "def f():\n    from ..artifacts import _umask\n"),
    ("bench/x.py", "from .plots import _plt, save_figure\n"),
    ("bench/x.py", "from selfspec_cli.bench.plots import _plt\n"),
    ("methods/x.py", "from .. import artifacts\nartifacts._check_fingerprint(m, p)\n"),
    ("artifacts.py", "from . import loading\n\ndef f(n):\n    return loading._looks_local(n)\n"),
    ("bench/x.py", "import selfspec_cli.loading as L\nL._HUB_ID\n"),
    ("bench/x.py", "import selfspec_cli.loading\nselfspec_cli.loading._HUB_ID\n"),
    ("bench/x.py", "from .. import engine\nengine.kernels._state\n"),
    ("methods/x.py", "from ..engine import Engine\nEngine._ops\n"),
])
def test_private_checker_catches(rel, source):
    assert private_uses(rel, source), (rel, source)


@pytest.mark.parametrize("rel,source", [
    ("bench/x.py", "from .plots import pyplot, save_figure\nfrom . import plots\nplots.pyplot()\n"),
    ("methods/x.py", "import os\nos._exit\nfrom ..engine import Engine\nself._x = Engine\n"),
    ("bench/plots.py", "from selfspec_cli.bench import plots\nplots._cache\n"),  # its own module
    ("x.py", "from . import __version__\nfrom .m import __all__\n"),  # dunders are not private
    ("methods/x.py", "def f(artifacts):\n    return _local(artifacts)\n"),
])
def test_private_checker_allows(rel, source):
    assert private_uses(rel, source) == [], (rel, source)


@pytest.mark.parametrize("sources", [
    [("runtime.py", "from .decoding.output import DecodeResult\n"), ("decoding/cost.py", "from ..runtime import timed\n")],
    [("loading.py", "from .engine.adapter import check_supported\n"),
     ("engine/runner.py", "def f():\n    from ..loading import gguf_source\n")],
    [("artifacts.py", "from . import loading\n"), ("loading.py", "from .engine import x\n"),
     ("engine/quant.py", "from ..artifacts import atomic_write\n")],  # around three units
    [("config.py", "import selfspec_cli.errors\n"), ("errors.py", "from selfspec_cli import config\n")],
])
def test_cycle_checker_catches(sources):
    assert unit_cycles(sources), sources


def test_cycle_checker_allows_a_chain_and_imports_inside_a_unit():
    sources = [("runtime.py", "from .decoding.cost import timed\n"), ("decoding/cost.py", "from ..engine import Engine\n"),
               ("decoding/output.py", "from .cost import timed\nfrom . import state\n"), ("decoding/state.py", "from .output import x\n"),
               ("engine/runner.py", "from ..paths import cache_root\nfrom .. import __version__\n")]
    assert unit_cycles(sources) == []


@pytest.mark.parametrize("sources", [
    [("cli/app.py", "from .entry import INTERRUPTED\n"), ("cli/entry.py", "def run():\n    from .app import main\n")],
    [("cli/a.py", "from . import b\n"), ("cli/b.py", "import selfspec_cli.cli.c\n"), ("cli/c.py", "from .a import x\n")],
    [("methods/__init__.py", "from .auto import Auto\n"), ("methods/auto.py", "from . import build\n")],
    [("engine/runner.py", "from .target import x\n"),
     ("engine/target.py", "if 1:\n    from .runner import Engine\n")],  # not TYPE_CHECKING: it runs
])
def test_file_cycle_checker_catches(sources):
    assert file_cycles(sources), sources


def test_file_cycle_checker_allows():
    sources = [("engine/runner.py", "from .target import x\nfrom . import cache\n"),
               ("engine/target.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runner import Engine\n"),
               ("engine/__init__.py", "from .runner import Engine\n"), ("engine/cache.py", "from ..errors import E\n"),
               ("cli/app.py", "from ..engine import runner\n"), ("errors.py", "from .engine.cache import x\n")]
    assert file_cycles(sources) == []  # (a loop between units is unit_cycles' to find)


# -- the package -----------------------------------------------------------

def test_every_file_is_classified():
    units = {_unit(rel) for rel, _ in _sources()}
    unknown = units - set(RANK) - SHARED - ENTRY - {"__init__"}
    assert not unknown, f"new top-level units {sorted(unknown)}: add them to RANK or SHARED in this test"
    assert set(RANK) <= units  # every package named here exists


@pytest.mark.parametrize("unit", [*RANK, "top-level"])
def test_import_direction(unit):
    found = [v for rel, src in _sources()
             if (_unit(rel) in SHARED | ENTRY | {"__init__"} if unit == "top-level" else _unit(rel) == unit)
             for v in violations(rel, src) if "may only be imported" not in v]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", sorted(THIRD_PARTY_ONLY_IN))
def test_third_party_confined(module):
    found = [v for rel, src in _sources() for v in violations(rel, src) if v.endswith(f"{module} may only be imported in "
                                                                                    f"{sorted(THIRD_PARTY_ONLY_IN[module])}")]
    assert not found, "\n".join(found)


# -- the repository: code, user docs, shipped artifacts ----------------------

REPO = PKG.parent
NOTEBOOK = "docs/log.md"
TRACKED_LIMIT = 10_000_000  # bytes of tracked files outside artifacts/models/ (issue 24)


def notebook_citations(rel: str, text: str) -> list[str]:
    """Lines of the library file ``rel`` that cite the lab notebook: a library file cites the
    user doc that states a fact (docs/engine.md, docs/design.md, ...), never docs/log.md."""
    return [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if "log.md" in line]


@pytest.mark.parametrize("text,found", [
    ("# measured: docs/log.md, 2026-11-23\n", 1),
    ('"""Why (docs/log.md, issue 12)."""\n', 1),
    ("// see log.md\n", 1),
    ('# measured: docs/engine.md, "Threads"\n', 0),
    ("logging.info('x')\n", 0),
])
def test_notebook_checker(text, found):
    assert len(notebook_citations("x.py", text)) == found


def _cites_nothing(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary data (none is expected to cite a document)
        found += notebook_citations(path.relative_to(REPO).as_posix(), text)
    return found


def test_library_does_not_cite_the_notebook():
    found = _cites_nothing(sorted(p for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts))
    assert not found, ("cite the user doc that states the fact, not the lab notebook:\n" + "\n".join(found))


def test_docs_and_scripts_do_not_cite_the_notebook():
    """The README, the user docs (docs/*.md but the notebook itself and its archive, docs/log/) and the scripts state
    a fact or link the user doc or committed run (docs/bench/...) that holds it, never a notebook entry (issue 49)."""
    docs = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "log.md"),
            *sorted((REPO / "scripts").glob("*.py"))]
    found = _cites_nothing([p for p in docs if p.is_file()])
    assert not found, ("state the fact, or cite the user doc or docs/bench run that holds it, not the lab "
                       "notebook:\n" + "\n".join(found))


# ---------------------------------------------------------------- complexity (issue 49)

MAX_COMPLEXITY = 12  # ruff's C901 (McCabe) over every function of selfspec_cli


def test_no_function_is_over_the_complexity_limit():
    """Every function of selfspec_cli has a McCabe complexity of at most 12 (ruff's C901; the `test` extra installs
    ruff): a longer one is split into named helpers that read top to bottom."""
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    out = subprocess.run([ruff, "check", "--no-cache", "--select", "C901", "--output-format", "concise",
                          "--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}", str(PKG)],
                         capture_output=True, text=True, timeout=300)
    over = [line for line in out.stdout.splitlines() if "C901" in line]
    assert out.returncode in (0, 1) and not over, "functions over complexity 12:\n" + "\n".join(over or [out.stderr])


# ---------------------------------------------------------------- the README's first screen and status table

README = REPO / "README.md"
FIRST_SCREEN = 40  # lines
MAX_STATUS_WORDS = 40


def status_table(text: str) -> list[list[str]]:
    """The cells of the README's status table (the table whose header starts ``| method | `--method` |``), one list
    per row below the header and its rule."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method | `--method` |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def long_cells(rows: list[list[str]], limit: int = MAX_STATUS_WORDS) -> list[str]:
    return [f"{row[0]}: {len(c.split())} words" for row in rows for c in row if len(c.split()) > limit]


def test_status_checker():
    table = ("| method | `--method` | status |\n|---|---|---|\n| a | `a` | " + "w " * 41 + "|\n"
             "| b | `b` | short, with a \\| pipe |\n\nafter")
    rows = status_table(table)
    assert [r[0] for r in rows] == ["a", "b"] and len(rows[1]) == 3
    assert long_cells(rows) == ["a: 41 words"]


def test_readme_status_cells_are_short():
    """One short cell per method (issue 49): its figure on the default target and a link to the run; the history
    and the older targets live in docs/benchmarks.md."""
    rows = status_table(README.read_text(encoding="utf-8"))
    assert rows, "the README has no status table"
    assert not long_cells(rows), f"status cells over {MAX_STATUS_WORDS} words: {long_cells(rows)}"


def test_readme_first_screen_has_the_quick_start():
    """The README's first 40 lines hold the setup command, the test command and a one-line
    ``selfspec generate -P`` example (issue 49: a newcomer reads them in one screen)."""
    first = README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN]
    assert any(line.startswith("make demo") for line in first), "no setup command (make demo) in the first screen"
    assert any(line.startswith("make test") for line in first), "no test command (make test) in the first screen"
    assert any("selfspec generate -P " in line for line in first), "no `selfspec generate -P` example in the first screen"


def _tracked_files() -> list[str] | None:
    """Paths git tracks in the checkout this package lives in, or None outside a git checkout."""
    import subprocess

    try:
        top = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=60)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO.resolve():
            return None
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def tracked_size(paths: list[str], root: Path) -> tuple[int, dict[str, int]]:
    """Bytes of the tracked files outside artifacts/models/ (as `du -b`: a link counts its own
    size; a tracked file missing from the working tree counts nothing), and per top folder."""
    total, by_dir = 0, {}
    for rel in paths:
        if rel.startswith("artifacts/models/"):
            continue
        try:
            size = (root / rel).lstat().st_size
        except FileNotFoundError:
            continue
        total += size
        key = "/".join(rel.split("/")[:2]) if rel.startswith("docs/") else rel.split("/")[0]
        by_dir[key] = by_dir.get(key, 0) + size
    return total, by_dir


def test_tracked_size_counts_outside_models(tmp_path):
    (tmp_path / "artifacts" / "models").mkdir(parents=True)
    (tmp_path / "artifacts" / "models" / "w.bin").write_bytes(b"x" * 1000)
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "r.json").write_bytes(b"x" * 30)
    (tmp_path / "README.md").write_bytes(b"x" * 7)
    total, by_dir = tracked_size(["artifacts/models/w.bin", "docs/bench/r.json", "README.md", "gone.txt"], tmp_path)
    assert total == 37 and by_dir == {"docs/bench": 30, "README.md": 7}


def test_tracked_files_outside_models_stay_small():
    paths = _tracked_files()
    if paths is None:
        pytest.skip("not a git checkout (an installed package): nothing to measure")
    total, by_dir = tracked_size(paths, REPO)
    largest = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(by_dir.items(), key=lambda kv: -kv[1])[:8])
    assert total <= TRACKED_LIMIT, (
        f"tracked files outside artifacts/models/ hold {total / 1e6:.1f} MB, over {TRACKED_LIMIT / 1e6:.0f} MB: "
        f"keep one current run per setting in docs/bench (older ones live in git history). Largest: {largest}")
def test_no_private_names_across_modules():
    found = [v for rel, src in _sources() for v in private_uses(rel, src)]
    assert not found, "\n".join(found)


def test_no_import_loop_between_units():
    found = unit_cycles(_sources())
    assert not found, "\n".join(found)


def test_no_import_loop_between_files_of_a_package():
    found = file_cycles(_sources())
    assert not found, "\n".join(found)


CLI_FUNCTION_LINES = 60  # issue 36: the CLI parses and prints; the work lives in session.py, bench/, methods/


def long_functions(rel: str, source: str, limit: int) -> list[str]:
    """Functions of ``source`` longer than ``limit`` lines (signature, docstring and body)."""
    return [f"{rel}:{n.lineno} {n.name} is {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_long_function_checker():
    assert long_functions("x.py", "def f():\n" + "    x = 1\n" * 3, 3) == ["x.py:1 f is 4 lines"]
    assert long_functions("x.py", "def f():\n" + "    x = 1\n" * 2, 3) == []


def test_cli_functions_stay_short():
    found = [v for rel, src in _sources() if rel.startswith("cli/") for v in long_functions(rel, src, CLI_FUNCTION_LINES)]
    assert not found, "\n".join(found)


UNTYPED_JSON_PACKAGES = ("decoding/", "methods/", "bench/")
# file -> public functions allowed to keep dict[str, Any] for now: none (the list may only shrink: an entry
# that no longer offends fails)
UNTYPED_JSON_PENDING: dict[str, set[str]] = {}


def _untyped_json_type(node: ast.expr | None) -> bool:
    """Whether the annotation ``node`` holds ``dict``/``Dict``/``Mapping`` ``[str, Any]`` anywhere (a quoted one too)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _untyped_json_type(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return False
    for n in ast.walk(node):
        if (isinstance(n, ast.Subscript) and (_dotted(n.value) or [""])[-1] in ("dict", "Dict", "Mapping")
                and isinstance(n.slice, ast.Tuple) and len(n.slice.elts) == 2
                and [(_dotted(e) or [""])[-1] for e in n.slice.elts] == ["str", "Any"]):
            return True
    return False


def untyped_json(rel: str, source: str) -> list[str]:
    """``rel:line name`` for each public function or method (module level, or in a class) of ``source`` with an
    untyped JSON object in a parameter or return annotation, and each module-level alias of one."""
    found: list[str] = []

    def visit(body: list[ast.stmt], owner: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{owner}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
                if any(_untyped_json_type(p.annotation) for p in params) or _untyped_json_type(node.returns):
                    found.append(f"{rel}:{node.lineno} {owner}{node.name}")

    tree = ast.parse(source)
    visit(tree.body, "")
    aliases = (ast.Assign, ast.AnnAssign, *((ast.TypeAlias,) if hasattr(ast, "TypeAlias") else ()))
    # an alias would hide the type from the check above
    found += [f"{rel}:{n.lineno} alias" for n in tree.body if isinstance(n, aliases) and _untyped_json_type(n.value)]
    return found


@pytest.mark.parametrize("source", [
    "from typing import Any\ndef f(x: dict[str, Any]) -> int: ...",
    "def f() -> 'Mapping[str, Any] | None': ...",
    "class C:\n    def f(self, *, d: list[typing.Dict[str, Any]]) -> None: ...",
    "Record = Mapping[str, Any]",
])
def test_untyped_json_checker_catches(source):
    assert untyped_json("bench/x.py", source)


@pytest.mark.parametrize("source", [
    "def _f(x: dict[str, Any]) -> None: ...",
    "def f(x: JsonObject, y: dict[str, int]) -> dict[int, Any]: ...",
    "def f():\n    def g(x: dict[str, Any]) -> None: ...",
    "x: dict[str, Any] = {}\ndef f(x: dict[str, object]) -> None: ...",
])
def test_untyped_json_checker_allows(source):
    assert not untyped_json("bench/x.py", source)


def test_no_untyped_json_across_module_boundaries():
    found = [(rel, v) for rel, src in _sources() if rel.startswith(UNTYPED_JSON_PACKAGES) for v in untyped_json(rel, src)]
    named = {(rel, v.split()[-1].rsplit(".", 1)[-1]) for rel, v in found}
    left = [v for rel, v in found if v.split()[-1].rsplit(".", 1)[-1] not in UNTYPED_JSON_PENDING.get(rel, ())]
    assert not left, ("dict[str, Any] in a signature across a module boundary (a dataclass, or jsonio.JsonObject for "
                      "a genuinely free-form JSON object):\n" + "\n".join(left))
    typed = [f"{rel} {name}" for rel, names in UNTYPED_JSON_PENDING.items() for name in names if (rel, name) not in named]
    assert not typed, "typed now: drop from UNTYPED_JSON_PENDING: " + ", ".join(typed)


# JsonObject (jsonio.py) is for documents written to or read from JSON files and streams only. A public function or
# method of decoding/, methods/ or bench/ that takes or returns one is either a serializer at the I/O point (a
# typed value's to_json/from_json/to_dict/from_dict/as_dict) or one of these documented exceptions, per file:
# (why, names). A new one fails; so does a listed one that no longer takes or returns a JsonObject (the list
# only shrinks).
JSON_SERIALIZERS = {"to_json", "from_json", "to_dict", "from_dict", "as_dict"}
JSON_OBJECT_EXCEPTIONS: dict[str, tuple[str, set[str]]] = {
    "decoding/cost_store.py": ("what is stored, as selfspec profile's JSON and generate's summary show it",
                               {"describe"}),
    "methods/__init__.py": ("a method's config values as the command line or a settings file gives them", {"config_for"}),
    "methods/offline.py": ("an offline step's options from the command line; the manifest and environment an artifact's "
                           "JSON file holds", {"prepare", "publish", "environment"}),
    "methods/onpolicy.py": ("training options from the command line; the manifest written beside the heads",
                            {"check_options", "collect", "finish"}),
    "methods/adadecode/__init__.py": ("the heads artifact's manifest, as read from disk", {"load_heads"}),
    "methods/adadecode/train.py": ("the training options and the manifest written beside the heads",
                                   {"evaluate_head", "prepare", "head_vocabulary", "run"}),
    "methods/fr_spec/calibrate.py": ("the vocabulary artifact's manifest and the step's summary, written as JSON",
                                     {"summary", "run"}),
    "methods/self_sd/__init__.py": ("the skip-set artifact's manifest, written to disk", {"to_manifest"}),
    "methods/self_sd/calibrate.py": ("the calibration's options and the manifest it writes",
                                     {"build_manifest", "prepare", "run", "write_result"}),
    "methods/self_sd/measure.py": ("measurements stored as an Optuna trial's user attributes (JSON)", {"confirm"}),
    "methods/self_sd/study.py": ("Optuna's own params and user attributes, and the study's setup stored with it",
                                 {"params_for", "skip_sets_from_params", "open_study", "seed_values", "run_search",
                                  "faster_starting_point", "confirm"}),
    "methods/specee/__init__.py": ("the exit-MLP and schedule artifacts' manifests, as read from disk",
                                   {"load_exit_mlps", "load_schedule"}),
    "methods/specee/calibrate.py": ("the schedule artifact's manifest it writes", {"run"}),
    "methods/specee/train.py": ("the training options and the manifest it writes", {"prepare", "run"}),
    "bench/engine_profile.py": ("plots of the written document (profile.json)", {"verify_cost_plot", "redundancy_plot"}),
    "bench/job.py": ("run.json's key and the JSONL lines, as written and read back", {"run_key", "earlier_records",
                                                                                      "write_jsonl"}),
    "bench/profile.py": ("selfspec profile's document, written as built", {"run"}),
    "bench/report.py": ("results.json, its headline, Spec-Bench's answer lines and the offline costs it holds",
                        {"summarize", "document", "headline", "spec_bench_answers"}),
    "bench/suite_loader.py": ("where the prompts came from, as results.json's setup records it", {"load_prompts"}),
}


def json_object_signatures(rel: str, source: str) -> list[str]:
    """``rel:line name`` for each public function or method of ``source`` (module level, or in a class) that is
    not a serializer (:data:`JSON_SERIALIZERS`) and names ``JsonObject`` in a parameter or return annotation."""
    found: list[str] = []

    def named(node: ast.expr | None) -> bool:
        return node is not None and any(
            (isinstance(n, ast.Name) and n.id == "JsonObject") or (isinstance(n, ast.Attribute) and n.attr == "JsonObject")
            or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "JsonObject" in n.value) for n in ast.walk(node))

    def visit(body: list[ast.stmt], owner: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{owner}{node.name}.")
            elif (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
                  and node.name not in JSON_SERIALIZERS):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
                if any(named(p.annotation) for p in params) or named(node.returns):
                    found.append(f"{rel}:{node.lineno} {owner}{node.name}")

    visit(ast.parse(source).body, "")
    return found


@pytest.mark.parametrize("source", [
    "def f(x: JsonObject) -> int: ...",
    "class C:\n    def report(self) -> 'JsonObject | None': ...",
    "def f() -> list[jsonio.JsonObject]: ...",
])
def test_json_object_checker_catches(source):
    assert json_object_signatures("bench/x.py", source)


@pytest.mark.parametrize("source", [
    "def _f(x: JsonObject) -> None: ...",
    "class C:\n    def to_json(self) -> JsonObject: ...\n    @classmethod\n    def from_dict(cls, d: JsonObject): ...",
    "x: JsonObject = {}\ndef f(x: dict[str, int]) -> None: ...",
])
def test_json_object_checker_allows(source):
    assert not json_object_signatures("bench/x.py", source)


def test_json_object_only_at_io_and_in_the_documented_exceptions():
    """Issue 49: a report with fixed keys that one module builds and another reads by key is a dataclass; JsonObject
    stays only for documents written to or read from JSON (the exceptions above, each with its reason)."""
    found = [(rel, v) for rel, src in _sources() if rel.startswith(UNTYPED_JSON_PACKAGES)
             for v in json_object_signatures(rel, src)]
    allowed = {rel: names for rel, (_, names) in JSON_OBJECT_EXCEPTIONS.items()}
    new = [v for rel, v in found if v.split()[-1].rsplit(".", 1)[-1] not in allowed.get(rel, ())]
    assert not new, ("JsonObject in a public signature (a report with fixed keys is a dataclass, serialized once "
                     "by its to_json; a document read from or written to JSON is a documented exception):\n" + "\n".join(new))
    named = {(rel, v.split()[-1].rsplit(".", 1)[-1]) for rel, v in found}
    typed = [f"{rel} {n}" for rel, names in allowed.items() for n in names if (rel, n) not in named]
    assert not typed, "no JsonObject there now: drop from JSON_OBJECT_EXCEPTIONS: " + ", ".join(typed)


def test_json_object_is_the_one_alias():
    from selfspec_cli import jsonio

    assert jsonio.JsonObject == dict[str, Any]


def test_every_shipped_artifacts_tensors_belong_to_its_manifest():
    """Each shipped artifact's tensors file carries its manifest's artifact id (the loader refuses a mismatch as a
    partial copy: a hand re-save that drops the safetensors metadata would ship an artifact no command can load)."""
    import json

    from safetensors import safe_open

    manifests = sorted((REPO / "artifacts").rglob("manifest.json"))
    assert manifests, "no shipped artifact found"
    bad = []
    for m in manifests:
        manifest = json.loads(m.read_text(encoding="utf-8"))
        tensors = m.parent / manifest.get("tensors_file", "tensors.safetensors")
        if not tensors.exists():
            continue
        with safe_open(str(tensors), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("artifact_id") != manifest.get("artifact_id"):
            bad.append(str(m.parent.relative_to(REPO)))
    assert not bad, f"tensors of another artifact (or none): {bad}"
