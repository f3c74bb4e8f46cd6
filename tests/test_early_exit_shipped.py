"""AdaDecode and SpecEE on the shipped model with the committed artifacts."""
from __future__ import annotations

import pytest

from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.loading import EXAMPLES_DIR, load_model
from selfspec_cli.methods import AR
from selfspec_cli.methods import build
from selfspec_cli.prompts import read_prompts

from .conftest import needs_shipped_model

pytestmark = [needs_shipped_model, pytest.mark.slow]
EXAMPLES = EXAMPLES_DIR / "prompts.jsonl"


@pytest.fixture(scope="module")
def shipped():
    model, tok = load_model("pystdlib", device="cpu")
    eng = Engine(model)
    cfg = GenerationConfig(max_new_tokens=64, eos_token_ids=(model.generation_config.eos_token_id,))
    ids = [tok(p.turns[0])["input_ids"] for p in read_prompts(str(EXAMPLES))]
    ar = AR(eng, tok)
    return eng, tok, cfg, ids, [ar.generate(p, cfg).token_ids for p in ids]


@pytest.mark.parametrize("opts", [{}, dict(adadecode_threshold=0.75),
                                  dict(adadecode_threshold=0.2, adadecode_max_pending=2)],
                         ids=["default", "paper-gamma", "low-gamma"])
def test_adadecode_equals_ar_on_all_example_prompts(shipped, opts):
    eng, tok, cfg, ids, want = shipped
    meth = build("adadecode", eng, tok, **opts)
    drafted = 0
    for p, w in zip(ids, want):
        res = meth.generate(p, cfg)
        assert res.token_ids == w
        drafted += res.stats.drafted_tokens
    assert drafted > 0  # the committed heads do predict early


@pytest.mark.parametrize("mode", ["empty", "deferred"])
def test_specee_runs_out_of_the_box(shipped, mode):
    eng, tok, cfg, ids, want = shipped
    meth = build("specee", eng, tok, specee_kv_mode=mode, specee_eval=True)
    res = meth.generate(ids[0], cfg)
    ev = res.stats.report.to_json()["evaluation"]
    assert not meth.lossless and len(res.token_ids) == len(want[0])
    assert ev["identical_prefix_tokens"] == next((i for i, (a, b) in enumerate(zip(res.token_ids, want[0])) if a != b),
                                                 len(want[0]))


def test_offline_cost_is_read_from_the_committed_artifacts(shipped):
    """`selfspec bench` reports what each method's artifacts cost offline, from their manifests."""
    eng, tok, *_ = shipped
    ada = build("adadecode", eng, tok).offline_info().to_json()
    assert ada["what"] == "lm-heads training" and ada["seconds"] > 0
    spe = build("specee", eng, tok).offline_info().to_json()
    kinds = [p["what"] for p in spe["parts"]]
    assert "drafter-head training" in kinds and "exit-mlp training" in kinds
    assert spe["seconds"] == pytest.approx(sum(p["seconds"] for p in spe["parts"]), abs=0.2)
    assert list(spe["parts"][0]) == ["what", "seconds", "created"] and list(spe["parts"][-1]) == ["what", "seconds"]
    sd = build("self-sd", eng, tok).offline_info().to_json()
    assert sd["what"] == "self-sd calibration" and sd["seconds"] > 0 and sd["parts"][0]["trials"] > 0
    assert list(sd["parts"][0]) == ["what", "seconds", "trials", "created"]  # results.json's keys, as always written
    # inline skip sets come from no artifact: nothing to report
    assert build("self-sd", eng, tok, skip_attn=(3,), skip_mlp=()).offline_info() is None
