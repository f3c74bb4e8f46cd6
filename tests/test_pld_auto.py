"""Prompt lookup, auto and the cost planner: exact greedy and sampling, and what the planner decides."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding import driver
from selfspec_cli.decoding.drafts import NoDraft, Plan, depth as draft_depth
from selfspec_cli.decoding.driver import Taps
from selfspec_cli.decoding.state import DecodeState
from selfspec_cli.decoding import cost_store
from selfspec_cli.decoding.measure import VerifyCurve, draft_step_cost
from selfspec_cli.decoding.planning import Planner, RoundClock
from selfspec_cli.engine import TARGET, Engine
from selfspec_cli.methods import AR, build
from selfspec_cli.methods.auto import Auto
from selfspec_cli.methods.pld import PLDConfig, PromptLookup, lookup

from .conftest import ARCHS, charge_forwards, make_tiny_model
from .test_decoding import ALPHA, distribution_test
from .test_speculative import _pair_samples, _prompt, accept_all, small_vocab_setup  # noqa: F401 (fixture)


def known_costs(monkeypatch, clock, draft: float = 0.05) -> None:
    """A machine whose costs are known, so that what a cost-aware method drafts does not depend
    on the host's load: a prefill costs 50 ms; a target forward of m rows v(m) = 1 + 0.1 (m - 1)
    plain steps of 10 ms (V's law, at every row count the verify curve measures); any draft
    forward (quantized weights or skipped sublayers) ``draft`` of a plain step. The verify
    curve, c and every round's time are read off these charges (``clock``: the
    ``virtual_clock`` fixture)."""
    def cost(e, rows, kw):
        if isinstance(kw["positions"], int) and kw["positions"] == 0:  # a prefill (a tree verify's positions: a tensor)
            return 0.05
        route = kw.get("route", TARGET)
        drafting = route.weights is not None or bool(route.skip_attn) or bool(route.skip_mlp)
        return 0.01 * (draft if drafting else 0.9 + 0.1 * rows)

    charge_forwards(monkeypatch, clock, cost)


def test_lookup_takes_the_longest_most_recent_match():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert lookup(ctx, 3, 1, 4) == ([7, 5, 1, 2], 3)  # [1,2,3] last seen before the tail at index 4
    assert lookup([4, 5, 6], 3, 1, 4) == ([], 0)
    assert lookup([4, 5, 4], 3, 1, 2) == ([5, 4], 1)  # only the unigram 4 matches
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 2, 10) == ([9, 1, 2, 3], 3)


def _lookup_reference(context, max_ngram, min_ngram, max_len):
    """The rule written plainly: longest n first, then the latest earlier occurrence."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == context[len(context) - n :] and context[start + n : start + n + max_len]:
                return context[start + n : start + n + max_len], n
    return [], 0


def test_lookup_equals_the_plain_rule_on_random_contexts():
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        n = int(torch.randint(1, 50, (), generator=g))
        vocab = int(torch.randint(2, 10, (), generator=g))
        ctx = torch.randint(0, vocab, (n,), generator=g).tolist()
        hi = int(torch.randint(1, 5, (), generator=g))
        lo = int(torch.randint(1, hi + 1, (), generator=g))
        k = int(torch.randint(1, 8, (), generator=g))
        assert lookup(ctx, hi, lo, k) == _lookup_reference(ctx, hi, lo, k), (ctx, hi, lo, k)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("method", ["pld", "auto"])
def test_greedy_equals_ar(arch, method, monkeypatch, virtual_clock):
    known_costs(monkeypatch, virtual_clock)  # what is drafted does not depend on the host's load
    model = make_tiny_model(arch, layers=4)
    eng = Engine(model)
    ar = AR(eng)
    m = build(method, eng)
    drafted = 0
    for seed in range(3):
        prompt = _prompt(14, seed) * 2  # repeated text: n-gram drafts happen
        cfg = GenerationConfig(max_new_tokens=40)
        res = m.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids
        drafted += res.stats.draft_rounds
    assert drafted > 0


def test_paper_drafting_drafts_every_match_and_stays_exact():
    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    prompt = _prompt(12, 5) * 3
    cfg = GenerationConfig(max_new_tokens=30)
    res = PromptLookup(eng, config=PLDConfig(paper_drafting=True)).generate(prompt, cfg)
    assert res.token_ids == AR(eng).generate(prompt, cfg).token_ids
    st = res.stats
    # replay the rounds: each drafted exactly the lookup of the context it started from, within the budget
    done = st.accept_lengths[0]
    for r, drafted in enumerate(st.draft_lengths):
        ctx = prompt + res.token_ids[:done]
        want, _ = lookup(ctx, 3, 1, min(10, cfg.max_new_tokens - done - 1))
        assert drafted == len(want), (r, drafted, want)
        done += st.accept_lengths[r + 1]
    assert st.draft_rounds == sum(1 for k in st.draft_lengths if k) > len(st.draft_lengths) // 2
    assert st.accepted_draft_tokens <= st.drafted_tokens


# False-positive rate per test: ALPHA = 1e-3. Drafts are deterministic (point masses).
@pytest.mark.slow  # 2,500 decodes; fast: test_verify_exact's deterministic-draft enumeration
def test_pld_sampling_is_exact(small_vocab_setup):
    model, prompt, law = small_vocab_setup
    m = PromptLookup(Engine(model), config=PLDConfig(paper_drafting=True, max_draft=4))
    samples = _pair_samples(m, prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


@pytest.mark.slow  # 2,500 decodes; fast: test_verify_exact's deterministic-draft enumeration
def test_pld_sampling_test_catches_a_broken_rule(small_vocab_setup, monkeypatch):
    """Control: accepting every drafted token (ignoring p) must fail the same test."""
    model, prompt, law = small_vocab_setup
    monkeypatch.setattr(driver, "verify_chain_sampling", accept_all)
    m = PromptLookup(Engine(model), config=PLDConfig(paper_drafting=True, max_draft=4))
    samples = _pair_samples(m, prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


@pytest.mark.slow  # 2,500 decodes; fast: the specqd and hybrid sampling tests of the sources auto picks from
def test_auto_sampling_is_exact(small_vocab_setup, monkeypatch, virtual_clock):
    known_costs(monkeypatch, virtual_clock)  # the same drafts (and so the same samples) on any host
    model, prompt, law = small_vocab_setup
    samples = _pair_samples(build("auto", Engine(model)), prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


# --- the planner ------------------------------------------------------------------------------

CURVE = VerifyCurve(0.01, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 6: 1.3, 8: 1.5, 16: 2.5})


def _trained(rate: float, rounds: int = 200, k: int = 4) -> Planner:
    p = Planner(CURVE, 8)
    g = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        acc = 0
        while acc < k and torch.rand((), generator=g).item() < rate:
            acc += 1
        p.observe(k, acc)
    return p


def test_planner_follows_acceptance_and_cost():
    good, bad = _trained(0.9), _trained(0.0)
    assert good.best(0.0, 8)[0] >= 4 and good.best(0.0, 8)[1] > 2.0
    assert bad.best(0.0, 8) == (0, 1.0)  # n-gram drafts that are never accepted do not pay
    assert good.best(0.9, 8)[0] < good.best(0.0, 8)[0]  # expensive drafts: shorter
    assert good.best(0.0, 2)[0] == 2  # never beyond the budget
    for p, c in ((good, 0.0), (good, 0.6), (bad, 0.0), (_trained(0.5), 0.3)):  # best() is the argmax of gain()
        k, g = p.best(c, 8)
        gains = [p.gain(j, c) for j in range(1, 9)]
        assert (k == 0 and max(gains) <= 1.0) or (g == pytest.approx(max(gains)) and p.gain(k, c) == pytest.approx(g))
    # E(k) / (k c + v(k+1)) by hand for k = 1
    a1 = good.acceptance.rate(1)
    assert good.gain(1, 0.3) == pytest.approx((1 + a1) / (0.3 + 1.05))


def test_planner_probes_within_its_budget():
    """A planner that does not draft still probes, and the probes' expected loss stays within
    the documented 1 % of a plain step per idle round: rare when a probe is expensive and seldom
    accepted, frequent when it is nearly free. A probe is one token, never beyond the round's
    budget, and the plan a round reports (``last``) is the round that runs."""
    a1 = 1 / 202  # _trained(0.0): depth 1 reached 200 times, never accepted, under a Beta(1, 1) prior
    for c in (0.6, 0.05):
        p = _trained(0.0)
        rounds = 2000
        plans = [(p.plan(c, 8), p.last) for _ in range(rounds)]
        probes = [last for k, last in plans if k]
        loss = c + 1.05 - (1 + a1)  # a one-token probe costs c + v(2) and yields 1 + a1 tokens
        assert p.probe_loss(c) == pytest.approx(loss) and probes  # probing continues, so a pessimistic estimate can recover
        assert {k for k, _ in plans} == {0, 1}  # a probe drafts one token
        assert len(probes) * loss <= 0.01 * rounds + loss
        assert len(probes) * loss >= 0.01 * rounds - 2 * loss  # and the budget is used
        assert all(last == (pytest.approx(1 + a1), pytest.approx(c + 1.05)) for last in probes)  # a probe's plan, not an idle round's
        assert all(last == (1.0, 1.0) for k, last in plans if not k)  # a round that drafts nothing: one plain step
        p.probes.savings = 100.0  # savings for many probes, and a round that may emit no draft token: none is drafted
        assert p.plan(c, 0) == 0 and p.probes.savings == 100.0 and p.plan(c, 1) == 1
    cheap, dear = _trained(0.0), _trained(0.0)
    n_cheap = sum(bool(cheap.plan(0.05, 8)) for _ in range(500))
    n_dear = sum(bool(dear.plan(0.6, 8)) for _ in range(500))
    assert n_cheap > 5 * n_dear >= 5
    good = _trained(0.9)
    assert good.plan(0.0, 8) >= 4 and good.probes.savings == 0.0  # drafting rounds earn no probe budget
    assert good.plan(0.0, 1) == 1 and good.plan(0.0, 0) == 0  # never beyond the budget
    # with no round seen, every depth is accepted with probability 1/2: E(k) = 2 - 2**-k, and the best
    # of E(k) / (k c + v(k + 1)) is k = 3 when drafts are free (1.875 / 1.15), k = 2 at c = 0.1 (1.75 / 1.3)
    fresh = Planner(CURVE, 8)
    assert fresh.plan(0.0, 8) == 3 and fresh.last == (1.875, pytest.approx(1.15))
    assert fresh.plan(0.1, 8) == 2 and fresh.last == (1.75, pytest.approx(1.3))


def test_planner_learns_round_overhead_and_declines_drafts_it_makes_unprofitable():
    """A drafting round measured to cost more than its plan teaches ``o``; the plan then
    includes it, so a draft that pays on forwards alone but not with its overhead is declined."""
    p = _trained(0.5)
    k, g = p.best(0.0, 8)
    assert k >= 1 and g > 1.0 and p.overhead.value == 0.0
    plan_cost = p.cost(k, 0.0)
    first = None
    for i in range(60):  # every round measured at plan + 0.9 plain steps
        p.observe_round(plan_cost + 0.9, Plan(p.expected_tokens(k), p.cost(k, 0.0)))
        first = p.overhead.value if i == 0 else first
    assert first == pytest.approx(0.9 / 4)  # one round against a prior of 0 worth 3 rounds
    assert p.overhead.value == pytest.approx(0.9, abs=2e-3)
    o = p.overhead.value
    assert p.cost(k, 0.0) == pytest.approx(plan_cost + o) and p.cost(0, 0.0) == 1.0
    assert p.best(0.0, 8) == (0, 1.0)  # at most 0.93 with o = 0.9 (1.66 without)
    assert p.probe_loss(0.0) == pytest.approx(1.05 + o - p.expected_tokens(1))  # a probe pays it too
    free = _trained(0.5)
    for _ in range(30):  # rounds that cost what they were planned to: no overhead
        free.observe_round(free.cost(k, 0.0), Plan(1.0, free.cost(k, 0.0)))
    assert free.overhead.value == pytest.approx(0.0, abs=1e-9) and free.best(0.0, 8) == (k, g)
    free.observe_round(None, Plan(1.0, 1.0))  # the driver measures no steps for a round that drafted nothing
    assert free.overhead.rounds == 30


def test_round_clock_measures_rounds_in_plain_rounds_then_t1():
    """Known readings: before any plain round a drafting round is measured in T(1) at its
    context (the curve's, with its slope); after, in the running average of plain rounds."""
    clock = RoundClock(VerifyCurve(0.010, {1: 1.0, 2: 1.1}, context=64, slope_s=1e-5))
    assert clock.steps(0.030, context=164) == pytest.approx(0.030 / 0.011)  # T(1) after 164 tokens: 11 ms
    clock.plain_round(0.020)
    clock.plain_round(0.040)  # running average: 0.8 * 20 + 0.2 * 40 ms
    assert clock.plain_s == pytest.approx(0.024)
    assert clock.steps(0.048, context=10_000) == pytest.approx(2.0)
    assert RoundClock(None).steps(1.0, 64) is None  # a policy that does not plan: no unit


# v(m) at every row count a pld round verifies (no interpolation involved), for a 10 ms plain step
V = {m: 1.0 + 0.1 * (m - 1) for m in range(1, 17)}


def _exact_machine(monkeypatch, clock, extra: dict) -> None:
    """A machine where a forward of m rows after the prompt costs exactly V[m] plain steps of
    10 ms, plus ``extra["steps"]`` when it verifies a draft (m > 1); a prefill costs 50 ms."""
    charge_forwards(monkeypatch, clock, lambda e, rows, kw: 0.05 if kw["positions"] == 0 else
                    0.01 * (V[rows] + (extra["steps"] if rows > 1 else 0.0)))


def _engine_with_curve_v() -> Engine:
    """A tiny engine whose verify curve is V at T(1) = 10 ms (as measured on the machine above)."""
    eng = Engine(make_tiny_model("llama-gqa", layers=4))
    cost_store.set_curve(eng, VerifyCurve(0.01, dict(V)))
    return eng


def test_driver_times_drafting_rounds_against_plain_ones(monkeypatch, virtual_clock):
    """The driver hands ``update`` each drafting round's cost in plain rounds (``Round.steps``; plain
    rounds get none) and the n-gram planners learn its excess over the plan as ``o``. On a machine whose
    forwards cost exactly the verify curve a k-token round measures v(k + 1) and ``o`` stays 0;
    when every drafting round costs 0.3 plain steps more, each measures v(k + 1) + 0.3 and ``o``
    rises towards 0.3 (from its prior of 0 worth 3 rounds: above 0.2 after 7 rounds)."""
    extra = {"steps": 0.0}
    prompt, cfg = _prompt(12, 3) * 3, GenerationConfig(max_new_tokens=40)
    _exact_machine(monkeypatch, virtual_clock, extra)
    for steps in (0.0, 0.3):
        extra["steps"] = steps
        eng = _engine_with_curve_v()
        m = build("pld", eng)
        seen: list[tuple[int, float | None]] = []
        real = m.drafter.accept

        def spy(state, rnd):
            seen.append((draft_depth(rnd.draft), rnd.steps))
            real(state, rnd)

        m.drafter.accept = spy
        ar = AR(eng).generate(prompt, cfg).token_ids
        assert m.generate(prompt, cfg).token_ids == ar
        assert any(n == 0 for n, _ in seen) and all(r is None for n, r in seen if n == 0)
        drafted = [(n, r) for n, r in seen if n]
        assert len(drafted) >= 7, seen
        assert all(r == pytest.approx(V[n + 1] + steps) for n, r in drafted), (steps, drafted)
        assert m.policy.overhead.rounds == len(drafted)
        if steps:
            assert 0.2 < m.policy.overhead.value <= steps + 1e-9
        else:
            assert m.policy.overhead.value == pytest.approx(0.0, abs=1e-9)


def test_verify_curve_interpolates_and_is_the_running_maximum_of_its_readings(monkeypatch, virtual_clock):
    assert CURVE.v(5) == pytest.approx(1.225) and CURVE.v(32) == pytest.approx(2.5 + 16 * 1.0 / 8)
    # a machine on which 3 rows read faster than 2, and 10 than 8 (noise): v(m) is the m-row time over the
    # one-row time, and never below a reading for fewer rows
    secs = {1: 1.0, 2: 1.2, 3: 1.1, 4: 1.5, 6: 1.8, 8: 2.4, 12: 2.2, 16: 3.0, 24: 3.6, 32: 4.5}
    charge_forwards(monkeypatch, virtual_clock, lambda e, rows, kw: 0.0 if kw["positions"] == 0 else secs[rows])
    c = VerifyCurve.measure(Engine(make_tiny_model("llama-gqa", layers=2)), context=16, rounds=1)
    assert c.t1_s == pytest.approx(1.0) and c.times_s == pytest.approx(secs) and c.slope_s == pytest.approx(0.0, abs=1e-12)
    assert c.ratios == {1: 1.0, 2: 1.2, 3: 1.2, 4: 1.5, 6: 1.8, 8: 2.4, 12: 2.4, 16: 3.0, 24: 3.6, 32: 4.5}
    assert c.v(26) == pytest.approx(3.6 + 2 * 0.9 / 8)  # read between measured rows, not extrapolated from 12 and 16


def test_verify_curve_reads_how_rows_grow_with_the_context_and_planners_price_rounds_there(monkeypatch, virtual_clock):
    """A machine on which an m-row forward after n tokens costs base(m) + (a + b (m - 1)) n: the curve
    reads a (slope_s) and b (row_slope_s) from 1- and 8-row forwards 190 tokens further on (the tiny
    model's positions end at 256), v_at is that law's m-row time over the one-row time, and a planner
    set at a context prices its rounds there."""
    a, b = 1e-3, 4e-4
    base = {m: 0.1 * (1 + 0.1 * (m - 1)) for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}

    def charge(e, rows, kw):
        return 0.0 if kw["positions"] == 0 else base[rows] + (a + b * (rows - 1)) * kw["positions"]

    charge_forwards(monkeypatch, virtual_clock, charge)
    c = VerifyCurve.measure(Engine(make_tiny_model("llama-gqa", layers=2)), context=64, rounds=1)
    assert c.slope_s == pytest.approx(a) and c.row_slope_s == pytest.approx(b)
    law = lambda m, n: base[m] + (a + b * (m - 1)) * n  # noqa: E731
    for m, n in ((1, 200), (4, 64), (4, 200), (8, 250), (16, 250)):
        assert c.v_at(m, n) == pytest.approx(law(m, n) / law(1, n), rel=1e-4)  # (v is kept to 4 decimals)
    assert c.v_at(4, None) == c.v(4) and c.v_at(4, 10) == c.v(4)  # no context, or before the curve's own: v
    assert VerifyCurve.from_record(c.to_record()) == c  # the store keeps the row slope
    assert VerifyCurve.from_record(dataclasses.replace(c.to_record(), row_slope_s=-1.0)) is None
    no_rows = VerifyCurve.from_record(dataclasses.replace(c.to_record(), row_slope_s=None))
    assert no_rows.row_slope_s is None and no_rows.v_at(4, 250) == no_rows.v(4)  # an older record: v as read
    p = Planner(c, 8)
    assert p.at(250).cost(3, 0.2) == pytest.approx(3 * 0.2 + law(4, 250) / law(1, 250) + p.overhead.value, rel=1e-4)
    assert p.at(None).cost(3, 0.2) == pytest.approx(3 * 0.2 + c.v(4) + p.overhead.value)


def test_curve_readings_pool_to_their_medians_and_draft_cost_is_timed_beside_a_target_step(monkeypatch, virtual_clock):
    """A host whose speed drifts: each refresh pools one more reading (per row count the median
    time), and c is a draft forward over a target forward timed in the same interleaved passes."""
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    pace, calls = [1.0], [0]

    def charge(e, rows, kw):
        calls[0] += 1
        if pace[0] is None:  # every forward 1 % slower than the one before; a draft forward is 0.3 of a step
            return (1 + 0.01 * calls[0]) * (0.3 if kw.get("route", TARGET).skip_mlp else 1.0)
        return 0.0 if kw["positions"] == 0 else pace[0] * (1 + rows / 8)

    charge_forwards(monkeypatch, virtual_clock, charge)
    assert cost_store.refresh_curve(eng) is None  # nothing to pool before the first reading
    cost_store.measure_fresh(eng)  # as the bench: a full first reading of its own, not a stored or short one
    first = cost_store.curve_for(eng)
    for p in (1.5, 1.2):
        pace[0] = p
        pooled = cost_store.refresh_curve(eng)
    assert cost_store.curve_for(eng) is pooled and pooled.readings == 3 and first.readings == 1
    assert pooled.t1_s == pytest.approx(1.2 * 1.125)  # the median of 1.0, 1.5 and 1.2 paces
    assert pooled.times_s[32] == pytest.approx(1.2 * 5.0) and pooled.v(32) == pytest.approx(5.0 / 1.125, rel=1e-4)
    # a drifting host: c still reads the draft's share of a step at the pace of the moment
    pace[0] = None
    c = draft_step_cost(eng, None, frozenset({0}), frozenset({0, 1}), context=16, rounds=9)
    assert c == pytest.approx(0.3, rel=0.005)  # timed apart (all drafts, then all targets) it reads 0.294


def test_driver_reports_predicted_and_realized_gain(monkeypatch, virtual_clock):
    """On a machine whose forwards cost exactly the verify curve, the reported plan costs each
    round what it took (a plain round 1, a k-token n-gram round v(k + 1)); the realized gain is
    the tokens after the prefill over that time in plain steps (the prefill's 50 ms left out); the
    predicted one is the rounds' planned tokens (as each round's plan said) over that cost."""
    _exact_machine(monkeypatch, virtual_clock, {"steps": 0.0})
    m = build("pld", _engine_with_curve_v())
    plans = []
    real = m.drafter.draft

    def spy(state, budget):
        d = real(state, budget)
        plans.append(d.plan)
        return d

    m.drafter.draft = spy
    res = m.generate(_prompt(12, 3) * 3, GenerationConfig(max_new_tokens=30))
    st = res.stats.as_dict()
    lengths = res.stats.draft_lengths
    assert any(lengths) and len(plans) == len(lengths)  # the repeated prompt is looked up
    cost = sum(V[k + 1] for k in lengths)
    assert st["plan"]["cost_steps"] == pytest.approx(cost, abs=1e-3)
    assert st["realized_gain"] == pytest.approx((len(res.token_ids) - 1) / cost, abs=1e-4)
    expected = sum(1.0 if plan is None else plan[0] for plan in plans)  # a round without a lookup: one token
    assert st["plan"]["expected_tokens"] == pytest.approx(expected, abs=1e-3)
    assert st["predicted_gain"] == pytest.approx(expected / cost, abs=1e-4)
    assert 0 < st["draft_round_share"] == sum(1 for k in lengths if k) / len(lengths)


def test_autos_first_decode_is_measured_in_plain_steps(monkeypatch, virtual_clock):
    """The round clock takes its unit from the policy's curve when a decode starts: ``auto`` has it
    from construction, so even a process's first decode learns its rounds' overhead and reports its
    realized gain (it read 0.0 when auto took the curve only at its first proposal)."""
    _exact_machine(monkeypatch, virtual_clock, {"steps": 0.0})
    m = build("auto", _engine_with_curve_v(), ngram_only=True)
    assert m.policy.curve is not None
    res = m.generate(_prompt(12, 3) * 3, GenerationConfig(max_new_tokens=30))
    st = res.stats.as_dict()
    assert any(res.stats.draft_lengths)
    assert st["realized_gain"] == pytest.approx((len(res.token_ids) - 1) / st["plan"]["cost_steps"], abs=1e-3)


# --- calibration's timing-free proxy -------------------------------------------------------


def test_proxy_objective_is_the_rounds_cost_model():
    from selfspec_cli.methods.self_sd.measure import Measurement, draft_cost_from_bytes, proxy_speedup

    # 2 prompts: 2 prefill tokens + 10 tokens in 6 rounds (drafts of 0, 2, 3, 0, 1, 4 tokens)
    m = Measurement(tokens=12, wall_s=1.0, target_forwards=8, draft_lengths=(0, 2, 3, 0, 1, 4))
    cost = sum(k * 0.5 + CURVE.v(k + 1) for k in m.draft_lengths)
    assert proxy_speedup(m, 0.5, CURVE, prompts=2) == pytest.approx(10 / cost)
    plain = Measurement(tokens=12, wall_s=1.0, target_forwards=12, draft_lengths=(0,) * 10)
    assert proxy_speedup(plain, 0.5, CURVE, prompts=2) == pytest.approx(1.0)
    eng = Engine(make_tiny_model("llama-gqa", layers=4))
    assert draft_cost_from_bytes(eng, frozenset(), frozenset()) == pytest.approx(1.0)
    half = draft_cost_from_bytes(eng, frozenset({1, 2}), frozenset({1, 2}))
    assert 0.2 < half < 0.9 and draft_cost_from_bytes(eng, frozenset({1, 2}), frozenset()) > half


class _NeverPays:
    """A layer-skip stand-in (a method with its drafter and policy: itself) whose drafts never pay;
    records when it is asked to draft."""

    name, lookahead, taps, curve = "stub", 0, Taps(), None

    def __init__(self) -> None:
        self.proposed = 0
        self.drafter = self.policy = self  # the method's drafter and policy: itself

    def gain(self, state, budget: int) -> float:
        return 0.9

    def draft(self, state, budget):
        self.proposed += 1
        return NoDraft()

    def begin(self, state, prefill) -> None: ...

    def accept(self, *a) -> None: ...

    def end(self) -> dict:
        return {}

    def describe(self) -> dict:
        return {}


def test_auto_lets_sources_take_turns_when_none_pays():
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    stub = _NeverPays()
    auto = Auto(eng, layer_skip=stub)
    state = DecodeState(eng, [3, 4, 3, 4, 3], max_new_tokens=8, lookahead=4, sampling=GenerationConfig().sampling,
                        generator=None)
    pld_calls = []
    auto.ngram.draft = lambda st, b: pld_calls.append(b) or NoDraft()
    auto.ngram.source.candidate = lambda st, b: ([4, 3], 3)  # a match every round...
    auto.ngram.policy.planner(3).best = lambda c, b: (0, 1.0)  # ...that does not pay either
    for _ in range(6):
        auto.drafter.draft(state, 4)
    assert stub.proposed == 3 and len(pld_calls) == 3  # each source gets every other round (and its own probes)


def test_pld_draft_ends_at_an_end_of_sequence_token():
    """A looked-up continuation is cut after its first stop token (nothing after it can be
    emitted); --paper-drafting keeps the paper's whole match."""
    eng = Engine(make_tiny_model("llama-gqa", layers=2))
    ctx = [5, 6, 2, 7, 8, 9, 5, 6]  # "5 6" was followed by the stop token 2, then more
    state = DecodeState(eng, ctx, max_new_tokens=8, lookahead=8, sampling=GenerationConfig().sampling,
                        generator=None, eos=frozenset({2}))
    assert state.through_stop([2, 7, 8]) == [2] and state.through_stop([7, 8]) == [7, 8]
    pld = build("pld", eng, None)
    pld.policy.planner(2).plan = lambda c, n: n  # take every token this round offers
    assert pld.drafter.draft(state, 4).tokens == [2]
    assert build("pld", eng, None, paper_drafting=True).drafter.draft(state, 4).tokens == [2, 7, 8, 9]


@pytest.mark.skipif(__import__("selfspec_cli.engine.kernels", fromlist=["x"]).load_extension() is None,
                    reason="quantized drafts need the CPU kernel")
def test_auto_learns_ngram_acceptance_from_the_ngram_branch_of_hybrid_rounds(tiny_tokenizer, monkeypatch, virtual_clock):
    """While the quantized chain wins the rounds (its measured prior is high), the n-gram
    continuation rides along as a second branch; its verdict is an n-gram draft's, and the
    n-gram planners learn from it, so a source that seldom wins is still measured.

    Which source wins a round rests on measured costs, so the machine's are known
    (:func:`known_costs`; a draft step 0.05 of a plain one: a tiny model's is not that cheap, a
    real model's is), not read off the host, whose load once made the n-gram source win every round."""
    known_costs(monkeypatch, virtual_clock, draft=0.05)
    eng = Engine(make_tiny_model("llama-gqa"))
    auto = build("auto", eng, tiny_tokenizer, draft_precision="int8")
    assert auto.quant.configuration.policy.draft_cost() == pytest.approx(0.05) and cost_store.curve_for(eng).ratios[4] == pytest.approx(V[4])
    prompt = [5, 6, 7, 8, 9, 10, 11] * 4  # lookups match from the first round
    auto.generate(prompt, GenerationConfig(max_new_tokens=40))
    own = auto.drafter.rounds["ngram"]
    seen = sum(p.acceptance.reached[1] + p.acceptance.prompt_reached[1] for p in auto.ngram.policy.planners.values())
    assert auto.drafter.rounds["quant"] > 0 and seen > own, (dict(auto.drafter.rounds), seen)
