"""The engine's costs on disk (decoding/cost_store.py): a later process reads them instead of timing
forwards, any change of the key misses, an unreadable or foreign file is measured again, the rounds
refresh them, and ``selfspec profile --remeasure`` takes a fresh full reading. Whether something was
measured is judged by counting the timing calls, never by the clock."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec_cli.cli.app import main
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding import cost_store, measure
from selfspec_cli.decoding.cost_store import CostRecord, DraftCost
from selfspec_cli.decoding.measure import CURVE_ROWS, SHORT_ROWS, CurveRecord, VerifyCurve
from selfspec_cli.engine import Engine, kernels
from selfspec_cli.methods import build

from .conftest import make_tiny_model
from .test_cli import write_lines

needs_kernel = pytest.mark.skipif(kernels.load_extension() is None, reason="quantized drafts need the CPU kernel")


@pytest.fixture
def timings(monkeypatch) -> dict[str, int]:
    """Counts of verify-curve readings (``VerifyCurve.measure``), of timed draft costs, and of every
    timed batch of forwards (``_median_forward_s``, which both use); the real ones still run."""
    seen = {"curve": 0, "draft": 0, "timed": 0}
    median, step_cost, measure_curve = measure._median_forward_s, measure.draft_step_cost, VerifyCurve.measure.__func__

    def counted_median(engine, context, runs, rounds):
        seen["timed"] += 1
        return median(engine, context, runs, rounds)

    def counted_step_cost(*args, **kw):
        seen["draft"] += 1
        return step_cost(*args, **kw)

    def counted_measure(cls, *args, **kw):
        seen["curve"] += 1
        return measure_curve(cls, *args, **kw)

    monkeypatch.setattr(measure, "_median_forward_s", counted_median)
    monkeypatch.setattr(cost_store, "draft_step_cost", counted_step_cost)
    monkeypatch.setattr(VerifyCurve, "measure", classmethod(counted_measure))
    return seen


def _fresh_process() -> None:
    """What a new process starts with: no curve kept in memory."""
    cost_store._CURVES.clear()
    cost_store._READINGS.clear()


def test_a_second_build_reads_the_curve_from_disk_without_timing_forwards(timings, capsys):
    eng = Engine(make_tiny_model("llama-gqa"))
    first = build("pld", eng).policy.curve
    assert timings["curve"] == 1 and sorted(first.ratios) == list(SHORT_ROWS)  # a short first reading, said once
    assert capsys.readouterr().err.count("measured a short verify curve") == 1
    path = cost_store.path_for(cost_store.engine_key(eng))
    assert path.parent == cost_store.costs_dir() and json.loads(path.read_text())["curve"]["times_s"]["1"] == first.t1_s
    _fresh_process()
    timed = timings["timed"]
    again = Engine(make_tiny_model("llama-gqa"))  # the same weights: the same fingerprint
    curve = build("pld", again).policy.curve
    assert timings["curve"] == 1 and timings["timed"] == timed  # read: not one forward timed
    assert curve.times_s == first.times_s and curve.ratios == first.ratios
    assert "measured" not in capsys.readouterr().err


@needs_kernel
def test_a_second_build_reads_the_draft_cost_from_disk(timings, tiny_tokenizer):
    eng = Engine(make_tiny_model("llama-gqa"))
    c = build("specqd", eng, tiny_tokenizer, draft_precision="int8").configuration.policy.draft_cost()
    assert timings["draft"] >= 1
    drafts, timed = timings["draft"], timings["timed"]
    _fresh_process()
    again = build("specqd", Engine(make_tiny_model("llama-gqa")), tiny_tokenizer, draft_precision="int8")
    assert timings["draft"] == drafts and again.configuration.policy.draft_cost() == pytest.approx(c, abs=1e-5)
    assert timings["curve"] == 1 and timings["timed"] == timed


@pytest.mark.parametrize("change", ["threads", "precision", "fingerprint"])
def test_a_changed_key_component_misses(timings, change):
    eng = Engine(make_tiny_model("llama-gqa"))
    cost_store.curve_for(eng)
    _fresh_process()
    threads = torch.get_num_threads()
    try:
        if change == "threads":
            torch.set_num_threads(threads + 1)
        other = Engine(make_tiny_model("llama-gqa", seed=1 if change == "fingerprint" else 0))
        if change == "precision":
            other.target_precision = "bf16"  # Engine.target_precision, where the engine has one
        cost_store.curve_for(other)
    finally:
        torch.set_num_threads(threads)
    key, other_key = cost_store.engine_key(eng), cost_store.engine_key(other)
    assert [k for k in key if key[k] != other_key[k]] == [{"fingerprint": "model"}.get(change, change)]
    assert timings["curve"] == 2  # measured again
    assert cost_store.path_for(key) != cost_store.path_for(other_key) and cost_store.path_for(other_key).is_file()


@pytest.mark.parametrize("damage", ["garbage", "foreign key", "bad curve", "bad timestamp"])
def test_an_unreadable_or_foreign_file_is_measured_again_and_replaced(timings, damage):
    eng = Engine(make_tiny_model("llama-gqa"))
    cost_store.curve_for(eng)
    path = cost_store.path_for(cost_store.engine_key(eng))
    rec = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "foreign key":
        path.write_text(json.dumps({**rec, "key": {**rec["key"], "cpu": "another CPU"}}))
    elif damage == "bad curve":
        path.write_text(json.dumps({**rec, "curve": {**rec["curve"], "times_s": {"1": -1.0, "2": 0.5}}}))
    else:  # hand-edited: profile's age must not fail on it
        path.write_text(json.dumps({**rec, "updated": "yesterday"}))
    _fresh_process()
    again = Engine(make_tiny_model("llama-gqa"))
    curve = cost_store.curve_for(again)
    assert timings["curve"] == 2 and curve.t1_s > 0
    assert cost_store.read(cost_store.engine_key(again)).curve.times_s["1"] == curve.t1_s  # written over


def test_the_rounds_refresh_the_stored_reading(timings):
    """A plain decode's one-row forwards are one more reading of T(1) (and of the slope): folded
    into the store at the process's end (here: flush), by 1 / (readings + 1) of the way."""
    eng = Engine(make_tiny_model("llama-gqa"))
    stored = cost_store.curve_for(eng)
    path = cost_store.path_for(cost_store.engine_key(eng))
    # a stored T(1) far from this machine's, so that the refresh shows (the rows keep their ratios)
    rec = json.loads(path.read_text())
    rec["curve"]["times_s"] = {m: t * 1000 for m, t in rec["curve"]["times_s"].items()}
    path.write_text(json.dumps(rec))
    _fresh_process()
    again = Engine(make_tiny_model("llama-gqa"))
    cost_store.curve_for(again)  # read; ar plans nothing, but its plain rounds are observed
    build("ar", again).generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=40))
    assert timings["curve"] == 1
    assert path in cost_store.flush()
    new = json.loads(path.read_text())["curve"]
    # one reading so far: halfway from the stored T(1) to this process's, a thousandth of it
    assert new["readings"] == 2 and new["times_s"]["1"] == pytest.approx(stored.t1_s * 1000 / 2, rel=0.01)
    assert new["times_s"]["2"] / new["times_s"]["1"] == pytest.approx(stored.times_s[2] / stored.t1_s)
    assert cost_store.flush() == []  # nothing left to fold


def test_blend_moves_each_observed_figure_towards_the_process_reading():
    rec = CostRecord({}, 0.0, 0.0, CurveRecord(64, 0.0, {"1": 1.0, "2": 1.2, "4": 1.6}, 3),
                     {"int8/attn[]/mlp[]": DraftCost(0.5, 1)})
    # this process: T(1) 2 s, two rows 2.8 s (ratio 1.4), eight rows (not stored yet) 6 s, a draft step 0.6 s,
    # plain steps 0.01 s dearer per token past the context; four rows seen too seldom to count
    new = cost_store.blend(rec, {1: [2.0] * 3, 2: [2.8] * 3, 8: [6.0] * 5, 4: [9.0] * 2}, {"int8/attn[]/mlp[]": [0.6] * 3},
                           [(0, 2.0), (50, 2.5), (100, 3.0)])
    t1 = (1.0 + 2.0) / 2  # the median of the stored T(1) (one sample: the curve kept none) and this process's
    times = {int(m): t for m, t in new.curve.times_s.items()}
    assert times[1] == pytest.approx(t1) and times[2] / t1 == pytest.approx(1.2 + (1.4 - 1.2) / 4)
    assert times[4] / t1 == pytest.approx(1.6) and times[8] / t1 == pytest.approx(3.0)
    assert new.curve.readings == 4 and new.curve.slope_s == pytest.approx(0.01 / 2.0 / 4 * t1)
    assert new.draft_costs["int8/attn[]/mlp[]"] == DraftCost(pytest.approx(0.5 + (0.3 - 0.5) / 2), 2)
    assert cost_store.blend(rec, {1: [2.0] * 2}, {}) is None  # too few to count
    assert new.curve.t1_samples == [1.0, 2.0]


def test_one_loaded_process_does_not_move_the_stored_step_time():
    """Issue 50: each call moved the stored T(1) a tenth of the way to its own, so a loaded afternoon drifted it
    from 16.4 to 26.1 ms and the same call read 0.62x to 1.10x ar. T(1) is the median of the processes' readings."""
    rec = CostRecord({}, 0.0, 0.0, CurveRecord(64, 0.0, {"1": 1.0, "2": 1.2}, 5, t1_samples=[1.0, 0.98, 1.02, 1.0, 0.99]))
    slow = cost_store.blend(rec, {1: [1.6] * 3}, {})  # one process on a loaded minute: 60 % slower
    assert float(slow.curve.times_s["1"]) == pytest.approx(1.0)
    assert slow.curve.t1_samples[-1] == 1.6 and len(slow.curve.t1_samples) == 6
    # the samples are bounded: the newest T1_KEEP
    many = dataclasses.replace(rec, curve=dataclasses.replace(rec.curve, t1_samples=[1.0] * cost_store.T1_KEEP))
    assert len(cost_store.blend(many, {1: [2.0] * 3}, {}).curve.t1_samples) == cost_store.T1_KEEP


def test_a_settled_store_is_refreshed_deliberately_not_by_every_process(timings):
    """Once the stored curve holds BLEND_CAP readings, a process's rounds change it only when it is REFRESH_S old."""
    eng = Engine(make_tiny_model("llama-gqa"))
    cost_store.curve_for(eng)
    path = cost_store.path_for(cost_store.engine_key(eng))
    rec = json.loads(path.read_text())
    rec["curve"]["readings"] = cost_store.BLEND_CAP
    path.write_text(json.dumps(rec))
    before = path.read_text()
    assert cost_store.describe(cost_store.engine_key(eng))["settled"]
    for _ in range(2):  # two later processes: the store is left as it was
        _fresh_process()
        again = Engine(make_tiny_model("llama-gqa"))
        cost_store.curve_for(again)
        build("ar", again).generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=12))
        assert cost_store.flush() == [] and path.read_text() == before
    rec["updated"] -= cost_store.REFRESH_S  # the same store, REFRESH_S older: the next process refreshes it
    path.write_text(json.dumps(rec))
    _fresh_process()
    again = Engine(make_tiny_model("llama-gqa"))
    cost_store.curve_for(again)
    build("ar", again).generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=12))
    assert path in cost_store.flush()
    assert json.loads(path.read_text())["curve"]["readings"] == cost_store.BLEND_CAP + 1


def test_an_engine_in_fresh_mode_measures_in_full_and_stores_it(timings):
    """The bench: every run measures its own curve (full), whatever is stored; what it measured is stored."""
    cost_store.curve_for(Engine(make_tiny_model("llama-gqa")))
    _fresh_process()
    eng = Engine(make_tiny_model("llama-gqa"))
    cost_store.measure_fresh(eng)
    curve = cost_store.curve_for(eng)
    assert timings["curve"] == 2 and curve.full and curve.slope_s >= 0
    assert sorted(int(m) for m in cost_store.read(cost_store.engine_key(eng)).curve.times_s) == list(CURVE_ROWS)


def _profile(model_dir, prompts, out, *extra: str) -> dict:
    rc = main(["profile", "-m", str(model_dir), "-p", str(prompts), "-o", str(out), "--rounds", "1", "--force",
               "--redundancy-prompts", "0", "--predict", "", "--no-plots", "--device", "cpu",
               "--threads", "1", *extra])  # one thread: no second, unstored 1-thread reading beside the store's
    assert rc == 0
    return json.loads((out / "profile.json").read_text())["cost_store"]


def test_profile_shows_the_store_and_remeasure_takes_a_fresh_full_reading(tiny_model_dir, tmp_path, timings, capsys):
    prompts = write_lines(tmp_path / "p.txt", ["def add(a, b):"])
    first = _profile(tiny_model_dir, prompts, tmp_path / "a")
    assert first["curve"] == "measured" and first["stored"] and first["rows"] == list(CURVE_ROWS)
    n = timings["curve"]
    second = _profile(tiny_model_dir, prompts, tmp_path / "a")
    assert second["curve"] == "read" and timings["curve"] == n and second["path"] == first["path"]
    err = capsys.readouterr().err
    assert "costs on disk" in err and "costs key" in err
    assert f"costs on disk: {first['path']}" in err.splitlines()  # the path whole, on a line of its own (issue 50)
    third = _profile(tiny_model_dir, prompts, tmp_path / "a", "--remeasure")
    assert third["curve"] == "measured" and timings["curve"] == n + 1
    assert third["readings"] == 1 and third["rows"] == list(CURVE_ROWS)


def test_readings_at_one_context_share_its_prefill(monkeypatch):
    """A first call's verify curve and a quantized draft's c read on one prefilled prefix: the second
    reading prefills nothing, and a reading at another context prefills its own."""
    eng = Engine(make_tiny_model("llama-gqa"))
    prefills = []
    real = Engine.forward

    def counted(self, cache, input_ids=None, **kw):
        if kw.get("positions") == 0:
            prefills.append(int(input_ids.shape[0]))
        return real(self, cache, input_ids, **kw)

    monkeypatch.setattr(Engine, "forward", counted)
    VerifyCurve.measure(eng, rounds=1, rows=SHORT_ROWS, extra=0)
    measure.draft_step_cost(eng, None, frozenset({1}), frozenset(), rounds=1)
    assert prefills == [64]
    VerifyCurve.measure(eng, context=32, rounds=1, rows=(1, 2), extra=0)
    assert prefills == [64, 32]


# a store file as this version writes it (selfspec-costs version 1): a record typed on reading must write it back
# byte for byte, and a file written before the typed record (no row slope, no T(1) samples) must still load
STORED_TODAY = """{
 "format": "selfspec-costs",
 "version": 1,
 "key": {
  "model": "abc123",
  "precision": "fp32",
  "threads": "2",
  "kernel": "F.linear",
  "device": "cpu",
  "cpu": "AMD EPYC"
 },
 "created": 1764400000.25,
 "updated": 1764403600.5,
 "curve": {
  "context": 64,
  "slope_s": 1.2e-06,
  "times_s": {
   "1": 0.0164,
   "2": 0.0178,
   "4": 0.0201
  },
  "readings": 3,
  "row_slope_s": 2e-08,
  "t1_samples": [
   0.0162,
   0.0164,
   0.0166
  ]
 },
 "draft_costs": {
  "int8/attn[]/mlp[]": {
   "c": 0.41,
   "readings": 2
  },
  "target/attn[1,3]/mlp[2]": {
   "c": 0.7,
   "readings": 1
  }
 }
}
"""


def test_a_store_file_in_todays_format_reads_typed_and_writes_back_the_same_text(tmp_path):
    doc = json.loads(STORED_TODAY)
    rec = CostRecord.from_json(doc)
    assert rec is not None and rec.key["cpu"] == "AMD EPYC" and rec.updated == 1764403600.5
    assert rec.curve == CurveRecord(64, 1.2e-06, {"1": 0.0164, "2": 0.0178, "4": 0.0201}, 3, 2e-08, [0.0162, 0.0164, 0.0166])
    assert rec.draft_costs == {"int8/attn[]/mlp[]": DraftCost(0.41, 2), "target/attn[1,3]/mlp[2]": DraftCost(0.7, 1)}
    assert json.dumps(rec.to_json(), indent=1) + "\n" == STORED_TODAY
    curve = VerifyCurve.from_record(rec.curve)
    assert curve is not None and curve.t1_s == 0.0164 and curve.row_slope_s == 2e-08
    path = tmp_path / "costs.json"
    path.write_text(STORED_TODAY)
    assert cost_store.read(doc["key"], path) == rec and cost_store.read({**doc["key"], "cpu": "other"}, path) is None
    cost_store.write(doc["key"], rec, path, now=rec.updated)
    assert path.read_text() == STORED_TODAY  # written back: the same text
    older = {**doc, "curve": {k: v for k, v in doc["curve"].items() if k not in ("row_slope_s", "t1_samples")}}
    old = CostRecord.from_json(json.loads(json.dumps(older)))
    assert old.curve.row_slope_s is None and old.curve.t1_samples is None and old.to_json() == older
    assert VerifyCurve.from_record(old.curve).row_slope_s is None
