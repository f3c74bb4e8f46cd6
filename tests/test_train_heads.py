"""``selfspec train-heads`` (both kinds), ``selfspec calibrate --method specee`` and
``generate --method adadecode/specee`` end to end on the saved tiny Llama: real
datasets loading, real safetensors artifacts with manifests, fingerprint refusal."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from selfspec_cli import loading
from selfspec_cli.engine import Engine
from selfspec_cli.errors import ArtifactError
from selfspec_cli.artifacts import save_layers
from selfspec_cli.methods.adadecode import HEADS, load_heads
from selfspec_cli.methods.specee import load_exit_mlps
from selfspec_cli.methods.onpolicy import collect_on_policy
from selfspec_cli.methods.adadecode.heads import LowRankHead, head_logits, init_head
from selfspec_cli.methods.adadecode.train import HeadTrainConfig, default_head_layers, train_lm_heads

from .conftest import make_tiny_model
from .test_calibrate import run_cli


@pytest.fixture()
def artifacts_dir(tmp_path, monkeypatch):
    d = tmp_path / "artifacts"
    monkeypatch.setattr(loading, "ARTIFACTS_DIR", d)
    return d


def _ok(argv):
    rc, out, err = run_cli(argv)
    assert rc == 0, err
    return out, err


def test_default_head_layers():
    assert default_head_layers(12) == (2, 5, 8)
    assert default_head_layers(32) == (7, 15, 23)
    assert default_head_layers(4) == (0, 1, 2)


def test_logit_lens_initialisation_is_exact():
    model = make_tiny_model("llama-gqa")
    eng = Engine(model)
    h = torch.randn(5, 64)
    head = init_head(eng.adapter.final_norm, 8, torch.Generator().manual_seed(0))
    torch.testing.assert_close(head_logits(h, head, eng.adapter.lm_head, eng.adapter.rms_eps), eng.final_logits(h))


def test_training_lowers_kl_and_data_is_cached(tmp_path):
    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    prompts = [torch.randint(2, 300, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(6)]
    data = collect_on_policy(eng, prompts, 24, "fp", cache_dir=tmp_path)
    assert data.hidden.shape == (6 * 24, 4, 64) and len(list(tmp_path.glob("*.safetensors"))) == 1
    again = collect_on_policy(eng, prompts, 24, "fp", cache_dir=tmp_path)
    assert torch.equal(again.hidden, data.hidden)
    # the last layer's row reproduces the target token (the data is the model's own greedy output)
    assert torch.equal(eng.final_logits(data.hidden[:, 3]).argmax(-1), data.target)
    heads, reports = train_lm_heads(eng, data, HeadTrainConfig(layers=(1,), rank=8, epochs=15, lr=1e-2))
    r = reports[0]
    assert r.kl_after < r.kl_before
    assert set(r.precision_coverage) == {"0.5", "0.75", "0.9", "0.95"}


def test_cli_train_calibrate_generate(tiny_model_dir, tmp_path, artifacts_dir):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                               ["def run(x):", "import os", "class A:", "for i in range(3):", "return x", "x = [1, 2"]))
    common = ["--model", str(tiny_model_dir), "--device", "cpu", "--dataset", str(prompts), "--dataset-field", "text",
              "--max-new-tokens", "10", "--cache-dir", str(tmp_path / "cache")]
    rc, out, err = run_cli(["train-heads", "--kind", "exit-mlp", *common])
    assert rc == 2 and "selfspec train-heads --kind lm-heads" in err and len(err.strip().splitlines()) == 1
    for lr in ("0", "-1e-3"):  # a learning rate of 0 once fell back to the default silently
        rc, out, err = run_cli(["train-heads", "--kind", "lm-heads", *common, "--lr", lr])
        assert rc == 2 and "--lr must be > 0" in err and len(err.strip().splitlines()) == 1
    for bad, said in ((["--rank", "100000"], "above the model's width"), (["--layers", ""], "names no layer")):
        rc, out, err = run_cli(["train-heads", "--kind", "lm-heads", *common, *bad])
        assert rc == 2 and said in err and len(err.strip().splitlines()) == 1, err
    out, _ = _ok(["train-heads", "--kind", "lm-heads", *common, "--rank", "4", "--epochs", "2"])
    summary = json.loads(out)
    assert summary["layers"] == [0, 1, 2] and len(summary["report"]) == 3
    heads_dir = Path(summary["artifact"])  # the user's data directory, named with the model fingerprint
    assert heads_dir.parent == Path(os.environ["SELFSPEC_HOME"]) / "artifacts" / "adadecode"
    assert heads_dir.name.startswith(f"{tiny_model_dir.name}-") and len(heads_dir.name) == len(tiny_model_dir.name) + 17
    assert not artifacts_dir.exists()  # nothing written into the shipped tree
    manifest = json.loads((heads_dir / "manifest.json").read_text())
    assert manifest["kind"] == "adadecode-heads" and manifest["model_fingerprint"] and manifest["rank"] == 4
    # this random model's predictors meet no threshold's precision bound, so they are written to the default path
    # only when named (tests/test_cli_findings.py has the .unusable path), with the warning; threshold 0 below exits
    exit_dir = heads_dir.parent.parent / "specee" / heads_dir.name
    out, err = _ok(["train-heads", "--kind", "exit-mlp", *common, "--epochs", "3", "-o", str(exit_dir)])
    assert json.loads(out)["drafter_layer"] == 0 and json.loads(out)["usable"] is False and "of no use" in err

    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("def main():\nimport sys\n")
    gen = ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "-p", str(prompt_file), "-n", "12"]
    rc, out, err = run_cli([*gen, "--method", "specee"])
    assert rc == 2 and "selfspec calibrate --method specee" in err
    # no token exits at the predictors' thresholds: too little data for a default schedule (README, "Artifacts"),
    # made the default here on purpose (--force), for the threshold-0 runs below
    out, err = _ok(["calibrate", "--method", "specee", "--model", str(tiny_model_dir), "--device", "cpu",
                    "--prompt-file", str(prompt_file), "--max-new-tokens", "8", "--force"])
    sched = json.loads(out)
    assert sched["selected_layers"] and set(sched["selected_layers"]) <= {0, 1, 2}
    assert sched["too_little_data"] is True and "because of --force" in err

    ar = [json.loads(l) for l in _ok([*gen, "--method", "ar"])[0].splitlines()]
    ada = [json.loads(l) for l in _ok([*gen, "--method", "adadecode", "--adadecode-threshold", "0.0"])[0].splitlines()]
    assert [r["token_ids"] for r in ada] == [r["token_ids"] for r in ar] and all(r["lossless"] for r in ada)
    for mode in ("empty", "deferred"):
        # threshold 0: every scheduled predictor fires, so tokens exit early and the output can leave ar's
        recs = [json.loads(l) for l in _ok([*gen, "--method", "specee", "--specee-kv-mode", mode, "--specee-eval",
                                            "--specee-threshold", "0"])[0].splitlines()]
        assert all(r["lossless"] is False and r["stats"]["kv_mode"] == mode for r in recs)
        assert sum(sum(r["stats"]["early_exits"].values()) for r in recs) > 0
        diverged = 0
        for r, a in zip(recs, ar, strict=True):
            # the evaluation's identical prefix (from its full-depth shadow) against ar's own output
            out, ref = r["token_ids"], a["token_ids"]
            same = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
            ev = r["stats"]["evaluation"]
            assert ev["identical_prefix_tokens"] == same, (mode, out, ref, ev)
            assert ev["identical_prefix_share"] == pytest.approx(same / len(out))
            diverged += same < len(out)
        assert diverged, (mode, recs)  # a divergence to locate

    # bench runs both KV modes side by side: specee (KV kept) and the specee-empty variant (the paper's)
    _ok(["bench", "--model", str(tiny_model_dir), "--device", "cpu", "-p", str(prompt_file), "-n", "8", "--no-plots",
         "--warmup", "0", "--methods", "ar,specee,specee-empty", "-o", str(tmp_path / "bench")])
    res = json.loads((tmp_path / "bench" / "results.json").read_text())
    for name, mode in (("specee", "deferred"), ("specee-empty", "empty")):
        assert res["methods"][name]["lossless"] is False
        recs = [json.loads(l) for l in (tmp_path / "bench" / "records" / f"{name}.jsonl").read_text().splitlines()]
        assert recs and all(r["stats"]["kv_mode"] == mode for r in recs)


def test_artifact_for_another_model_is_refused(tmp_path):
    a, b = make_tiny_model("llama-gqa", seed=0), make_tiny_model("llama-gqa", seed=1)
    head = init_head(a.model.norm.weight.detach(), 4)
    save_layers(HEADS, tmp_path / "h", a, {1: head}, {})
    heads, _ = load_heads(tmp_path / "h", a)
    assert torch.equal(heads[1].a, head.a)
    with pytest.raises(ArtifactError, match="another model"):
        load_heads(tmp_path / "h", b)
    with pytest.raises(ArtifactError, match="selfspec train-heads --kind exit-mlp"):
        load_exit_mlps(tmp_path / "missing", a)


def test_exit_threshold_needs_the_precision_lower_bound_not_the_point_estimate():
    from selfspec_cli.methods.specee.train import choose_threshold, wilson_lower

    assert wilson_lower(20, 20, 0.0) == 1.0
    assert 0.86 < wilson_lower(20, 20, 1.645) < 0.89  # n / (n + z^2) for a perfect record
    assert wilson_lower(300, 300, 1.645) > 0.99
    # 20 confident rows, all right: a perfect point estimate, but too few to vouch for 97 %
    few = torch.tensor([0.9] * 20 + [0.1] * 80)
    ok = torch.ones(100, dtype=torch.bool)
    y = torch.tensor([True] * 20 + [False] * 80)
    assert choose_threshold(few, ok, y, 0.97, z=0.0) == 0.5
    assert choose_threshold(few, ok, y, 0.97) == 1.0  # never exit
    many = torch.tensor([0.9] * 300 + [0.1] * 80)
    y = torch.tensor([True] * 300 + [False] * 80)
    assert choose_threshold(many, torch.ones(380, dtype=torch.bool), y, 0.97) == 0.5


def _data_with_prompts(num_prompts: int, rows_per_prompt: int = 4):
    from selfspec_cli.methods.onpolicy import OnPolicyData

    n = num_prompts * rows_per_prompt
    return OnPolicyData(torch.zeros(n, 1, 2), torch.zeros(n, dtype=torch.long),
                        torch.arange(num_prompts).repeat_interleave(rows_per_prompt), "k")


def test_three_way_split_is_by_prompt_and_disjoint():
    data = _data_with_prompts(16)
    train, val, test = data.split3()
    _, held = data.split()
    assert torch.equal(test, held)  # the test prompts are the held-out ones
    by = lambda idx: set(data.prompt_index[idx].tolist())  # noqa: E731
    assert by(train) == set(range(12)) and by(val) == {12, 13} and by(test) == {14, 15}
    assert len(train) + len(val) + len(test) == data.num_rows
    # two prompts: one to train on, one to test on; validation falls back to the training rows
    train2, val2, test2 = _data_with_prompts(2).split3()
    assert torch.equal(train2, val2) and len(test2) == 4


def test_head_training_keeps_the_best_validation_epoch(tmp_path):
    """A learning rate that wrecks the head must not wreck the artifact: early stopping keeps
    the epoch with the lowest validation KL (here the logit lens or an early epoch)."""
    from selfspec_cli.methods.adadecode.train import evaluate_head

    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    prompts = [torch.randint(2, 300, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(8)]
    data = collect_on_policy(eng, prompts, 16, "fp", cache_dir=tmp_path)
    _, val, _ = data.split3()
    teacher = torch.log_softmax(eng.final_logits(data.hidden[:, 3]).float(), dim=-1)
    heads, reports = train_lm_heads(eng, data, HeadTrainConfig(layers=(1,), rank=8, epochs=4, lr=50.0, warmup_share=0.0))
    r = reports[0]
    a = eng.adapter
    lens = init_head(a.final_norm, 8, torch.Generator().manual_seed(0))
    kept = evaluate_head(data.hidden[val, 1], teacher[val], data.target[val], heads[1], a.lm_head, a.rms_eps, ())["kl"]
    lens_kl = evaluate_head(data.hidden[val, 1], teacher[val], data.target[val], lens, a.lm_head, a.rms_eps, ())["kl"]
    assert kept == pytest.approx(r.val_kl, rel=1e-4, abs=1e-6)
    assert kept <= lens_kl + 1e-6


def test_exit_threshold_bound_counts_prompts_not_just_rows():
    """1000 exits at 95 % precision pass a 0.93 Wilson bound over rows. If all 50 wrong exits
    come from one of 20 prompts, a bootstrap over prompts sees that precision swings with
    which prompts are drawn and refuses; the same errors spread over every prompt pass."""
    from selfspec_cli.methods.specee.train import choose_threshold, cluster_bootstrap_lower

    groups = torch.arange(20).repeat_interleave(50)
    prob = torch.full((1000,), 0.9)
    verified = torch.ones(1000, dtype=torch.bool)
    concentrated = groups != 7
    spread = (torch.arange(1000) % 50) >= 2  # 2 wrong rows in each prompt ...
    spread[torch.arange(20) * 50 + 2] = torch.arange(20) >= 10  # ... and one more in half of them: 50 wrong in all
    assert int((~concentrated).sum()) == int((~spread).sum()) == 50
    assert choose_threshold(prob, verified, concentrated, 0.93) == 0.5  # rows only
    assert choose_threshold(prob, verified, concentrated, 0.93, groups=groups) == 1.0
    assert choose_threshold(prob, verified, spread, 0.93, groups=groups) == 0.5
    one = torch.tensor([3.0]), torch.tensor([4.0])
    assert cluster_bootstrap_lower(*one, 1.645) == 0.75  # a single prompt: the point estimate


def test_heads_over_a_draft_vocabulary_train_save_and_load(tmp_path):
    """Heads that score a draft vocabulary (FR-Spec): the teacher is the final law renormalised
    over those tokens, every head keeps the token ids, its predictions are token ids, training
    lowers the KL, and the artifact round trip keeps the ids (int) beside the float factors."""
    model = make_tiny_model("llama-gqa", layers=4)
    eng = Engine(model)
    prompts = [torch.randint(2, 300, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(6)]
    data = collect_on_policy(eng, prompts, 24, "fp", cache_dir=tmp_path)
    # the vocabulary holds most of the model's own tokens and some others, in no particular order
    seen = data.target.unique()
    unseen = torch.tensor([t for t in range(eng.vocab_size) if t not in set(seen.tolist())][:20])
    vocab = torch.cat([seen[: max(1, len(seen) * 3 // 4)], unseen])
    vocab = vocab[torch.randperm(len(vocab), generator=torch.Generator().manual_seed(0))]
    heads, reports = train_lm_heads(eng, data, HeadTrainConfig(layers=(1, 2), rank=8, epochs=15, lr=1e-2), vocab=vocab)
    for k, r in zip((1, 2), reports):
        assert torch.equal(heads[k].vocab, vocab) and r.best_epoch > 0  # training beat the logit lens on validation
        assert 0.0 < r.in_vocab < 1.0 and r.top1_after <= r.in_vocab + 1e-9  # a token outside is never predicted
    h = torch.randn(3, 64)
    logits = head_logits(h, heads[1], heads[1].rows(eng.adapter.lm_head), eng.adapter.rms_eps)
    assert logits.shape == (3, vocab.numel())
    assert set(heads[1].tokens(logits.argmax(-1)).tolist()) <= set(vocab.tolist())
    path = tmp_path / "heads"
    save_layers(HEADS, path, model, heads, {"rank": 8})
    back, _ = load_heads(path, model)
    assert back[1].vocab.dtype == torch.int64 and torch.equal(back[1].vocab, vocab)
    assert torch.equal(back[2].a, heads[2].a.float())
    full = {1: LowRankHead(heads[1].a, heads[1].b, heads[1].g)}  # a head over the whole vocabulary writes no ids
    save_layers(HEADS, tmp_path / "full", model, full, {"rank": 8})
    assert load_heads(tmp_path / "full", model)[0][1].vocab is None
