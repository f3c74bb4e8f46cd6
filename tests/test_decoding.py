"""Plain decoding (`ar`), token selection and the shared stopping bookkeeping."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from selfspec_cli.config import GenerationConfig, SamplingConfig
from selfspec_cli.decoding.output import TokenSink
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ConfigError
from selfspec_cli.methods import AR, METHODS, Method

from .conftest import ARCHS, VOCAB, make_tiny_model


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def _hf_greedy(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=eos, pad_token_id=1)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ar_greedy_equals_hf_generate(arch):
    model = make_tiny_model(arch)
    ar = AR(Engine(model))
    for seed, (plen, n) in enumerate([(5, 40), (17, 25), (1, 30)]):
        prompt = _prompt(plen, seed)
        got = ar.generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids
        assert got == _hf_greedy(model, prompt, n, eos=None)
        assert len(got) == n


def test_ar_stops_at_eos_like_hf():
    model = make_tiny_model("llama-gqa")
    ar = AR(Engine(model))
    # choose as "EOS" a token that greedy decoding actually produces mid-way
    prompt = _prompt(6, 42)
    free = ar.generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids
    eos = free[7]
    res = ar.generate(prompt, GenerationConfig(max_new_tokens=30, eos_token_ids=(eos,)))
    assert res.finish_reason == "eos"
    assert res.token_ids == free[: free.index(eos) + 1]
    assert res.token_ids == _hf_greedy(model, prompt, 30, eos=eos)
    assert res.stats.target_forwards == len(res.token_ids) == sum(res.stats.accept_lengths)


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_exact(n):
    ar = AR(Engine(make_tiny_model("qwen3-qknorm")))
    res = ar.generate(_prompt(4, 0), GenerationConfig(max_new_tokens=n))
    assert len(res.token_ids) == n and res.finish_reason == "length"


def test_processed_probs_match_hf_warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    logits[0, :5] = 2.0  # ties at the top-k boundary
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9), (1.0, 3, 0.5)]:
        procs = LogitsProcessorList([TemperatureLogitsWarper(t)]
                                    + ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else []))
        want = procs(torch.zeros(4, 1, dtype=torch.long), logits.clone()).softmax(-1)
        got = processed_probs(logits, SamplingConfig(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got, want)


def test_seeded_sampling_reproducible_and_seed_sensitive():
    ar = AR(Engine(make_tiny_model("llama-gqa")))
    prompt = _prompt(5, 1)

    def run(seed):
        return ar.generate(prompt, GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(0.9, 0, 0.95, seed))).token_ids

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(5)}) > 1


def first_tokens(method, prompt, sampling: SamplingConfig, n_samples: int, n_new: int = 1) -> list[tuple[int, ...]]:
    out = []
    for s in range(n_samples):
        cfg = GenerationConfig(max_new_tokens=n_new, sampling=SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, s))
        out.append(tuple(method.generate(prompt, cfg).token_ids))
    return out


def distribution_test(samples: list[int], probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of ``samples`` to ``probs``; low-mass tokens are pooled
    into one bin so every bin expects at least ``min_expected`` counts. Returns the p-value."""
    n = len(samples)
    if any(probs[t] <= 0 for t in set(samples)):
        return 0.0  # a token the target can never produce was sampled
    order = np.argsort(-probs)
    big = [i for i in order if probs[i] * n >= min_expected]
    counts = np.bincount(np.asarray(samples), minlength=len(probs))
    obs = [counts[i] for i in big] + [n - sum(counts[i] for i in big)]
    exp = [probs[i] * n for i in big] + [n * (1 - sum(probs[i] for i in big))]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, np.asarray(exp) * sum(obs) / sum(exp)).pvalue)


# False-positive rate of each distribution test below: ALPHA = 1e-3 (the chance that a
# correct sampler fails). The broken-sampler control shows the test has power.
ALPHA = 1e-3


def test_ar_sampling_follows_target_distribution():
    model = make_tiny_model("llama-gqa")
    eng = Engine(model)
    ar = AR(eng)
    prompt = _prompt(6, 3)
    sampling = SamplingConfig(temperature=1.5, top_k=0, top_p=0.95)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    probs = processed_probs(logits, sampling).double().numpy()
    samples = [s[0] for s in first_tokens(ar, prompt, sampling, 3000)]
    assert distribution_test(samples, probs) > ALPHA


def test_distribution_test_rejects_a_broken_sampler():
    """Control: a sampler that ignores top-p (a typical speculative-sampling bug: bonus
    token drawn from unprocessed logits) must be caught by the same test."""
    model = make_tiny_model("llama-gqa")
    prompt = _prompt(6, 3)
    sampling = SamplingConfig(temperature=1.5, top_k=0, top_p=0.8)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    target = processed_probs(logits, sampling).double().numpy()
    wrong = processed_probs(logits, SamplingConfig(temperature=1.5)).double()
    g = torch.Generator().manual_seed(0)
    samples = torch.multinomial(wrong, 3000, replacement=True, generator=g).tolist()
    assert distribution_test(samples, target) < ALPHA


def test_token_sink_truncates_bursts():
    sink = TokenSink(GenerationConfig(max_new_tokens=5, eos_token_ids=(9,)))
    assert sink.push([1, 2]) == 2 and not sink.done
    assert sink.push([3, 9, 4, 5]) == 2 and sink.finish_reason == "eos"
    assert sink.tokens == [1, 2, 3, 9]
    sink = TokenSink(GenerationConfig(max_new_tokens=3))
    assert sink.push([1, 2, 3, 4]) == 3 and sink.finish_reason == "length"
    # ignore_eos: the EOS id is an ordinary token; only the length limit ends generation
    sink = TokenSink(GenerationConfig(max_new_tokens=5, eos_token_ids=(9,), ignore_eos=True))
    assert sink.push([9, 9]) == 2 and not sink.done and sink.finish_reason is None
    assert sink.push([9, 1, 9, 9]) == 3 and sink.finish_reason == "length"
    assert sink.tokens == [9, 9, 9, 1, 9]
    assert sink.push([9]) == 0 and sink.tokens == [9, 9, 9, 1, 9]


def test_token_sink_stop_string(tiny_tokenizer):
    ids = tiny_tokenizer("def main():\n    return value\n", add_special_tokens=False)["input_ids"]
    sink = TokenSink(GenerationConfig(max_new_tokens=100, stop_strings=("return",)), tiny_tokenizer)
    sink.push(ids)
    text = tiny_tokenizer.decode(sink.tokens)
    assert sink.finish_reason == "stop_string" and "return" in text
    assert "return" not in tiny_tokenizer.decode(sink.tokens[:-1])


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.2), dict(top_k=-1)])
def test_sampling_config_validation(kwargs):
    with pytest.raises(ConfigError):
        SamplingConfig(**kwargs)


def test_registry_holds_every_method_class_under_its_documented_name():
    """METHODS is built as {m.name: m}, so it cannot list a class under another class's name, but a
    name clash would silently drop a class. Checked independently: the Method subclasses found by
    walking selfspec_cli.methods are exactly the registered ones (private helpers such as the on-policy
    data recorder aside), each under the name of its file or package (self_sd/ -> self-sd), and the names are the CLI's documented --method values (README)."""
    import importlib
    import inspect
    import pkgutil

    import selfspec_cli.methods as pkg

    documented = {"ar", "pld", "auto", "specqd", "self-sd", "swift", "asd", "adadecode", "specee"}
    assert set(METHODS) == documented
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, Method) and "name" in vars(cls) and cls.__module__ == module.__name__
                    and cls.__name__[0] != "_"):  # a named method (not a base: Method, LayerSkipMethod, ...)
                found[cls] = info.name
    assert set(found) == set(METHODS.values()), (found, METHODS)
    for key, cls in METHODS.items():
        assert found[cls] == key.replace("-", "_") and cls.name == key


@pytest.mark.parametrize("arch", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_chunked_prefill_gives_the_bits_of_one_forward(monkeypatch, arch, precision):
    """A prompt longer than PREFILL_CHUNK prefills in chunks (DecodeState.prefill): the same logits and
    KV cache bits as one forward, on the loaded weights and on a kernel target, with a sliding window
    shorter than the prompt too; and the chunks did run (the forward count says so)."""
    from selfspec_cli.decoding import state as st

    model = make_tiny_model(arch)
    if precision is not None and not Engine(model).kernel_info.get("backend", "").startswith("small_gemm"):
        pytest.skip("no CPU kernel on this host (SELFSPEC_KERNELS=0 or no AVX2): only the loaded weights run")
    engine = Engine(model, target_precision=precision)
    prompt = torch.randint(2, VOCAB, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    sampling = SamplingConfig()

    def prefill(chunk: int):
        monkeypatch.setattr(st, "PREFILL_CHUNK", chunk)
        s = st.DecodeState(engine, prompt, max_new_tokens=4, lookahead=1, sampling=sampling, generator=None)
        calls = []
        real = engine.forward
        monkeypatch.setattr(engine, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        with torch.inference_mode():
            out = s.prefill()
        monkeypatch.setattr(engine, "forward", real)
        return out.logits.clone(), s.cache.k.clone(), s.cache.v.clone(), len(calls)

    one = prefill(512)
    assert one[3] == 1
    for chunk in (16, 7, 44, 45):
        got = prefill(chunk)
        assert got[3] == -(-len(prompt) // chunk)
        for a, b in zip(one[:3], got[:3]):
            assert torch.equal(a, b), chunk
