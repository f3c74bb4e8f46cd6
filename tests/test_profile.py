"""``selfspec profile`` on a tiny real model: the documented keys, consistent figures, the
plots, the redundancy map against a direct computation, and one-line errors; each typed section of
profile.json written with the keys, order and values the document always had."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec_cli.bench import engine_profile as prof
from selfspec_cli.decoding.measure import CURVE_ROWS, VerifyCurve
from selfspec_cli.decoding.planning import iid_chain_gains
from selfspec_cli.cli.app import main
from selfspec_cli.bench.engine_profile import STACK_PARTS
from selfspec_cli.engine import TARGET, Engine, Route, kernels

from .conftest import charge_forwards, make_tiny_model
from .test_cli import assert_user_error, write_lines

PROMPTS = ["def add(a, b):", "import os\nimport sys", "class Stack:\n    def push(self, x):"]


def fp32_step_bytes(cfg) -> int:
    """Bytes of float32 weights one decode step reads, from a Llama config by hand: per layer two
    norms, q/k/v, o, gate, up and down; then the final norm and the LM head (no embedding table)."""
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = 2 * h + (q + 2 * kv) * h + h * q + 3 * h * i
    return 4 * (n * per_layer + h + v * h)


def test_profile_writes_json_and_plots(capsys, tiny_tokenizer, tmp_path):
    # a model with two sublayers that add nothing (layer 1's MLP, layer 2's attention) and MLPs
    # strong enough that skipping any other sublayer changes some greedy token
    model = make_tiny_model("llama-gqa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(8.0)
        model.model.layers[1].mlp.down_proj.weight.zero_()
        model.model.layers[2].self_attn.o_proj.weight.zero_()
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    prompts = write_lines(tmp_path / "p.txt", PROMPTS)
    out = tmp_path / "prof"
    capsys.readouterr()
    rc = main(["profile", "-m", str(model_dir), "-p", str(prompts), "-o", str(out), "--rounds", "2",
               "--redundancy-prompts", "2", "--redundancy-tokens", "3", "--device", "cpu"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads((out / "profile.json").read_text())
    for key in ("floor_ms", "step_ms", "verify_cost", "draft_cost", "lm_head_share", "bandwidth_gbs", "weight_bytes",
                "kernel", "kernel_max_logit_diff", "redundancy", "environment"):
        assert key in doc, key
    assert sorted(int(k) for k in doc["verify_cost"]) == list(CURVE_ROWS)  # the planners' curve, shared
    assert set(doc["draft_cost"]) == {"0.2", "0.3", "0.4", "0.5", "0.6"}
    assert doc["floor_ms"] > 0 and doc["step_ms"] > 0 and 0 < doc["lm_head_share"]
    if doc["environment"]["threads"] > 1:  # the default thread count is the cores: T(1) and v(k) at one thread too
        one = doc["one_thread"]
        assert one["step_ms"] > 0 and sorted(int(k) for k in one["verify_cost"]) == list(CURVE_ROWS)
        assert doc["environment"]["pool_threads"] == doc["environment"]["threads"]  # restored after the 1-thread timing
    if kernels.load_extension() is not None:  # where a step's time goes: per thread count, at two contexts
        rows = doc["step_parts"]["rows"]
        threads = sorted({1, doc["environment"]["threads"]})
        assert [r["threads"] for r in rows] == threads * 2 and rows[0]["context_tokens"] < rows[-1]["context_tokens"]
        for r in rows:
            assert list(r["parts_ms"]) == list(STACK_PARTS) and r["step_ms"] > 0
            assert r["parts_ms"]["qkv"] > 0 and r["parts_ms"]["attention"] > 0 and r["outside_layers_ms"] > 0
        assert "step at 1 thread" in err
    # (the figures themselves, on a machine with known costs: test_engine_costs_on_a_machine_with_known_costs)
    assert doc["weight_bytes"] == fp32_step_bytes(model.config) == 772352
    red = doc["redundancy"]
    assert len(red["attn"]) == len(red["mlp"]) == doc["num_layers"] == 4
    assert red["drafts_per_set"] == 2 * 3
    # skipping a sublayer that adds nothing drafts the full model's token every time; skipping any
    # other one does not, here: each entry belongs to its own sublayer
    assert red["attn"][2] == 1.0 and red["mlp"][1] == 1.0
    assert all(a < 1.0 for i, a in enumerate(red["attn"]) if i != 2), red
    assert all(a < 1.0 for i, a in enumerate(red["mlp"]) if i != 1), red
    assert (out / "verify_cost.png").stat().st_size > 1000 and (out / "redundancy.png").stat().st_size > 1000
    from PIL import Image
    with Image.open(out / "verify_cost.png") as im:  # plots are stored with a palette (bench/plots.py)
        assert im.format == "PNG" and im.mode == "P"
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
    # the ceilings: n-gram, layer skip at each measured r, each measured copy, from the figures in this document
    ceil = doc["draft_ceilings"]
    curve = VerifyCurve(1.0, {int(k): v for k, v in doc["verify_cost"].items()})
    ks = [int(k) - 1 for k in doc["verify_cost"] if int(k) >= 2]
    want = {"n-gram": 0.0, **{f"layer skip at {r}": c for r, c in doc["draft_cost"].items()},
            **{n: quant[n].get("c_draft_vocab", quant[n]["c"]) for n in ("int8", "int8-g32")}}
    assert [e["source"] for e in ceil["entries"]] == list(want)
    for e in ceil["entries"]:
        assert e["c"] == want[e["source"]]
        assert e["gain"] == round(max(iid_chain_gains(curve, 0.999, e["c"], ks).values()), 3)
    assert ceil["summary"].startswith("at most ") and "ceiling, every draft accepted" in err
    line = json.loads(stdout.strip().splitlines()[-1])
    assert line["step_ms"] == doc["step_ms"] and line["verify_cost"] == doc["verify_cost"]
    # a second run into the same directory needs --force
    assert_user_error(capsys, ["profile", "-m", str(model_dir), "-p", str(prompts), "-o", str(out)],
                      "already holds a profile", "--force")
    # ... and --force replaces the whole profile: no plot of the earlier one stays beside the new profile.json
    assert main(["profile", "-m", str(model_dir), "-p", str(prompts), "-o", str(out), "--rounds", "1", "--force",
                 "--redundancy-prompts", "0", "--predict", "", "--no-plots", "--device", "cpu"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"]


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
    from selfspec_cli.decoding import cost_store

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
    curve = cost_store.curve_for(eng)
    assert costs.curve.verify_cost == {str(k): round(v, 3) for k, v in curve.ratios.items()}
    assert costs.curve.step_ms == round(curve.t1_s * 1e3, 3)
    multi = lambda: sum(k > 1 for k in seen)  # noqa: E731 (profile's own one-row steps at the prompt's context aside)
    n = multi()
    prof.measure_costs(eng, [5, 17, 42], rounds=1)
    assert multi() == n  # the curve is not measured twice
    assert all(b >= a for a, b in zip(list(curve.ratios.values()), list(curve.ratios.values())[1:]))


def test_engine_costs_on_a_machine_with_known_costs(monkeypatch, virtual_clock):
    """The profile's figures from timings the test sets (conftest.VirtualClock): a k-row forward
    costs F[k] seconds times the share of sublayers it runs, plus 10 ms per context token beyond
    64; the LM head H; every timed interval 1 s more (the clock's tick, which also makes the
    2**30-byte read of the bandwidth probe take 1 s: 2**30 B/s). T(1), v(k) (the running maximum
    over the rows: F[3] dips below F[2]), its raw medians, the context slope, c(r) and the LM
    head's share (over a step at the prompt's context, 100 tokens, not the curve's 64), the
    weight bytes and the floor are then known exactly."""
    L = 4
    F = {1: 10.0, 2: 11.0, 3: 10.5, 4: 12.0, 6: 14.0, 8: 16.0, 12: 20.0, 16: 24.0, 24: 32.0, 32: 40.0}
    H, TICK = 2.0, 1.0
    eng = Engine(make_tiny_model("llama-gqa", layers=L))

    def cost(engine, rows, kw):
        pos = kw["positions"]
        if pos == 0:  # prefills are never timed
            return 0.0
        route = kw.get("route", TARGET)
        skipped = len(route.skip_attn) + len(route.skip_mlp)
        return F[rows] * (1 - skipped / (2 * L)) + 1e-2 * max(0, pos - 64)

    virtual_clock.tick = TICK
    charge_forwards(monkeypatch, virtual_clock, cost, head_cost=H)
    doc = prof.engine_costs(eng, list(range(2, 102)), rounds=3).to_json()  # as profile.json holds it

    t1 = TICK + F[1] + H  # 13 s: one row with its logits, at the curve's context (64)
    step = t1 + 0.36  # the same at the prompt's context (100 tokens)
    assert doc["step_ms"] == t1 * 1e3 and doc["context_tokens"] == 64 and doc["draft_context_tokens"] == 100
    # v(k): the k-row time over the one-row time; 3 rows read cheaper than 2 and are reported as 2's
    want_v = {1: 13, 2: 14, 3: 14, 4: 15, 6: 17, 8: 19, 12: 23, 16: 27, 24: 35, 32: 43}
    assert doc["verify_cost"] == {str(k): pytest.approx(x / 13, abs=6e-4) for k, x in want_v.items()}
    assert doc["verify_ms"] == {str(k): pytest.approx((TICK + f + H) * 1e3) for k, f in F.items()}  # raw: 13500 at 3
    # T(1) after 64 + 190 tokens (the tiny model's 256 positions) is 1.9 s longer: 10 ms per token
    assert doc["step_ms_per_1k_context"] == pytest.approx(10000.0)
    # c(r): uniform_layers skips both sublayers of 1 (r = 0.2, 0.3) or 2 (r >= 0.4) of the 4 layers
    kept = {"0.2": 0.75, "0.3": 0.75, "0.4": 0.5, "0.5": 0.5, "0.6": 0.5}
    assert doc["draft_cost"] == {r: pytest.approx((TICK + F[1] * k + 0.36 + H) / step, abs=6e-4) for r, k in kept.items()}
    assert doc["lm_head_ms"] == (TICK + H) * 1e3 and doc["lm_head_share"] == pytest.approx(3 / step, abs=6e-4)
    # the products alone: one tick and the head's charge (the layers' products are not forwards)
    assert doc["products_ms"] == (TICK + H) * 1e3 and doc["non_product_share"] == pytest.approx(1 - 3 / step, abs=6e-4)
    # the floor: 772352 bytes of weights read at 2**30 bytes per second
    assert doc["weight_bytes"] == fp32_step_bytes(eng.model.config) == 772352
    assert doc["bandwidth_gbs"] == 1.07
    floor_ms = 772352 / 2**30 * 1e3
    assert doc["floor_ms"] == round(floor_ms, 3) == 0.719
    assert doc["step_over_floor"] == pytest.approx(t1 * 1e3 / floor_ms, abs=1e-3)


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
                d = eng.forward(c, torch.tensor(seq[-1:]), positions=len(seq) - 1, route=Route(skip_attn=sa, skip_mlp=sm)).logits[0].argmax().item()
                hits[(kind, layer)] += d == full
            c = eng.new_cache(32)
            eng.forward(c, torch.tensor(seq[:-1]), positions=0)
            d = eng.forward(c, torch.tensor(seq[-1:]), positions=len(seq) - 1, route=Route(skip_attn={1}, skip_mlp={0, 2})).logits[0].argmax().item()
            hits["cal"] += d == full
            seq.append(full)
    assert red.attn[1] == hits[("attn", 1)] / 4
    assert red.mlp[2] == hits[("mlp", 2)] / 4
    assert red.calibrated is not None and red.calibrated.agreement == hits["cal"] / 4


def written(section) -> str:
    """A section as profile.json writes it: its keys in order, its values, nested, to the byte."""
    return json.dumps(section.to_json())


def test_each_profile_section_is_written_as_the_dicts_it_replaced():
    """Each typed section serialized (``to_json``) is, key for key, in the same order and to the byte, the
    dict the profile built before the sections were typed (issue 49): the literals below are those dicts,
    laid out as the old code wrote them from the same inputs."""
    curve = prof.CurveFields(context_tokens=64, step_ms=25.0, step_ms_per_1k_context=1.5, row_ms_per_1k_context=None,
                             verify_ms={"1": 25.0, "2": 26.1}, verify_cost={"1": 1.0, "2": 1.044}, curve_readings=1)
    curve_dict = {"context_tokens": 64, "step_ms": 25.0, "step_ms_per_1k_context": 1.5, "row_ms_per_1k_context": None,
                  "verify_ms": {"1": 25.0, "2": 26.1}, "verify_cost": {"1": 1.0, "2": 1.044}, "curve_readings": 1}
    assert written(curve) == json.dumps(curve_dict)
    measured = prof.MeasuredCosts(curve=curve, draft_context_tokens=100, draft_cost={"0.2": 0.9, "0.5": 0.61},
                                  draft_skip_ratio_actual={"0.2": 0.25, "0.5": 0.5}, lm_head_ms=2.4, lm_head_share=0.096,
                                  products_ms=20.0, non_product_share=0.2, rounds=7)
    # measure_costs: {**curve_fields(...), "draft_context_tokens": ..., ..., "rounds": rounds, **vocab}
    measured_dict = {**curve_dict, "draft_context_tokens": 100, "draft_cost": {"0.2": 0.9, "0.5": 0.61},
                     "draft_skip_ratio_actual": {"0.2": 0.25, "0.5": 0.5}, "lm_head_ms": 2.4, "lm_head_share": 0.096,
                     "products_ms": 20.0, "non_product_share": 0.2, "rounds": 7}
    assert written(measured) == json.dumps(measured_dict)
    vocab = dataclasses.replace(measured, vocab=prof.DraftVocabCosts(8192, {"0.2": 0.7, "0.5": 0.45}))
    vocab_dict = {**measured_dict, "draft_vocab_size": 8192, "draft_cost_draft_vocab": {"0.2": 0.7, "0.5": 0.45}}
    assert written(vocab) == json.dumps(vocab_dict)
    costs = prof.EngineCosts(weight_bytes=538000000, bandwidth_gbs=21.5, floor_ms=25.023, measured=vocab,
                             step_over_floor=0.999, kernel={"backend": "small_gemm", "reason": None})
    # engine_costs: {"weight_bytes", "bandwidth_gbs", "floor_ms", **costs, "step_over_floor", "kernel"}
    costs_dict = {"weight_bytes": 538000000, "bandwidth_gbs": 21.5, "floor_ms": 25.023, **vocab_dict,
                  "step_over_floor": 0.999, "kernel": {"backend": "small_gemm", "reason": None}}
    assert written(costs) == json.dumps(costs_dict)
    # profile: costs["one_thread"] = {...}, after the kernel
    one = prof.OneThread(step_ms=30.0, verify_cost={"1": 1.0, "2": 1.5}, bandwidth_gbs=12.0, floor_ms=44.833,
                         step_over_floor=0.669)
    assert written(dataclasses.replace(costs, one_thread=one)) == json.dumps({**costs_dict, "one_thread": {
        "step_ms": 30.0, "verify_cost": {"1": 1.0, "2": 1.5}, "bandwidth_gbs": 12.0, "floor_ms": 44.833,
        "step_over_floor": 0.669}})
    # bench: engine_costs.update(curve_fields(last curve)); engine_costs["step_over_floor"] = round(step / floor, 3)
    later = dataclasses.replace(curve, step_ms=26.0, verify_cost={"1": 1.0, "2": 1.05}, curve_readings=3)
    bench_dict = dict(costs_dict)
    bench_dict.update(later.to_json())
    bench_dict["step_over_floor"] = round(bench_dict["step_ms"] / bench_dict["floor_ms"], 3)
    assert written(costs.with_curve(later)) == json.dumps(bench_dict) and bench_dict["step_over_floor"] == 1.039
    # redundancy_map, with and without the calibrated row
    red = prof.Redundancy(attn=[0.5, 1.0], mlp=[0.25, 0.75], prompts=2, tokens_per_prompt=3, drafts_per_set=6)
    red_dict = {"attn": [0.5, 1.0], "mlp": [0.25, 0.75], "prompts": 2, "tokens_per_prompt": 3, "drafts_per_set": 6}
    assert written(red) == json.dumps(red_dict)
    cal = dataclasses.replace(red, calibrated=prof.CalibratedAgreement(skip_attn=[1], skip_mlp=[0, 2], agreement=0.5))
    assert written(cal) == json.dumps({**red_dict, "calibrated": {"skip_attn": [1], "skip_mlp": [0, 2], "agreement": 0.5}})
    # quantized_drafts: the copy as loaded, int8_fallback when any, then c, c_draft_vocab when measured, agreement,
    # draft_step_ms; "unavailable" with the reason; "_" last
    gguf = prof.QuantizedDraft(draft_bytes=300, load_s=0.5, cache="miss", formats=["q4_0", "int8"], isa="avx2",
                               int8_fallback=["output.weight (Q6_K)"], c=0.9, c_draft_vocab=0.8, agreement=0.75,
                               draft_step_ms=22.5)
    int8 = prof.QuantizedDraft(draft_bytes=200, load_s=0.1, cache="hit", formats=["int8"], isa=None, c=0.7,
                               agreement=None, draft_step_ms=17.5)
    quant = prof.QuantizedDrafts({"int8": int8, "w4a8": prof.Unavailable("the w4a8 target itself"), "gguf": gguf},
                                 prof.QuantizedMeta(t1_ms=25.0, agreement_positions=0, rounds=7))
    assert written(quant) == json.dumps({
        "int8": {"draft_bytes": 200, "load_s": 0.1, "cache": "hit", "formats": ["int8"], "isa": None, "c": 0.7,
                 "agreement": None, "draft_step_ms": 17.5},
        "w4a8": {"unavailable": "the w4a8 target itself"},
        "gguf": {"draft_bytes": 300, "load_s": 0.5, "cache": "miss", "formats": ["q4_0", "int8"], "isa": "avx2",
                 "int8_fallback": ["output.weight (Q6_K)"], "c": 0.9, "c_draft_vocab": 0.8, "agreement": 0.75,
                 "draft_step_ms": 22.5},
        "_": {"t1_ms": 25.0, "agreement_positions": 0, "rounds": 7}})
    assert written(prof.QuantizedDrafts({"gguf": prof.Unavailable("no GGUF")})) == json.dumps({"gguf": {"unavailable": "no GGUF"}})
    # draft_verdict: {"drafts": {name: {"c", "agreement", "best_k", "best_gain"}}, "summary"}; the copy's c with
    # its draft vocabulary; a copy without an agreement left out
    verdict = prof.draft_verdict(quant, {"1": 1.0, "2": 1.05, "3": 1.1})
    assert written(verdict) == json.dumps({"drafts": {"gguf": {"c": 0.8, "agreement": 0.75, "best_k": 1,
                                                               "best_gain": verdict.drafts["gguf"].best_gain}},
                                           "summary": verdict.summary})
    # predicted_speedups: per method, its prediction or why there is none
    pred = prof.PredictedSpeedups({"pld": prof.Predicted(predicted_speedup=1.3, draft_round_share=0.4),
                                   "auto": prof.Predicted(predicted_speedup=None, draft_round_share=0.0),
                                   "self-sd": prof.Unavailable("no Self-SD skip-set artifact for this model")})
    assert written(pred) == json.dumps({"pld": {"predicted_speedup": 1.3, "draft_round_share": 0.4},
                                        "auto": {"predicted_speedup": None, "draft_round_share": 0.0},
                                        "self-sd": {"unavailable": "no Self-SD skip-set artifact for this model"}})
