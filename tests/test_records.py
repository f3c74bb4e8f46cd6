"""Output records are typed (decoding/output.py: OutputRecord, TurnRecord; issue 49) and serialized once
at I/O: the JSONL keys, their order and their values are what records always held, and a record read
back (``--resume``, the report) writes out the same text."""
from __future__ import annotations

import dataclasses
import json

import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.output import OutputRecord, PlainRounds, TurnStats
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build
from selfspec_cli.prompts import Prompt
from selfspec_cli.runtime import run_prompt

from .conftest import make_tiny_model

ONE_TURN_KEYS = ["id", "method", "lossless", "text", "token_ids", "new_tokens", "prompt_tokens", "wall_time_s",
                 "tokens_per_s", "finish_reason", "stats"]
TURN_KEYS = ["text", "token_ids", "new_tokens", "accept_lengths", "prompt_tokens", "wall_time_s", "tokens_per_s",
             "finish_reason", "stats"]


def test_a_record_keeps_its_keys_and_reads_back_to_the_same_text(tiny_tokenizer):
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    pld = build("pld", eng, tiny_tokenizer)
    cfg = GenerationConfig(max_new_tokens=10)
    one = run_prompt(pld.generate, tiny_tokenizer, Prompt("a", ("def run_prompt(tokenizer, prompt):",)), cfg,
                     torch.device("cpu"), "pld", use_chat_template=False)
    assert isinstance(one, OutputRecord) and list(one.to_dict()) == ONE_TURN_KEYS
    again = pld.generate(tiny_tokenizer("def run_prompt(tokenizer, prompt):")["input_ids"], cfg)
    assert one.token_ids == again.token_ids and one.stats.accept_lengths == again.stats.accept_lengths
    many = run_prompt(pld.generate, tiny_tokenizer, Prompt(7, ("import torch", "return the record"), category="code"), cfg,
                      torch.device("cpu"), "pld", use_chat_template=False)
    d = many.to_dict()
    assert list(d) == ONE_TURN_KEYS + ["category", "num_turns", "turns"] and d["num_turns"] == 2
    assert [list(t) for t in d["turns"]] == [TURN_KEYS, TURN_KEYS]
    assert list(d["stats"]) == ["target_forwards", "accept_lengths", "mean_accepted_length"]
    assert many.token_ids == many.turns[0].token_ids + many.turns[1].token_ids
    marked = dataclasses.replace(many, repeat=1, rank=0)
    assert list(marked.to_dict())[-2:] == ["repeat", "rank"]
    generated = dataclasses.replace(one, threads=2, prompt_sha256="ab", settings={"model": "m"}, artifacts={"k": "p"})
    assert list(generated.to_dict())[-4:] == ["threads", "prompt_sha256", "settings", "artifacts"]
    for rec in (one.to_dict(), d, marked.to_dict(), generated.to_dict(), {**one.to_dict(), "peer_field": [1, 2]}):
        back = OutputRecord.from_dict(json.loads(json.dumps(rec)))
        assert json.dumps(back.to_dict()) == json.dumps(rec)  # the same text: keys, order and values
    typed = OutputRecord.from_dict(d)
    assert isinstance(typed.stats, TurnStats) and len(typed.all_turns()) == 2 and typed.category == "code"
    assert OutputRecord.from_dict(one.to_dict()).all_turns()[0].token_ids == one.token_ids


def test_the_drivers_figures_are_typed_and_kept_where_records_always_had_them(tiny_tokenizer):
    """The driver's timings, plain rounds and plan are typed fields of the stats (the drafter's own report is a
    typed DraftReport, serialized after them), and a record keeps them at their old place: the counters, the plan and skip sets,
    the timings, then the drafter's keys."""
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    res = build("pld", eng, tiny_tokenizer).generate(tiny_tokenizer("import torch import torch")["input_ids"],
                                                     GenerationConfig(max_new_tokens=12))
    st = res.stats
    assert all(isinstance(getattr(st, k), float) for k in ("prefill_s", "draft_s", "verify_s", "update_s"))
    assert st.plain_rounds is None or isinstance(st.plain_rounds, PlainRounds)
    keys = list(st.as_dict())
    timings = keys.index("prefill_s")
    assert keys[timings:timings + 4] == ["prefill_s", "draft_s", "verify_s", "update_s"]
    assert all(k in keys[timings:] for k in st.report.to_json()) and keys.index("draft_round_share") < timings
    text = json.dumps(st.as_dict())
    assert json.dumps(TurnStats.from_dict(json.loads(text)).to_dict()) == text
