"""Write selfspec's benchmark prompt suites for the shipped demo model.

Every prompt is cut from the demo model's HELD-OUT files (the standard library's
``test``/``tests``/``idle_test`` packages, same discovery as
``scripts/train_demo_model.py``), so a benchmark never measures on training text.
Deterministic for a given Python installation (the files) and seed::

    python scripts/make_suites.py [--seed 0] [--per-category 20] [--mini 2] \
        [--model artifacts/models/pystdlib-llama-12x256] [--out selfspec_cli/bench/suites]

Writes ``pystdlib.jsonl`` (every category) and ``pystdlib-mini.jsonl`` (the first
``--mini`` prompts of each category), one JSON object per line:
``{"id": "<category>-<nn>", "category": ..., "turns": [prompt], "source": "<file>:<line>"}``.

Categories:
  code          a function or method (with its class line) cut mid-line inside its body
  docstring     a docstring or a comment block cut mid-sentence, after a word
  boilerplate   repetitive structure cut inside its 3rd+ repetition: runs of the same
                assert call, multi-line literal tables, runs of constant assignments,
                runs of short test methods
  long-context  a 600+ token stretch of a file starting at a statement, cut mid-line

Every prompt ends mid-line at a token boundary of the uncut text (no newline, no
trailing whitespace: the byte-level BPE merges a newline with the next line's
indentation, so a prompt cut after a newline would not end at a boundary of the uncut text), and fits the model's context with
``--max-new-tokens`` new tokens. Files that do not parse, contain tabs, non-ASCII
text or lines over 100 characters are skipped, and each file gives at most one prompt.
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import stdlib_files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ("code", "docstring", "boilerplate", "long-context")
MAX_LINE = 100
# prompt token ranges per category (the upper bound is also capped by context - new tokens)
TOKEN_RANGE = {"code": (40, 400), "docstring": (24, 400), "boilerplate": (40, 450), "long-context": (600, 10**6)}
LONG_TARGET = (600, 740)
BOILERPLATE_KINDS_BY_RARITY = ("constants", "tests", "table", "asserts")


class Source:
    """One held-out file that passed the filters."""

    def __init__(self, rel: str, text: str, tree: ast.Module):
        self.rel = rel
        self.text = text
        self.lines = text.split("\n")
        self.tree = tree
        # top-level functions/classes and methods of top-level classes, with their class
        self.funcs: list[tuple[ast.AST, ast.ClassDef | None]] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.funcs.append((node, None))
            elif isinstance(node, ast.ClassDef):
                self.funcs.extend((n, node) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))

    def line(self, lineno: int) -> str:  # 1-based
        return self.lines[lineno - 1]

    def span(self, start: int, end: int) -> list[str]:  # 1-based, inclusive
        return self.lines[start - 1 : end]


def load_sources() -> list[Source]:
    root = Path(sysconfig.get_paths()["stdlib"])
    _, held = stdlib_files()
    out = []
    for path in held:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.isascii() or "\t" in text or "\x0c" in text or "\r" in text:
            continue
        if max((len(ln) for ln in text.split("\n")), default=0) > MAX_LINE:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        out.append(Source(path.relative_to(root).as_posix(), text, tree))
    return out


class Cutter:
    """Mid-line cut points that are token boundaries of the uncut text."""

    def __init__(self, tok):
        self.tok = tok
        self.pre = tok.backend_tokenizer.pre_tokenizer

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=True)["input_ids"])

    def _pretoken_ends(self, line: str) -> list[int]:
        return [end for _, (_, end) in self.pre.pre_tokenize_str(line)]

    def cut(self, head: str, line: str, rng: random.Random, prose: bool = False, min_col: int = 6) -> str | None:
        """``head`` (complete lines, ending in '\\n' or empty) + a prefix of ``line``.

        Code cuts end at a pre-token boundary with at least ``min_col`` non-space
        characters before it on the line and 3 characters after it; prose cuts end
        after a word that is followed by another word on the same line. The tokens of
        the prompt must be a prefix of the tokens of ``head + line``.
        """
        line = line.rstrip()
        indent = len(line) - len(line.lstrip())
        cands = []
        for p in self._pretoken_ends(line):
            if p - indent < min_col or len(line) - p < 3:
                continue
            a, b = line[p - 1], line[p]
            if a.isspace() or a in "_\\" or b == "_":
                continue
            if prose and not (a.isalpha() and b == " " and line[p + 1 : p + 2].isalpha() and _words(line[:p]) >= 2):
                continue
            cands.append(p)
        rng.shuffle(cands)
        full = self.tok(head + line, add_special_tokens=True)["input_ids"]
        for p in cands[:8]:
            prompt = head + line[:p]
            ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
            if ids == full[: len(ids)]:
                return prompt
        return None


def _words(text: str) -> int:
    return sum(any(c.isalpha() for c in w) for w in text.split())


def _start(node: ast.AST) -> int:
    decos = getattr(node, "decorator_list", None)
    return decos[0].lineno if decos else node.lineno


def _class_header(src: Source, cls: ast.ClassDef | None) -> str | None:
    """The class line of a method's class ('' for a function), None if it spans lines."""
    if cls is None:
        return ""
    if cls.decorator_list:
        return None
    line = src.line(cls.lineno)
    return line + "\n" if line.rstrip().endswith(":") else None


def _docstring_lines(func: ast.AST) -> set[int]:
    body = getattr(func, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        return set(range(body[0].lineno, body[0].end_lineno + 1))
    return set()


def _stmt_lines(node: ast.AST) -> set[int]:
    """Lines on which a single-line simple statement starts and ends inside ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.stmt) and n is not node and not isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            if not isinstance(n, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
                if n.lineno == n.end_lineno:
                    out.add(n.lineno)
            else:
                out.add(n.lineno)  # the header line of a compound statement
    return out


# ----------------------------------------------------------------- categories


def make_code(src: Source, cut: Cutter, rng: random.Random) -> tuple[str, int] | None:
    funcs = [(f, c) for f, c in src.funcs if f.end_lineno - f.lineno >= 5]
    helpers = [fc for fc in funcs if not fc[0].name.startswith("test")]
    pool = helpers if helpers and rng.random() < 0.6 else funcs
    rng.shuffle(pool)
    for func, cls in pool[:4]:
        header = _class_header(src, cls)
        if header is None:
            continue
        doc = _docstring_lines(func)
        first_body = func.body[0].lineno
        lines = sorted(ln for ln in _stmt_lines(func) if ln > first_body and ln not in doc)
        if not lines:
            continue
        ln = rng.choice(lines)
        head = header + "\n".join(src.span(_start(func), ln - 1)) + "\n"
        prompt = cut.cut(head, src.line(ln), rng)
        if prompt:
            return prompt, ln
    return None


def make_docstring(src: Source, cut: Cutter, rng: random.Random) -> tuple[str, int] | None:
    if rng.random() < 0.5:
        return _docstring(src, cut, rng) or _comment(src, cut, rng)
    return _comment(src, cut, rng) or _docstring(src, cut, rng)


def _prose_lines(src: Source, first: int, last: int) -> list[int]:
    return [ln for ln in range(first, last + 1) if len(src.line(ln).split()) >= 5]


def _docstring(src: Source, cut: Cutter, rng: random.Random) -> tuple[str, int] | None:
    cands: list[tuple[str, int, int]] = []  # (header, start, docstring line)
    mod_doc = _docstring_lines(src.tree)
    if mod_doc:
        cands += [("", 1, ln) for ln in _prose_lines(src, min(mod_doc), max(mod_doc))]
    for func, cls in src.funcs + [(n, None) for n in src.tree.body if isinstance(n, ast.ClassDef)]:
        header = _class_header(src, cls)
        doc = _docstring_lines(func)
        if header is None or not doc:
            continue
        cands += [(header, _start(func), ln) for ln in _prose_lines(src, min(doc), max(doc))]
    rng.shuffle(cands)
    for header, start, ln in cands[:6]:
        head = header + "\n".join(src.span(start, ln - 1)) + ("\n" if ln > start else "")
        prompt = cut.cut(head, src.line(ln), rng, prose=True, min_col=3)
        if prompt:
            return prompt, ln
    return None


def _comment(src: Source, cut: Cutter, rng: random.Random) -> tuple[str, int] | None:
    """A comment block (2+ lines) inside a function or method, from the def line."""
    cands = []
    for func, cls in src.funcs:
        header = _class_header(src, cls)
        if header is None:
            continue
        code = _stmt_lines(func)
        ln = func.body[0].lineno
        while ln <= func.end_lineno:
            if src.line(ln).lstrip().startswith("# "):
                end = ln
                while end + 1 <= func.end_lineno and src.line(end + 1).lstrip().startswith("# "):
                    end += 1
                words = sum(len(src.line(i).split()) for i in range(ln, end + 1))
                if end > ln and words >= 10 and ln - _start(func) <= 25 and (end + 1) in code | {func.end_lineno + 1}:
                    cands += [(header, _start(func), i) for i in _prose_lines(src, ln, end)]
                ln = end + 1
            else:
                ln += 1
    rng.shuffle(cands)
    for header, start, ln in cands[:6]:
        head = header + "\n".join(src.span(start, ln - 1)) + "\n"
        prompt = cut.cut(head, src.line(ln), rng, prose=True, min_col=4)
        if prompt:
            return prompt, ln
    return None


def _runs(items: list, key, min_len: int = 4) -> list[list]:
    """Maximal runs of consecutive items (on consecutive lines) with the same non-None key."""
    runs, cur = [], []
    for it in items:
        k = key(it)
        if cur and k is not None and k == key(cur[-1]) and it.lineno == cur[-1].end_lineno + 1:
            cur.append(it)
        else:
            if len(cur) >= min_len:
                runs.append(cur)
            cur = [it] if k is not None else []
    if len(cur) >= min_len:
        runs.append(cur)
    return runs


def _assert_key(stmt: ast.stmt):
    if stmt.lineno != stmt.end_lineno:
        return None
    if isinstance(stmt, ast.Assert):
        return "assert"
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        if isinstance(f, ast.Attribute) and f.attr.startswith("assert"):
            return f.attr
    return None


def _const_key(stmt: ast.stmt):
    if isinstance(stmt, ast.Assign) and stmt.lineno == stmt.end_lineno and len(stmt.targets) == 1:
        if isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, (ast.Constant, ast.UnaryOp, ast.BinOp, ast.Tuple)):
            return "const"
    return None


def make_boilerplate(src: Source, cut: Cutter, rng: random.Random, kind: str) -> tuple[str, int] | None:
    cands: list[tuple[str, int, int]] = []  # (header, start line, line to cut)
    if kind == "asserts":
        for func, cls in src.funcs:
            header = _class_header(src, cls)
            if header is None:
                continue
            for node in ast.walk(func):
                for run in _runs(getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else [], _assert_key):
                    cands += [(header, _start(func), s.lineno) for s in run[2:]]
    elif kind == "constants":
        top = [_start(n) for n in src.tree.body]
        bodies = [(None, src.tree.body)] + [
            (n, n.body) for n in src.tree.body if isinstance(n, ast.ClassDef) and not n.decorator_list
        ]
        for cls, body in bodies:
            for run in _runs(body, _const_key):
                if cls is not None:  # a class body: from its class line
                    start = cls.lineno if run[0].lineno - cls.lineno <= 25 else run[0].lineno
                else:  # module level: from the first statement at most 20 lines before the run
                    start = min(ln for ln in top if run[0].lineno - 20 <= ln <= run[0].lineno)
                cands += [("", start, s.lineno) for s in run[2:]]
    elif kind == "table":
        stmts = [(s, "", s.lineno) for s in src.tree.body] + [
            (s, _class_header(src, cls), _start(func)) for func, cls in src.funcs for s in ast.walk(func)
            if isinstance(s, ast.stmt) and s is not func
        ]
        for stmt, header, fstart in stmts:
            if header is None or stmt.end_lineno - stmt.lineno > 60:
                continue
            for node in ast.walk(stmt):
                elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else None
                if not elts or len(elts) < 5 or any(e is None for e in elts):
                    continue
                lns = [e.lineno for e in elts]
                if len(set(lns)) != len(lns) or any(e.lineno != e.end_lineno for e in elts):
                    continue
                start = fstart if stmt.lineno - fstart <= 25 else stmt.lineno
                cands += [(header, start, ln) for ln in lns[3:]]
                break
    elif kind == "tests":
        for cls in (n for n in src.tree.body if isinstance(n, ast.ClassDef)):
            header = _class_header(src, cls)
            if header is None:
                continue
            tests = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
            for i in range(len(tests) - 2):
                trio = tests[i : i + 3]
                if all(t.end_lineno - _start(t) <= 8 for t in trio) and trio[2].end_lineno - _start(trio[0]) <= 30:
                    body = trio[2].body[0]
                    if body.lineno == body.end_lineno and body.lineno > trio[2].lineno and not _docstring_lines(trio[2]):
                        cands.append((header, _start(trio[0]), body.lineno))
    rng.shuffle(cands)
    for header, start, ln in cands[:6]:
        head = header + "\n".join(src.span(start, ln - 1)) + "\n"
        prompt = cut.cut(head, src.line(ln), rng)
        if prompt:
            return prompt, ln
    return None


def make_long(src: Source, cut: Cutter, rng: random.Random, max_tokens: int) -> tuple[str, int] | None:
    if len(src.text) < 4000:
        return None
    starts = sorted({1} | {_start(n) for n in src.tree.body} | {_start(f) for f, c in src.funcs if c is not None})
    stmt_lines = _stmt_lines(src.tree)
    rng.shuffle(starts)
    for start in starts[:3]:
        target = rng.randint(*LONG_TARGET)
        end = start
        while end <= len(src.lines) and cut.count("\n".join(src.span(start, end))) < target:
            end += 10
        if end > len(src.lines):
            continue
        for ln in range(end - 10, end + 20):
            if ln in stmt_lines and ln > start:
                prompt = cut.cut("\n".join(src.span(start, ln - 1)) + "\n", src.line(ln), rng)
                if prompt and LONG_TARGET[0] <= cut.count(prompt) <= max_tokens:
                    return prompt, ln
    return None


# ----------------------------------------------------------------- driver


def acceptable(prompt: str) -> bool:
    return (
        prompt.isascii()
        and prompt == prompt.rstrip()
        and not prompt.endswith("\n")
        and all(len(ln) <= MAX_LINE for ln in prompt.split("\n"))
    )


def build(sources: list[Source], cut: Cutter, seed: int, per_category: int, max_tokens: int) -> list[dict]:
    used: set[str] = set()  # each file gives at most one prompt
    seen_text: set[str] = set()
    rows: list[dict] = []

    def collect(cat: str, make, n: int, rng: random.Random) -> list[dict]:
        lo, hi = TOKEN_RANGE[cat]
        hi = min(hi, max_tokens)
        order = sorted(sources, key=lambda s: s.rel)
        rng.shuffle(order)
        got = []
        for src in order:
            if len(got) == n:
                break
            if src.rel in used:
                continue
            res = make(src, rng)
            if not res:
                continue
            prompt, ln = res
            tokens = cut.count(prompt)
            if not (lo <= tokens <= hi) or not acceptable(prompt) or prompt in seen_text:
                continue
            used.add(src.rel)
            seen_text.add(prompt)
            got.append({"category": cat, "turns": [prompt], "source": f"{src.rel}:{ln}", "_tokens": tokens})
        return got

    # boilerplate first, rarest kind first: constant runs come from few files
    kinds: list[list[dict]] = []
    for i, kind in enumerate(BOILERPLATE_KINDS_BY_RARITY):
        quota = (per_category - sum(map(len, kinds))) // (len(BOILERPLATE_KINDS_BY_RARITY) - i)
        kinds.append(collect("boilerplate", lambda src, rng, kind=kind: make_boilerplate(src, cut, rng, kind), quota,
                             random.Random(f"{seed}-boilerplate-{kind}")))
        print(f"boilerplate/{kind}: {len(kinds[-1])}", file=sys.stderr)
    # interleave the kinds, so that any first k prompts (the -mini suite) mix them
    by_cat = {"boilerplate": [k[i] for i in range(max(map(len, kinds))) for k in kinds if i < len(k)]}
    makers = {
        "code": lambda src, rng: make_code(src, cut, rng),
        "docstring": lambda src, rng: make_docstring(src, cut, rng),
        "long-context": lambda src, rng: make_long(src, cut, rng, max_tokens),
    }
    for cat, make in makers.items():
        by_cat[cat] = collect(cat, make, per_category, random.Random(f"{seed}-{cat}"))
    for cat in CATEGORIES:
        if len(by_cat[cat]) < per_category:
            raise SystemExit(f"only {len(by_cat[cat])} prompts for category {cat}; lower --per-category")
        for i, row in enumerate(by_cat[cat], start=1):
            rows.append({"id": f"{cat}-{i:02d}", **row})
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-category", type=int, default=20)
    ap.add_argument("--mini", type=int, default=2, help="prompts per category in the -mini suite")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="every prompt must fit the context with this many new tokens")
    ap.add_argument("--model", type=Path, default=ROOT / "artifacts/models/pystdlib-llama-12x256")
    ap.add_argument("--out", type=Path, default=ROOT / "selfspec_cli/bench/suites")
    ap.add_argument("--name", default="pystdlib")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ctx = json.loads((args.model / "config.json").read_text())["max_position_embeddings"]
    max_tokens = ctx - args.max_new_tokens
    sources = load_sources()
    print(f"{len(sources)} held-out files pass the filters (Python {sys.version.split()[0]})", file=sys.stderr)
    rows = build(sources, Cutter(tok), args.seed, args.per_category, max_tokens)

    args.out.mkdir(parents=True, exist_ok=True)
    write(rows, args.out / f"{args.name}.jsonl")
    mini = [r for cat in CATEGORIES for r in [r for r in rows if r["category"] == cat][: args.mini]]
    write(mini, args.out / f"{args.name}-mini.jsonl")
    print(f"wrote {len(rows)} prompts to {args.out / (args.name + '.jsonl')} and {len(mini)} to "
          f"{args.out / (args.name + '-mini.jsonl')} (context {ctx}, prompt <= {max_tokens} tokens)")
    print("category       n  tokens min / median / mean / max")
    for cat in CATEGORIES + ("all",):
        ns = [r["_tokens"] for r in rows if cat in ("all", r["category"])]
        print(f"{cat:<13} {len(ns):>3}  {min(ns):>4} / {statistics.median(ns):>6.0f} / {statistics.mean(ns):>5.0f} / {max(ns):>4}")


if __name__ == "__main__":
    main()
