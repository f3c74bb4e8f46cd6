"""Every backend against the one decoder layer (engine/layer.py ``decoder_layer``), on every family.

The reference is the op-by-op loop of ``Engine._forward``, which runs ``decoder_layer`` layer by layer
(``stack_layers = False``). Each backend runs the same forwards (a prompt past the sliding windows, a
decode step, a k-row verification, a layer-skip draft keeping hidden states) on a fresh cache:

* ``one-call``: the C++ forward (csrc ``DecoderStack``), bit for bit: logits, hidden states, K/V;
* ``fixed-shape``: the GPU's fixed-shape forward (engine/graphs.py, run eagerly here), to float rounding
  (it sums attention over the whole buffer, masked slots as zeros), and the same greedy tokens;
* ``transformers``: the model's own forward, to float rounding: the family's entry in engine/adapter.py
  ``FAMILIES`` reads the right weights and terms.

A family is one ``ARCHS`` entry of tests/conftest.py; this test takes each one as it comes.
"""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.engine import Engine, ForwardTaps, Route, kernels
from selfspec_cli.engine.runner import ALL_ROWS
from selfspec_cli.methods import AR

from .conftest import ARCHS, VOCAB, make_tiny_model

BACKENDS = ("one-call", "fixed-shape", "transformers")


def _model(arch: str) -> torch.nn.Module:
    # the kernel's attention takes heads of 16, 32, ...: the tiny Qwen3's 24 become 16 here
    return make_tiny_model(arch, **({"head_dim": 16} if arch == "qwen3-qknorm" else {}))


def _forwards(eng: Engine) -> list[tuple]:
    """The same forwards on a fresh cache: (logits, hidden, hidden_at, k, v) after each."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (24,), generator=g)
    calls = [dict(input_ids=ids[:14], positions=0, logits_rows=ALL_ROWS),  # past every tiny window
             dict(input_ids=ids[14:15], positions=14),  # a decode step
             dict(input_ids=ids[15:20], positions=15, logits_rows=ALL_ROWS),  # a 5-row verification
             dict(input_ids=ids[20:23], positions=20, route=Route(skip_attn={1}, skip_mlp={0, 2}),
                  taps=ForwardTaps(hidden_at=(1, 3)))]
    cache = eng.new_cache(64)
    outs = []
    for kw in calls:
        o = eng.forward(cache, **kw)
        outs.append((o.logits, o.hidden, dict(o.hidden_at), cache.k[:, :, :cache.length(0)].clone(),
                     cache.v[:, :, :cache.length(0)].clone()))
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_backend_computes_the_one_layer(arch, backend):
    model = _model(arch)
    if backend == "one-call":
        if kernels.load_extension() is None:
            pytest.skip(f"kernel unavailable: {kernels.status()['reason']}")
        eng = Engine(model)
        eng.stack_layers = False
        ref = _forwards(eng)
        eng.stack_layers = True
        before = eng.stacked_forwards
        got = _forwards(eng)
        assert eng.stacked_forwards - before == 4  # every forward ran in one call
        for a, b in zip(ref, got):
            assert (a[0] is None and b[0] is None) or torch.equal(a[0], b[0])
            assert torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
            assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][l], b[2][l]) for l in a[2])
        return
    loop = Engine(model, fast_kernels=False)
    loop.stack_layers = False
    if backend == "fixed-shape":
        fixed = Engine(model, fast_kernels=False, static_rows=4)
        for a, b in zip(_forwards(loop), _forwards(fixed)):
            assert (a[0] is None and b[0] is None) or torch.allclose(a[0], b[0], atol=1e-4, rtol=1e-4)
            assert torch.allclose(a[1], b[1], atol=1e-4, rtol=1e-4) and torch.allclose(a[3], b[3], atol=1e-5)
            assert a[2].keys() == b[2].keys() and all(torch.allclose(a[2][l], b[2][l], atol=1e-4) for l in a[2])
        prompt = torch.randint(2, VOCAB, (15,), generator=torch.Generator().manual_seed(2)).tolist()
        cfg = GenerationConfig(max_new_tokens=16)
        assert AR(fixed).generate(prompt, cfg).token_ids == AR(loop).generate(prompt, cfg).token_ids
        return
    ids = torch.randint(2, VOCAB, (20,), generator=torch.Generator().manual_seed(4))  # past every tiny window
    ours = loop.forward(loop.new_cache(32), ids, positions=0, logits_rows=ALL_ROWS).logits
    with torch.no_grad():
        theirs = model(ids[None]).logits[0].float()
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_a_term_the_layer_does_not_compute_is_refused():
    """A family entry reads only what the one layer computes: a rotary over part of each head (Phi-3.5/4-mini's
    ``partial_rotary_factor``) is refused with its name, not run wrong."""
    from selfspec_cli.errors import UnsupportedModelError

    model = make_tiny_model("phi3-fused", partial_rotary_factor=0.5)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        Engine(model)
