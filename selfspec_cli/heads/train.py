"""Training loops for AdaDecode's intermediate heads and SpecEE's exit predictors.

Both train on :class:`~.data.OnPolicyData` (full-depth greedy decoding of the
target, hidden states after every layer) with the backbone, the final norm and
the LM head frozen. Prompts are split three ways (:meth:`~.data.OnPolicyData.split3`):
training rows, validation prompts on which each trainer tunes what it tunes (the
early-stopping epoch of a head, the decision threshold of a predictor), and test
prompts (the last ones of the collection) on which every reported figure is
computed, never on rows that were trained or tuned on.

* :func:`train_lm_heads` — KL(p* || p_i) distillation of each head towards the final
  layer's distribution (forward KL, as in the paper), Adam with a cosine schedule
  and warmup. Reports KL before (step 0 = logit lens) and after, and early-prediction
  precision (head argmax == full model's token) and coverage (share of rows whose
  head confidence reaches the threshold) at several thresholds.
* :func:`train_exit_mlps` — one SpecEE predictor per layer from the drafter layer to
  L-2. The 4 speculative tokens are the top-4 of the shallowest trained head (the
  drafter). The label is exactly the exit test that inference applies: the argmax of
  the full LM head on the normalised state at that layer is one of the 4 speculative
  tokens (the verification) *and* equals the full model's token (the exit is right).
  Class imbalance: positives are weighted by n_neg / n_pos in the BCE loss.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..engine import Engine
from .data import OnPolicyData
from ..methods.exit_heads import (NUM_FEATURES, NUM_SPEC_TOKENS, PREDICTOR_HIDDEN, ExitPredictor, LowRankHead, exit_logit,
                      head_logits, init_head, spec_local, specee_features)

DEFAULT_THRESHOLDS = (0.5, 0.75, 0.9, 0.95)
Progress = Callable[[str, int, int, str], None]  # (task, done, total, info)


def default_head_layers(num_layers: int) -> tuple[int, ...]:
    """0-based ids of the layers *after* which heads sit: L/4, L/2, 3L/4 layers run."""
    return tuple(sorted({max(0, (num_layers * k) // 4 - 1) for k in (1, 2, 3)} - {num_layers - 1}))


def _cosine_lr(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def _teacher_logprobs(engine: Engine, final_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    return torch.cat([torch.log_softmax(engine.final_logits(final_hidden[i:i + chunk].to(engine.device, engine.dtype))
                                        .float().cpu(), dim=-1) for i in range(0, final_hidden.shape[0], chunk)])


def _frozen(engine: Engine) -> tuple[torch.Tensor, torch.Tensor, float]:
    a = engine.adapter
    return a.lm_head.detach().float().cpu(), a.final_norm.detach().float().cpu(), float(a.rms_eps)


def _step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _splits(data: OnPolicyData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`~.data.OnPolicyData.split3`, the training rows standing in for an empty test set (one prompt)."""
    train_idx, val_idx, hold_idx = data.split3()
    return train_idx, val_idx, hold_idx if len(hold_idx) else train_idx


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


@torch.no_grad()
def evaluate_head(x: torch.Tensor, teacher_logp: torch.Tensor, target: torch.Tensor, head: LowRankHead,
                  lm_head: torch.Tensor, eps: float, thresholds: Sequence[float], chunk: int = 1024) -> dict[str, Any]:
    """KL(p*||p_i), top-1 agreement, precision/coverage at ``thresholds`` over rows ``x``."""
    kl_sum, maxp, pred = 0.0, [], []
    for i in range(0, x.shape[0], chunk):
        logp = torch.log_softmax(head_logits(x[i:i + chunk], head, lm_head, eps).float(), dim=-1)
        t = teacher_logp[i:i + chunk]
        kl_sum += float((t.exp() * (t - logp)).sum())
        m, a = logp.max(dim=-1)
        maxp.append(m.exp())
        pred.append(a)
    maxp_t, right = torch.cat(maxp), torch.cat(pred) == target
    pc = {}
    for th in thresholds:
        sel = maxp_t >= th
        pc[f"{th:g}"] = {"precision": float(right[sel].float().mean()) if bool(sel.any()) else float("nan"),
                         "coverage": float(sel.float().mean())}
    return {"kl": kl_sum / max(1, x.shape[0]), "top1": float(right.float().mean()), "precision_coverage": pc}


def train_lm_heads(engine: Engine, data: OnPolicyData, cfg: HeadTrainConfig,
                   progress: Progress = lambda *_: None) -> tuple[dict[int, LowRankHead], list[HeadReport]]:
    """Train one low-rank head per layer in ``cfg.layers``; returns (heads, reports)."""
    import time

    L = engine.num_layers
    layers = cfg.layers if cfg.layers is not None else default_head_layers(L)
    lm_head, final_norm, eps = _frozen(engine)
    train_idx, val_idx, hold_idx = _splits(data)
    teacher = _teacher_logprobs(engine, data.hidden[:, L - 1])
    gen = torch.Generator().manual_seed(cfg.seed)
    heads: dict[int, LowRankHead] = {}
    reports: list[HeadReport] = []
    for layer in layers:
        t0 = time.perf_counter()
        x_all = data.hidden[:, layer]

        def evaluate(rows: torch.Tensor, head: LowRankHead, thresholds: Sequence[float] = ()) -> dict[str, Any]:
            return evaluate_head(x_all[rows], teacher[rows], data.target[rows], head, lm_head, eps, thresholds)

        init = init_head(final_norm, cfg.rank, gen)
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
                opt.param_groups[0]["lr"] = _cosine_lr(step, total, warmup, cfg.lr)  # one group: a, b, g
                logp = torch.log_softmax(head_logits(x_all[rows], LowRankHead(a, b, g), lm_head, eps), dim=-1)
                t = teacher[rows]
                loss = (t.exp() * (t - logp)).sum(dim=-1).mean()  # forward KL(p* || p_i)
                _step(opt, loss)
                loss_sum += float(loss.detach()) * len(rows)
                step += 1
            cand = LowRankHead(a.detach().clone(), b.detach().clone(), g.detach().clone())
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
                                  time.perf_counter() - t0, best_epoch, best_kl))
    return heads, reports


# ---------------------------------------------------------------- SpecEE exit predictors


@dataclass(frozen=True, slots=True)
class ExitTrainConfig:
    epochs: int = 100
    batch_size: int = 1024
    lr: float = 1e-3
    seed: int = 0
    balance: bool = True  # weight positives by n_neg / n_pos
    target_precision: float = 0.97  # per-layer decision threshold: the lowest >= 0.5 reaching this exit precision on validation prompts
    confidence_z: float = 1.645  # ... as one-sided 95 % lower bounds (Wilson over rows, bootstrap over prompts), not the point estimate (0: point estimate)


@dataclass(slots=True)
class ExitReport:
    layer: int
    rows: int
    positive_share: float
    precision: float  # held-out: P(exit is right | predictor fires and verification passes)
    recall: float
    fire_share: float  # held-out share of rows where the predictor fires and verification passes
    threshold: float = 0.5  # chosen decision threshold (1.0: the layer never exits)
    precision_at_threshold: float = float("nan")
    recall_at_threshold: float = float("nan")
    fire_share_at_threshold: float = 0.0


def _rates(prob: torch.Tensor, verified: torch.Tensor, y: torch.Tensor, threshold: float) -> tuple[float, float, float, int]:
    fire = (prob > threshold) & verified
    tp = float((fire & y).sum())
    nf = int(fire.sum())
    return (tp / nf if nf else float("nan"), tp / float(y.sum()) if bool(y.any()) else float("nan"),
            float(fire.float().mean()), nf)


def wilson_lower(successes: int, n: int, z: float) -> float:
    """One-sided Wilson score lower bound of a binomial proportion at the normal quantile ``z``
    (scipy's ``binomtest(...).proportion_ci(method="wilson")``; the point estimate when z = 0)."""
    if n == 0:
        return float("nan")
    if z <= 0:
        return successes / n
    from scipy.stats import binomtest, norm  # imported here: only threshold selection needs it

    ci = binomtest(successes, n, alternative="greater").proportion_ci(float(norm.cdf(z)), method="wilson")
    return float(ci.low)


def cluster_bootstrap_lower(tp: torch.Tensor, fires: torch.Tensor, z: float, resamples: int = 400,
                            seed: int = 0) -> float:
    """Lower confidence bound of a pooled precision sum(tp) / sum(fires) when rows come in
    correlated clusters (the rows of one prompt's continuation): resample whole clusters
    with replacement and take the one-sided percentile matching ``z`` (z 1.645: the 5th
    percentile), by ``scipy.stats.bootstrap`` over the paired per-cluster counts (a resample
    that draws no fire counts as precision 0). ``tp``, ``fires``: per-cluster counts. With a
    single cluster there is nothing to resample and the point estimate is returned."""
    g = tp.shape[0]
    total = float(fires.sum())
    if total == 0:
        return float("nan")
    if g < 2 or z <= 0:
        return float(tp.sum()) / total
    import numpy as np
    from scipy.stats import bootstrap, norm  # imported here: only threshold selection needs it

    def pooled(tp_: np.ndarray, fires_: np.ndarray, axis: int = -1) -> np.ndarray:
        f = fires_.sum(axis=axis)
        return np.where(f > 0, tp_.sum(axis=axis) / np.maximum(f, 1e-9), 0.0)

    res = bootstrap((tp.double().numpy(), fires.double().numpy()), pooled, paired=True, vectorized=True,
                    n_resamples=resamples, confidence_level=float(norm.cdf(z)), alternative="greater",
                    method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low)


def choose_threshold(prob: torch.Tensor, verified: torch.Tensor, y: torch.Tensor, target: float,
                     min_fires: int = 5, z: float = 1.645, groups: torch.Tensor | None = None) -> float:
    """The lowest threshold >= 0.5 whose exits (predictor fires and verification passes)
    reach ``target`` precision on these rows, judged by a lower confidence bound at ``z``,
    not the point estimate (a point estimate on a few hundred rows overstates what holds on
    new prompts): the Wilson bound over rows and, when ``groups`` gives each row's prompt,
    also a prompt-level bootstrap bound (rows of one continuation are correlated, so the
    rows are fewer independent observations than they look, and prompts differ); both
    must reach the target. 1.0 (never exit) if no threshold does."""
    gid = torch.unique(groups, return_inverse=True)[1] if groups is not None and len(groups) else None
    for t in [0.5 + 0.005 * i for i in range(100)]:
        prec, _, _, nf = _rates(prob, verified, y, t)
        if nf < min_fires or wilson_lower(round(prec * nf) if nf else 0, nf, z) < target:
            continue
        if gid is not None:
            fire = (prob > t) & verified  # per prompt: true positives, fires
            per_tp, per_fire = (torch.bincount(gid, w.float()) for w in (fire & y, fire))
            if cluster_bootstrap_lower(per_tp, per_fire, z) < target:
                continue
        return t
    return 1.0


@torch.no_grad()
def build_exit_dataset(engine: Engine, data: OnPolicyData, drafter_layer: int, drafter: LowRankHead,
                       chunk: int = 512) -> tuple[dict[int, torch.Tensor], ...]:
    """Features and labels for every predictor layer (drafter layer .. L-2), built like inference
    builds them; three dicts layer -> tensor: the features (N, 12), ``verified`` (N,) bool (the
    full-vocab argmax at this layer is a speculative token) and the labels (N,) float (verified
    and equal to the full model's token)."""
    lm_head, final_norm, eps = _frozen(engine)
    layers = range(drafter_layer, engine.num_layers - 1)
    feats, verified, labels = ({l: [] for l in layers} for _ in range(3))  # layer -> per-chunk tensors
    for i in range(0, data.num_rows, chunk):
        h = data.hidden[i:i + chunk]
        target = data.target[i:i + chunk]
        spec = head_logits(h[:, drafter_layer], drafter, lm_head, eps).topk(NUM_SPEC_TOKENS, dim=-1).indices  # (R, 4)
        spec_rows = lm_head[spec]  # (R, 4, d)
        s_prev = None
        for l in layers:
            s = spec_local(h[:, l], spec_rows, final_norm, eps)
            feats[l].append(specee_features(s, s_prev))
            s_prev = s
            full = F.linear(F.rms_norm(h[:, l], (h.shape[-1],), final_norm, eps), lm_head).argmax(dim=-1)  # (R,)
            ok = (spec == full[:, None]).any(dim=-1)
            verified[l].append(ok)
            labels[l].append((ok & (full == target)).float())
    return tuple({l: torch.cat(v) for l, v in d.items()} for d in (feats, verified, labels))


def _init_predictor(gen: torch.Generator) -> list[torch.Tensor]:
    """A predictor's (w1, b1, w2, b2), trainable, initialised as ``nn.Linear`` does."""
    def lin(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
        bound = 1 / math.sqrt(in_f)
        return ((torch.rand(out_f, in_f, generator=gen) * 2 - 1) * bound, (torch.rand(out_f, generator=gen) * 2 - 1) * bound)

    return [t.requires_grad_(True) for t in (*lin(PREDICTOR_HIDDEN, NUM_FEATURES), *lin(1, PREDICTOR_HIDDEN))]


def train_exit_mlps(engine: Engine, data: OnPolicyData, drafter_layer: int, drafter: LowRankHead, cfg: ExitTrainConfig,
                    progress: Progress = lambda *_: None) -> tuple[dict[int, ExitPredictor], list[ExitReport]]:
    feats, verified, labels = build_exit_dataset(engine, data, drafter_layer, drafter)
    train_idx, val_idx, hold_idx = _splits(data)
    gen = torch.Generator().manual_seed(cfg.seed)
    predictors: dict[int, ExitPredictor] = {}
    reports: list[ExitReport] = []
    for l in feats:
        x, y = feats[l], labels[l]
        xt, yt = x[train_idx], y[train_idx]
        pos = float(yt.sum())
        pos_weight = torch.tensor((len(yt) - pos) / pos if (cfg.balance and pos > 0) else 1.0)  # n_neg / n_pos
        params = _init_predictor(gen)
        opt = torch.optim.Adam(params, lr=cfg.lr)
        n = len(xt)
        for epoch in range(cfg.epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(0, n, cfg.batch_size):
                rows = perm[i:i + cfg.batch_size]
                logit = exit_logit(xt[rows], ExitPredictor(*params))
                loss = F.binary_cross_entropy_with_logits(logit, yt[rows], pos_weight=pos_weight)
                _step(opt, loss)
            if (epoch + 1) % 10 == 0:
                progress(f"exit-mlp@{l}", epoch + 1, cfg.epochs, f"loss {float(loss.detach()):.3f}")
        p = ExitPredictor(*(t.detach() for t in params))
        predictors[l] = p
        with torch.no_grad():
            # the threshold is chosen on validation prompts and reported on test prompts
            prob_v = torch.sigmoid(exit_logit(x[val_idx], p))
            t = choose_threshold(prob_v, verified[l][val_idx], y[val_idx].bool(), cfg.target_precision,
                                 z=cfg.confidence_z, groups=data.prompt_index[val_idx])
            prob = torch.sigmoid(exit_logit(x[hold_idx], p))
            vh, yh = verified[l][hold_idx], y[hold_idx].bool()
            prec, rec, fire, _ = _rates(prob, vh, yh, 0.5)
            prec_t, rec_t, fire_t, _ = _rates(prob, vh, yh, t)
            reports.append(ExitReport(l, int(len(y)), float(y.mean()), prec, rec, fire, t, prec_t, rec_t, fire_t))
    return predictors, reports
