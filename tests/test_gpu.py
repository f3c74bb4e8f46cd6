"""On a CUDA device only (skipped elsewhere; scripts/gpu_bench.sh runs it): the fixed-shape forwards
replayed as CUDA graphs (engine/graphs.py) on the shipped code model, in float32 and bfloat16.

* a k-row forward equals k one-row steps bit for bit (chains up to a forward's rows and past them),
  which is what makes every lossless method exact in bf16 on the GPU (trees are verified as chains
  there: Engine.exact_trees);
* plain decoding and the layer-skip, n-gram and auto methods give the very tokens of ``ar``, with
  every forward of plain decoding replayed from a graph (no eager fallback), greedy and sampled (the
  gumbel rule's noise drawn on the device);
* the model read without transformers (selfspec_cli/lite.py) is transformers' on the device too.

Under ``SELFSPEC_COMPILE=1`` (scripts/gpu_bench.sh ... compiled) the engines' sublayers are compiled
(engine/sublayers.py) and the same checks hold.
"""
from __future__ import annotations

import os

import pytest
import torch

from selfspec_cli import methods
from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.engine import Engine
from selfspec_cli.engine.runner import ALL_ROWS
from selfspec_cli.engine.sublayers import compile_requested
from selfspec_cli.loading import load_model

# SELFSPEC_GPU_TEST_ON_CPU=1: the same tests on the CPU, fixed-shape forwards run eagerly (a dry run of the script)
ON_CPU = os.environ.get("SELFSPEC_GPU_TEST_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
pytestmark = pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs a CUDA device")

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module", params=list(DTYPES))
def code_model(request):
    model, tok = load_model("pystdlib", dtype=DTYPES[request.param], device=DEVICE)
    return Engine(model, **({"fast_kernels": False, "static_rows": 32} if ON_CPU else {})), tok


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_k_rows_equal_one_row_steps_bit_for_bit(code_model):
    eng, tok = code_model
    assert eng.static is not None and eng.static.capture != ON_CPU
    assert eng.sublayers.compiled == compile_requested()  # SELFSPEC_COMPILE=1: the same checks, compiled
    ids = torch.tensor(_ids(tok, "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
                                  "description='copy files')\n    parser.add_argument('--src')\n"), device=DEVICE)
    p = 20
    n = min(int(ids.shape[0]) - p, 40)
    cache = eng.new_cache(128)
    eng.forward(cache, ids[:p], positions=0, logits_rows=None)
    steps = torch.stack([eng.forward(cache, ids[p + i:p + i + 1], positions=p + i).logits[0] for i in range(n)])
    for k in (1, 4, 8, eng.static.rows, n):
        cache.crop(p)
        out = eng.forward(cache, ids[p:p + k], positions=p, logits_rows=ALL_ROWS)
        assert torch.equal(out.logits, steps[:k]), k
    assert eng.static.eager_fallbacks == 0 and (eng.static.replays > 0) != ON_CPU


@pytest.mark.parametrize("name", ["pld", "self-sd", "swift", "asd", "auto"])
def test_lossless_methods_give_the_tokens_of_ar(code_model, name):
    eng, tok = code_model
    cfg = GenerationConfig(max_new_tokens=48)
    ar = methods.build("ar", eng, tok)
    method = methods.build(name, eng, tok)
    prompts = ["def read_lines(path):\n", "class Stack:\n    def __init__(self):\n",
               "import json\n\n\ndef load(path):\n    with open(path) as f:\n"]
    for text in prompts:
        ids = _ids(tok, text)
        assert method.generate(ids, cfg).token_ids == ar.generate(ids, cfg).token_ids, (name, text)


@pytest.mark.parametrize("name", ["pld", "swift", "auto"])
def test_sampling_on_the_device_gives_the_samples_of_ar(code_model, name):
    """The gumbel rule's noise drawn on the device (decoding/sampling.py): a seed's samples are ar's for every
    lossless method, and they are samples (two seeds differ)."""
    eng, tok = code_model
    ar, method = methods.build("ar", eng, tok), methods.build(name, eng, tok)
    ids = _ids(tok, "def parse_args(argv):\n")
    runs = {}
    for seed in (1, 2):
        cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=seed))
        runs[seed] = ar.generate(ids, cfg).token_ids
        assert method.generate(ids, cfg).token_ids == runs[seed], (name, seed)
    assert runs[1] != runs[2]


def test_the_model_read_without_transformers_is_transformers_on_the_device():
    """generate, chat and the bench read the model without transformers (selfspec_cli/lite.py): on the
    device too, the same fingerprint, rotary tables and logits as transformers' model."""
    from selfspec_cli.engine.adapter import model_fingerprint

    (hf, tok), (lite, _) = (load_model("pystdlib", dtype="float32", device=DEVICE, lite=flag) for flag in (False, True))
    assert type(lite).__name__ == "LiteLlama" and model_fingerprint(lite) == model_fingerprint(hf)
    kw = {"fast_kernels": False, "static_rows": 32} if ON_CPU else {}
    a, b = Engine(hf, **kw), Engine(lite, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.adapter.rope_table(300), b.adapter.rope_table(300)))
    ids = torch.tensor(_ids(tok, "def read_lines(path):\n    with open(path) as f:\n"), device=DEVICE)
    la = a.forward(a.new_cache(64), ids, positions=0, logits_rows=ALL_ROWS).logits
    lb = b.forward(b.new_cache(64), ids, positions=0, logits_rows=ALL_ROWS).logits
    assert torch.equal(la, lb)
