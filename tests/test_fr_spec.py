"""FR-Spec's draft vocabulary (methods/fr_spec/: the vocabulary and its calibration): the subset head,
exact sampling with restricted drafts, the artifact and its calibration. (Greedy parity with a
draft vocabulary on every tiny architecture is in test_speculative.py; the verification rule
with a restricted law is enumerated exactly in test_verify_exact.py.)"""
from __future__ import annotations

import inspect

import pytest
import torch

from selfspec_cli.artifacts import save_tensors_artifact
from selfspec_cli.methods.self_sd import SkipSet
from selfspec_cli.methods.fr_spec.calibrate import artifact_tensors, calibrate_draft_vocab, held_out_coverage
from selfspec_cli.config import GenerationConfig
from selfspec_cli.decoding.drafts import Chain, Tree
from selfspec_cli.decoding.layer_skip import DraftModel, DraftSettings, LayerSkipDrafter
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ArtifactError, FieldError
from selfspec_cli.loading import model_fingerprint
from selfspec_cli.methods import AR, build, fr_spec
from selfspec_cli.methods.base import DraftInputs
from selfspec_cli.methods.self_sd import SelfSD

from .conftest import VOCAB, make_tiny_model
from .test_decoding import ALPHA, distribution_test
from .test_speculative import SMALL_VOCAB, _pair_samples, _prompt, small_vocab_setup  # noqa: F401 (fixture)


def _subset(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n]


def test_subset_head_columns_are_the_full_heads():
    eng = Engine(make_tiny_model("llama-gqa"))
    ids = _subset(VOCAB, 37)
    x = torch.randn(3, eng.adapter.hidden_size)
    full, sub = eng.final_logits(x), eng.final_logits(x, eng.subset_head(ids))
    assert sub.shape == (3, 37)
    if eng.kernel_info["backend"] == "small_gemm":  # one FMA chain per output: bit for bit
        assert torch.equal(sub, full[:, ids])
    else:
        assert torch.allclose(sub, full[:, ids], atol=1e-5)


def test_a_subset_head_is_built_once_per_vocabulary():
    """Every drafter over the same vocabulary shares one head (auto's sources built six copies of a 41 MB head on
    Qwen2.5-Coder-1.5B); other ids, another order, or share=False build their own."""
    eng = Engine(make_tiny_model("llama-gqa"))
    ids = _subset(VOCAB, 37)
    first = eng.subset_head(ids)
    assert eng.subset_head(ids.clone()) is first
    assert eng.subset_head(ids.flip(0)) is not first
    assert eng.subset_head(_subset(VOCAB, 37, seed=5)) is not first
    assert eng.subset_head(ids, share=False) is not first
    x = torch.randn(2, eng.adapter.hidden_size)
    assert torch.equal(eng.final_logits(x, eng.subset_head(ids.flip(0))), eng.final_logits(x, first).flip(1))


def test_drafts_come_only_from_the_draft_vocabulary(monkeypatch):
    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    ids = _subset(VOCAB, 20, seed=3)
    settings = DraftSettings(cost_aware=False, max_draft=6, threshold=0.0)
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=settings, inputs=DraftInputs(vocab=ids))
    seen: list[int] = []
    real = LayerSkipDrafter.draft

    def spy(self, state, budget):
        d = real(self, state, budget)
        seen.extend(d.tokens if isinstance(d, (Chain, Tree)) else [])
        return d

    monkeypatch.setattr(LayerSkipDrafter, "draft", spy)
    sd.generate(_prompt(6, 0), GenerationConfig(max_new_tokens=30))
    assert seen and set(seen) <= set(ids.tolist())
    assert sd.describe().draft_vocab == 20
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=settings)  # the whole vocabulary
    assert sd.configuration.vocab_ids is None and sd.describe().draft_vocab == "full"


# False-positive rate per test: ALPHA = 1e-3.
def _restricted(model) -> SelfSD:
    return SelfSD(Engine(model), skip=SkipSet([1, 2], [2]), draft=DraftSettings(cost_aware=False, max_draft=4, threshold=0.0),
                  inputs=DraftInputs(vocab=_subset(SMALL_VOCAB, SMALL_VOCAB // 2, seed=5)))


@pytest.mark.slow  # 2,500 decodes; fast: the law handed to the verifier, and test_verify_exact
def test_sampling_with_a_draft_vocabulary_is_exact(small_vocab_setup):
    model, prompt, law = small_vocab_setup
    samples = _pair_samples(_restricted(model), prompt, 2500)
    assert distribution_test(samples, law) > ALPHA


@pytest.mark.slow  # 2,500 decodes; fast: the law handed to the verifier, and test_verify_exact
def test_sampling_test_catches_a_misplaced_restricted_law(small_vocab_setup, monkeypatch):
    """Control: the subset's probabilities written at columns 0..N-1 instead of at their
    token ids (an indexing bug) must fail the same test."""
    model, prompt, law = small_vocab_setup
    monkeypatch.setattr(LayerSkipDrafter, "_full_law",
                        lambda self, p: torch.cat([p, p.new_zeros(self.engine.vocab_size - p.numel())]))
    samples = _pair_samples(_restricted(model), prompt, 2500)
    assert distribution_test(samples, law) < ALPHA


def test_sampled_drafts_hand_the_verifier_their_law_at_the_subset_token_ids(small_vocab_setup, monkeypatch):
    """The cheap check behind the chi-square pair above (marked slow; the rule itself, given the
    restricted law, is enumerated exactly in test_verify_exact.py): every law a sampled draft hands
    the verifier is a distribution over the draft vocabulary's token ids only, and gives the drafted
    token positive mass. The misplaced law of the control (columns 0..N-1) fails it."""
    from selfspec_cli.config import SamplingConfig
    from selfspec_cli.decoding import driver

    model, prompt, _ = small_vocab_setup
    sd = _restricted(model)
    subset = torch.zeros(SMALL_VOCAB, dtype=torch.bool)
    subset[sd.configuration.vocab_ids] = True
    assert not subset[: subset.sum()].all()  # not the first N ids: a misplaced law would show
    laws = []
    real = driver.verify_chain_sampling

    def spy(draft_tokens, q, target_logits, cfg, gen):
        laws.append((list(draft_tokens), q.clone()))
        return real(draft_tokens, q, target_logits, cfg, gen)

    monkeypatch.setattr(driver, "verify_chain_sampling", spy)
    for seed in range(8):
        sd.generate(prompt, GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0, 25, 0.95, seed, "speculative")))
    assert sum(len(d) for d, _ in laws) >= 20
    for draft, q in laws:
        assert q.shape == (len(draft), SMALL_VOCAB)
        assert torch.allclose(q.sum(-1), torch.ones(len(draft)), atol=1e-5)
        assert (q[:, ~subset] == 0).all() and all(q[i, d] > 0 and subset[d] for i, d in enumerate(draft))


def test_ranking_and_coverage():
    counts = torch.tensor([0, 5, 2, 5, 0, 1])
    ranked = fr_spec.rank_vocabulary(counts)
    assert ranked.tolist() == [1, 3, 2, 5, 0, 4]  # by count, ties (and unseen tokens) in id order
    assert fr_spec.coverage(ranked, counts, 2) == 10 / 13
    prior = torch.tensor([0.1, 0.0, 0.0, 0.9, 0.3, 0.0])  # ties by the expected counts, then by id
    assert fr_spec.rank_vocabulary(counts, prior).tolist() == [3, 1, 2, 5, 4, 0]
    outs = [[1, 1, 2], [1, 3], [3, 3, 2], [1]]
    # fold A = prompts 0, 2 (top-1: token 1, tied with 2 and 3 at two, lowest id) covers 2 of fold B's
    # 3 tokens; fold B = prompts 1, 3 (top-1: token 1) covers 2 of fold A's 6
    one, full = held_out_coverage(outs, 6, [1, 6])
    assert one == pytest.approx((2 / 3 + 2 / 6) / 2)
    assert full == 1.0


def test_calibrated_artifact_round_trip(tmp_path):
    model = make_tiny_model("llama-gqa", layers=6)
    eng = Engine(model)
    prompts = [_prompt(6, s) for s in range(4)]
    res = calibrate_draft_vocab(eng, None, prompts, GenerationConfig(max_new_tokens=12))
    assert sorted(res.ranked_ids.tolist()) == list(range(VOCAB)) and res.tokens == 4 * 12
    assert res.n in [r["n"] for r in res.candidates] and res.candidates[-1]["n"] == VOCAB
    assert res.candidates[-1]["held_out_coverage"] == 1.0
    path = tmp_path / "vocab"
    tensors = artifact_tensors(res)  # the format `selfspec calibrate --method fr-spec` writes
    assert torch.equal(tensors["counts"].sum(), torch.tensor(4 * 12, dtype=torch.int32))
    assert torch.equal(res.counts[tensors["counted_ids"].long()], tensors["counts"].long())
    save_tensors_artifact(path, tensors,
                          {"kind": fr_spec.VOCAB.kind, "model_fingerprint": model_fingerprint(model),
                           **res.summary()})
    vocab = fr_spec.resolve(str(path), model, size=50)
    assert vocab.n == 50 and torch.equal(vocab.ids, res.ranked_ids[:50])
    m = build("self-sd", eng, None, skip_attn=(1, 3), skip_mlp=(2, 4), draft_vocab=str(path), draft_vocab_size=50)
    assert m.describe().draft_vocab == 50
    cfg = GenerationConfig(max_new_tokens=20)
    assert m.generate(prompts[0], cfg).token_ids == AR(eng).generate(prompts[0], cfg).token_ids
    with pytest.raises(FieldError):
        fr_spec.resolve(str(path), model, size=VOCAB + 1)
    with pytest.raises(ArtifactError):  # another model's artifact
        fr_spec.resolve(str(path), make_tiny_model("llama-gqa", seed=1, layers=6))
    assert fr_spec.resolve("full", model) is None


def test_the_cost_of_a_draft_counts_its_vocabulary(monkeypatch):
    """A draft that scores only the draft vocabulary reads only those rows of the LM head: the
    prior for c (bytes) counts them, the layer-skip drafter plans with that c, the cost store keeps
    it apart, and Self-SD's search decodes with the vocabulary the method drafts with and scores
    its trials with the same c (on Gemma 3 the head is over half a step: a search over the whole
    vocabulary found nothing that pays)."""
    from selfspec_cli.decoding.cost_store import draft_variant
    from selfspec_cli.decoding.measure import prior_draft_cost, weight_bytes
    from selfspec_cli.engine.kernels import stream_bytes
    from selfspec_cli.methods.self_sd import measure as sd_measure

    eng = Engine(make_tiny_model("llama-gqa", layers=6))
    ids = _subset(VOCAB, 20, seed=3)
    attn, mlp = frozenset({1, 3}), frozenset({2, 4})
    full, sub = prior_draft_cost(eng, attn, mlp), prior_draft_cost(eng, attn, mlp, vocab_rows=20)
    saved = stream_bytes(eng.lm_head) * (1 - 20 / VOCAB) / weight_bytes(eng)
    assert sub < full and sub == pytest.approx(full - saved, rel=1e-3)
    assert prior_draft_cost(eng, vocab_rows=VOCAB) == pytest.approx(1.0)
    sd = SelfSD(eng, skip=SkipSet([1, 3], [2, 4]), draft=DraftSettings(max_draft=4), inputs=DraftInputs(vocab=ids))
    assert sd.configuration.policy.draft_cost() == pytest.approx(sub)
    assert draft_variant("int8", attn, mlp, 20) != draft_variant("int8", attn, mlp)

    monkeypatch.setattr(fr_spec, "draft_vocab", lambda engine, weights, spec="auto", size=None: ids)
    vocabs = sd_measure.draft_vocabs(eng, ["target"])
    assert torch.equal(vocabs["target"], ids)
    assert sd_measure.full_depth_costs(eng, ["target"], vocabs)["target"] == pytest.approx(
        prior_draft_cost(eng, vocab_rows=20), abs=1e-4)
    assert sd_measure.draft_cost_from_bytes(eng, attn, mlp, None, ids) == pytest.approx(sub)
    made: list = []
    real = DraftModel.build.__func__

    def spy(cls, *args, **kw):
        made.append(inspect.signature(real).bind(cls, *args, **kw).arguments.get("vocab"))
        return real(cls, *args, **kw)

    monkeypatch.setattr(DraftModel, "build", classmethod(spy))
    sd_measure.measure_self_sd(eng, None, [_prompt(6, 0)], GenerationConfig(max_new_tokens=8), attn, mlp,
                               vocab=vocabs["target"])
    assert made and all(v is not None and torch.equal(v, ids) for v in made)


def test_a_vocabulary_from_too_little_data_never_becomes_the_default(capsys, tiny_model_dir, tmp_path, selfspec_home):
    """Issue 50: `calibrate --method fr-spec --num-prompts 2 -n 8` (16 tokens counted) wrote the default vocabulary,
    which auto then used. Now it goes beside the default as .too-little-data (one warning); --force makes it the
    default on purpose; enough tokens (MIN_TOKENS) make the default as before. Real calibrations of a tiny model."""
    import json
    from pathlib import Path

    from selfspec_cli.cli.app import main
    from selfspec_cli.methods.fr_spec.calibrate import MIN_TOKENS

    from .test_cli import write_lines

    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i} says" for i in range(8)])
    base = ["calibrate", "--method", "fr-spec", "-m", str(tiny_model_dir), "-p", str(prompts), "--device", "cpu"]

    def run(*extra: str) -> tuple[dict, str]:
        capsys.readouterr()
        rc = main([*base, *extra])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out.strip().splitlines()[-1]), err

    thin, err = run("--num-prompts", "2", "-n", "8")
    art = Path(thin["artifact"])
    default = art.with_name(art.name.removesuffix(".too-little-data"))
    assert thin["tokens_counted"] < MIN_TOKENS and thin["too_little_data"] is True
    assert art.name.endswith(".too-little-data") and (art / "manifest.json").is_file()
    assert not default.exists()  # what generate would load is untouched
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "not made this model's default" in warnings[0] and "--force" in warnings[0]
    again, _ = run("--num-prompts", "2", "-n", "8")  # the same command replaces its own set-aside result
    assert again["artifact"] == str(art)
    forced, err = run("--num-prompts", "2", "-n", "8", "--force")
    assert forced["artifact"] == str(default) and (default / "manifest.json").is_file()
    assert "made this model's default because of --force" in err
    enough, err = run("--num-prompts", "8", "-n", str(-(-MIN_TOKENS // 8)), "--force")
    assert enough["tokens_counted"] >= MIN_TOKENS and enough["too_little_data"] is False
    assert enough["artifact"] == str(default) and "warning:" not in err
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    assert f"fewer than {MIN_TOKENS} tokens counted" in readme  # the one place the rule is stated, with this figure


def test_a_stored_head_of_the_ranking_is_completed_in_token_id_order():
    """An artifact stores the first max(65536, 2n) ranked ids; the loader completes the ranking with every other id
    in token-id order, and refuses a stored head that repeats an id or names one outside the vocabulary."""
    from selfspec_cli.methods.fr_spec import RANKS_KEPT, complete_ranking, stored_ranks

    assert stored_ranks(49152, 8192) == 49152 and stored_ranks(262144, 16384) == RANKS_KEPT
    assert stored_ranks(151936, 40000) == 80000
    whole = complete_ranking(torch.tensor([7, 2, 9], dtype=torch.int32), 10)
    assert whole.tolist() == [7, 2, 9, 0, 1, 3, 4, 5, 6, 8] and whole.dtype == torch.int64
    assert complete_ranking(torch.tensor([3, 3]), 10) is None
    assert complete_ranking(torch.tensor([3, 10]), 10) is None and complete_ranking(torch.tensor([-1]), 10) is None
    full = torch.randperm(10)
    assert torch.equal(complete_ranking(full, 10), full)  # a whole ranking (older artifacts) is read as it is


@pytest.mark.parametrize("chunk", [64, 128])
def test_a_quantized_heads_subset_is_read_by_chunks_of_rows(chunk):
    """quant.subset unpacks the head a chunk of super-panels at a time (the whole of a 151,936-row head held
    2.7 GB): the subset it packs holds the same codes, scales and minimums, in ``ids``' order, as one unpack."""
    from selfspec_cli.engine.kernels import QLinear
    from selfspec_cli.engine.quant import subset

    eng = Engine(make_tiny_model("llama-gqa"))
    head = eng.quantized("int8-g32").head
    ids = torch.tensor([200, 3, 64, 255, 127, 128, 0, 191])
    got = subset(head, ids, eng._module, chunk=chunk)
    want = QLinear.make(head.quant.take_rows(ids), None, eng._module)
    for part in ("codes", "scales", "mins"):
        a, b = getattr(got, part), getattr(want, part)
        assert (a is None and b is None) or torch.equal(a, b), part
