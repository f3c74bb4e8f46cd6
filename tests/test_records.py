"""Output records are typed (decoding/output.py: OutputRecord, TurnRecord; issue 49) and serialized once
at I/O: the JSONL keys, their order and their values are what records always held, and a record read
back (``--resume``, the report) writes out the same text."""
from __future__ import annotations

import json

import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.output import OutputRecord, TurnStats
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
    assert list(one) == ONE_TURN_KEYS
    again = pld.generate(tiny_tokenizer("def run_prompt(tokenizer, prompt):")["input_ids"], cfg)
    assert one["token_ids"] == again.token_ids and one["stats"]["accept_lengths"] == again.stats.accept_lengths
    many = run_prompt(pld.generate, tiny_tokenizer, Prompt(7, ("import torch", "return the record"), category="code"), cfg,
                      torch.device("cpu"), "pld", use_chat_template=False)
    assert list(many) == ONE_TURN_KEYS + ["category", "num_turns", "turns"] and many["num_turns"] == 2
    assert [list(t) for t in many["turns"]] == [TURN_KEYS, TURN_KEYS]
    assert list(many["stats"]) == ["target_forwards", "accept_lengths", "mean_accepted_length"]
    assert many["token_ids"] == many["turns"][0]["token_ids"] + many["turns"][1]["token_ids"]
    for rec in (one, many, {**many, "repeat": 1, "rank": 0}, {**one, "peer_field": [1, 2]}):
        back = OutputRecord.from_dict(json.loads(json.dumps(rec)))
        assert json.dumps(back.to_dict()) == json.dumps(rec)  # the same text: keys, order and values
    typed = OutputRecord.from_dict(many)
    assert isinstance(typed.stats, TurnStats) and len(typed.all_turns()) == 2 and typed.category == "code"
    assert OutputRecord.from_dict(one).all_turns()[0].token_ids == one["token_ids"]
