"""selfspec bench: metric arithmetic on hand-built step logs, parity reporting when a
contender is wrong, the Hugging Face peers' recovered statistics, and the CLI outputs."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from selfspec_cli.bench import metrics
from selfspec_cli.bench.peers import make_peer
from selfspec_cli.bench.report import MethodSummary, spec_bench_answers, summarize
from selfspec_cli.bench.runner import Contender, ContenderResult, run_bench
from selfspec_cli.cli.app import main
from selfspec_cli.cli.bench import _table
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.output import DecodeResult, DecodeStats, OutputRecord
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build
from selfspec_cli.prompts import Prompt

from .conftest import make_tiny_model


def rec(pid, tokens, wall, accept, drafted=None, accepted=None, category=None, ids=None):
    st = {"accept_lengths": accept, "target_forwards": len(accept)}
    if drafted is not None:
        st.update(drafted_tokens=drafted, accepted_draft_tokens=accepted)
    r = {"id": pid, "text": "", "new_tokens": tokens, "wall_time_s": wall, "stats": st,
         "token_ids": ids if ids is not None else list(range(tokens))}
    if category:
        r["category"] = category
    return OutputRecord.from_dict(r)


def _dicts(summary):
    """The summary as results.json holds it."""
    return {n: m.to_dict() for n, m in summary.items()}


# ---------------------------------------------------------------- metric arithmetic


def test_mean_accepted_length_and_acceptance_rate_pool_all_steps():
    # prompt a: prefill 1 token, then rounds adding 3, 1, 4 (drafted 3+3+3, accepted 2+0+3)
    a = rec("a", 9, 1.0, [1, 3, 1, 4], drafted=9, accepted=5)
    # prompt b: prefill, rounds 2, 2 (drafted 2+4, accepted 1+1)
    b = rec("b", 5, 1.0, [1, 2, 2], drafted=6, accepted=2)
    assert metrics.mean_accepted_length([a, b]) == pytest.approx(14 / 7)
    assert metrics.acceptance_rate([a, b]) == pytest.approx(7 / 15)
    # plain decoding: M = 1, no drafts -> alpha undefined
    c = rec("c", 4, 1.0, [1, 1, 1, 1])
    assert metrics.mean_accepted_length([c]) == 1.0
    assert metrics.acceptance_rate([c]) is None
    # multi-turn records pool their turns
    mt = OutputRecord.from_dict({"id": "m", "new_tokens": 6, "wall_time_s": 1.0, "token_ids": [], "turns": [
        {"stats": {"accept_lengths": [1, 2], "drafted_tokens": 2, "accepted_draft_tokens": 1}},
        {"stats": {"accept_lengths": [1, 1, 1], "drafted_tokens": 3, "accepted_draft_tokens": 0}}]})
    assert metrics.mean_accepted_length([mt]) == pytest.approx(6 / 5)
    assert metrics.acceptance_rate([mt]) == pytest.approx(1 / 5)


def test_throughput_is_spec_bench_mean_of_per_prompt_rates_and_speedup_is_ratio_of_means():
    # repeat 1: prompts at 10 and 30 tok/s -> 20; repeat 2: 20 and 40 -> 30; repeat 3: 5 and 15 -> 10
    reps = [[rec("a", 10, 1.0, [1] * 10), rec("b", 30, 1.0, [1] * 30)],
            [rec("a", 10, 0.5, [1] * 10), rec("b", 40, 1.0, [1] * 40)],
            [rec("a", 10, 2.0, [1] * 10), rec("b", 15, 1.0, [1] * 15)]]
    s = metrics.throughput_summary(reps)
    assert s.tokens_per_s == pytest.approx(20.0)  # median of 20, 30, 10
    assert (s.tokens_per_s_min, s.tokens_per_s_max) == (pytest.approx(10.0), pytest.approx(30.0))
    assert s.tokens_per_s_mean == pytest.approx(20.0)
    base = [[rec("a", 10, 1.0, [1] * 10), rec("b", 10, 1.0, [1] * 10)]]  # mean 10 tok/s
    assert metrics.speedup(reps, base) == pytest.approx(2.0)
    # not the ratio of total tokens / total time (which would weight long prompts)
    assert metrics.speedup([[rec("a", 100, 1.0, [1]), rec("b", 10, 10.0, [1])]], base) == pytest.approx(50.5 / 10)


def test_paired_speedup_cancels_a_slowdown_both_contenders_saw():
    """Each (repeat, prompt) pair is a ratio; a pass in which the machine was twice as slow for
    both contenders leaves the paired figure at exactly 2x with no spread, while the ratio of
    means only happens to agree; with noisy ratios the interval is Student's t on the logs."""
    base = [[rec("a", 10, 1.0, [1]), rec("b", 20, 1.0, [1])], [rec("a", 10, 2.0, [1]), rec("b", 20, 2.0, [1])]]
    fast = [[rec("a", 10, 0.5, [1]), rec("b", 20, 0.5, [1])], [rec("a", 10, 1.0, [1]), rec("b", 20, 1.0, [1])]]
    p = metrics.paired_speedup(fast, base).to_dict()
    assert p["speedup"] == pytest.approx(2.0) and p["ci95"] == [pytest.approx(2.0), pytest.approx(2.0)] and p["pairs"] == 4
    # pairs are matched by repeat and prompt id, not by position
    swapped = [list(reversed(rs)) for rs in fast]
    assert metrics.paired_speedup(swapped, base).speedup == pytest.approx(2.0)
    # ratios 1.1, 0.9, 1.0, 1.2 -> exp(mean log), t(0.975, 3) = 3.182
    noisy = [[rec("a", 11, 1.0, [1]), rec("b", 18, 1.0, [1])], [rec("a", 10, 2.0, [1]), rec("b", 24, 2.0, [1])]]
    p = metrics.paired_speedup(noisy, base).to_dict()
    logs = [math.log(x) for x in (1.1, 0.9, 1.0, 1.2)]
    m, half = statistics.fmean(logs), 3.1824463 * statistics.stdev(logs) / 2
    assert p["speedup"] == pytest.approx(math.exp(m))
    assert p["ci95"] == [pytest.approx(math.exp(m - half), rel=1e-6), pytest.approx(math.exp(m + half), rel=1e-6)]
    assert metrics.paired_speedup([[rec("c", 10, 1.0, [1])]], base) is None  # no common prompt
    one = metrics.paired_speedup([[rec("a", 20, 1.0, [1])]], base)
    assert one.speedup == pytest.approx(2.0) and one.ci95 is None


def test_decode_only_throughput_leaves_out_each_turns_prefill():
    # one turn: 11 tokens in 1.5 s of which 0.5 s prefill -> 10 tokens in 1.0 s
    a = {"id": "a", "new_tokens": 11, "wall_time_s": 1.5, "stats": {"prefill_s": 0.5}}
    fast = OutputRecord.from_dict({**a, "wall_time_s": 1.0})  # 10 tokens in 0.5 s: 2x decode-only, 1.5x end to end
    a = OutputRecord.from_dict(a)
    # two turns: (5 - 1) tokens in 1.0 - 0.2 s and (9 - 1) in 2.0 - 0.4 s -> 12 tokens in 2.4 s
    mt = {"id": "m", "new_tokens": 14, "wall_time_s": 3.0, "stats": {"prefill_s": 0.6}, "turns": [
        {"new_tokens": 5, "wall_time_s": 1.0, "stats": {"prefill_s": 0.2}},
        {"new_tokens": 9, "wall_time_s": 2.0, "stats": {"prefill_s": 0.4}}]}
    mt = OutputRecord.from_dict(mt)
    assert metrics.decode_tps(a) == pytest.approx(10.0)
    assert metrics.decode_tps(mt) == pytest.approx(12 / 2.4)
    peer = OutputRecord.from_dict({"id": "a", "new_tokens": 11, "wall_time_s": 1.5, "stats": {"accept_lengths": [1] * 11}})
    assert metrics.decode_tps(peer) is None  # no prefill reported: no decode-only figure
    assert metrics.decode_speedup([[fast]], [[a]]) == pytest.approx(2.0)
    assert metrics.speedup([[fast]], [[a]]) == pytest.approx(1.5)
    assert metrics.decode_speedup([[fast]], [[peer]]) is None


def test_parity_reports_first_divergence_and_token_share():
    ref = [rec(1, 4, 1.0, [1] * 4, ids=[5, 6, 7, 8]), rec(2, 4, 1.0, [1] * 4, ids=[1, 2, 3, 4]),
           rec(3, 2, 1.0, [1] * 2, ids=[9, 9])]
    same = metrics.parity(ref, ref).to_dict()
    assert same["parity"] == 1.0 and same["token_parity"] == 1.0 and same["differing"] == []
    mine = [rec(1, 4, 1.0, [1] * 4, ids=[5, 6, 0, 8]), rec(2, 3, 1.0, [1] * 3, ids=[1, 2, 3]),
            rec(3, 2, 1.0, [1] * 2, ids=[9, 9])]
    p = metrics.parity(mine, ref).to_dict()
    assert p["prompts_identical"] == 1 and p["parity"] == pytest.approx(1 / 3)
    assert p["differing"] == [{"id": 1, "first_divergence": 2}, {"id": 2, "first_divergence": 3}]
    assert p["token_parity"] == pytest.approx((2 + 3 + 2) / 10)
    # a missing prompt counts as differing
    assert metrics.parity(mine[:1], ref).to_dict()["differing"][-1] == {"id": 3, "first_divergence": 0, "missing": True}


def test_summary_per_category_and_spec_bench_answers():
    def res(name, walls):
        r = ContenderResult(name, True, "selfspec")
        r.repeats = [[rec(i, 10, w, [1, 3, 3, 3], drafted=9, accepted=6, category=c)
                      for i, (c, w) in enumerate(zip(["x", "x", "y"], walls))]]
        return r
    results = {"ar": res("ar", [1.0, 1.0, 1.0]), "fast": res("fast", [0.5, 0.5, 0.25])}
    s = _dicts(summarize(results, "ar", None))
    assert s["fast"]["speedup_vs_ar"] == pytest.approx((20 + 20 + 40) / 3 / 10, abs=1e-4)
    assert s["fast"]["categories"]["x"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert s["fast"]["categories"]["y"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert s["fast"]["mean_accepted_length"] == pytest.approx(2.5)
    assert s["fast"]["acceptance_rate"] == pytest.approx(6 / 9, abs=1e-4)
    assert s["fast"]["speedup_vs_hf"] is None
    ans = spec_bench_answers(results["fast"].records, "m")
    assert ans[0]["question_id"] == 0 and ans[0]["category"] == "x"
    ch = ans[0]["choices"][0]
    assert ch["new_tokens"] == [10] and ch["wall_time"] == [0.5] and ch["decoding_steps"] == [4]
    assert ch["accept_lengths"] == [1, 3, 3, 3]


def test_predicted_decode_speedup_weighs_prompts_as_the_measured_one_does():
    """Two prompts, predicted gains 3 and 1 (plans 30/10 and 5/5): the prediction weighs each by ar's
    decode rate on it, 10 and 30 tokens/s (over both of ar's passes), so (10 x 3 + 30 x 1) / 40 = 1.5,
    where pooling the rounds would say 35 / 15; a prompt without a plan is left out."""
    from selfspec_cli.bench.report import predicted_decode_speedup

    def rec(pid, new, wall, plan=None):
        st = {"prefill_s": 0.0, **({"plan": {"expected_tokens": plan[0], "cost_steps": plan[1]}} if plan else {})}
        return OutputRecord.from_dict({"id": pid, "new_tokens": new, "wall_time_s": wall, "stats": st})

    ar = [[rec("a", 11, 1.0), rec("b", 31, 1.0)], [rec("a", 11, 1.0), rec("b", 31, 1.0)]]
    method = [[rec("a", 11, 0.4, (30.0, 10.0)), rec("b", 31, 0.9, (5.0, 5.0)), rec("c", 5, 0.1)]]
    assert predicted_decode_speedup(method, ar) == pytest.approx(1.5)
    assert predicted_decode_speedup([[rec("c", 5, 0.1)]], ar) is None


def test_cost_model_predicts_decode_only_speed():
    """The bench's cost model on hand-built records: the predicted speedup is the plans' expected
    tokens over their cost, summed over every turn of every prompt (42 / 19 here; the mean of
    the per-turn gains would be 1.8). The decode-only speedup (2.0: the prefill left out; not the
    end-to-end one, 1.45) is a ratio of mean per-prompt rates, so measured over predicted divides it by
    the plans' gains aggregated the same way: per prompt (3, 1.2 and 1.5), weighted by ar's decode rate
    on each (10 tokens/s on all three here): 1.9."""
    def turn(new, wall, prefill, plan=None, share=None):
        st = {"accept_lengths": [1] * new, "target_forwards": new, "prefill_s": prefill}
        if plan is not None:
            st.update(plan={"expected_tokens": plan[0], "cost_steps": plan[1]}, draft_round_share=share)
        return {"new_tokens": new, "wall_time_s": wall, "token_ids": list(range(new)), "stats": st}

    def record(pid, turns, last_stats=None):
        if len(turns) == 1:
            return OutputRecord.from_dict({"id": pid, **turns[0]})
        return OutputRecord.from_dict({"id": pid, "new_tokens": sum(t["new_tokens"] for t in turns), "token_ids": [],
                                       "wall_time_s": sum(t["wall_time_s"] for t in turns), "stats": last_stats or {},
                                       "turns": turns})

    def result(name, records):
        r = ContenderResult(name, True, "selfspec")
        r.repeats = [records]
        return r

    # ar: 10 tokens after the prefill in 1.0 s of each prompt's decoding (c: two turns of 5 in 0.5 s)
    ar = [record("a", [turn(11, 1.5, 0.5)]), record("b", [turn(11, 1.5, 0.5)]),
          record("c", [turn(6, 1.0, 0.5), turn(6, 1.0, 0.5)])]
    # the method decodes the same tokens in half the time after the same prefills
    fast = [record("a", [turn(11, 1.0, 0.5, (30.0, 10.0), 0.5)]), record("b", [turn(11, 1.0, 0.5, (6.0, 5.0), 0.1)]),
            record("c", [turn(6, 0.75, 0.5, (4.0, 2.0), 0.2), turn(6, 0.75, 0.5, (2.0, 2.0), 0.4)],
                   last_stats={"skip_attn": [1, 2], "skip_mlp": [3]})]
    s = _dicts(summarize({"ar": result("ar", ar), "fast": result("fast", fast)}, "ar", None, num_layers=6))
    m = s["fast"]
    assert m["decode_speedup_vs_ar"] == pytest.approx(2.0)
    assert m["speedup_vs_ar"] == pytest.approx((11 + 11 + 8) / 3 / ((11 / 1.5 + 11 / 1.5 + 6) / 3), abs=1e-4)
    cm = m["cost_model"]
    assert cm["predicted_speedup"] == pytest.approx(42 / 19, abs=1e-4)
    assert cm["predicted_decode_speedup"] == pytest.approx(1.9, abs=1e-4)
    assert cm["measured_over_predicted"] == pytest.approx(2.0 / 1.9, abs=1e-4)
    assert cm["draft_round_share"] == pytest.approx((0.5 + 0.1 + 0.2 + 0.4) / 4)  # over turns
    assert cm["skip_ratio"] == pytest.approx(3 / 12)
    assert "cost_model" not in s["ar"]  # no plans, no prediction


# ---------------------------------------------------------------- parity drops when a token is wrong


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model("llama-gqa")
    return model, Engine(model)


PROMPTS = [Prompt(id=f"p{i}", turns=(f"prompt {i}",), category="c" if i % 2 else "d") for i in range(4)]


class _Tok:
    """Token ids from characters: enough for run_prompt without a chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [2 + (ord(c) % 200) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_injected_wrong_token_drops_the_parity_column(tiny):
    model, engine = tiny
    cfg = GenerationConfig(max_new_tokens=8)
    ar = build("ar", engine, None)

    def corrupt(prompt_ids, cfg):
        res = ar.generate(prompt_ids, cfg)
        if prompt_ids == _Tok()("prompt 2")["input_ids"]:
            ids = list(res.token_ids)
            ids[5] = (ids[5] + 1) % 300
            return DecodeResult(ids, res.finish_reason, res.stats)
        return res

    contenders = [Contender("ar", lambda: ar.generate), Contender("broken", lambda: corrupt)]
    results = run_bench(contenders, PROMPTS, _Tok(), cfg, torch.device("cpu"), warmup=0, repeats=2)
    summary = summarize(results, "ar", None)
    s = _dicts(summary)
    assert _dicts({n: MethodSummary.from_dict(json.loads(json.dumps(m))) for n, m in s.items()}) == s  # read back
    assert s["ar"]["parity"]["parity"] == 1.0
    par = s["broken"]["parity"]
    assert par["parity"] == pytest.approx(0.75)
    assert par["differing"] == [{"id": "p2", "first_divergence": 5}]
    assert s["broken"]["categories"]["d"]["parity"]["parity"] == pytest.approx(0.5)
    assert s["broken"]["categories"]["c"]["parity"]["parity"] == 1.0
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(_table(summary, "t", True, False))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "broken" in line)
    assert "75%" in row and "p2@5" in row
    assert "100%" in next(line for line in text.splitlines() if line.strip().startswith("│ ar"))


# ---------------------------------------------------------------- peers


@pytest.mark.parametrize("peer", ["hf-pld", "hf-early-exit"])
def test_hf_assisted_peers_match_greedy_and_report_steps(tiny, peer):
    model, engine = tiny
    ar = build("ar", engine, None)
    p = make_peer(peer, model)
    cfg = GenerationConfig(max_new_tokens=20, eos_token_ids=())
    # a repetitive prompt gives prompt lookup something to match
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    want = ar.generate(prompt, cfg).token_ids
    got = p.generate(prompt, cfg)
    assert got.token_ids == want and len(got.token_ids) <= 20
    st = got.stats.as_dict()
    assert sum(st["accept_lengths"]) == len(got.token_ids)
    assert st["target_forwards"] == len(st["accept_lengths"]) <= len(got.token_ids)
    assert st.get("drafted_tokens", 0) >= st.get("accepted_draft_tokens", 0)
    assert metrics.mean_accepted_length([OutputRecord.from_dict({"stats": st})]) >= 1.0


@pytest.mark.parametrize("peer", ["hf", "hf-static"])
def test_hf_plain_peers_match_greedy_one_token_a_forward(tiny, peer):
    """Plain ``generate``, with the dynamic cache and with the static one (compiled on a GPU only)."""
    model, engine = tiny
    cfg = GenerationConfig(max_new_tokens=12, eos_token_ids=())
    prompt = [5, 6, 7, 8, 9, 10, 11]
    got = make_peer(peer, model).generate(prompt, cfg)
    assert got.token_ids == build("ar", engine, None).generate(prompt, cfg).token_ids
    assert got.stats.accept_lengths == [1] * 12 and got.stats.drafted_tokens == 0


def test_hf_assisted_peer_with_a_second_model(tiny):
    model, engine = tiny
    draft = make_tiny_model("llama-gqa", seed=1, layers=2)  # same vocabulary, different weights
    ar = build("ar", engine, None)
    p = make_peer("hf-assisted", model, assistant=draft)
    cfg = GenerationConfig(max_new_tokens=16, eos_token_ids=())
    prompt = [5, 6, 7, 8, 9, 10]
    got = p.generate(prompt, cfg)
    assert got.token_ids == ar.generate(prompt, cfg).token_ids
    st = got.stats.as_dict()
    assert sum(st["accept_lengths"]) == len(got.token_ids) and st["drafted_tokens"] > 0


def test_hf_early_exit_rejects_a_layer_out_of_range(tiny):
    from selfspec_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="--early-exit-layer"):
        make_peer("hf-early-exit", tiny[0], early_exit_layer=4)


# ---------------------------------------------------------------- the command


@pytest.mark.parametrize("methods,lite", [("ar,pld", True), ("ar,hf", False)])
def test_the_bench_reads_the_model_without_transformers_unless_a_peer_runs_it(tiny_model_dir, tmp_path, capsys,
                                                                              monkeypatch, methods, lite):
    from selfspec_cli.session import Session

    asked = []
    real = Session.open.__func__

    def recorded(cls, *args, **kw):
        asked.append(kw.get("lite"))
        return real(cls, *args, **kw)

    monkeypatch.setattr(Session, "open", classmethod(recorded))
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    rc = main(["bench", "--methods", methods, "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "4", "--warmup", "0",
               "--device", "cpu", "--no-plots", "--no-costs", "-o", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    assert asked == [lite]


def test_bench_cli_writes_results_answers_records_and_plots(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = [{"id": f"{c}-{i}", "category": c, "prompt": f"def f{i}(x):\n    return x + {i}"}
             for c in ("code", "prose") for i in range(2)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out_dir = tmp_path / "out"
    capsys.readouterr()
    rc = main(["bench", "--methods", "ar,hf,hf-pld,swift,asd", "-m", str(tiny_model_dir), "-p", str(prompts),
               "-n", "40", "--warmup", "1", "--repeats", "2", "--device", "cpu", "-o", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    head = json.loads(out.strip().splitlines()[-1])
    assert set(head["methods"]) == {"ar", "hf", "hf-pld", "swift", "asd"}
    doc = json.loads((out_dir / "results.json").read_text())
    assert doc["schema"] == "selfspec-bench/1"
    for key in ("torch", "transformers", "device", "dtype", "threads", "cpu"):
        assert key in doc["environment"]
    assert doc["setup"]["repeats"] == 2 and doc["setup"]["categories"] == {"code": 2, "prose": 2}
    # the tiny tokenizer has no chat template (a base model's case): asked for, but the prompts are raw text
    assert doc["setup"]["chat_template"] is False and doc["setup"]["chat_template_asked"] is True
    # the verify curve pooled over a reading per pass, and the figures derived from it restated with it
    costs = doc["engine_costs"]
    assert costs["curve_readings"] == 2
    # profile's record, keys in its order (the last pass's curve restated in place, not appended)
    assert list(costs)[:4] == ["weight_bytes", "bandwidth_gbs", "floor_ms", "context_tokens"]
    assert list(costs)[-2:] == ["step_over_floor", "kernel"] and "one_thread" not in costs
    assert costs["step_over_floor"] == pytest.approx(costs["step_ms"] / costs["floor_ms"], abs=1e-3)
    # the command as given to main(), not the test runner's argv
    assert doc["setup"]["command"].startswith("selfspec bench --methods ar,hf,hf-pld,swift,asd -m ")
    for name, m in doc["methods"].items():
        assert m["parity"]["parity"] == 1.0, (name, m["parity"])  # every contender here is lossless
        assert len(m["per_repeat_tokens_per_s"]) == 2
        assert set(m["categories"]) == {"code", "prose"}
        assert m["peak_rss_mb"] > 0
        answers = [json.loads(x) for x in (out_dir / "answers" / f"{name}.jsonl").read_text().splitlines()]
        assert [a["question_id"] for a in answers] == [x["id"] for x in lines]
        records = (out_dir / "records" / f"{name}.jsonl").read_text().splitlines()
        assert len(records) == 2 * len(lines)  # every timed pass, streamed
    assert doc["methods"]["swift"]["optimization_s"] is not None
    cm = doc["methods"]["swift"]["cost_model"]
    assert 0 < cm["skip_ratio"] < 1 and cm["predicted_speedup"] > 0 and 0 <= cm["draft_round_share"] <= 1
    swift = doc["methods"]["swift"]  # the plans predict decode-only speed: measured is decode-only too
    # decode-only exceeds end to end only when a prefill outlasts a decode step, which a tiny model need not
    # do: the formula is tested on known records (test_decode_only_throughput_leaves_out_each_turns_prefill)
    assert swift["decode_speedup_vs_ar"] > 0 and swift["decode_tokens_per_s"] > 0
    assert cm["measured_over_predicted"] > 0  # its value on known records: test_cost_model_predicts_decode_only_speed
    assert doc["methods"]["hf"]["decode_tokens_per_s"] is None and doc["methods"]["hf"]["decode_speedup_vs_ar"] is None
    assert 0 <= doc["methods"]["asd"]["cost_model"]["skip_ratio"] < 1
    assert "cost_model" not in doc["methods"]["hf-pld"]
    assert doc["methods"]["hf-pld"]["acceptance_rate"] is not None
    for key in ("speedup_by_category", "accept_lengths", "swift_skip_sets"):
        png = Path(doc["files"]["plots"][key])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup by category" in err


def test_the_bandwidth_is_read_once_before_the_engine_and_contenders_are_built(capsys, tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    """The probe's 1 GiB buffer must not sit on top of the contenders (a bench of ar and auto on Qwen2.5-Coder-1.5B
    peaked at 2.39 GB with it read after them, 1.65 GB before: docs/benchmarks.md, "Memory"), nor on top of the
    engine, whose block panels are resident from the start (engine/arena.py: 2.34 GB again with the probe read
    after the engine); the engine costs then use that same reading."""
    from selfspec_cli.bench import engine_profile, job
    from selfspec_cli.session import Session

    events: list[str] = []
    monkeypatch.setattr(engine_profile, "read_bandwidth_gbs", lambda **kw: events.append("probe") or 12.5)
    make = Session.engine
    monkeypatch.setattr(Session, "engine", lambda self, *a, **kw: events.append("engine") or make(self, *a, **kw))
    built = job.build_contenders
    monkeypatch.setattr(job, "build_contenders", lambda *a, **kw: events.append("contenders") or built(*a, **kw))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def f(x):\n    return x"}) + "\n")
    rc = main(["bench", "--methods", "ar,pld", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "4", "--warmup",
               "0", "--device", "cpu", "--no-plots", "-o", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    assert events == ["probe", "engine", "contenders"]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["engine_costs"]["bandwidth_gbs"] == 12.5


def test_bench_bad_input_is_one_line(capsys, tiny_model_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    for argv, needle in ((["--suite", "nope"], "nope"),
                         (["-p", str(prompts), "--suite", "pystdlib"], "not both"),
                         (["-p", str(prompts), "--methods", "ar,hf-assisted"], "--assistant-model"),
                         (["-p", str(prompts), "-o", str(tmp_path / "f")], "is a file"),
                         (["-p", str(prompts), "--methods", "ar,hf-early-exit", "--early-exit-layer", "9"], "--early-exit-layer"),
                         (["-p", str(prompts), "--threads", "0"], "--threads")):
        rc = main(["bench", "-m", str(tiny_model_dir), "--device", "cpu", "-n", "4", *argv])
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_target_peer_decodes_in_its_own_process_and_the_block_side_frees_its_floats(capsys, tiny_model_dir, tmp_path):
    """ar-fp32 runs in a child process (bench/peer_process.py): its tokens are those of the fp32 target
    decoded here, its peak_rss_mb is that process's, the child is gone after the run, and the bench's
    own process released the float matrices its bf16 target does not read."""
    import multiprocessing

    from selfspec_cli.loading import load_model
    from selfspec_cli.runtime import run_prompt
    from selfspec_cli.prompts import Prompt

    if not Engine(make_tiny_model()).kernel_info["backend"].startswith("small_gemm"):
        pytest.skip("no CPU kernel on this host: only the loaded weights can be the target, no ar-fp32 row")
    prompts = tmp_path / "p.jsonl"
    texts = ["def add(a, b):\n    return", "The capital of France is"]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out_dir = tmp_path / "out"
    rc = main(["bench", "--methods", "ar,ar-fp32", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "12", "--warmup", "0",
               "--target-precision", "bf16", "--no-costs", "--no-plots", "--device", "cpu", "-o", str(out_dir)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads((out_dir / "results.json").read_text())
    assert set(doc["methods"]) == {"ar", "ar-fp32"}
    assert "process of its own" in doc["methods"]["ar-fp32"]["description"]
    assert multiprocessing.active_children() == []
    got = {r["id"]: r["token_ids"] for r in map(json.loads, (out_dir / "records" / "ar-fp32.jsonl").read_text().splitlines())}
    mdl, tok = load_model(str(tiny_model_dir), device="cpu")
    ar = build("ar", Engine(mdl, target_precision="fp32"), tok)
    cfg = GenerationConfig(max_new_tokens=12, eos_token_ids=(tok.eos_token_id,))
    for i, t in enumerate(texts):
        want = run_prompt(ar.generate, tok, Prompt(id=i, turns=(t,)), cfg, torch.device("cpu"), "ar").token_ids
        assert got[i] == want
    assert doc["methods"]["ar"]["peak_rss_mb"] != doc["methods"]["ar-fp32"]["peak_rss_mb"]


def test_the_bench_runs_the_contenders_listed_and_no_others(capsys, tiny_model_dir, tmp_path):
    """No ar-fp32 row unless --methods lists it; listed on a float32 target, it would be ar itself: left
    out, with a note."""
    if not Engine(make_tiny_model()).kernel_info["backend"].startswith("small_gemm"):
        pytest.skip("no CPU kernel on this host: no bf16 target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 1, "prompt": "The capital of France is"}) + "\n")
    base = ["bench", "-m", str(tiny_model_dir), "-p", str(prompts), "-n", "4", "--warmup", "0", "--no-costs",
            "--no-plots", "--device", "cpu"]
    for methods, precision, want in (("ar", "bf16", {"ar"}), ("ar,ar-fp32,pld", "fp32", {"ar", "pld"})):
        out_dir = tmp_path / precision
        assert main([*base, "--methods", methods, "--target-precision", precision, "-o", str(out_dir)]) == 0
        err = capsys.readouterr().err
        assert set(json.loads((out_dir / "results.json").read_text())["methods"]) == want
        assert ("ar-fp32 left out: the target is the float32 weights already" in err) == (precision == "fp32")


def test_a_peer_process_that_fails_says_why_in_the_parent(tmp_path):
    """A child that cannot open the model ends its row with its own message, raised in the bench's process."""
    from selfspec_cli.bench.peer_process import PeerProcessError, PeerSpec, ProcessPeer

    peer = ProcessPeer(PeerSpec(str(tmp_path / "no-such-model"), "auto", "cpu", "fp32", 1, {}))
    try:
        with pytest.raises(PeerProcessError, match="fp32 peer's process failed: .*no-such-model"):
            peer.wait_ready()
    finally:
        peer.close()
    assert not peer._proc.is_alive()


def test_bound_heap_pins_the_threshold_where_the_c_library_is_glibc():
    import ctypes.util
    import platform

    from selfspec_cli.heap import bound_heap

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's M_MMAP_THRESHOLD is glibc's")
    assert ctypes.util.find_library("c") and bound_heap() is True  # mallopt accepted the parameter and value
