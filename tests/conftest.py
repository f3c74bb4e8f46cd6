"""Shared fixtures: tiny real transformers models of each supported architecture,
a tiny byte-level BPE tokenizer trained in-process, and saved model directories."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "2")))

from selfspec_cli.loading import CODE_MODEL_DIR  # noqa: E402
from selfspec_cli.engine import kernels as _kernels  # noqa: E402
from selfspec_cli.paths import cache_root  # noqa: E402

# build or load the CPU kernel once, from the real cache, before any test moves SELFSPEC_HOME
_kernels.load_extension()
# the caches keyed by content that tests have always shared from the real cache: the compiled
# kernel, converted GGUF models and quantized drafts (a test that checks a cache sets its own)
SHARED_CACHES = {sub: cache_root() / sub for sub in ("kernels", "models", "drafts")}

VOCAB = 320


@pytest.fixture(autouse=True)
def selfspec_home(tmp_path_factory, monkeypatch) -> Path:
    """Every test writes user artifacts and caches under a fresh temporary SELFSPEC_HOME,
    never into ~ or the source tree; its cache (<home>/cache) links the real cache's
    kernels/, models/ and drafts/ (SHARED_CACHES), so neither this process nor the ones a test
    starts rebuild them; the on-policy data stays per test."""
    home = tmp_path_factory.mktemp("selfspec-home")
    for sub, real in SHARED_CACHES.items():
        real.mkdir(parents=True, exist_ok=True)
        (home / "cache").mkdir(exist_ok=True)
        (home / "cache" / sub).symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("SELFSPEC_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def fresh_bandwidth_reading(monkeypatch) -> None:
    """Each test reads the bandwidth anew (a process keeps its first reading per thread count:
    bench/engine_profile.py's bandwidth_gbs), so that a test's clock or machine is the one it reads."""
    from selfspec_cli.bench import engine_profile

    monkeypatch.setattr(engine_profile, "_BANDWIDTH", {})

# name -> (config class name, model class name, config overrides)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "llama-tied-rope3": ("LlamaConfig", "LlamaForCausalLM", {
        "num_key_value_heads": 4, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 12}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False}),
    # Gemma 3: sliding layers (window 6, shorter than the tests' prompts) every other layer between full ones,
    # two rotary tables (the global one scaled), query_pre_attn_scalar != head_dim, GeGLU, (1 + w) norms
    "gemma3-window": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}}),
    # Phi-3: q/k/v and gate/up each one fused product (engine/adapter.py FAMILIES), a window on every layer
    "phi3-fused": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "sliding_window": 10,
                                                     "tie_word_embeddings": False}),
}


def make_tiny_model(arch: str = "llama-gqa", seed: int = 0, vocab: int = VOCAB, layers: int = 4, **overrides):
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    kwargs.update(extra)
    kwargs.update(overrides)
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    # random init is nearly uniform; sharpen so greedy decoding has structure and sampling is non-trivial
    with torch.no_grad():
        if cfg.model_type == "gemma3_text":  # its norms start at w = 0 (weight 1 + w): make each one differ;
            for name, p in model.named_parameters():  # the post-sublayer norms small, so that the residual
                if "norm" in name:  # stream changes gradually (early exits and skipped layers can agree)
                    p.normal_(-0.8 if ".post_" in name else 0.0, 0.1 if ".post_" in name else 0.3)
            model.model.embed_tokens.weight.mul_(4.0)  # (scaled by sqrt(hidden) = 8 in the forward: the norms undo it)
        elif cfg.tie_word_embeddings:
            model.model.embed_tokens.weight.mul_(4.0)
        else:
            model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # a fixed corpus (a snapshot of selfspec_cli/runtime.py): tests that pick stop strings from the
    # output depend on this tokenizer, so it must not change when the library's source does
    text = (Path(__file__).parent / "data" / "tokenizer_corpus.py.txt").read_text() * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    assert fast.eos_token_id == 1 and len(fast) <= VOCAB
    return fast


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama + tokenizer: a real Hugging Face model directory."""
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama-gqa").save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


shipped_model_available = (CODE_MODEL_DIR / "config.json").is_file()
needs_shipped_model = pytest.mark.skipif(not shipped_model_available, reason="shipped model not present")


# ---------------------------------------------------------------- a machine with known costs


class VirtualClock:
    """A deterministic clock for code that times itself. In the modules it is installed in
    (``virtual_clock``), ``time.perf_counter()`` reads ``now``, which moves only by
    :meth:`advance` (the test's charges for the work it cares about) and by ``tick`` per read;
    every other ``time`` function is the real one. The work itself still runs for real: only
    what the code *measures* is known in advance, so figures derived from timings can be
    checked against values computed by hand."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now = 0.0
        self.tick = tick

    def perf_counter(self) -> float:
        t = self.now
        self.now += self.tick
        return t

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


@pytest.fixture
def virtual_clock(monkeypatch) -> VirtualClock:
    """A :class:`VirtualClock` as ``time`` of every module that times decoding: decoding/measure.py
    (``timed``: run_prompt's wall times, the profile's and the verify curve's readings), the
    driver (rounds, prefill) and the layer-skip proposer (its draft step)."""
    from selfspec_cli.decoding import driver, layer_skip, measure

    clock = VirtualClock()
    for mod in (measure, driver, layer_skip):
        monkeypatch.setattr(mod, "time", clock)
    return clock


def charge_forwards(monkeypatch, clock: VirtualClock, cost, head_cost=None) -> None:
    """Every ``Engine.forward`` advances ``clock`` by ``cost(engine, rows, kwargs)`` seconds and
    then runs for real (``head_cost``: also every ``Engine.final_logits``, by that many seconds)."""
    from selfspec_cli.engine import Engine

    forward = Engine.forward

    def charged(self, cache, input_ids=None, **kw):
        rows = input_ids.shape[0] if input_ids is not None else kw["hidden"].shape[0]
        clock.advance(cost(self, rows, kw))
        return forward(self, cache, input_ids, **kw)

    monkeypatch.setattr(Engine, "forward", charged)
    if head_cost is not None:
        final_logits = Engine.final_logits

        def charged_head(self, *args, **kw):
            clock.advance(head_cost)
            return final_logits(self, *args, **kw)

        monkeypatch.setattr(Engine, "final_logits", charged_head)
