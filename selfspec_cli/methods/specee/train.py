"""``selfspec train-heads --kind exit-mlp``: SpecEE's exit predictors, trained on the target's
own greedy output (:class:`~selfspec_cli.methods.onpolicy.OnPolicyData`; backbone, final norm
and LM head frozen; prompts split three ways: training rows, validation prompts on which each
layer's decision threshold is chosen, test prompts on which every reported figure is computed).

One predictor per layer from the drafter layer to L-2. The 4 speculative tokens are the
top-4 of the shallowest trained AdaDecode head (the drafter). The label is exactly the exit
test that inference applies: the argmax of the full LM head on the normalised state at that
layer is one of the 4 speculative tokens (the verification) *and* equals the full model's
token (the exit is right). Class imbalance: positives are weighted by n_neg / n_pos in the
BCE loss. :func:`run` is the offline step (docs/design.md, "A method is one package").
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ...engine import Engine
from ..adadecode import HEADS, LowRankHead, head_logits, load_heads
from ..offline import OfflineJob
from ..onpolicy import (OnPolicyData, Progress, TrainSetting, check_options, collect, finish, frozen_head, optimizer_step,
                        progress_callback, splits)
from . import EXIT_MLPS
from .predictor import NUM_FEATURES, NUM_SPEC_TOKENS, PREDICTOR_HIDDEN, ExitPredictor, exit_logit, spec_local, specee_features
from ...jsonio import JsonObject


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
    lm_head, final_norm, eps = frozen_head(engine)
    layers = range(drafter_layer, engine.num_layers - 1)
    feats, verified, labels = ({l: [] for l in layers} for _ in range(3))  # layer -> per-chunk tensors
    for i in range(0, data.num_rows, chunk):
        h = data.hidden[i:i + chunk]
        target = data.target[i:i + chunk]
        spec = drafter.tokens(head_logits(h[:, drafter_layer], drafter, drafter.rows(lm_head), eps)
                              .topk(NUM_SPEC_TOKENS, dim=-1).indices)  # (R, 4) token ids
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
    train_idx, val_idx, hold_idx = splits(data)
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
                optimizer_step(opt, loss)
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


def prepare(options: JsonObject) -> TrainSetting:
    setting = check_options(options, epochs=100, batch_size=1024, lr=1e-3)
    if setting.heads is not None:  # a wrong path costs no model load
        HEADS.precheck(setting.heads, "--heads")
    return setting


def run(job: OfflineJob) -> JsonObject:
    """Load the drafter heads (before the slow data collection), collect, train the predictors,
    choose each layer's threshold, save :data:`~selfspec_cli.methods.specee.EXIT_MLPS`."""
    s: TrainSetting = job.setting
    heads, drafter_manifest = load_heads(s.heads, job.model)
    data, common = collect(job)
    drafter_layer = min(heads)
    cfg = ExitTrainConfig(epochs=s.epochs, batch_size=s.batch_size, lr=s.lr, seed=s.seed)
    t0 = time.perf_counter()
    with job.progress() as bar:
        predictors, reports = train_exit_mlps(job.engine, data, drafter_layer, heads[drafter_layer], cfg,
                                              progress_callback(bar))
    train_s = time.perf_counter() - t0
    manifest = {
        **common, "drafter": {"kind": "adadecode-head", "layer": drafter_layer,
                              "heads_artifact_id": drafter_manifest.get("artifact_id"), "top_k": NUM_SPEC_TOKENS},
        "features": "[s (4 speculative-token logits of final_norm(h_l)), q = softmax(s), q - q_(l-1) (q at the drafter layer)]",
        "label": "argmax of the full LM head on final_norm(h_l) is a speculative token and equals the full model's token",
        "training": {"loss": "BCE, positives weighted n_neg/n_pos", "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                     "lr": cfg.lr, "seed": s.seed},
        "thresholds": {str(r.layer): r.threshold for r in reports},
        "threshold_rule": (f"lowest threshold >= 0.5 whose exit precision on the validation prompts has one-sided lower "
                           f"bounds (z {cfg.confidence_z}: Wilson over rows and a bootstrap over prompts) "
                           f">= {cfg.target_precision}"),
        "report": [asdict(r) for r in reports]}
    lines = [f"predictor after layer {r.layer}: positives {r.positive_share:.3f}; test prompts at 0.5: exit precision "
             f"{r.precision:.3f}, recall {r.recall:.3f}, fires {r.fire_share:.3f}; threshold {r.threshold:.3f}: precision "
             f"{r.precision_at_threshold:.3f}, recall {r.recall_at_threshold:.3f}, fires {r.fire_share_at_threshold:.3f}"
             for r in reports]
    # a set none of whose predictors fires at its threshold on the test prompts never exits (a threshold of 1.0:
    # no threshold met the precision bound): of no use as the default (a lower --specee-threshold exits imprecisely)
    unusable = (None if any(r.fire_share_at_threshold > 0 for r in reports) else
                "no exit predictor fires at its threshold on the test prompts (SpecEE would never exit)")
    return finish(job, EXIT_MLPS, predictors, manifest, train_s, lines, unusable, kind="exit-mlp",
                  drafter_layer=drafter_layer)
