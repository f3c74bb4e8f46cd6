"""``selfspec profile`` on a tiny real model: the documented keys, consistent figures, the
plots, the redundancy map against a direct computation, and one-line errors."""
from __future__ import annotations

import json

import torch

from selfspec_cli.bench import profile as prof
from selfspec_cli.decoding.cost import CURVE_ROWS
from selfspec_cli.cli.app import main
from selfspec_cli.engine import Engine

from .conftest import make_tiny_model
from .test_cli import assert_user_error, write_lines

PROMPTS = ["def add(a, b):", "import os\nimport sys", "class Stack:\n    def push(self, x):"]


def test_profile_writes_json_and_plots(capsys, tiny_model_dir, tmp_path):
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    out = tmp_path / "prof"
    capsys.readouterr()
    rc = main(["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "-o", str(out), "--rounds", "2",
               "--redundancy-prompts", "2", "--redundancy-tokens", "3", "--device", "cpu"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads((out / "profile.json").read_text())
    for key in ("floor_ms", "step_ms", "verify_cost", "draft_cost", "lm_head_share", "bandwidth_gbs", "weight_bytes",
                "kernel", "kernel_max_logit_diff", "redundancy", "environment"):
        assert key in doc, key
    assert sorted(int(k) for k in doc["verify_cost"]) == list(CURVE_ROWS)  # the planners' curve, shared
    assert doc["verify_cost"]["1"] == 1.0
    assert set(doc["draft_cost"]) == {"0.2", "0.3", "0.4", "0.5", "0.6"}
    assert doc["floor_ms"] > 0 and doc["step_ms"] > 0 and 0 < doc["lm_head_share"]
    assert abs(doc["floor_ms"] - doc["weight_bytes"] / (doc["bandwidth_gbs"] * 1e9) * 1e3) < 0.01 * doc["floor_ms"] + 1e-3
    red = doc["redundancy"]
    assert len(red["attn"]) == len(red["mlp"]) == doc["num_layers"]
    assert red["drafts_per_set"] == 2 * 3 and all(0 <= a <= 1 for a in red["attn"] + red["mlp"])
    assert (out / "verify_cost.png").stat().st_size > 1000 and (out / "redundancy.png").stat().st_size > 1000
    pred = doc["predicted_speedup"]
    assert set(pred) == {"pld", "auto", "specqd", "self-sd", "asd", "swift", "adadecode"}
    for name in ("pld", "auto", "asd", "swift"):  # no artifacts needed: each decoded and planned
        assert pred[name]["predicted_speedup"] > 0 and 0 <= pred[name]["draft_round_share"] <= 1, (name, pred[name])
    assert "unavailable" in pred["self-sd"] and "unavailable" in pred["adadecode"]  # no skip set / heads for this model
    quant = doc["quantized_drafts"]
    assert "unavailable" in quant["gguf"]  # a plain Hugging Face directory: no GGUF blocks
    for name in ("int8", "int8-g32"):
        q = quant[name]
        assert q["c"] > 0 and 0 <= q["agreement"] <= 1 and q["formats"] == [name] and q["cache"] in ("hit", "miss")
    # int8 per 32 stores a scale per 32 weights, per channel one per row: more bytes, by exactly that
    assert quant["int8-g32"]["draft_bytes"] > quant["int8"]["draft_bytes"]
    assert quant["_"]["agreement_positions"] == 2 * 3
    line = json.loads(stdout.strip().splitlines()[-1])
    assert line["step_ms"] == doc["step_ms"] and line["verify_cost"] == doc["verify_cost"]
    # a second run into the same directory needs --force
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "-o", str(out)],
                      "already holds a profile", "--force")


def test_profile_bad_inputs(capsys, tiny_model_dir, tmp_path):
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "--rounds", "0"], "--rounds")
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "--predict", "pld,nope"], "--predict")
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "--suite", "spec-bench-mini"],
                      "not both")
    f = tmp_path / "file"
    f.write_text("x")
    assert_user_error(capsys, ["profile", "-m", str(tiny_model_dir), "-p", str(prompts), "-o", str(f)], "is a file")


def test_profile_reports_the_planners_own_verify_curve(monkeypatch):
    """T(1) and v(k) are measured once per engine and shared: profile's figures are the
    planners' (with k-row forwards of exactly k rows, also when the prompt is short), and a
    second call measures nothing again."""
    from selfspec_cli.decoding import cost as cost_mod

    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    seen: list[int] = []
    forward = eng.forward

    def spy(cache, input_ids=None, **kw):
        if kw.get("logits_rows") == slice(None):
            seen.append(int(input_ids.shape[0]))
        return forward(cache, input_ids, **kw)

    monkeypatch.setattr(eng, "forward", spy)
    costs = prof.measure_costs(eng, [5, 17, 42], rounds=1)
    assert sorted(set(seen)) == list(CURVE_ROWS)
    curve = cost_mod.VerifyCurve.for_engine(eng)
    assert costs["verify_cost"] == {str(k): round(v, 3) for k, v in curve.ratios.items()}
    assert costs["step_ms"] == round(curve.t1_s * 1e3, 3)
    multi = lambda: sum(k > 1 for k in seen)  # noqa: E731 (profile's own one-row steps at the prompt's context aside)
    n = multi()
    prof.measure_costs(eng, [5, 17, 42], rounds=1)
    assert multi() == n  # the curve is not measured twice
    assert all(b >= a for a, b in zip(list(curve.ratios.values()), list(curve.ratios.values())[1:]))


def test_redundancy_map_matches_direct_computation():
    """Agreement of a single skipped sublayer, recomputed by hand: full-model greedy
    continuation, and for each step a one-row draft over the full model's KV."""
    model = make_tiny_model("llama-gqa", layers=3)
    eng = Engine(model)
    prompt = [5, 17, 42, 8, 99, 3]
    red = prof.redundancy_map(eng, [prompt], tokens=4, calibrated=(frozenset({1}), frozenset({0, 2})))
    with torch.inference_mode():
        seq = list(prompt)
        hits = {("attn", 1): 0, ("mlp", 2): 0, "cal": 0}
        for _ in range(4):
            full = model(torch.tensor([seq])).logits[0, -1].argmax().item()
            for (kind, layer) in (("attn", 1), ("mlp", 2)):
                c = eng.new_cache(32)
                eng.forward(c, torch.tensor(seq[:-1]), positions=0)
                sa, sm = ({layer}, set()) if kind == "attn" else (set(), {layer})
                d = eng.forward(c, torch.tensor(seq[-1:]), positions=len(seq) - 1, skip_attn=sa, skip_mlp=sm).logits[0].argmax().item()
                hits[(kind, layer)] += d == full
            c = eng.new_cache(32)
            eng.forward(c, torch.tensor(seq[:-1]), positions=0)
            d = eng.forward(c, torch.tensor(seq[-1:]), positions=len(seq) - 1, skip_attn={1}, skip_mlp={0, 2}).logits[0].argmax().item()
            hits["cal"] += d == full
            seq.append(full)
    assert red["attn"][1] == hits[("attn", 1)] / 4
    assert red["mlp"][2] == hits[("mlp", 2)] / 4
    assert red["calibrated"]["agreement"] == hits["cal"] / 4
