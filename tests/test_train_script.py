"""scripts/train_demo_model.py's LayerSkip-style stochastic depth, on a tiny model."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from selfspec_cli.engine import Engine, Route

from .conftest import make_tiny_model


def _script():
    spec = importlib.util.spec_from_file_location("train_demo_model", Path(__file__).resolve().parents[1] / "scripts" / "train_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layerdrop_removes_exactly_the_dropped_sublayers_and_only_in_training():
    mod = _script()
    model = make_tiny_model("llama-gqa", layers=4)
    L = model.config.num_hidden_layers
    ids = torch.randint(2, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
    drop = mod.LayerDrop(model, 1.0)  # p rises 0, 1/3, 2/3, 1: the last layer is always dropped
    assert drop.p[0] == 0.0 and drop.p[-1] == 1.0
    drop.resample(2, torch.Generator().manual_seed(1))
    # row 0 keeps every sublayer but the last layer's; row 1 also drops layer 1's attention
    for (i, kind), m in drop.masks.items():
        keep = i < L - 1 and not (i == 1 and kind == "attn")
        m[0] = float(i < L - 1)
        m[1] = float(keep)
    model.train()
    with torch.no_grad():
        dropped = model(input_ids=ids).logits
    model.eval()
    with torch.no_grad():
        again = model(input_ids=ids).logits
    torch.testing.assert_close(again, full)  # hooks are inert outside training
    eng = Engine(model)
    for row, attn in ((0, {L - 1}), (1, {1, L - 1})):
        want = eng.forward(eng.new_cache(16), ids[row], positions=0, route=Route(skip_attn=attn, skip_mlp={L - 1}),
                           logits_rows=slice(None)).logits
        torch.testing.assert_close(dropped[row], want, rtol=1e-4, atol=1e-4)
    drop.remove()
    model.train()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, full)  # removed: the plain model again
