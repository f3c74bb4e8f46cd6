"""FR-Spec (Zhao et al. 2025, arXiv:2502.14856): a frequency-ranked draft vocabulary.

A draft forward ends in the LM head; on SmolLM2 (49152 x 576) that is 12-20 % of a
step and a larger share of a layer-skipping draft. FR-Spec drafts over the ``N``
most frequent tokens only: the draft's logits come from the head's rows for those
tokens (:meth:`~selfspec_cli.engine.Engine.subset_head`), verification keeps the
full head. Unlike the paper, which ranks tokens by their frequency in a pretraining
corpus, the ranking here counts the model's own greedy outputs on calibration
prompts (``selfspec calibrate --method fr-spec``): what a draft has to propose is
what this model says. Ties, and the tokens the outputs never used, are ordered by the
model's expected frequency at those positions (the sum of its next-token
probabilities over every output position), so a few thousand counted tokens still
rank the whole vocabulary sensibly.

Exactness (what the layer-skip drafter relies on, :mod:`selfspec_cli.decoding.layer_skip`):

* **greedy**: the draft proposes the argmax over the subset; verification compares
  each draft token with the full model's argmax over the whole vocabulary and keeps
  the longest agreeing prefix plus the full model's own next token. The output is
  the full model's greedy output whatever the draft proposes, so restricting the
  draft changes only how many drafts are accepted, never the tokens.
* **sampling**: let ``S`` be the subset and ``q`` the draft's processed distribution
  over ``S``, extended by ``q(x) = 0`` for ``x`` outside ``S``; the draft token is
  sampled from this ``q`` and the verifier is handed the same ``q``. Speculative
  sampling accepts ``x ~ q`` with probability ``min(1, p(x)/q(x))`` and otherwise
  samples from ``r(x) ∝ max(0, p(x) - q(x))``. Then
  ``P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(q(x), p(x)) + (p(x) - min(q(x), p(x)))``
  because ``P(reject) = Σ_y max(0, q(y) - p(y)) = Σ_y max(0, p(y) - q(y))`` (both laws
  sum to one) is exactly ``r``'s normalizer; so
  ``P(emit x) = p(x)`` for every ``x``. For ``x`` outside ``S``, ``q(x) = 0``: ``x``
  is never drafted and is emitted only through the residual with probability
  ``p(x)``. Nothing in the argument needs ``q`` to cover the vocabulary; it only
  needs the draft to be sampled from the very ``q`` the verifier sees
  (tests/test_verify_exact.py enumerates this, and the broken variant that hands the
  verifier the unrestricted law fails there).

The package is the whole method: this module holds the vocabulary and its artifact
(:data:`VOCAB`), :mod:`.calibrate` the offline step that makes it. The artifact: ``ranked_ids`` (the vocabulary most
frequent first: its first :func:`stored_ranks` ids, the rest taken in token-id order when it is read), ``counted_ids`` and
``counts`` (each token the calibration outputs held, and how often; an older artifact holds
dense ``counts`` and ``expected`` instead) and a manifest with the chosen size ``n`` and the
measurements behind it. Only ``ranked_ids`` is read to draft.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...artifacts import ArtifactSpec
from ...engine.target import QUANT_TARGETS
from ...errors import FieldError
from ..offline import OfflineStep

VOCAB = ArtifactSpec(kind="fr-spec-vocab", folder="fr-spec-vocab", what="FR-Spec draft-vocabulary artifact",
                     make="selfspec calibrate --method fr-spec", args=" --prompt-file <prompts>")
CALIBRATE = OfflineStep("calibrate", "fr-spec", VOCAB, "selfspec_cli.methods.fr_spec.calibrate", num_prompts=64,
                        max_new_tokens=128)


def rank_vocabulary(counts: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids, most frequent first; ties (unseen tokens included) by ``prior`` (higher
    first, e.g. the model's expected frequency), then in token-id order."""
    ids = torch.arange(counts.numel())
    if prior is not None:  # stable sorts: the last key sorted is the primary one
        ids = ids[torch.sort(-prior.double(), stable=True).indices]
    return ids[torch.sort(-counts[ids].to(torch.int64), stable=True).indices]


def coverage(ranked: torch.Tensor, counts: torch.Tensor, n: int) -> float:
    """Share of the counted tokens that fall in the top ``n`` of ``ranked``."""
    total = int(counts.sum())
    return float(counts[ranked[:n]].sum()) / total if total else 0.0


RANKS_KEPT = 65536  # an artifact stores at least this many of its ranked ids (or the whole vocabulary)


def stored_ranks(vocab: int, n: int) -> int:
    """How many ranked ids an artifact of a ``vocab``-token vocabulary and draft size ``n`` stores: at least
    :data:`RANKS_KEPT` and twice ``n`` (a size chosen later up to there keeps the measured order), at most all."""
    return min(vocab, max(RANKS_KEPT, 2 * n))


def complete_ranking(stored: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """The whole ranking from a stored head of it: its ids, then every other id in token-id order; None when the
    stored ids are not distinct ids of the vocabulary."""
    stored = stored.to(torch.int64)
    if stored.dim() != 1 or not 0 < stored.numel() <= vocab:
        return None
    if int(stored.min()) < 0 or int(stored.max()) >= vocab:
        return None
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[stored] = True
    if int(seen.sum()) != stored.numel():
        return None
    return torch.cat([stored, torch.nonzero(~seen).flatten()])


@dataclass(frozen=True)
class DraftVocab:
    """The ranked vocabulary and the size drafts use."""

    ranked_ids: torch.Tensor  # (V,) int64
    n: int
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> torch.Tensor:
        return self.ranked_ids[: self.n]

    def with_size(self, n: int | None) -> DraftVocab:
        if n is None:
            return self
        if not 1 <= n <= self.ranked_ids.numel():
            raise FieldError("draft_vocab_size", f"must be in 1..{self.ranked_ids.numel()} (the vocabulary), got {n}")
        return DraftVocab(self.ranked_ids, n, self.manifest)

    @classmethod
    def load(cls, path: str | os.PathLike | None, model: torch.nn.Module) -> DraftVocab:
        p, manifest, tensors = VOCAB.load(path, model)
        ranked = tensors.get("ranked_ids")
        vocab = int(model.config.vocab_size)  # the head's rows (its weights may be released: Engine.release_float_weights)
        whole = None if ranked is None else complete_ranking(ranked, vocab)
        if whole is None:
            raise VOCAB.error(p, model, f"it does not rank this model's {vocab}-token vocabulary")
        return cls(whole, int(manifest.get("n", vocab)), manifest)


def resolve(spec: str | None, model: torch.nn.Module, size: int | None = None) -> DraftVocab | None:
    """The draft vocabulary a config names: ``'full'`` (or None): none; ``'auto'``: this
    model's calibrated one when there is one (the user's first, then a shipped one),
    else none; anything else: a path that must hold one."""
    if spec is None or spec == "full":
        if size is not None:
            raise FieldError("draft_vocab_size", "needs a draft vocabulary (draft_vocab 'auto' with an artifact, or a path)")
        return None
    if spec == "auto":
        spec, _ = VOCAB.find(model)
        if spec is None:
            return None
    return DraftVocab.load(spec, model).with_size(size)


def draft_vocab(engine: Any, weights: str | None, spec: str | None = "auto", size: int | None = None) -> torch.Tensor | None:
    """The token ids of the draft vocabulary ``spec`` names (see :func:`resolve`) for a layer-skip
    draft over ``weights`` (None: the whole vocabulary). ``auto`` keeps the full vocabulary for a
    draft over quantized weights: its head is cheap there, and a subset caps the acceptance of a
    draft that otherwise agrees with the target (measured on SmolLM2 with the GGUF-block draft:
    M 4.7 -> 9.0, decode-only 2.00x -> 2.07x `ar`; docs/engine.md, "Quantized drafts"). Not on a
    block target: the draft's head is then the target's own blocks, as costly as the target's head
    (docs/engine.md, "The target's weights")."""
    block_target = engine.target_precision in QUANT_TARGETS
    if spec == "auto" and size is None and weights is not None and not block_target:
        spec = "full"
    vocab = resolve(spec, engine.model, size)
    return None if vocab is None else vocab.ids


def ranked_from_outputs(outputs: Iterable[list[int]], vocab_size: int,
                        prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranked ids, counts per token id)`` from generated token sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in outputs:
        if seq:
            counts += torch.bincount(torch.tensor(seq, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return rank_vocabulary(counts, prior), counts
