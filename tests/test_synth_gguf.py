"""scripts/synth_gguf.py: a GGUF of a real file's exact shape with random blocks, for speed measurements where the
real file cannot travel (docs/benchmarks.md, "Many cores"). The copy must read as the same model to selfspec: the
same header, every tensor of the same type, shape, offset and size, sane scales, and a forward with finite logits."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from .gguf_utils import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("synth_gguf", ROOT / "scripts" / "synth_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_synthetic_copy_is_the_real_files_shape_and_runs(tmp_path):
    from gguf import GGUFReader

    from selfspec_cli.engine import Engine
    from selfspec_cli.loading import load_model

    synth = _script()
    real, _, _ = make_tiny_gguf(tmp_path / "real", qtype="Q4_1+Q8_0")
    synth.header(real, tmp_path / "stem")
    out = tmp_path / "synth.gguf"
    synth.fill(tmp_path / "stem", out, seed=1)
    assert out.stat().st_size == real.stat().st_size
    assert out.read_bytes()[:GGUFReader(real).data_offset] == real.read_bytes()[:GGUFReader(real).data_offset]
    a, b = GGUFReader(real), GGUFReader(out)
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in a.tensors] == \
           [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in b.tensors]
    q41 = next(t for t in b.tensors if t.tensor_type.name == "Q4_1")
    d = np.asarray(q41.data).reshape(-1, 20)[:, :2].copy().view(np.float16)
    assert np.all(d == np.float16(0.003))  # every block's scale set, none left random (NaN, inf, subnormal)
    model, _ = load_model(str(out), device="cpu", lite=True)
    engine = Engine(model, target_precision="auto")
    logits = engine.forward(engine.new_cache(8), torch.tensor([1, 2, 3]), positions=0).logits
    assert torch.isfinite(logits).all()


def test_a_block_type_it_does_not_fill_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="block type IQ4_NL is not filled"):
        _script()._fill_blocks("IQ4_NL", 36, np.random.default_rng(0))
