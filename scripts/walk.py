"""Follow one parameter through the library's calls, as a reader does, and count the returns to a file.

Run: python scripts/walk.py selfspec_cli/methods/self_sd/calibrate.py:run:job [--trace]

The walk reads the start function top to bottom. A call that is handed the parameter, or a value made from it
(an assignment whose right side uses a followed name follows its targets; a tuple unpacking follows every
target), is read in turn, depth first, where it can be resolved statically: a function of the same module, an
imported function or class (its ``__init__``), or a method of a followed value whose class is known from an
annotation, a constructor call or ``self``. Each function is read once: a second call to it is not followed
again. Nested functions and lambdas are read where they are defined. The walk stays inside the package.

The figures printed: how many times the walk enters a file it had already left, by a call or by a callee returning
to its caller in another file, and how many of those were calls (the count issues 36 and 49 bound: a reader who
jumps back into a file to read one more function of it). ``--trace`` prints the walk.
Invariants: reads the source only (imports nothing of the package); the same tree gives the same count.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Module:
    path: Path
    name: str
    tree: ast.Module
    funcs: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "module" or "module:attr"


def _resolve_from(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    is_pkg = mod.path.name == "__init__.py"
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def load(root: Path) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        m = Module(p, ".".join(parts), ast.parse(p.read_text()))
        for node in m.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.funcs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                m.classes[node.name] = node
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve_from(m, node)
                for a in node.names:
                    m.imports[a.asname or a.name] = f"{src}:{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    m.imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        mods[m.name] = m
    return mods


class Walk:
    def __init__(self, mods: dict[str, Module], trace: bool, within: str) -> None:
        self.mods, self.trace, self.within = mods, trace, within
        self.read: set[tuple[str, str]] = set()
        self.files: list[str] = []  # the file the reader is in, each time it changes
        self.left: set[str] = set()
        self.returns = 0
        self.by_call = 0  # of those, by a call (not a callee returning to its caller)

    # -- where the reader is
    def goto(self, file: str, why: str, depth: int) -> None:
        cur = self.files[-1] if self.files else None
        if file == cur:
            return
        back = file in self.left
        if cur is not None:
            self.left.add(cur)
        self.returns += back
        self.by_call += back and why != "back"
        self.files.append(file)
        if self.trace:
            print(f"{'  ' * depth}{'RETURN ' if back else ''}-> {file}  ({why})")

    # -- resolving names
    def lookup(self, mod: Module, name: str, seen: frozenset = frozenset()) -> tuple[Module, ast.AST] | None:
        if (mod.name, name) in seen:
            return None
        seen = seen | {(mod.name, name)}
        if name in mod.funcs:
            return mod, mod.funcs[name]
        if name in mod.classes:
            return mod, mod.classes[name]
        target = mod.imports.get(name)
        if target is None:
            return None
        if ":" in target:
            src, attr = target.split(":")
            if src in self.mods:
                other = self.mods[src]
                if attr in other.funcs or attr in other.classes or attr in other.imports:
                    return self.lookup(other, attr, seen)
            if f"{src}.{attr}" in self.mods:
                return self.mods[f"{src}.{attr}"], self.mods[f"{src}.{attr}"].tree
        elif target in self.mods:
            return self.mods[target], self.mods[target].tree
        return None

    def method(self, mod: Module, cls: ast.ClassDef, name: str) -> tuple[Module, ast.FunctionDef] | None:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return mod, node
        for base in cls.bases:
            if isinstance(base, ast.Name) and (got := self.lookup(mod, base.id)) and isinstance(got[1], ast.ClassDef):
                if (m := self.method(got[0], got[1], name)) is not None:
                    return m
        return None

    def class_of(self, mod: Module, ann: ast.AST | None) -> tuple[Module, ast.ClassDef] | None:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(ann, ast.BinOp):  # X | None
            return self.class_of(mod, ann.left) or self.class_of(mod, ann.right)
        if isinstance(ann, ast.Name) and (got := self.lookup(mod, ann.id)) and isinstance(got[1], ast.ClassDef):
            return got  # type: ignore[return-value]
        return None

    # -- reading one function
    def function(self, mod: Module, fn: ast.FunctionDef, followed: set[str], types: dict, depth: int,
                 owner: tuple[Module, ast.ClassDef] | None = None) -> None:
        key = (mod.name, f"{owner[1].name + '.' if owner else ''}{fn.name}")
        if key in self.read or not str(mod.path).startswith(self.within):
            return
        self.read.add(key)
        self.goto(str(mod.path), ".".join(key), depth)
        types = {k: v for k, v in types.items() if isinstance(k, tuple)}
        for a in fn.args.args + fn.args.kwonlyargs:
            if (c := self.class_of(mod, a.annotation)) is not None:
                types[a.arg] = c
        if owner is not None and fn.args.args:
            types[fn.args.args[0].arg] = owner
        self.body(mod, fn.body, set(followed), types, depth, str(mod.path))

    def body(self, mod: Module, stmts: list[ast.stmt], followed: set[str], types: dict, depth: int, here: str) -> None:
        for st in stmts:
            self.statement(mod, st, followed, types, depth, here)

    def uses(self, node: ast.AST | None, followed: set[str]) -> bool:
        return node is not None and any(isinstance(n, ast.Name) and n.id in followed for n in ast.walk(node))

    def statement(self, mod: Module, st: ast.stmt, followed: set[str], types: dict, depth: int, here: str) -> None:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a nested function: read where defined
            if self.uses(st, followed):
                self.body(mod, st.body, followed | {st.name}, types, depth, here)
                followed.add(st.name)
            return
        if isinstance(st, ast.ClassDef):
            return
        self.calls(mod, st, followed, types, depth, here)
        targets: list[ast.AST] = []
        value = None
        if isinstance(st, ast.Assign):
            targets, value = st.targets, st.value
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)) and st.value is not None:
            targets, value = [st.target], st.value
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            targets, value = [st.target], st.iter
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                if item.optional_vars is not None and self.uses(item.context_expr, followed):
                    followed.update(n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name))
        if value is not None and self.uses(value, followed):
            for t in targets:
                followed.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                if isinstance(t, ast.Name) and isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                    got = self.lookup(mod, value.func.id)
                    if got is not None and isinstance(got[1], ast.ClassDef):
                        types[t.id] = got
        for name in ("body", "orelse", "finalbody", "handlers"):
            for sub in getattr(st, name, []) or []:
                if isinstance(sub, ast.ExceptHandler):
                    self.body(mod, sub.body, followed, types, depth, here)
                elif isinstance(sub, ast.stmt):
                    self.statement(mod, sub, followed, types, depth, here)

    def calls(self, mod: Module, st: ast.stmt, followed: set[str], types: dict, depth: int, here: str) -> None:
        """The calls of statement ``st``'s own expressions (not its nested blocks), in source order."""
        exprs = [v for k, v in ast.iter_fields(st) if k not in ("body", "orelse", "finalbody", "handlers")]
        nodes: list[ast.AST] = []
        for e in exprs:
            for item in e if isinstance(e, list) else [e]:
                if isinstance(item, ast.AST):
                    nodes.extend(n for n in ast.walk(item) if isinstance(n, ast.Call))
        nodes.sort(key=lambda n: (n.lineno, n.col_offset))
        for call in nodes:
            args = [*call.args, *(k.value for k in call.keywords)]
            func = call.func
            receiver = func.value if isinstance(func, ast.Attribute) else None
            callback = isinstance(func, ast.Name) and ("callback", func.id) in types
            if not callback and not any(self.uses(a, followed) for a in args) and not self.uses(receiver, followed):
                continue
            target = self.resolve(mod, func, types)
            if target is None:
                continue
            tmod, node, owner = target
            callee = self.bind(node, call, followed, owner is not None and (callback or self.uses(receiver, followed)))
            if not callee and not callback:
                continue
            self.function(tmod, node, callee, self.callbacks(mod, node, call, types), depth + 1, owner)
            self.goto(here, "back", depth)

    def callbacks(self, mod: Module, fn: ast.FunctionDef, call: ast.Call, types: dict) -> dict:
        """The callee's parameters bound to a function the caller names (``obj.method`` of a known class, or a
        function), so that the callee calling them is followed there."""
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        offset = 1 if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute) else 0
        pairs = [(params[i + offset], a) for i, a in enumerate(call.args) if i + offset < len(params)]
        pairs += [(k.arg, k.value) for k in call.keywords if k.arg]
        out = {}
        for name, value in pairs:
            if isinstance(value, (ast.Attribute, ast.Name)) and (got := self.resolve(mod, value, types)) is not None:
                out[("callback", name)] = got
        return out

    def resolve(self, mod: Module, func: ast.AST, types: dict):
        if isinstance(func, ast.Name) and ("callback", func.id) in types:
            return types[("callback", func.id)]
        if isinstance(func, ast.Name):
            got = self.lookup(mod, func.id)
            if got is None:
                return None
            m, node = got
            if isinstance(node, ast.ClassDef):
                init = self.method(m, node, "__init__") or self.method(m, node, "__post_init__")
                return (init[0], init[1], (m, node)) if init else None
            return (m, node, None) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name):
                if base.id in types:
                    cm, cls = types[base.id]
                    got = self.method(cm, cls, func.attr)
                    return (got[0], got[1], (cm, cls)) if got else None
                got = self.lookup(mod, base.id)
                if got is not None and isinstance(got[1], ast.Module):
                    target_mod = next(m for m in self.mods.values() if m.tree is got[1])
                    return self.resolve(target_mod, ast.Name(func.attr), {})
                if got is not None and isinstance(got[1], ast.ClassDef):  # Cls.classmethod(...)
                    m = self.method(got[0], got[1], func.attr)
                    return (m[0], m[1], got) if m else None
        return None

    def bind(self, fn: ast.FunctionDef, call: ast.Call, followed: set[str], self_followed: bool) -> set[str]:
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        out: set[str] = set()
        offset = 0
        if self_followed is not None and params and params[0] in ("self", "cls"):
            if self_followed:
                out.add(params[0])
            offset = 1
        for i, a in enumerate(call.args):
            if self.uses(a, followed):
                if i + offset < len(params):
                    out.add(params[i + offset])
                elif fn.args.vararg is not None:
                    out.add(fn.args.vararg.arg)
        names = set(params) | {a.arg for a in fn.args.kwonlyargs}
        for k in call.keywords:
            if self.uses(k.value, followed):
                if k.arg in names:
                    out.add(k.arg)
                elif fn.args.kwarg is not None:
                    out.add(fn.args.kwarg.arg)
        return out


def main(argv: list[str]) -> int:
    spec = next(a for a in argv if not a.startswith("--"))
    path, func, param = spec.rsplit(":", 2)
    root = Path(path).parts[0]
    mods = load(Path(root))
    mod = next(m for m in mods.values() if m.path == Path(path))
    cls_name, _, fname = func.rpartition(".")
    owner = (mod, mod.classes[cls_name]) if cls_name else None
    fn = owner[1] and next(n for n in owner[1].body if getattr(n, "name", None) == fname) if owner else mod.funcs[fname]
    within = next((a.split("=", 1)[1] for a in argv if a.startswith("--within=")), str(Path(*Path(path).parts[:2])))
    w = Walk(mods, "--trace" in argv, within)
    w.function(mod, fn, {param}, {}, 0, owner)
    entered: dict[str, int] = {}
    for f in w.files:
        entered[f] = entered.get(f, 0) + 1
    print(f"returns to a file already left: {w.returns} ({w.by_call} by a call, the rest a callee returning to its "
          f"caller); functions read: {len(w.read)}; "
          f"files: {len(entered)}; most entered: {max(entered.items(), key=lambda kv: kv[1]) if entered else None}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
