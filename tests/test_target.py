"""The target's weights (engine/target.py): block, bf16 and fp32 targets.

Real GGUF files (written in-process by tests/gguf_utils.py and loaded through transformers' own
GGUF loader) and real tiny transformers models. What is checked:

* a k-row verification forward on every target equals k one-row steps bit for bit, at every block
  type the kernel takes, on the AVX2 path and (where the CPU has it) the AVX-512 path;
* ``auto`` resolves to the checkpoint's own storage; explicit targets this engine cannot run are
  refused with one line;
* a bf16 target of bf16-valued weights gives the fp32 target's very logits;
* every lossless method keeps greedy parity with ``ar`` on the block target.
"""
from __future__ import annotations

import pytest
import torch

from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.measure import weight_bytes
from selfspec_cli.engine import Engine
from selfspec_cli.engine.adapter import model_fingerprint
from selfspec_cli.engine import kernels as K
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods import AR, build

from .conftest import make_tiny_model

ext = K.load_extension()
needs_kernel = pytest.mark.skipif(ext is None, reason="the CPU kernel is not available here")
ISAS = ["avx2"] + (["avx512"] if ext is not None and ext.qisa() == "avx512" else [])


@needs_kernel
def test_the_avx512_halves_run_here():
    """The ISA tests below run their AVX-512 half only where the CPU has it; on an AVX2 host this
    skip says so (in ``pytest -rs``), instead of the half going missing without a word."""
    if "avx512" not in ISAS:
        pytest.skip(f"no AVX-512 on this CPU (the kernel chose {ext.qisa()}): the ISA tests of test_target.py "
                    "ran their AVX2 half only; run them on an AVX-512 host for the other half")


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """A tiny Llama per block type, converted from its GGUF (Q4_1, Q4_0, Q8_0; Q5_0 with a Q8_0 v)."""
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    root = tmp_path_factory.mktemp("target")
    mp = pytest.MonkeyPatch()
    mp.setenv("SELFSPEC_HOME", str(root / "home"))
    out = {}
    for qtype in ("Q4_1", "Q4_0", "Q8_0", "Q5_0+Q8_0"):
        path, _, _ = make_tiny_gguf(root, qtype=qtype, name=f"tiny-{qtype}.gguf")
        out[qtype] = load_model(str(path), dtype="float32", device="cpu", log=None)[0]
    path, _, _ = make_tiny_gguf(root, qtype="Q4_1", name="tiny-Q4_1-6.gguf", layers=6)  # SWIFT needs >= 4 layers
    out["Q4_1x6"] = load_model(str(path), dtype="float32", device="cpu", log=None)[0]
    yield out
    mp.undo()


def _k_rows_equal_one_row_steps(eng: Engine, prompt: list[int], k: int) -> None:
    ids = torch.tensor(prompt)
    c1, ck = eng.new_cache(64), eng.new_cache(64)
    p = len(prompt) - k
    eng.forward(c1, ids[:p], positions=0)
    eng.forward(ck, ids[:p], positions=0)
    many = eng.forward(ck, ids[p:], positions=p, logits_rows=slice(None)).logits
    ones = torch.cat([eng.forward(c1, ids[p + i:p + i + 1], positions=p + i).logits for i in range(k)])
    assert torch.equal(many, ones), k


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0", "Q5_0+Q8_0"])
def test_block_target_k_rows_equal_one_row_steps(gguf_models, monkeypatch, qtype, isa):
    monkeypatch.setenv("SELFSPEC_ISA", isa)  # read when the kernel's panels are made
    eng = Engine(gguf_models[qtype], target_precision="gguf")
    assert eng.target_precision == "gguf" and eng.target_info["fp32_fallback"] == []
    assert all(lin.isa == ("avx2" if isa == "avx2" else "auto") for lin in eng._lin[0].values())
    prompt = list(range(3, 23))
    for k in (2, 3, 4, 6, 7, 8, 13):
        _k_rows_equal_one_row_steps(eng, prompt, k)


@needs_kernel
@needs_kernel
def test_fused_parts_of_two_types_of_one_layout_stay_blocks(gguf_models):
    """A Q4_K_M file stores q/k as Q5_0 and v as Q8_0 in some layers (Gemma 3 270M): both are byte codes with a
    scale per 32, so the fused q/k/v is one block matrix (named ``q5_0+q8_0``), exactly the target's weights."""
    eng = Engine(gguf_models["Q5_0+Q8_0"], target_precision="gguf")
    d = eng.quantized("gguf")
    assert eng.target_info["fp32_fallback"] == [] and d.info["int8_fallback"] == []
    assert {eng._lin[0][n].meta.fmt for n in ("qkv", "o")} == {"q5_0+q8_0", "q5_0"}
    for l, w in enumerate(eng.adapter.layers):
        for n in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(d.layers[l][n].quant.dequantize(), getattr(w, f"w_{n}")), (l, n)
    assert eng.lm_head.meta.fmt == "q8_0" and torch.equal(d.head.quant.dequantize(), eng.adapter.lm_head)


def test_block_target_is_the_isa_independent_and_streams_the_files_bytes(gguf_models, monkeypatch):
    model = gguf_models["Q4_1"]
    ids = torch.arange(3, 20)
    logits = {}
    for isa in ISAS:
        monkeypatch.setenv("SELFSPEC_ISA", isa)
        eng = Engine(model, target_precision="gguf")
        logits[isa] = eng.forward(eng.new_cache(32), ids, positions=0, logits_rows=slice(None)).logits
    assert all(torch.equal(v, logits["avx2"]) for v in logits.values())
    fp32 = Engine(model, target_precision="fp32")
    # Q4_1: 20 bytes per 32 weights in the file, 24 here (scale and minimum as float32), against 128 in fp32
    assert weight_bytes(eng) < 0.25 * weight_bytes(fp32)
    # the block target computes the fp32 weights exactly, up to summation order
    want = fp32.forward(fp32.new_cache(32), ids, positions=0, logits_rows=slice(None)).logits
    assert float((want - logits["avx2"]).abs().max()) < 1e-3


@needs_kernel
def test_auto_follows_the_checkpoints_storage(gguf_models):
    assert Engine(gguf_models["Q4_1"], target_precision="auto").target_precision == "gguf"
    model = make_tiny_model("llama-gqa", layers=2)
    assert Engine(model, target_precision="auto").target_precision == "fp32"  # random fp32 weights
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # what loading a bf16 checkpoint as float32 gives
    assert Engine(model, target_precision="auto").target_precision == "bf16"
    assert Engine(model).target_precision == "fp32"  # the library's default: the weights as loaded


@needs_kernel
@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16_bit_target_of_such_values_is_the_fp32_target_bit_for_bit(name, dtype):
    model = make_tiny_model("qwen2-bias", layers=3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())  # a bf16 or fp16 checkpoint loaded as float32
    assert Engine(model, target_precision="auto").target_precision == name
    b16, f32 = Engine(model, target_precision=name), Engine(model, target_precision="fp32")
    assert b16.target_info["rounded_matrices"] == 0
    assert weight_bytes(b16) < 0.6 * weight_bytes(f32)
    ids = torch.arange(3, 30)
    got = b16.forward(b16.new_cache(40), ids, positions=0, logits_rows=slice(None)).logits
    want = f32.forward(f32.new_cache(40), ids, positions=0, logits_rows=slice(None)).logits
    assert torch.equal(got, want)
    _k_rows_equal_one_row_steps(b16, list(range(3, 20)), 5)


@needs_kernel
def test_targets_an_engine_cannot_run_are_refused():
    model = make_tiny_model("llama-gqa", layers=2)
    with pytest.raises(ConfigError, match="--target-precision gguf"):
        Engine(model, target_precision="gguf")
    with pytest.raises(ConfigError, match="unknown target precision"):
        Engine(model, target_precision="int3")


@needs_kernel
@pytest.mark.parametrize("method,options", [
    ("self-sd", {"skip_attn": "1", "skip_mlp": "0", "paper_drafting": True}),
    ("self-sd", {"skip_attn": "0", "skip_mlp": "1", "hybrid": True}),
    ("swift", {"paper_drafting": True}),
    ("asd", {"paper_drafting": True}),
    ("pld", {}),
    ("auto", {}),
])
def test_lossless_methods_keep_greedy_parity_on_the_block_target(gguf_models, method, options):
    _block_target_parity(gguf_models["Q4_1x6"], method, options, [(0, 40), (1, 13)])


def _block_target_parity(model, method: str, options: dict, runs: list[tuple[int, int]]) -> dict:
    """``method`` on the block target gives ``ar``'s tokens for each (seed, length); with paper
    drafting it drafts at all. Returns the method's ``describe()``."""
    eng = Engine(model, target_precision="gguf")
    m = build(method, eng, None, **options)
    ar = AR(eng)
    drafted = 0
    for seed, n in runs:
        prompt = torch.randint(3, eng.vocab_size, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        cfg = GenerationConfig(max_new_tokens=n)
        res = m.generate(prompt, cfg)
        assert res.token_ids == ar.generate(prompt, cfg).token_ids, (method, seed)
        drafted += res.stats.drafted_tokens
    if options.get("paper_drafting"):
        assert drafted > 0
    return m.describe().to_json()


@needs_kernel
def test_specqd_refuses_a_draft_at_the_targets_own_precision(gguf_models):
    eng = Engine(gguf_models["Q4_1"], target_precision="gguf")
    assert build("specqd", eng, None).describe().draft_precision == "w4a8"  # auto: the W4A8 product
    with pytest.raises(ConfigError, match="target"):
        build("specqd", eng, None, draft_precision="gguf")


# ---- the W4A8 draft: the block target's own codes times int8 activations ------------------------


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_w4a8_is_close_batch_invariant_and_the_same_on_both_paths(gguf_models, monkeypatch, qtype):
    logits = {}
    for isa in ISAS:
        monkeypatch.setenv("SELFSPEC_ISA", isa)
        eng = Engine(gguf_models[qtype], target_precision="gguf")
        lin = eng.quantized("w4a8").layers[0]["gate_up"]
        x = torch.randn(9, lin.quant.codes.shape[1], generator=torch.Generator().manual_seed(1))
        many = lin(x)
        assert torch.equal(many, torch.cat([lin(x[i:i + 1]) for i in range(9)]))  # batch-invariant
        # against the exact product with the same weights: int8 rounding of x per group of 32
        want = x.double() @ lin.quant.dequantize().double().T
        err = float((many.double() - want).abs().max() / want.abs().max())
        assert 1e-7 < err < 0.03, err  # not the target's arithmetic, but close to it
        logits[isa] = many
        assert eng.quantized("w4a8").layers[0]["qkv"].base is eng._lin[0]["qkv"]  # the target's own codes: no copy
    assert all(torch.equal(v, logits["avx2"]) for v in logits.values())


@needs_kernel
@pytest.mark.parametrize("method,options", [("specqd", {"paper_drafting": True}), ("auto", {}),
                                            ("self-sd", {"skip_attn": "1", "skip_mlp": "2", "paper_drafting": True})])
def test_w4a8_drafts_keep_parity_on_the_block_target(gguf_models, method, options):
    info = _block_target_parity(gguf_models["Q4_1x6"], method, options, [(0, 40), (3, 17)])
    assert (info.get("quant") or info.get("layer_skip") or info)["draft_precision"] == "w4a8"


@needs_kernel
def test_releasing_the_float_weights_keeps_every_token(gguf_models):
    """A block target frees the model's float matrices and its tied float embedding (rows then come
    from the head's Q8_0 blocks): the same tokens, the bytes given back."""
    from selfspec_cli.loading import load_model

    path = gguf_models["Q4_1x6"].name_or_path  # a model of its own: this one loses its float weights
    Engine(gguf_models["Q4_1x6"], target_precision="gguf")  # the block copy on disk (a first build reads the floats)
    eng = Engine(load_model(path, dtype="float32", device="cpu", log=None)[0], target_precision="gguf")
    m, ar = build("auto", eng, None), AR(eng)
    # the block target never reads the float q/k/v and gate/up, so they are never fused (a copy of their bytes)
    assert all(w.qkv.tensor is None and w.gate_up.tensor is None for w in eng.adapter.layers)
    attn = eng.model.model.layers[0].self_attn
    parts = sum(p.numel() * 4 for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    prompt = list(range(5, 15))
    cfg = GenerationConfig(max_new_tokens=24)
    before = ar.generate(prompt, cfg).token_ids
    emb = eng.embed(torch.arange(eng.vocab_size))
    fp = model_fingerprint(eng.model)
    eng.model._selfspec_fingerprint = None  # computed afresh by the release, from the weights it is about to free
    head = eng.head_rows(torch.arange(eng.vocab_size))
    freed = eng.release_float_weights()
    assert model_fingerprint(eng.model) == fp  # artifacts built after the release still know the model
    assert freed >= sum(t.numel() * 4 for t in [eng.adapter.embed]) and eng._embed_rows is not None
    assert eng.adapter.embed.numel() == 0 and all(p.numel() == 0 for p in eng.model.model.layers[0].mlp.parameters())
    assert all(p.numel() == 0 for p in attn.parameters()) and freed >= eng.num_layers * parts
    assert torch.equal(eng.embed(torch.arange(eng.vocab_size)), emb)
    assert torch.equal(eng.head_rows(torch.arange(eng.vocab_size)), head)  # SpecEE's speculative rows
    assert ar.generate(prompt, cfg).token_ids == before == m.generate(prompt, cfg).token_ids
    assert Engine(make_tiny_model("llama-gqa", layers=2), target_precision="fp32").release_float_weights() == 0


@needs_kernel
def test_float_targets_fuse_q_k_v_and_the_module_reads_the_fused_tensor(gguf_models):
    """q/k/v and gate/up are fused when a float target first reads them: the module's parameters then view
    the fused tensor (one copy of the weights), and its values are the parts'."""
    model = make_tiny_model("qwen2-bias", layers=2)
    attn = model.model.layers[0].self_attn
    want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).clone()
    eng = Engine(model, target_precision="fp32")
    w = eng.adapter.layers[0]
    assert w.qkv.tensor is not None and torch.equal(w.w_qkv, want)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == w.w_qkv.untyped_storage().data_ptr()
    assert attn.q_proj.bias.untyped_storage().data_ptr() == w.b_qkv.untyped_storage().data_ptr()


@needs_kernel
def test_an_f16_gguf_streams_its_16_bit_values(tmp_path, monkeypatch):
    """A GGUF of F16 tensors holds no block the kernel takes: auto reads its float16 values as
    float16 panels (bit for bit the fp32 target); a mixed file's F16 matrices get 16-bit panels too."""
    from selfspec_cli.engine.target import target_linears
    from selfspec_cli.loading import load_model

    from .gguf_utils import make_tiny_gguf

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    path, _, _ = make_tiny_gguf(tmp_path, qtype="F16", name="tiny-f16.gguf")
    model = load_model(str(path), dtype="float32", device="cpu", log=None)[0]
    eng = Engine(model, target_precision="auto")
    assert eng.target_precision == "fp16"
    lins = target_linears(eng, "gguf")[0][0]  # every matrix a fallback: 16-bit float panels
    assert all(isinstance(l, K.Linear) and l.packed.dtype == torch.float16 for l in lins.values())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_block_type_reads_as_gguf_py_dequantizes_it(qtype):
    """The codes, scales and minimums read from a tensor's blocks dequantize to exactly what gguf-py
    computes for them (the values transformers' GGUF loader gives the model). K-quant blocks are
    random bytes (gguf-py cannot quantize them) with finite float16 scales."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    from selfspec_cli.engine.quant import _gguf_block

    kind = Q[qtype]
    per, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(3)
    rows, cols = 5, 512
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208]}[qtype]
    for at in halves:  # finite, moderate float16 scales (random bytes could be NaN or inf)
        raw[:, :, at:at + 2] = rng.uniform(0.001, 0.1, (rows, cols // per)).astype(np.float16).view(np.uint8).reshape(
            rows, cols // per, 2)
    raw = raw.reshape(rows, -1)

    class Tensor:
        tensor_type, data = kind, raw

    got = _gguf_block(Tensor())
    want = quants.dequantize(raw, kind).reshape(rows, cols)
    assert got is not None and got.codes.shape == (rows, cols)
    assert np.array_equal(got.dequantize().numpy(), want.astype(np.float32))


# ---- what the methods and profile make of a block target ------------------------------------------


@needs_kernel
def test_a_copy_at_the_targets_precision_is_never_a_draft(gguf_models):
    from selfspec_cli.bench.engine_profile import quantized_drafts
    from selfspec_cli.methods.base import method_precision

    eng = Engine(gguf_models["Q4_1"], target_precision="gguf")
    # a skip set calibrated on the GGUF copy drafts with auto's weights once that copy is the target
    assert method_precision(eng, "auto", "gguf") == "w4a8"
    assert method_precision(eng, "auto", "target") is None
    out = quantized_drafts(eng, list(range(3, 12)), [list(range(3, 9))], 2, rounds=1, precisions=("gguf", "w4a8"))
    assert out.drafts["gguf"].to_json() == {"unavailable": "the gguf target itself"} and out.drafts["w4a8"].c > 0


@needs_kernel
def test_fr_spec_auto_vocabulary_applies_to_quantized_drafts_only_on_a_block_target(gguf_models, monkeypatch):
    from selfspec_cli.methods import fr_spec

    asked = []
    monkeypatch.setattr(fr_spec, "resolve", lambda spec, model, size=None: asked.append(spec))  # records, no artifact
    block = build("specqd", Engine(gguf_models["Q4_1"], target_precision="gguf"), None)
    fp32 = build("specqd", Engine(gguf_models["Q4_1"], target_precision="fp32"), None, draft_precision="int8")
    asked.clear()
    fr_spec.draft_vocab(block.engine, block.weights)
    fr_spec.draft_vocab(fp32.engine, fp32.weights)
    assert asked == ["auto", "full"]  # the block target's draft head is the target's own: a subset pays


def test_draft_verdict_says_whether_any_full_depth_copy_pays():
    from selfspec_cli.bench.engine_profile import QuantizedDrafts, draft_verdict

    from .test_planning import measured_copies

    v = {"2": 1.05, "4": 1.35, "8": 2.36}
    cheap = draft_verdict(measured_copies(int8=(0.3, 0.95)), v)
    assert cheap.summary.startswith("int8 can pay") and cheap.drafts["int8"].best_gain > 1.5
    # a copy at 0.97 of a step pays nothing even at full agreement: 2 tokens / (0.97 + v(2)) < 1
    dear = draft_verdict(measured_copies(w4a8=(0.97, 1.0)), v)
    assert dear.drafts["w4a8"].best_gain < 1.0 and dear.summary.startswith("nothing cheaper")
    assert draft_verdict(QuantizedDrafts({}), v).summary == "no quantized copy measured"


@needs_kernel
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_releasing_the_float_matrices_of_a_panel_target(precision):
    """With ``panels``, a packed-panel target frees the layers' float matrices (its panels are its weights):
    the same tokens after, the bytes given back, and a draft or plain_linear() that would read the freed
    matrices is refused rather than computed from empty tensors. Without ``panels`` nothing is freed."""
    eng = Engine(make_tiny_model("llama-gqa", layers=3), target_precision=precision)
    ar, prompt, cfg = AR(eng), list(range(5, 25)), GenerationConfig(max_new_tokens=20)
    before = ar.generate(prompt, cfg).token_ids
    assert eng.release_float_weights() == 0
    matrices = sum(getattr(w, f"w_{n}").numel() * 4 for w in eng.adapter.layers for n in ("qkv", "o", "gate_up", "down"))
    assert eng.release_float_weights(panels=True) == matrices
    assert all(getattr(w, "w_down").numel() == 0 for w in eng.adapter.layers)
    assert ar.generate(prompt, cfg).token_ids == before
    with pytest.raises(RuntimeError, match="release_float_weights"):
        eng.quantized("int8")
    with pytest.raises(RuntimeError, match="release_float_weights"), eng.plain_linear():
        pass


@needs_kernel
def test_released_panel_target_keeps_every_norm_its_own():
    """After ``release_float_weights(panels=True)`` every layer's norms are still its own: the release moves
    the remaining parameters to fresh memory and re-points the engine's references by address, so no clone
    may take a replaced tensor's address while it remaps. Before that rule, on the shipped code model loaded
    as the bench's fp32 process loads it (lite, fp32 target), 2 of 8 engines in a row had a layer whose MLP
    norm read its attention norm, and the logits moved by up to 2.9. Whether a clone lands on a freed
    address depends on the process's heap: under the old rule this test failed in 2 of 4 runs (and in 2
    of 3 with 12 engines), never under the new one."""
    from selfspec_cli.loading import load_model

    for _ in range(24):
        model, _tok = load_model("pystdlib", dtype="float32", device="cpu", log=None, lite=True)
        eng = Engine(model, target_precision="fp32")
        want = [(w.attn_norm.clone(), w.mlp_norm.clone()) for w in eng.adapter.layers]
        eng.release_float_weights(panels=True)
        for l, (w, layer) in enumerate(zip(eng.adapter.layers, model.model.layers)):
            assert torch.equal(w.attn_norm, layer.input_layernorm.weight), l
            assert torch.equal(w.mlp_norm, layer.post_attention_layernorm.weight), l
            assert torch.equal(w.attn_norm, want[l][0]) and torch.equal(w.mlp_norm, want[l][1]), l
