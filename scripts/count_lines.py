"""Count the library's code lines: no blank, comment or docstring lines (the figure issue 13 compares).

Run: python scripts/count_lines.py [selfspec_cli] [--files]
"""
import ast
import io
import pathlib
import sys
import tokenize

SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}


def code_lines(path: pathlib.Path) -> int:
    src = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in SKIP:
            lines.update(l for l in range(tok.start[0], tok.end[0] + 1) if l not in docstrings)
    return len(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rows = sorted(((code_lines(p), str(p)) for p in pathlib.Path(args[0] if args else "selfspec_cli").rglob("*.py")), reverse=True)
    if "--files" in sys.argv:
        for n, p in rows:
            print(n, p)
    print("code lines:", sum(n for n, _ in rows), "physical:", sum(len(pathlib.Path(p).read_text().splitlines()) for _, p in rows))
