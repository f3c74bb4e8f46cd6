"""The one decode driver, seen from outside, for every method:

* stop strings and EOS end every method's output at exactly the token that completes
  them (lossless methods: ar's tokens up to it; SpecEE, lossy: its own first stop);
* statistics have one definition (accept lengths, drafted and accepted draft tokens,
  target forwards), checked round by round, including a last round the sink cuts;
* the KV cache refuses rows written out of order (engine and drafter misuse);
* a drafter defined here (the four verbs of the contract), with no method-specific code in the
  driver, is exact.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding.drafts import Chain, Decided, Draft, NoDraft, depth as draft_depth
from selfspec_cli.decoding.driver import Drafter, Plain, decode
from selfspec_cli.decoding.state import DecodeState
from selfspec_cli.engine import Engine
from selfspec_cli.engine.cache import CacheInvariantError
from selfspec_cli.methods import build
from selfspec_cli.methods.adadecode import AdaDecode, AdaDecodeConfig
from selfspec_cli.methods.specee import SpecEE, SpecEEConfig

from .conftest import VOCAB, make_tiny_model
from .test_adadecode import random_heads
from .test_specee import constant_predictor
from .test_speculative import _prompt

LAYERS = 6
LOSSLESS = ("ar", "self-sd", "asd", "swift", "adadecode")
SPECEE = ("specee-empty", "specee-deferred")
TEXT_PROMPT = "import torch\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all per-op overhead: one thread is fastest, and on a shared CPU two
    threads that wait for each other make these tests tens of times slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module", params=["llama-gqa", "mistral-window", "qwen3-qknorm"])
def setup(request, tiny_tokenizer):
    """A tiny model whose vocabulary is the tokenizer's (mistral-window: windows of 12,
    so they cut), its engine, and two prompts."""
    assert len(tiny_tokenizer) == VOCAB  # the model's vocabulary: every id decodes
    model = make_tiny_model(request.param, layers=LAYERS)
    eng = Engine(model)
    prompts = [tiny_tokenizer(TEXT_PROMPT, add_special_tokens=False)["input_ids"], _prompt(8, 2)]
    return model, eng, tiny_tokenizer, prompts


def make_method(name: str, model, eng: Engine, tok):
    """Each method, configured so that it drafts (or exits) often on a tiny random model."""
    fixed = {"paper_drafting": True, "max_draft": 5}  # no cost planning: draft every round
    if name == "ar":
        return build("ar", eng, tok)
    if name == "self-sd":
        return build("self-sd", eng, tok, skip_attn=(1, 3), skip_mlp=(2,), draft_threshold=0.3, **fixed)
    if name == "asd":
        return build("asd", eng, tok, asd_alpha=0.3, **fixed)
    if name == "swift":
        return build("swift", eng, tok, context_window=4, tree_nodes=8, optimize_budget=0.0, **fixed)
    if name == "adadecode":
        return AdaDecode(eng, tok, heads=random_heads(model, [1, 3]), config=AdaDecodeConfig(adadecode_threshold=0.02, paper_drafting=True))
    if name in SPECEE:
        heads = random_heads(model, [1])
        preds = {l: constant_predictor(20.0) for l in range(1, LAYERS - 1)}  # always fire; verification decides
        return SpecEE(eng, tok, SpecEEConfig(specee_kv_mode=name.split("-")[1], specee_threshold=0.5),
                      drafter_layer=1, drafter=heads[1], predictors=preds, offline_layers=[2, 3])
    raise AssertionError(name)


# -- stats bookkeeping, checked round by round -------------------------------

@dataclasses.dataclass
class Round:
    depth: int
    decided: bool
    full_depth: bool
    tokens: int  # tokens the round offered the sink
    accepted: int  # accepted draft tokens in the verdict


def record_rounds(drafter: Drafter) -> list[Round]:
    """Wrap ``accept`` (the driver calls it after every round, with the draft and the verdict) of
    ``drafter``, or of a method's drafter."""
    rounds: list[Round] = []
    drafter = getattr(drafter, "drafter", drafter)
    inner = drafter.accept

    def update(state, rnd):
        d, v = rnd.draft, rnd.verdict
        decided = isinstance(d, Decided)
        rounds.append(Round(draft_depth(d), decided, decided and d.full_depth, len(v.tokens), len(v.accepted)))
        return inner(state, rnd)

    drafter.accept = update
    return rounds


def check_stats(res, rounds: list[Round], lossless: bool, budget_respected: bool = True) -> bool:
    """Every invariant of DecodeStats; returns whether the sink cut the last round."""
    st, n, total = res.stats, len(res.stats.accept_lengths), len(res.token_ids)
    assert sum(st.accept_lengths) == total
    assert n == len(rounds) + 1 and st.accept_lengths[0] == 1  # round 0: the prefill's token
    assert all(k >= 1 for k in st.accept_lengths)
    # the sink keeps every token of every round but the last, which it may cut
    assert [r.tokens for r in rounds[:-1]] == st.accept_lengths[1:-1]
    cut = bool(rounds) and st.accept_lengths[-1] < rounds[-1].tokens
    verified = [r for r in rounds if not r.decided]
    assert st.drafted_tokens == sum(r.depth for r in verified)
    assert st.draft_rounds == sum(1 for r in verified if r.depth)
    assert st.accepted_draft_tokens <= st.drafted_tokens
    if hasattr(st, "draft_lengths"):  # per round after the prefill: draft depth, 0 for none or decided
        assert st.draft_lengths == [0 if r.decided else r.depth for r in rounds]
    # every kept round adds its accepted drafts plus one target token; a cut last round
    # keeps only drafts (the target token is after the cut)
    assert st.accepted_draft_tokens == total - n + int(cut)
    if lossless:
        assert all(r.tokens == r.accepted + 1 and not r.decided for r in rounds)
        assert st.target_forwards == n
    else:  # SpecEE: one decided token per round, full depth unless it exited
        assert all(r.decided and r.tokens == 1 and r.accepted == 0 and r.depth == 1 for r in rounds)
        assert st.drafted_tokens == st.accepted_draft_tokens == 0
        exits = sum(st.report.early_exits.values())
        assert st.target_forwards == 1 + sum(r.full_depth for r in rounds) == n - exits
    if res.finish_reason == "length" and budget_respected:
        assert not cut  # a round never offers more than the remaining budget
    d = st.as_dict()
    assert d["mean_accepted_length"] == pytest.approx(total / n)
    if st.drafted_tokens:
        assert d["acceptance_rate"] == pytest.approx(st.accepted_draft_tokens / st.drafted_tokens)
    return cut


def run(method, prompt, cfg, lossless=True, budget_respected=True):
    rounds = record_rounds(method)
    try:
        res = method.generate(prompt, cfg)
    finally:
        del getattr(method, "drafter", method).accept
    cut = check_stats(res, rounds, lossless, budget_respected)
    return res, cut


# -- choosing stop strings and EOS from an output at run time ----------------

def first_stop(tok, tokens: list[int], stop: str) -> int | None:
    """Index of the token whose decoding first contains ``stop`` (full-prefix decode)."""
    for i in range(len(tokens)):
        if stop in tok.decode(tokens[: i + 1]):
            return i
    return None


def pick_stops(tok, tokens: list[int], starts=(3, 14)) -> list[tuple[str, int]]:
    """For each start, a 2-3 character printable ASCII string that the output first
    completes at some token index >= start: (stop, index)."""
    out = []
    for start in starts:
        for i in range(start, len(tokens)):
            text, before = tok.decode(tokens[: i + 1]), tok.decode(tokens[:i])
            cand = [text[-k:] for k in (3, 2) if len(text) >= k]
            cand = [s for s in cand if s.isascii() and s.isprintable() and s not in before]
            if cand:
                if (cand[0], i) not in out:
                    out.append((cand[0], i))
                break
    assert out, "no usable stop string in the output"
    return out


def pick_eos(tokens: list[int], starts=(5, 12)) -> list[int]:
    """Indices >= each start where a token occurs for the first time."""
    out = []
    for start in starts:
        j = next((j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j]), None)
        if j is not None and j not in out:
            out.append(j)
    assert out, "no fresh token to use as EOS"
    return out


# -- a. stop strings and EOS --------------------------------------------------

@pytest.mark.parametrize("p", [0, 1])
def test_stop_strings_and_eos_every_method(setup, p):
    model, eng, tok, prompts = setup
    prompt = prompts[p]
    free_cfg = GenerationConfig(max_new_tokens=40)
    ref, _ = run(make_method("ar", model, eng, tok), prompt, free_cfg)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 40
    stops = pick_stops(tok, ref.token_ids)
    eos_at = pick_eos(ref.token_ids)
    cuts = drafted = 0
    for name in LOSSLESS:
        m = make_method(name, model, eng, tok)
        res, _ = run(m, prompt, free_cfg)
        assert res.token_ids == ref.token_ids, name
        drafted += res.stats.drafted_tokens
        for stop, i in stops:
            cfg = GenerationConfig(max_new_tokens=40, stop_strings=(stop,))
            res, cut = run(m, prompt, cfg)
            assert first_stop(tok, ref.token_ids, stop) == i
            assert res.token_ids == ref.token_ids[: i + 1], (name, stop)
            assert res.finish_reason == "stop_string"
            cuts += cut
        for j in eos_at:
            cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=(ref.token_ids[j],))
            res, cut = run(m, prompt, cfg)
            assert res.token_ids == ref.token_ids[: j + 1] and res.finish_reason == "eos", (name, j)
            cuts += cut
            # ignore_eos: the same id does not stop anything
            res, _ = run(m, prompt, dataclasses.replace(cfg, ignore_eos=True))
            assert res.token_ids == ref.token_ids and res.finish_reason == "length"
    assert drafted > 20  # the speculative methods drafted
    assert cuts > 0  # some method's last round was cut by the stop (the kept tokens all drafts)


def check_stop_contract(tok, res, cfg: GenerationConfig) -> None:
    """The output ends at its own first EOS or stop string, with the matching reason."""
    toks = res.token_ids
    eos = set(cfg.eos_token_ids)
    hits = [i for i, t in enumerate(toks) if t in eos or any(s in tok.decode(toks[: i + 1]) for s in cfg.stop_strings)]
    if hits:
        assert hits == [len(toks) - 1], (hits, len(toks))
        kind = "eos" if toks[-1] in eos else "stop_string"
        assert res.finish_reason == kind
    else:
        assert res.finish_reason == "length" and len(toks) == cfg.max_new_tokens


@pytest.mark.parametrize("name", SPECEE)
def test_specee_stopping_contract(setup, name):
    model, eng, tok, prompts = setup
    exits = 0
    for prompt in prompts:
        m = make_method(name, model, eng, tok)
        free_cfg = GenerationConfig(max_new_tokens=40)
        own, _ = run(m, prompt, free_cfg, lossless=False)
        exits += sum(own.stats.report.early_exits.values())
        ar = make_method("ar", model, eng, tok).generate(prompt, free_cfg).token_ids
        # its own stops: deterministic, so it stops exactly there
        for stop, i in pick_stops(tok, own.token_ids):
            cfg = GenerationConfig(max_new_tokens=40, stop_strings=(stop,))
            res, _ = run(m, prompt, cfg, lossless=False)
            assert res.token_ids == own.token_ids[: i + 1] and res.finish_reason == "stop_string"
        for j in pick_eos(own.token_ids):
            cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=(own.token_ids[j],))
            res, _ = run(m, prompt, cfg, lossless=False)
            assert res.token_ids == own.token_ids[: j + 1] and res.finish_reason == "eos"
        # ar's stops and EOS: only the contract (its output may differ from ar's)
        for stop, _ in pick_stops(tok, ar):
            cfg = GenerationConfig(max_new_tokens=40, stop_strings=(stop,))
            check_stop_contract(tok, run(m, prompt, cfg, lossless=False)[0], cfg)
        cfg = GenerationConfig(max_new_tokens=40, eos_token_ids=tuple(ar[j] for j in pick_eos(ar)),
                               stop_strings=tuple(s for s, _ in pick_stops(tok, ar)))
        check_stop_contract(tok, run(m, prompt, cfg, lossless=False)[0], cfg)
    assert exits > 0  # the lossy path (decided tokens from an early exit) ran


# -- b. statistics --------------------------------------------------------------

@pytest.mark.parametrize("name", [*LOSSLESS, *SPECEE])
def test_stats_one_definition(setup, name):
    model, eng, tok, prompts = setup
    m = make_method(name, model, eng, tok)
    lossless = name in LOSSLESS
    ar = make_method("ar", model, eng, tok)
    for prompt in prompts:
        for n in (1, 2, 3, 5, 9, 31):
            cfg = GenerationConfig(max_new_tokens=n)
            res, cut = run(m, prompt, cfg, lossless=lossless)
            assert len(res.token_ids) == n and res.finish_reason == "length" and not cut
            if lossless:
                assert res.token_ids == ar.generate(prompt, cfg).token_ids


class OwnDrafter(Plain):
    """A drafter written here, on ``engine``: the contract's verbs (``draft`` overridden), run by the driver."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, prompt, cfg):
        return decode(self.engine, None, self, prompt, cfg)


class Oracle(OwnDrafter):
    """Drafts the true continuation (ar's output), 3 tokens a round; with
    ``respect_budget=False`` it ignores the budget, so the sink must cut."""

    lookahead = 3

    def __init__(self, engine, ref: list[int], respect_budget: bool = True) -> None:
        super().__init__(engine)
        self.ref, self.respect = ref, respect_budget

    def draft(self, state: DecodeState, budget: int) -> Draft:
        i = len(state.output)
        k = min(3, budget) if self.respect else 3
        return Chain(self.ref[i : i + k])


def test_stats_last_round_cut(setup):
    model, eng, tok, prompts = setup
    prompt = prompts[1]
    ref = make_method("ar", model, eng, tok).generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
    # the budget holds every round inside max_new_tokens: nothing is cut, the last round is short
    for n in range(1, 9):
        res, cut = run(Oracle(eng, ref), prompt, GenerationConfig(max_new_tokens=n))
        assert res.token_ids == ref[:n] and not cut
        assert res.stats.accept_lengths == [1] + [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else [])
        assert res.stats.accepted_draft_tokens == n - len(res.stats.accept_lengths)
    # a drafter that ignores the budget: the sink cuts the last round at max_new_tokens
    for n in (3, 4, 7, 8):  # 1 + 4 + 4 ...: n = 3, 4, 7, 8 end inside a round
        res, cut = run(Oracle(eng, ref, respect_budget=False), prompt, GenerationConfig(max_new_tokens=n),
                       budget_respected=False)
        assert res.token_ids == ref[:n] and res.finish_reason == "length"
        assert cut == ((n - 1) % 4 != 0)
        assert res.stats.accepted_draft_tokens == n - len(res.stats.accept_lengths) + int(cut)
    # EOS on a drafted token inside an accepted chain: the kept tokens of that round are all drafts
    j = next(j for j in range(2, 30) if ref[j] not in ref[:j] and (j - 1) % 4 != 3)
    res, cut = run(Oracle(eng, ref), prompt, GenerationConfig(max_new_tokens=40, eos_token_ids=(ref[j],)))
    assert res.token_ids == ref[: j + 1] and res.finish_reason == "eos" and cut
    assert res.stats.accepted_draft_tokens == (j + 1) - len(res.stats.accept_lengths) + 1


# -- c. the cache refuses misuse ------------------------------------------------

def test_cache_refuses_out_of_order_writes(setup):
    model, eng, _, prompts = setup
    ids = torch.tensor(prompts[1])
    cache = eng.new_cache(32)
    eng.forward(cache, ids, positions=0)
    assert cache.lengths == [len(ids)] * LAYERS
    with pytest.raises(CacheInvariantError):
        eng.forward(cache, ids, positions=0)  # the same positions again
    cache = eng.new_cache(32)
    eng.forward(cache, ids[:5], positions=0)
    with pytest.raises(CacheInvariantError):
        eng.forward(cache, ids[4:6], positions=4)  # overlaps the newest position
    with pytest.raises(CacheInvariantError):
        eng.forward(cache, ids[5:6], positions=2)  # before it
    # a layer range: layers [0, 2) hold position 5, so only layers [2, L) may take it
    cache = eng.new_cache(32)
    eng.forward(cache, ids[:5], positions=0)
    out = eng.forward(cache, ids[5:6], positions=5, end=2)
    with pytest.raises(CacheInvariantError):
        eng.forward(cache, ids[5:6], positions=5, end=2)
    eng.forward(cache, None, hidden=out.hidden, positions=5, start=2)
    assert cache.lengths == [6] * LAYERS
    # after a rollback the same positions are fine again
    cache.crop(5)
    eng.forward(cache, ids[5:6], positions=5)
    eng.forward(cache, ids[6:7], positions=9)  # a gap is allowed (SpecEE's holes) ...
    with pytest.raises(CacheInvariantError):  # ... going back is not
        eng.forward(cache, ids[6:7], positions=8)


class RunsTwice(OwnDrafter):
    """A buggy drafter: runs the pending token twice without feeding anything."""

    lookahead = 2

    def draft(self, state: DecodeState, budget: int) -> Draft:
        state.run(state.ids([state.pending]))
        state.run(state.ids([state.pending]))
        return NoDraft()


def test_drafter_misuse_fails_loudly(setup):
    _, eng, _, prompts = setup
    with pytest.raises(CacheInvariantError):
        RunsTwice(eng).generate(prompts[1], GenerationConfig(max_new_tokens=5))


# -- d. a new drafter plugs in -------------------------------------------------

class WrongChain(OwnDrafter):
    """Three fixed tokens every round (deterministic drafts, ``q=None``)."""

    lookahead = 3

    def __init__(self, engine, chain: list[int]) -> None:
        super().__init__(engine)
        self.chain = chain

    def draft(self, state: DecodeState, budget: int) -> Draft:
        return Chain(self.chain[: max(0, budget)])


def test_custom_drafter_is_exact(setup):
    model, eng, tok, prompts = setup
    ar = make_method("ar", model, eng, tok)
    for prompt in prompts:
        cfg = GenerationConfig(max_new_tokens=30)
        want = ar.generate(prompt, cfg).token_ids
        chain = [t for t in range(2, 320) if t not in want][:3]  # never the right token
        res, _ = run(WrongChain(eng, chain), prompt, cfg)
        assert res.token_ids == want and res.finish_reason == "length"
        st = res.stats
        assert st.accepted_draft_tokens == 0 and st.accept_lengths == [1] * 30
        budgets = [29 - r for r in range(1, 30)]  # round r may still emit 30 - r tokens: r drafts at most 29 - r
        assert st.drafted_tokens == sum(min(3, b) for b in budgets) and st.draft_rounds == sum(b > 0 for b in budgets)
        res = decode(eng, tok, WrongChain(eng, chain), prompt, cfg)  # the driver function itself
        assert res.token_ids == want
        # sampling: the driver turns the deterministic drafts into point masses
        scfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0, seed=1234))
        a, _ = run(WrongChain(eng, chain), prompt, scfg)
        b = WrongChain(eng, chain).generate(prompt, scfg)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30 and a.finish_reason == "length"
        assert all(0 <= t < eng.vocab_size for t in a.token_ids)
