"""On-policy training data: the target's own greedy continuations, with the
residual stream captured after every layer, cached on disk.

AdaDecode trains its heads on the base model's greedy responses (paper App. D)
and SpecEE collects its predictor data from full-depth greedy decoding; both
need, for each decoded position, the hidden state after each layer and the
token the full model picks there. One row per position whose next token the
model predicted: the last prompt position and every generated token but the
last. The training pieces both trainers share (the frozen LM head, the teacher's
log-probabilities, the three-way split, the cosine schedule) close the module.

Stored per collection (safetensors, in a cache directory keyed by the model
fingerprint, the tokenized prompts and the generation length):

* ``hidden``: (N, L, d) float32, residual stream after layer ``l`` (``l = L-1``
  is the final layer, before the final norm);
* ``target``: (N,) the full model's greedy next token at that row;
* ``prompt_index``: (N,) which prompt the row came from (for a held-out split).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from typing import Any

from ..config import GenerationConfig
from ..decoding.state import DecodeState
from ..decoding.drafts import Round
from ..decoding.driver import Plain, Taps, decode
from ..engine import Engine, ForwardOutput
from ..errors import ArtifactError, ConfigError, count
from ..paths import atomic_write, cache_root
from ..jsonio import JsonObject


@dataclass(frozen=True, slots=True)
class OnPolicyData:
    hidden: torch.Tensor  # (N, L, d) float32
    target: torch.Tensor  # (N,) long
    prompt_index: torch.Tensor  # (N,) long
    key: str

    @property
    def num_rows(self) -> int:
        return int(self.target.shape[0])

    def _held_prompts(self, share: float) -> tuple[int, int]:
        """(number of prompts, prompts per held-out block): ``share`` of them, at least 1
        when there are 2 or more."""
        num_prompts = int(self.prompt_index.max()) + 1 if self.num_rows else 0
        return num_prompts, (max(1, round(num_prompts * share)) if num_prompts > 1 else 0)

    def split(self, holdout_share: float = 0.125) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices (train, held-out): the last prompts are held out, never rows of
        one prompt on both sides (rows of one continuation are strongly correlated)."""
        num_prompts, n_hold = self._held_prompts(holdout_share)
        hold = self.prompt_index >= num_prompts - n_hold
        idx = torch.arange(self.num_rows)
        return idx[~hold], idx[hold]

    def split3(self, share: float = 0.125) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row indices (train, validation, test) by prompt: the last prompts are the test
        set (:meth:`split`), the block just before them the validation set. Training
        chooses what it tunes (early-stopping epoch, decision thresholds) on validation
        and reports on test, so reported figures are not the ones it was tuned on. With
        fewer than 3 prompts validation falls back to the training rows."""
        train, test = self.split(share)
        num_prompts, n = self._held_prompts(share)
        if num_prompts - n < 2:
            return train, train, test
        val = self.prompt_index[train] >= num_prompts - 2 * n
        return train[~val], train[val], test


class _HiddenRecorder(Plain):
    """Plain greedy decoding's drafter (it never drafts) that keeps, for each round's input row,
    the residual stream after every layer and the token the model picked (over all the
    prompts it decodes): its taps ask every forward for the hidden states of every layer."""

    def __init__(self, engine: Engine) -> None:
        self.layers = range(engine.num_layers)
        self.taps = Taps(hidden=tuple(self.layers))
        self.rows: list[torch.Tensor] = []
        self.targets: list[int] = []

    def _take(self, out: ForwardOutput, token: int) -> None:
        self.rows.append(torch.stack([out.hidden_at[l][-1] for l in self.layers]).float().cpu())  # (L, d)
        self.targets.append(token)

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._take(prefill, state.pending)

    def accept(self, state: DecodeState, rnd: Round) -> None:
        self._take(rnd.out, rnd.verdict.tokens[0])


def collect_on_policy(
    engine: Engine,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    fingerprint: str,
    eos_ids: tuple[int, ...] = (),
    cache_dir: Path | None = None,
    on_prompt: Callable[[int, int], None] = lambda i, n: None,
) -> OnPolicyData:
    """Collect (or load from the disk cache) the on-policy rows for ``prompt_ids``."""
    from safetensors.torch import load_file, save_file

    blob = json.dumps({"fp": fingerprint, "prompts": prompt_ids, "n": max_new_tokens, "v": 1}).encode()
    key = hashlib.sha256(blob).hexdigest()[:20]  # the cache entry: model, tokenized prompts, generation length
    directory = Path(cache_dir) if cache_dir is not None else cache_root() / "onpolicy"
    path = directory / f"{key}.safetensors"
    if path.is_file():
        try:
            t = load_file(str(path))
            on_prompt(len(prompt_ids), len(prompt_ids))
            return OnPolicyData(t["hidden"], t["target"], t["prompt_index"], key)
        except Exception:  # noqa: BLE001 - a damaged cache entry is recomputed
            pass
    rec, index = _HiddenRecorder(engine), []  # index: each row's prompt
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids)  # greedy, full depth
    for i, ids in enumerate(prompt_ids):
        decode(engine, None, rec, ids, gen_cfg)
        index += [i] * (len(rec.targets) - len(index))
        on_prompt(i + 1, len(prompt_ids))
    data = OnPolicyData(torch.stack(rec.rows), torch.tensor(rec.targets, dtype=torch.long), torch.tensor(index), key)
    tensors = {"hidden": data.hidden.contiguous(), "target": data.target, "prompt_index": data.prompt_index}
    atomic_write(path, lambda f: save_file(tensors, f.name), error=lambda exc: ArtifactError(
        f"cannot write the on-policy data cache '{directory}' ({exc.strerror}); pass --cache-dir"))
    return data


# ---------------------------------------------------------------- pieces both trainers share

Progress = Callable[[str, int, int, str], None]  # (task, done, total, info)


def cosine_lr(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def teacher_logprobs(engine: Engine, final_hidden: torch.Tensor, chunk: int = 1024,
                     vocab: torch.Tensor | None = None) -> torch.Tensor:
    """The final layer's log-probabilities (R, V) of residual rows; over ``vocab`` (token ids, a
    draft vocabulary) only: (R, N), renormalised over those tokens (the distribution a head over
    that vocabulary can match; R x 262k floats would be 8.6 GB for Gemma 3's 8k rows)."""
    head = None if vocab is None else engine.subset_head(vocab)
    return torch.cat([torch.log_softmax(engine.final_logits(final_hidden[i:i + chunk].to(engine.device, engine.dtype), head)
                                        .float().cpu(), dim=-1) for i in range(0, final_hidden.shape[0], chunk)])


def frozen_head(engine: Engine, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The LM head's float rows, the final norm's weight and epsilon: what the trained heads' outputs are scored
    through. ``rows``: only those tokens' rows (a draft vocabulary: Qwen2.5's 151,936-row head widened whole is
    0.93 GB of float32); None: every token's. A model read straight from its GGUF holds no float head: its rows
    come from the blocks, and only the rows asked for are widened."""
    a = engine.adapter
    held = not a.lm_head.is_meta and a.lm_head.numel() > 0  # else it stays in (or was freed to) the blocks
    ids = torch.arange(engine.vocab_size) if rows is None else rows.to(torch.int64)
    head = (a.lm_head if rows is None else a.lm_head[ids.to(a.lm_head.device)]) if held else engine.head_rows(ids)
    return head.detach().float().cpu(), a.final_norm.detach().float().cpu(), float(a.rms_eps)


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def splits(data: OnPolicyData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`OnPolicyData.split3`, the training rows standing in for an empty test set (one prompt)."""
    train_idx, val_idx, hold_idx = data.split3()
    return train_idx, val_idx, hold_idx if len(hold_idx) else train_idx


# ---------------------------------------------------------------- the offline steps' shared frame


MIN_PROMPTS = 3  # training, validation and test prompts are disjoint


@dataclass(frozen=True)
class TrainSetting:
    """``selfspec train-heads``' options, checked before the model loads (defaults per kind)."""

    epochs: int
    batch_size: int
    lr: float
    seed: int = 0
    cache_dir: Path | None = None
    layers: tuple[int, ...] | None = None
    rank: int = 64
    heads: Path | None = None
    draft_vocab: str | None = None  # lm-heads: the vocabulary the heads score (auto, full, or an FR-Spec artifact path)


def check_options(options: JsonObject, epochs: int, batch_size: int, lr: float) -> TrainSetting:
    """The options of a training step, with this kind's defaults for those not given."""
    o = {"epochs": epochs, "batch_size": batch_size, "lr": lr, **{k: v for k, v in options.items() if v is not None}}
    for name in ("epochs", "batch_size", "rank"):
        if name in o and o[name] < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {o[name]}")
    if not o["lr"] > 0:
        raise ConfigError(f"--lr must be > 0, got {o['lr']}")
    return TrainSetting(**o)


def collect(job: Any) -> tuple[OnPolicyData, JsonObject]:
    """The job's on-policy rows (cached) and the manifest fields every trained artifact records:
    the data (prompts, rows, split) and the environment."""
    import time

    from ..loading import model_fingerprint

    if len(job.prompt_ids) < MIN_PROMPTS:
        raise ConfigError(f"train-heads needs at least {MIN_PROMPTS} prompts (disjoint training, validation and test "
                          f"prompts), got {len(job.prompt_ids)}; pass more prompts")
    n, new = len(job.prompt_ids), job.gen.max_new_tokens
    job.log(f"[dim]model {job.model.config.model_type} {job.engine.num_layers} layers; {count(n, 'prompt')} x {new} greedy "
            f"tokens (on-policy data, cached)[/dim]")
    t0 = time.perf_counter()
    with job.progress() as bar:
        task = bar.add_task("on-policy data", total=n, info="")
        data = collect_on_policy(job.engine, job.prompt_ids, new, model_fingerprint(job.model), job.gen.eos_token_ids,
                                 job.setting.cache_dir, on_prompt=lambda i, _n: bar.update(task, completed=i))
    collect_s = time.perf_counter() - t0
    tr, va, ho = data.split3()
    job.log(f"[dim]{data.num_rows} rows ({len(tr)} train, {len(va)} validation, {len(ho)} test) in {collect_s:.1f}s[/dim]")
    info = {**job.prompts, "max_new_tokens": new, "rows": data.num_rows, "train_rows": len(tr),
            "validation_rows": len(va), "heldout_rows": len(ho), "collect_seconds": collect_s}
    return data, {"data": info, "environment": job.environment()}


def progress_callback(bar: Any) -> Progress:
    """A :data:`Progress` callback drawing one bar per task name on ``bar``."""
    tasks: dict[str, int] = {}

    def on_progress(name: str, done: int, total: int, info: str) -> None:
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total, info="")
        bar.update(tasks[name], completed=done, info=info)

    return on_progress


UNUSABLE_TAG = "unusable"  # beside the default path (<default>.unusable): trained, but never loaded by default


def finish(job: Any, spec: Any, items: dict[int, Any], manifest: JsonObject, train_s: float, lines: list[str],
           unusable: str | None = None, **summary: Any) -> JsonObject:
    """Log the per-layer report ``lines``, save the per-layer artifact (``manifest``: the fields of
    :func:`collect` and the trainer's own, its ``training`` completed with the two durations),
    say where; returns the command's summary. ``unusable`` (why the artifact has no usable quality):
    without an explicit ``--output`` or ``--force`` it is written beside the default path as
    ``<default>.unusable``, which no command loads by default (:meth:`OfflineJob.destination`, the one
    rule), and either way one warning line says so and how to remove it."""
    from ..artifacts import save_layers

    for line in lines:
        job.log(line)
    collect_s = manifest["data"]["collect_seconds"]
    manifest["training"].update(collect_seconds=collect_s, train_seconds=train_s)
    out = job.destination(spec, unusable, UNUSABLE_TAG)  # never a default without a usable head (methods/offline.py)
    save_layers(spec, out, job.model, items, manifest)
    job.log(f"wrote {out} (data {collect_s:.1f}s, training {train_s:.1f}s)")
    if unusable:
        job.warn_throwaway(out, unusable, "train on more prompts and tokens")
    return {**summary, "artifact": str(out), "usable": unusable is None, "layers": sorted(items),
            "report": manifest["report"], "rows": manifest["data"]["rows"], "collect_seconds": collect_s,
            "train_seconds": train_s}
