"""The one round-cost formula (decoding/planning.py, issue 49): every figure that prices a speculative
round, the planners', the hybrid merge's, ``selfspec profile``'s draft verdict and draft ceilings and the
predicted speedups of a decode and of the bench, is computed by it and agrees with what the planner computes."""
from __future__ import annotations

import dataclasses

import pytest

from selfspec_cli.bench.engine_profile import (QuantizedDraft, QuantizedDrafts, Unavailable, draft_ceilings,
                                               draft_verdict)
from selfspec_cli.bench.report import summarize
from selfspec_cli.bench.runner import ContenderResult
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding import cost_store
from selfspec_cli.decoding.hybrid import merged_plan
from selfspec_cli.decoding.measure import VerifyCurve
from selfspec_cli.decoding.output import OutputRecord
from selfspec_cli.decoding.planning import (Planner, expected_tokens, iid_chain_gains, predicted_speedup, round_cost,
                                            round_gain, round_plan)
from selfspec_cli.engine import Engine
from selfspec_cli.methods import build

from .conftest import make_tiny_model

V = {1: 1.0, 2: 1.04, 3: 1.09, 4: 1.15, 6: 1.3, 8: 1.46, 12: 1.8, 16: 2.2, 24: 3.0, 32: 3.8}


def measured_copies(**copies: tuple[float, float | None]) -> QuantizedDrafts:
    """Quantized copies as profile's quantized_drafts reports them, each with the (c, agreement) given (the
    copy's bytes and load time made up: the verdict and the ceilings read only c and the agreement)."""
    return QuantizedDrafts({name: QuantizedDraft(draft_bytes=1, load_s=0.0, cache="hit", formats=[name], isa=None,
                                                 c=c, agreement=a, draft_step_ms=1.0) for name, (c, a) in copies.items()})


def _iid_planner(a: float, max_len: int = 32) -> Planner:
    """A planner whose every depth is accepted with probability ``a`` (no rounds observed: its prior)."""
    return Planner(VerifyCurve(0.01, dict(V)), max_len, prior=a)


def test_the_formula_by_hand():
    curve = VerifyCurve(0.01, dict(V))
    assert expected_tokens([0.8, 0.6]) == 1.0 + 0.8 + 0.6
    assert round_cost(curve, 2, 0.3, 2, 0.05) == pytest.approx(2 * 0.3 + V[3] + 0.05)
    assert round_cost(curve, 0, 0.3, 0, 0.05) == 1.0  # a plain step: no overhead
    assert round_plan(curve, 2, [0.8, 0.6], 0.3, 2) == (2.4, 2 * 0.3 + V[3])
    assert round_gain(2.4, 1.2) == 2.0
    assert predicted_speedup([(2.0, 1.0), (1.0, 1.0)]) == 1.5 and predicted_speedup([]) is None


@pytest.mark.parametrize("a", [0.3, 0.7, 0.95, 0.999])
def test_the_profile_verdict_is_the_planners_gain(a):
    """draft_verdict (bench/engine_profile.py) prices a chain with i.i.d. acceptance as a planner whose every
    depth is accepted with that probability: the same gain at every length, and the same best length. Its
    former closed form, (1 - a^(k+1)) / (1 - a), agrees to rounding."""
    c = 0.3
    planner = _iid_planner(a)
    ks = [m - 1 for m in V if m >= 2]  # the lengths the verify curve covers
    gains = iid_chain_gains(planner.curve, a, c, ks)
    for k, g in gains.items():
        assert g == planner.gain(k, c)  # bit for bit: the same functions
        assert g == pytest.approx((1 - a ** (k + 1)) / (1 - a) / (k * c + V[k + 1]), rel=1e-12)
    verdict = draft_verdict(measured_copies(int8=(c, a)), {str(m): v for m, v in V.items()}).drafts["int8"]
    best_k = max(ks, key=lambda k: planner.gain(k, c))
    assert verdict.best_k == best_k and verdict.best_gain == round(planner.gain(best_k, c), 3)


def test_the_draft_ceilings_by_hand():
    """What no draft can exceed with every drafted token accepted (a = 0.999), from known costs: the best
    chain over the lengths the verify curve covers (1, 2, 4, 8 here), by the closed form
    (1 - a^(k+1)) / (1 - a) / (k c + v(k+1))."""
    a, v = 0.999, {2: 1.32, 3: 1.8, 5: 2.6, 9: 4.43}
    verify_cost = {str(k): x for k, x in v.items()}
    copies = measured_copies(w4a8=(0.95, 0.4), int8=(1.02, None))  # an agreement is not needed for a ceiling
    copies = QuantizedDrafts({**copies.drafts, "w4a8": dataclasses.replace(copies.drafts["w4a8"], c_draft_vocab=0.9),
                              "gguf": Unavailable("the model was not loaded from a GGUF file")})
    ceil = draft_ceilings(verify_cost, {"0.3": 0.8, "0.5": 0.59}, copies)
    got = {e.source: e for e in ceil.entries}
    assert list(got) == ["n-gram", "layer skip at 0.3", "layer skip at 0.5", "w4a8", "int8"]
    # skipping half the sublayers: one draft is best, (1 + a) / (c + v(2)) = 1.999 / 1.91
    half = got["layer skip at 0.5"]
    assert (half.c, half.best_k, half.gain) == (0.59, 1, round((1 + a) / (0.59 + 1.32), 3)) and half.gain == 1.047
    # n-gram drafts cost nothing: the longest chain is best, 9 tokens (to rounding) over v(9)
    ngram = got["n-gram"]
    assert (ngram.c, ngram.best_k, ngram.gain) == (0.0, 8, round((1 - a ** 9) / (1 - a) / 4.43, 3)) and ngram.gain == 2.023
    # a copy is priced at c with its draft vocabulary when it has one (as specqd drafts)
    assert (got["w4a8"].c, got["w4a8"].best_k, got["w4a8"].gain) == (0.9, 1, round((1 + a) / (0.9 + 1.32), 3))
    assert got["int8"].gain == round((1 + a) / (1.02 + 1.32), 3)
    for e in ceil.entries:  # each entry is the planners' formula, at its best length
        gains = iid_chain_gains(VerifyCurve(1.0, dict(v)), a, e.c, [1, 2, 4, 8])
        assert e.gain == round(max(gains.values()), 3) and gains[e.best_k] == max(gains.values())
    assert ceil.summary == ("at most 2.02x for n-gram drafts (k 8), 1.05x skipping 50% of the sublayers (k 1), 0.90x "
                            "for the w4a8 copy (k 1), even if every drafted token is accepted (v(k) and c measured here)")
    assert ceil.to_json() == {"entries": [{"source": "n-gram", "c": 0.0, "best_k": 8, "gain": 2.023}, *(
        {"source": e.source, "c": e.c, "best_k": e.best_k, "gain": e.gain} for e in ceil.entries[1:])],
        "summary": ceil.summary}
    # no quantized copy measured, or a verify curve of one row: said so
    assert draft_ceilings(verify_cost, {}, None).summary.startswith("at most 2.02x for n-gram drafts (k 8), even if")
    assert draft_ceilings({"1": 1.0}, {"0.5": 0.59}, copies).entries == []


def test_the_hybrid_merge_prices_its_round_with_the_formula():
    chain, ngram = _iid_planner(0.9), _iid_planner(0.5)
    plan = merged_plan(chain, ngram, 2, 3, 5, 0.25)
    reach = [max(x, y) for x, y in zip(chain.reach(2) + [0.0], ngram.reach(3))]
    assert plan == round_plan(chain.curve, 2, reach, 0.25, 5, chain.overhead.value, chain.context)
    assert plan.cost == 2 * 0.25 + V[6]


def test_a_decodes_and_the_benchs_predicted_speedups_come_from_its_plans():
    """A cost-aware decode's ``predicted_gain`` and the bench's ``predicted_speedup`` of it are the formula's
    ratio of the plans' expected tokens to their cost (decoding/planning.py: predicted_speedup)."""
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    cost_store.set_curve(eng, VerifyCurve(0.01, dict(V)))
    method = build("pld", eng)
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    res = method.generate(ids, GenerationConfig(max_new_tokens=24))
    plan = res.stats.summary().plan
    assert plan is not None
    # the summary's plan holds its sums to 4 decimals: their ratio agrees with the decode's own to the last one
    assert res.stats.predicted_gain == pytest.approx(predicted_speedup([(plan.expected_tokens, plan.cost_steps)]), abs=1.5e-4)
    rec = OutputRecord("p", "pld", True, "", res.token_ids, len(res.token_ids), len(ids), 1.0, None, res.finish_reason,
                       res.stats.summary())
    summary = summarize({"pld": ContenderResult("pld", True, "selfspec", [[rec]])}, None, None)
    assert summary["pld"].cost_model.predicted_speedup == round(plan.expected_tokens / plan.cost_steps, 4)


def test_a_prompts_own_rounds_count_at_once_against_the_earlier_prompts_pool():
    """Acceptance's per-prompt level (n-gram drafts, decoding/ngram.py): a prompt's rate is the Beta posterior of
    weight 2 centred on the pooled rate of the earlier prompts; the last prompt joins the pool at new_prompt()."""
    from selfspec_cli.decoding.planning import Acceptance

    pooled, per = Acceptance(4), Acceptance(4, prompt_weight=2.0)
    for a in (pooled, per):  # a first prompt (no pool yet: prior 0.5) that accepts 8 of 10 one-token drafts
        for i in range(10):
            a.observe(1, int(i < 8))
    assert per.rate(1) == pytest.approx((8 + 2 * 0.5) / (10 + 2)) == pytest.approx(pooled.rate(1))
    per.new_prompt()
    assert per.rate(1) == pytest.approx((8 + 2 * 0.5) / (10 + 2))  # the pool's estimate, before any round
    pooled.observe(1, 0)
    per.observe(1, 0)  # the next prompt's first draft fails
    g = (8 + 2 * 0.5) / (10 + 2)
    assert per.rate(1) == pytest.approx(2 * g / 3)  # (0 + 2 g) / (1 + 2): a third lower at once
    assert pooled.rate(1) == pytest.approx((8 + 1) / (11 + 2))  # one round in eleven: barely moved
    per.new_prompt()
    assert per.rate(1) == pytest.approx((8 + 1) / (11 + 2))  # both prompts pooled: the same counts as one pool


def test_an_ngram_policy_learns_per_prompt(tmp_path):
    """pld's planners: a prompt whose drafts all fail stops drafting within the prompt, and the next prompt starts
    from the pooled estimate again (NgramDrafter.begin calls new_prompt)."""
    from selfspec_cli.decoding.ngram import NgramPolicy, NgramLookup

    eng = Engine(make_tiny_model("llama-gqa"))
    lookup = NgramLookup()
    pol = NgramPolicy(eng, lookup, lookup.max_draft)
    p = pol.planner(1)
    for _ in range(6):
        p.observe(1, 1)
    pol.new_prompt()
    before = p.acceptance.rate(1)
    p.observe(1, 0)
    p.observe(1, 0)
    assert p.acceptance.rate(1) == pytest.approx(2 * before / 4)
    pol.new_prompt()
    assert p.acceptance.rate(1) == pytest.approx((6 + 0 + 2 * 0.5) / (8 + 2))
