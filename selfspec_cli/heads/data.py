"""On-policy training data: the target's own greedy continuations, with the
residual stream captured after every layer, cached on disk.

AdaDecode trains its heads on the base model's greedy responses (paper App. D)
and SpecEE collects its predictor data from full-depth greedy decoding; both
need, for each decoded position, the hidden state after each layer and the
token the full model picks there. One row per position whose next token the
model predicted: the last prompt position and every generated token but the
last.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from typing import Any

from ..config import GenerationConfig
from ..decoding.state import DecodeState
from ..decoding.drafts import Round
from ..engine import Engine, ForwardOutput
from ..methods.ar import AR
from ..errors import ArtifactError
from ..paths import atomic_write, cache_root


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


def collection_key(fingerprint: str, prompt_ids: list[list[int]], max_new_tokens: int) -> str:
    blob = json.dumps({"fp": fingerprint, "prompts": prompt_ids, "n": max_new_tokens, "v": 1}).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


class _HiddenRecorder(AR):
    """Plain greedy decoding through the driver that keeps, for each round's input row,
    the residual stream after every layer and the token the model picked (over all the
    prompts it decodes)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.layers = range(engine.num_layers)
        self.rows: list[torch.Tensor] = []
        self.targets: list[int] = []

    def verify_options(self) -> dict[str, Any]:
        return {"output_hidden": self.layers}

    def _take(self, out: ForwardOutput, token: int) -> None:
        self.rows.append(torch.stack([out.hidden_at[l][-1] for l in self.layers]).float().cpu())  # (L, d)
        self.targets.append(token)

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self._take(prefill, state.pending)

    def update(self, state: DecodeState, rnd: Round) -> None:
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

    key = collection_key(fingerprint, prompt_ids, max_new_tokens)
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
        rec.generate(ids, gen_cfg)
        index += [i] * (len(rec.targets) - len(index))
        on_prompt(i + 1, len(prompt_ids))
    data = OnPolicyData(torch.stack(rec.rows), torch.tensor(rec.targets, dtype=torch.long), torch.tensor(index), key)
    tensors = {"hidden": data.hidden.contiguous(), "target": data.target, "prompt_index": data.prompt_index}
    atomic_write(path, lambda f: save_file(tensors, f.name), error=lambda exc: ArtifactError(
        f"cannot write the on-policy data cache '{directory}' ({exc.strerror}); pass --cache-dir"))
    return data
