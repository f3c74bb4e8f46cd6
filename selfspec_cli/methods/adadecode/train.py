"""``selfspec train-heads --kind lm-heads``: AdaDecode's intermediate heads, trained on the
target's own greedy output (:class:`~selfspec_cli.methods.onpolicy.OnPolicyData`, backbone,
final norm and LM head frozen; prompts split three ways, every reported figure on the test
prompts).

KL(p* || p_i) distillation of each head towards the final layer's distribution (forward KL,
as in the paper; for heads over a draft vocabulary, ``--draft-vocab``, the final distribution
renormalised over its tokens, and top-1 is reported against the full model's token together
with the share of tokens the vocabulary holds), Adam with a cosine schedule and warmup, early stopping on the validation
prompts' KL. Reports KL before (step 0 = logit lens) and after, and early-prediction
precision (head argmax == full model's token) and coverage (share of rows whose head
confidence reaches the threshold) at several thresholds. Heads none of which predicts the
model's token on the test prompts (top-1 0) are of no use: they are never written as the
model's default (:func:`~selfspec_cli.methods.onpolicy.finish`). :func:`run` is the offline
step (docs/design.md, "A method is one package").
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...engine import Engine
from ...errors import ConfigError
from ..base import layer_list
from ..offline import OfflineJob
from ..onpolicy import (OnPolicyData, Progress, TrainSetting, check_options, collect, cosine_lr, finish, frozen_head, optimizer_step,
                        progress_callback, splits, teacher_logprobs)
from . import HEADS
from .heads import LowRankHead, head_logits, init_head
from ...jsonio import JsonObject

DEFAULT_THRESHOLDS = (0.5, 0.75, 0.9, 0.95)


def default_head_layers(num_layers: int) -> tuple[int, ...]:
    """0-based ids of the layers *after* which heads sit: L/4, L/2, 3L/4 layers run."""
    return tuple(sorted({max(0, (num_layers * k) // 4 - 1) for k in (1, 2, 3)} - {num_layers - 1}))


# ---------------------------------------------------------------- AdaDecode heads


@dataclass(frozen=True, slots=True)
class HeadTrainConfig:
    layers: tuple[int, ...] | None = None  # None: default_head_layers
    rank: int = 64
    epochs: int = 30
    batch_size: int = 128
    lr: float = 5e-3
    warmup_share: float = 0.03
    seed: int = 0
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS


@dataclass(slots=True)
class HeadReport:
    layer: int
    kl_before: float
    kl_after: float
    top1_before: float
    top1_after: float
    precision_coverage: dict[str, dict[str, float]] = field(default_factory=dict)  # threshold -> {precision, coverage}
    train_seconds: float = 0.0
    best_epoch: int = 0  # early stopping: epoch kept (0: the logit-lens initialisation)
    val_kl: float = float("nan")  # validation KL of the kept epoch
    in_vocab: float = 1.0  # share of the test rows whose model token the head's vocabulary holds (top-1's ceiling)


@torch.no_grad()
def evaluate_head(x: torch.Tensor, teacher_logp: torch.Tensor, target: torch.Tensor, head: LowRankHead,
                  lm_head: torch.Tensor, eps: float, thresholds: Sequence[float], chunk: int = 1024) -> JsonObject:
    """KL(p*||p_i), top-1 agreement with the full model's token ``target``, precision/coverage at
    ``thresholds`` over rows ``x``. ``teacher_logp`` and ``lm_head`` are over the head's vocabulary."""
    kl_sum, maxp, pred = 0.0, [], []
    for i in range(0, x.shape[0], chunk):
        logp = torch.log_softmax(head_logits(x[i:i + chunk], head, lm_head, eps).float(), dim=-1)
        t = teacher_logp[i:i + chunk]
        kl_sum += float((t.exp() * (t - logp)).sum())
        m, a = logp.max(dim=-1)
        maxp.append(m.exp())
        pred.append(head.tokens(a))  # token ids (a head over a draft vocabulary scores its columns)
    maxp_t, right = torch.cat(maxp), torch.cat(pred) == target
    pc = {}
    for th in thresholds:
        sel = maxp_t >= th
        pc[f"{th:g}"] = {"precision": float(right[sel].float().mean()) if bool(sel.any()) else float("nan"),
                         "coverage": float(sel.float().mean())}
    return {"kl": kl_sum / max(1, x.shape[0]), "top1": float(right.float().mean()), "precision_coverage": pc}


def train_lm_heads(engine: Engine, data: OnPolicyData, cfg: HeadTrainConfig, progress: Progress = lambda *_: None,
                   vocab: torch.Tensor | None = None) -> tuple[dict[int, LowRankHead], list[HeadReport]]:
    """Train one low-rank head per layer in ``cfg.layers``; returns (heads, reports). ``vocab``:
    the token ids the heads score (a draft vocabulary, FR-Spec; None: the whole vocabulary); the
    teacher is then the final distribution renormalised over those tokens."""

    L = engine.num_layers
    layers = cfg.layers if cfg.layers is not None else default_head_layers(L)
    if vocab is not None:
        vocab = vocab.to(torch.int64)
    lm_head, final_norm, eps = frozen_head(engine, vocab)  # the rows the heads score, only those widened
    train_idx, val_idx, hold_idx = splits(data)
    teacher = teacher_logprobs(engine, data.hidden[:, L - 1], vocab=vocab)
    held = data.target[hold_idx]
    in_vocab = 1.0 if vocab is None else float(torch.isin(held, vocab).float().mean())
    gen = torch.Generator().manual_seed(cfg.seed)
    heads: dict[int, LowRankHead] = {}
    reports: list[HeadReport] = []
    for layer in layers:
        t0 = time.perf_counter()
        x_all = data.hidden[:, layer]

        def evaluate(rows: torch.Tensor, head: LowRankHead, thresholds: Sequence[float] = ()) -> JsonObject:
            return evaluate_head(x_all[rows], teacher[rows], data.target[rows], head, lm_head, eps, thresholds)

        init = init_head(final_norm, cfg.rank, gen, vocab)
        before = evaluate(hold_idx, init, cfg.thresholds)
        a, b, g = (t.clone().requires_grad_(True) for t in (init.a, init.b, init.g))
        opt = torch.optim.Adam([a, b, g], lr=cfg.lr)
        n = len(train_idx)
        total = max(1, math.ceil(n / cfg.batch_size)) * cfg.epochs  # steps
        warmup = max(1, int(cfg.warmup_share * total))
        step = 0
        # early stopping: keep the epoch with the lowest validation KL (epoch 0: the logit
        # lens), so a learning rate or an epoch count that hurts cannot make the head worse
        best_kl = evaluate(val_idx, init)["kl"]
        best, best_epoch = init, 0
        for epoch in range(cfg.epochs):
            perm = train_idx[torch.randperm(n, generator=gen)]
            loss_sum = 0.0
            for i in range(0, n, cfg.batch_size):
                rows = perm[i:i + cfg.batch_size]
                opt.param_groups[0]["lr"] = cosine_lr(step, total, warmup, cfg.lr)  # one group: a, b, g
                logp = torch.log_softmax(head_logits(x_all[rows], LowRankHead(a, b, g, vocab), lm_head, eps), dim=-1)
                t = teacher[rows]
                loss = (t.exp() * (t - logp)).sum(dim=-1).mean()  # forward KL(p* || p_i)
                optimizer_step(opt, loss)
                loss_sum += float(loss.detach()) * len(rows)
                step += 1
            cand = LowRankHead(a.detach().clone(), b.detach().clone(), g.detach().clone(), vocab)
            val_kl = evaluate(val_idx, cand)["kl"]
            if val_kl < best_kl:
                best_kl, best, best_epoch = val_kl, cand, epoch + 1
            progress(f"head@{layer}", epoch + 1, cfg.epochs,
                     f"train KL {loss_sum / n:.3f}, val KL {val_kl:.3f} (best epoch {best_epoch})")
        after = evaluate(hold_idx, best, cfg.thresholds)
        heads[layer] = best
        pc = {th: {**v, "precision_before": before["precision_coverage"][th]["precision"],
                   "coverage_before": before["precision_coverage"][th]["coverage"]}
              for th, v in after["precision_coverage"].items()}
        reports.append(HeadReport(layer, before["kl"], after["kl"], before["top1"], after["top1"], pc,
                                  time.perf_counter() - t0, best_epoch, best_kl, in_vocab))
    return heads, reports


def prepare(options: JsonObject) -> TrainSetting:
    layers = layer_list(options.get("layers"), "--layers")  # "3,7" -> (3, 7); a bad list is one line naming the flag
    if layers is not None and (twice := sorted({k for k in layers if layers.count(k) > 1})):
        raise ConfigError(f"--layers names layer {', '.join(map(str, twice))} more than once (one head per layer); "
                          "list each layer once")
    return check_options({**options, "layers": layers}, epochs=30, batch_size=128, lr=5e-3)


def head_vocabulary(spec: str | None, model: Any) -> tuple[torch.Tensor | None, JsonObject]:
    """The token ids the heads score and the manifest's note of them: ``auto`` (the default): this
    model's FR-Spec draft vocabulary when it has one (the user's first, then the shipped one), as
    every other draft of the model scores; ``full``: the whole vocabulary; else an artifact path."""
    from .. import fr_spec

    vocab = fr_spec.resolve(spec or "auto", model)
    if vocab is None:
        return None, {"size": int(model.config.vocab_size), "source": "full"}
    return vocab.ids, {"size": int(vocab.n), "source": "fr-spec", "artifact_id": vocab.manifest.get("artifact_id")}


def run(job: OfflineJob) -> JsonObject:
    """Collect the on-policy data, train the heads, save :data:`~selfspec_cli.methods.adadecode.HEADS`."""
    s: TrainSetting = job.setting
    L, width = job.engine.num_layers, job.engine.adapter.hidden_size
    if s.layers is not None and not s.layers:
        raise ConfigError("--layers names no layer; give layer ids such as 2,5, or leave it out for the default")
    if s.rank > width:  # a correction of a width-wide state has rank at most width
        raise ConfigError(f"--rank {s.rank} is above the model's width ({width}); pass --rank {width} or less")
    if s.layers is not None and not all(0 <= k < L - 1 for k in s.layers):
        raise ConfigError(f"--layers {list(s.layers)}: head layers must be in 0..{L - 2} for a {L}-layer model")
    vocab, vocab_note = head_vocabulary(s.draft_vocab, job.model)  # a bad path costs no data collection
    data, common = collect(job)
    cfg = HeadTrainConfig(layers=s.layers, rank=s.rank, epochs=s.epochs, batch_size=s.batch_size, lr=s.lr, seed=s.seed)
    job.log(f"[dim]heads score {vocab_note['size']} tokens ({vocab_note['source']})[/dim]")
    t0 = time.perf_counter()
    with job.progress() as bar:
        heads, reports = train_lm_heads(job.engine, data, cfg, progress_callback(bar), vocab)
    train_s = time.perf_counter() - t0
    manifest = {**common, "rank": s.rank, "head_layers_note": "0-based id of the layer after which the head reads",
                "head_vocab": vocab_note,
                "training": {"loss": "forward KL(p_final || p_head)", "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                             "lr": cfg.lr, "schedule": f"cosine, {cfg.warmup_share:.0%} warmup", "seed": s.seed,
                             "early_stopping": "epoch with the lowest validation KL (validation prompts)"},
                "report": [asdict(r) for r in reports]}
    lines = [f"head after layer {r.layer} (epoch {r.best_epoch} kept): test KL {r.kl_before:.3f} -> {r.kl_after:.3f}, "
             f"top-1 {r.top1_before:.3f} -> {r.top1_after:.3f}"
             + (f" (model's token in the head's vocabulary: {r.in_vocab:.3f})" if vocab is not None else "") + "; "
             + ", ".join(f"@{th}: prec {v['precision']:.3f} cov {v['coverage']:.3f}" for th, v in r.precision_coverage.items())
             for r in reports]
    best = max(r.top1_after for r in reports)  # a head that never predicts the model's token is of no use
    unusable = None if best > 0 else f"no head predicts the model's next token on the test prompts (top-1 {best:.3f})"
    return finish(job, HEADS, heads, manifest, train_s, lines, unusable, kind="lm-heads", rank=s.rank,
                  thresholds=list(DEFAULT_THRESHOLDS))
