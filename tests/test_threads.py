"""The ``--threads auto`` governor (engine/threads.py), driven by injected forward times."""
from __future__ import annotations

from selfspec_cli.session import apply_threads
from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine, threads
from selfspec_cli.engine.threads import ThreadGovernor
from selfspec_cli.methods import AR

from .conftest import make_tiny_model


def _gov() -> tuple[ThreadGovernor, list[int]]:
    """A governor past its one-thread warm-up (8 one-row forwards of 16 ms)."""
    calls: list[int] = []
    g = ThreadGovernor(2, set_threads=calls.append)
    for _ in range(8):
        g.observe(1, 0.016)
    return g, calls


def test_contention_from_the_start_is_seen_against_one_thread():
    """A team that is slow from its first forward has a slow best: it is compared with one thread."""
    g, calls = _gov()
    assert calls == [1, 2] and g.current == 2
    g.observe(1, 0.040)  # the team's first forward pays its wake-up: not judged
    assert g.current == 2
    g.observe(1, 0.040)  # the next, still under a busy competitor (probe of the warm-up)
    assert g.current == 1


def test_the_wake_up_forward_after_a_switch_is_not_judged():
    """Measured on SmolLM2: the first forward after going to two threads took 31 ms against a 25 ms
    one-thread step (and 18 ms against a 12 ms team step); judged, it failed every idle probe."""
    g, calls = _gov()
    g.observe(1, 0.031)  # wake-up
    for _ in range(300):
        g.observe(1, 0.010)
    assert g.current == 2 and calls == [1, 2]
    g.observe(1, 0.019)
    g.observe(1, 0.019)  # two slow forwards: contention, one thread
    assert g.current == 1
    while g.current == 1:
        g.observe(1, 0.016)
    g.observe(1, 0.018)  # the probe's wake-up, slower than 1.3x the best: not judged
    g.observe(1, 0.010)  # the probe itself is fast: stay
    for _ in range(100):
        g.observe(1, 0.010)
    assert g.current == 2 and g.interval == 50


def test_stays_at_two_threads_while_forwards_keep_their_speed():
    g, calls = _gov()
    for i in range(500):
        g.observe(1, 0.010 * (1.0 + 0.3 * (i % 3 == 0)))  # ordinary jitter, never 1.8x, faster than one thread
    assert g.current == 2 and calls == [1, 2] and g.switches == 1


def test_drops_to_one_thread_under_contention_and_probes_less_often_while_it_lasts():
    g, calls = _gov()
    for _ in range(5):
        g.observe(1, 0.010)
    g.observe(1, 0.019)
    assert g.current == 2  # one slow forward is noise
    g.observe(1, 0.019)
    assert g.current == 1 and calls[-1] == 1
    probes = []
    for i in range(2000):
        before = g.current
        g.observe(1, 0.030 if g.current == 2 else 0.012)  # probes (and their wake-ups) still contended
        if before == 1 and g.current == 2:
            probes.append(i)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the interval doubles


def test_a_good_probe_returns_to_two_threads_for_good():
    g, _ = _gov()
    for _ in range(3):
        g.observe(4, 0.020)
    g.observe(4, 0.045)
    g.observe(4, 0.045)
    assert g.current == 1
    while g.current == 1:
        g.observe(4, 0.032)
    g.observe(4, 0.021)  # the contender left: the probe is as fast as before
    for _ in range(200):
        g.observe(4, 0.020)
    assert g.current == 2 and g.interval == 50


def test_buckets_keep_apart_forwards_of_different_sizes():
    g, _ = _gov()
    g.observe(1, 0.010)
    g.observe(16, 0.040)  # a 16-row verification is not a slow one-row step
    g.observe(16, 0.041)
    g.observe(1, 0.010)
    assert g.current == 2


def test_auto_attaches_a_governor_and_keeps_the_output():
    model = make_tiny_model("llama-gqa", layers=2)
    prompt = [5, 6, 7, 8, 9]
    cfg = GenerationConfig(max_new_tokens=16)
    try:
        apply_threads("1")
        plain = AR(Engine(model)).generate(prompt, cfg).token_ids
        n = apply_threads("auto")
        eng = Engine(model)
        assert eng.governor is not None and n >= 1
        assert AR(eng).generate(prompt, cfg).token_ids == plain  # whatever the thread count did meanwhile
        assert eng.governor.switches >= (1 if n > 1 else 0)  # past its warm-up it tried the full count
        apply_threads(None)
        assert Engine(model).governor is None and not threads.AUTO
    finally:
        apply_threads(None)
