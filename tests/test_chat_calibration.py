"""examples/chat-calibration.jsonl: 64 original chat calibration prompts in Spec-Bench's six groups,
sharing no question (no 12-word shingle) with Spec-Bench itself."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "examples" / "chat-calibration.jsonl"
GROUPS = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
SHINGLE = 12


def _rows():
    lines = CALIBRATION.read_text(encoding="utf-8").splitlines()
    return lines, [json.loads(line) for line in lines]


def _spec_bench_path() -> Path | None:
    for path in (REPO / "selfspec_cli" / "bench" / "data" / "spec_bench" / "question.jsonl",
                 REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl"):
        if path.is_file():
            return path
    return None


def _shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_schema_and_counts():
    lines, rows = _rows()
    assert len(lines) == 64
    ids = [row["id"] for row in rows]
    assert len(set(ids)) == len(ids)
    for row in rows:
        assert set(row) == {"id", "category", "turns"}, row.get("id")
        assert isinstance(row["id"], str) and row["id"].startswith("cal-")
        assert row["category"] in GROUPS, row["id"]
        turns = row["turns"]
        assert isinstance(turns, list) and all(isinstance(t, str) and t.strip() for t in turns), row["id"]
        assert len(turns) == (2 if row["category"] == "mt_bench" else 1), row["id"]
    counts = Counter(row["category"] for row in rows)
    assert set(counts) == GROUPS
    assert min(counts.values()) >= 8, counts


def test_group_shapes():
    _, rows = _rows()
    for row in rows:
        text, words = row["turns"][0], len(row["turns"][0].split())
        if row["category"] == "translation":
            assert text.startswith("Translate ") and " to English: " in text, row["id"]
        elif row["category"] == "summarization":
            assert text.startswith("Summarize") and 250 <= words <= 550, (row["id"], words)
        elif row["category"] == "rag":
            assert "Question:" in text and 3 <= text.count("Passage ") <= 5 and 150 <= words <= 600, row["id"]


def test_no_shared_question_with_spec_bench():
    path = _spec_bench_path()
    if path is None:
        pytest.skip("Spec-Bench question.jsonl not found (neither vendored nor in ../shared/data)")
    bench = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                bench |= _shingles(turn)
    assert len(bench) > 1000  # the real file, not an empty stand-in
    _, rows = _rows()
    shared = [(row["id"], " ".join(s)) for row in rows for turn in row["turns"] for s in _shingles(turn) & bench]
    assert not shared, shared[:5]
