"""SpecEE on a sliding-window model, against an independent reference.

The reference below is plain torch on the Hugging Face model's own weights (q/k/v/o
projections, the model's rotary module, RMSNorm with the config's eps), one token at
a time, with its own K/V store: at each layer a token attends to exactly the earlier
tokens whose K/V exist at that layer and whose position is inside the window
(``query pos - key pos < window``, as Hugging Face's sliding-window mask).

* empty mode (the paper): a token that exited at layer ``e`` has K/V at layers
  ``0..e`` only, so later tokens do not see it deeper (holes), and windows must be cut
  by stored positions, not by slot counts;
* deferred mode: every token ends up with K/V at every layer.

Each SpecEE round is replayed through the reference at the layer SpecEE stopped at
(read from its ``early_exits`` statistics round by round): the residual stream there
must match to 1e-4 and the emitted token must be the reference's argmax of the final
norm + LM head at that layer. The reference itself is first checked against the
Hugging Face forward, and controls show that both the window and the holes matter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine
from selfspec_cli.methods.specee import SpecEE, SpecEEConfig

from .conftest import make_tiny_model
from .test_adadecode import random_heads
from .test_specee import constant_predictor
from .test_speculative import _prompt

L = 6
WINDOW = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all per-op overhead: one thread is fastest on a shared CPU."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def windowed_model(window: int | None = WINDOW):
    return make_tiny_model("mistral-window", layers=L, sliding_window=window)


# -- the reference -----------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Reference:
    """Token-by-token forward with a per-layer {position: (k, v)} store.

    ``window``: the attention window (None: none). ``holes``: whether a token run to
    depth ``e`` stores K/V only at layers ``0..e`` (True) or, wrongly for empty mode,
    as if it had all layers (False, a control)."""

    def __init__(self, model, window: int | None, holes: bool = True) -> None:
        c = model.config
        self.model, self.window, self.holes = model, window, holes
        self.eps = c.rms_norm_eps
        self.hq, self.hkv = c.num_attention_heads, c.num_key_value_heads
        self.d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.store: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(c.num_hidden_layers)]

    @torch.no_grad()
    def step(self, token: int, pos: int, depth: int) -> list[torch.Tensor]:
        """Run ``token`` at ``pos`` through layers ``0..depth``; the residual stream after each."""
        inner = self.model.model
        h = inner.embed_tokens.weight[token][None]  # (1, H)
        cos, sin = inner.rotary_emb(h[None], torch.tensor([[pos]]))
        cos, sin = cos[0], sin[0]  # (1, D)
        out = []
        for l in range(depth + 1 if self.holes else len(self.store)):
            layer, attn = inner.layers[l], inner.layers[l].self_attn
            x = _rms(h, layer.input_layernorm.weight, self.eps)
            q = attn.q_proj(x).view(self.hq, self.d)
            k = attn.k_proj(x).view(self.hkv, self.d)
            v = attn.v_proj(x).view(self.hkv, self.d)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            self.store[l][pos] = (k, v)
            seen = [p for p in sorted(self.store[l]) if p <= pos and (self.window is None or pos - p < self.window)]
            keys = torch.stack([self.store[l][p][0] for p in seen], 1).repeat_interleave(self.hq // self.hkv, 0)
            vals = torch.stack([self.store[l][p][1] for p in seen], 1).repeat_interleave(self.hq // self.hkv, 0)
            att = (q[:, None, :] @ keys.transpose(1, 2)) / self.d**0.5  # (Hq, 1, S)
            h = h + attn.o_proj((att.softmax(-1) @ vals)[:, 0].reshape(1, -1))
            x = _rms(h, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            out.append(h)
        return out[: depth + 1]

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_rms(h, self.model.model.norm.weight, self.eps))[0]


def test_reference_matches_hugging_face():
    """The reference without exits is the model: same logits as the HF forward (whose
    sliding-window mask is Hugging Face's own) over a sequence 5 windows long."""
    model = windowed_model()
    ids = _prompt(20, 0)
    ref = Reference(model, WINDOW)
    mine = torch.stack([ref.logits(ref.step(t, p, L - 1)[-1]) for p, t in enumerate(ids)])
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(mine, hf, atol=1e-4, rtol=1e-4)
    # and the window matters for this sequence
    plain = Reference(model, None)
    full = torch.stack([plain.logits(plain.step(t, p, L - 1)[-1]) for p, t in enumerate(ids)])
    assert (full[WINDOW:] - hf[WINDOW:]).abs().max() > 1e-2


# -- SpecEE, round by round ------------------------------------------------------

def run_specee(model, prompt: list[int], n: int, kv_mode: str):
    """Decode with exits at every scheduled layer where the verification passes
    (threshold 0: every predictor fires). Returns the result, per round (depth, the
    residual row SpecEE stopped with) and the decode's cache."""
    eng = Engine(model)
    preds = {l: constant_predictor(0.0) for l in range(1, L - 1)}
    m = SpecEE(eng, None, SpecEEConfig(specee_kv_mode=kv_mode, specee_threshold=0.0),
               drafter_layer=1, drafter=random_heads(model, [1])[1], predictors=preds, offline_layers=[2, 3])
    rounds: list[tuple[int, torch.Tensor]] = []
    calls: list[torch.Tensor] = []
    caches = []
    forward, propose, new_cache = eng.forward, m.drafter.draft, eng.new_cache

    def spy_forward(*a, **kw):
        out = forward(*a, **kw)
        calls.append(out.hidden[-1:].clone())  # the current token is the last row of every call
        return out

    def spy_propose(state, budget):
        before = dict(m.describe().early_exits)
        calls.clear()
        draft = propose(state, budget)
        after = m.describe().early_exits
        exited = [int(k) for k, v in after.items() if v != before.get(k, 0)]
        assert len(exited) <= 1
        rounds.append((exited[0] if exited else L - 1, calls[-1]))
        return draft

    eng.forward, m.drafter.draft = spy_forward, spy_propose
    eng.new_cache = lambda capacity: caches.append(new_cache(capacity)) or caches[-1]
    res = m.generate(prompt, GenerationConfig(max_new_tokens=n))
    # the statistics agree with what was seen round by round
    counts = {str(d): sum(1 for e, _ in rounds if e == d) for d in range(L - 1)}
    assert res.stats.report.early_exits == {k: v for k, v in counts.items() if v}
    return res, rounds, caches[0]


def replay(model, prompt, res, rounds, *, window, holes=True, deferred=False):
    """Feed SpecEE's tokens through the reference at SpecEE's depths. Returns per
    round (max |hidden difference|, whether the emitted token is the reference's)."""
    ref = Reference(model, window, holes=holes)
    for p, t in enumerate(prompt):
        ref.step(t, p, L - 1)
    out = []
    for r, (depth, row) in enumerate(rounds):
        pos = len(prompt) + r
        # deferred: the exited token's deep layers are filled later, so it has K/V at every layer
        h = ref.step(res.token_ids[r], pos, L - 1 if deferred else depth)[depth]
        out.append((float((h - row).abs().max()), int(ref.logits(h).argmax()) == res.token_ids[r + 1]))
    return out


def check_holes(cache, prompt, rounds) -> None:
    """The cache holds K/V of a token that stopped at layer e at layers 0..e only."""
    for l in range(L):
        want = list(range(len(prompt))) + [len(prompt) + r for r, (d, _) in enumerate(rounds) if d >= l]
        assert cache.positions[l] == want, l


CASES = [(8, 3), (6, 0), (5, 1)]  # (prompt length >= window, seed)


@pytest.mark.parametrize("plen,seed", CASES)
def test_empty_mode_matches_reference(plen, seed):
    model = windowed_model()
    prompt = _prompt(plen, seed)
    res, rounds, cache = run_specee(model, prompt, 30, "empty")
    depths = [d for d, _ in rounds]
    assert len(set(depths) - {L - 1}) >= 2 and depths.count(L - 1) >= 2  # exits at several layers, and full depth
    check_holes(cache, prompt, rounds)
    assert cache.has_holes(L - 1) and len(prompt) + len(rounds) > 2 * WINDOW
    got = replay(model, prompt, res, rounds, window=WINDOW)
    assert max(d for d, _ in got) < 1e-4
    assert all(ok for _, ok in got), [r for r, (_, ok) in enumerate(got) if not ok]
    # controls: a reference without the window, or without the holes, does not match
    assert max(d for d, _ in replay(model, prompt, res, rounds, window=None)) > 1e-3
    assert max(d for d, _ in replay(model, prompt, res, rounds, window=WINDOW, holes=False)) > 1e-3


@pytest.mark.parametrize("plen,seed", CASES[:2])
def test_deferred_mode_matches_full_kv_reference(plen, seed):
    model = windowed_model()
    prompt = _prompt(plen, seed)
    res, rounds, cache = run_specee(model, prompt, 30, "deferred")
    assert len({d for d, _ in rounds}) >= 3
    got = replay(model, prompt, res, rounds, window=WINDOW, deferred=True)
    assert max(d for d, _ in got) < 1e-4 and all(ok for _, ok in got)


def test_window_changes_specee():
    """The same weights without a window: SpecEE's residual rows differ once the
    sequence is longer than the window (so the tests above do test the window)."""
    windowed, plain = windowed_model(), windowed_model(None)
    for a, b in zip(windowed.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    prompt = _prompt(8, 3)
    _, rw, _ = run_specee(windowed, prompt, 30, "empty")
    _, rp, _ = run_specee(plain, prompt, 30, "empty")
    assert max(float((a - b).abs().max()) for (da, a), (db, b) in zip(rw, rp) if da == db) > 1e-3


# A windowed layer with holes whose slot count is at most the window, but whose stored
# positions span more than the window: Engine._mask once returned None ("no window cut")
# because past + T <= window, so the query attended to positions outside the window (found
# by these tests; the window cut is now decided by positions). Only SpecEE's empty mode
# makes such holes; short prompts reach it.
@pytest.mark.parametrize("plen,seed", [(2, 2), (1, 0)])
def test_empty_mode_short_prompt_matches_reference(plen, seed):
    model = windowed_model()
    prompt = _prompt(plen, seed)
    res, rounds, cache = run_specee(model, prompt, 30, "empty")
    check_holes(cache, prompt, rounds)
    got = replay(model, prompt, res, rounds, window=WINDOW)
    bad = [r for r, (d, ok) in enumerate(got) if d >= 1e-4 or not ok]
    assert not bad, f"rounds {bad} differ from the reference (depths {[d for d, _ in rounds]})"


def test_engine_window_with_holes_minimal():
    """The bug above without SpecEE: positions 0..2 at every layer, position 3 at layers
    0..L-2 only (a hole in the last layer), then position 4 at full depth. Its last layer
    holds 3 slots + 1 row <= WINDOW = 4, but position 0 is 4 positions back: outside."""
    model = windowed_model()
    ids = _prompt(5, 0)
    eng = Engine(model)
    cache = eng.new_cache(8)
    ref = Reference(model, WINDOW)
    eng.forward(cache, torch.tensor(ids[:3]), positions=0)
    eng.forward(cache, torch.tensor(ids[3:4]), positions=3, end=L - 1)
    out = eng.forward(cache, torch.tensor(ids[4:5]), positions=4)
    assert cache.positions[L - 1] == [0, 1, 2, 4]
    for p in range(3):
        ref.step(ids[p], p, L - 1)
    ref.step(ids[3], 3, L - 2)
    want = ref.logits(ref.step(ids[4], 4, L - 1)[-1])
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=1e-4)
