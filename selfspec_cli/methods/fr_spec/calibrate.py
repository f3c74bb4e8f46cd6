"""FR-Spec's draft vocabulary, calibrated (``selfspec calibrate --method fr-spec``).

Decode the calibration prompts greedily with the full model, count the tokens it
emits and its expected counts at those positions, rank the vocabulary
(:mod:`selfspec_cli.methods.fr_spec`), then choose the size ``n`` by measurement:

* **coverage**, held out: rank on half of the prompts and count how many of the
  other half's tokens fall in the top ``n`` (two folds, averaged). A token outside
  the subset can never be drafted, so coverage bounds the share of draft tokens the
  restriction keeps;
* **cost**: the time of the subset head (one row, this engine's kernel, timed right
  after a full step so that it comes from memory as in decoding) against the full
  head and against one full decoding step.

The choice maximizes ``coverage(n) / (c_body + head(n))``: draft tokens the subset
can still propose per unit of draft cost, for a draft whose body keeps half of the
sublayers (``c_body = 0.5 (1 - head share)``; the assumed body only sets how much a
smaller head is worth against lost coverage). Every candidate's figures are saved in
the manifest and printed, and ``--draft-vocab-size`` picks another size at decode time.
:func:`run` is the offline step.

A vocabulary counted from fewer than :data:`MIN_TOKENS` tokens is **too little data**: the held-out
coverage each size is chosen by would then be known to no better than :data:`COVERAGE_SE` (its
standard error, at most ``0.5 / sqrt(tokens)`` for the two folds' mean), the scale of the differences
between neighbouring sizes. Such a result is written beside the default path as
``<default>.too-little-data`` and never becomes the default unless ``--force`` (methods/offline.py:
the one rule; a new user's 2 prompts x 8 tokens, 16 tokens counted, once chose a 16,384-token
vocabulary that ``auto`` then loaded instead of the shipped one).
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import GenerationConfig
from ...errors import count
from ...decoding.measure import timed
from ...engine import Engine
from ..ar import AR
from ..offline import OfflineJob
from . import VOCAB, coverage, ranked_from_outputs, stored_ranks
from ...jsonio import JsonObject

BODY_SHARE = 0.5  # the draft body the choice assumes: half the sublayers kept
COVERAGE_SE = 0.02  # the held-out coverage's standard error a vocabulary that may become the default is chosen at
MIN_TOKENS = math.ceil((0.5 / COVERAGE_SE) ** 2)  # 625: the tokens counted that bound it there (module docstring)


def candidate_sizes(vocab_size: int) -> list[int]:
    """512, 1024, ... below the vocabulary size, then the whole vocabulary."""
    return [*itertools.takewhile(lambda n: n < vocab_size, (512 << i for i in itertools.count())), vocab_size]


@dataclass(frozen=True)
class VocabCalibration:
    ranked_ids: torch.Tensor
    counts: torch.Tensor
    expected: torch.Tensor  # the model's expected counts (the tie-break)
    n: int
    tokens: int
    candidates: list[dict[str, Any]]
    step_ms: float
    head_ms: float
    decode_s: float

    def summary(self) -> JsonObject:
        return {"n": self.n, "tokens_counted": self.tokens, "distinct_tokens": int((self.counts > 0).sum()),
                "step_ms": round(self.step_ms, 3), "full_head_ms": round(self.head_ms, 3),
                "candidates": self.candidates, "rule": f"argmax coverage(n) / (c_body + head(n)), c_body = "
                f"{BODY_SHARE} x (1 - head share)", "decode_s": round(self.decode_s, 1)}


def held_out_coverage(outputs: Sequence[list[int]], vocab_size: int, sizes: Sequence[int],
                      expected: Sequence[torch.Tensor] | None = None) -> list[float]:
    """For each n in ``sizes``: two folds over prompts, rank on one half (its counts, then its
    expected counts), count the other half's tokens in the top n; the folds' mean."""
    even, odd = range(0, len(outputs), 2), range(1, len(outputs), 2)
    odd = odd or even  # a single prompt: its own held-out half
    folds = []
    for a, b in ((even, odd), (odd, even)):
        prior = sum(expected[i] for i in a) if expected is not None else None
        ranked, _ = ranked_from_outputs([outputs[i] for i in a], vocab_size, prior)
        _, counts = ranked_from_outputs([outputs[i] for i in b], vocab_size)
        folds.append((ranked, counts))
    return [sum(coverage(r, c, n) for r, c in folds) / len(folds) for n in sizes]


def expected_counts(engine: Engine, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """Sum of the model's next-token probabilities over the positions that produced ``output``."""
    if not output:
        return torch.zeros(engine.vocab_size, dtype=torch.float64)
    seq = torch.tensor([*prompt, *output[:-1]], dtype=torch.long, device=engine.device)
    cache = engine.new_cache(len(seq))
    logits = engine.forward(cache, seq, positions=0, logits_rows=slice(len(prompt) - 1, None)).logits
    return logits.double().softmax(-1).sum(0).cpu()


def calibrate_draft_vocab(engine: Engine, tokenizer: Any, prompt_ids: Sequence[list[int]], cfg: GenerationConfig,
                          on_prompt: Callable[[int, int], None] = lambda i, n: None) -> VocabCalibration:
    vocab = engine.vocab_size
    ar = AR(engine, tokenizer)
    t0 = time.perf_counter()
    outputs = []
    for i, ids in enumerate(prompt_ids, 1):
        outputs.append(ar.generate(list(ids), cfg).token_ids)
        on_prompt(i, len(prompt_ids))
    expected = [expected_counts(engine, p, o) for p, o in zip(prompt_ids, outputs)]
    decode_s = time.perf_counter() - t0
    prior = sum(expected)
    ranked, counts = ranked_from_outputs(outputs, vocab, prior)

    # costs: one full step (200-token context) and the head alone, one row
    cache = engine.new_cache(256)
    engine.forward(cache, torch.arange(200) % vocab, positions=0)
    step = torch.tensor([1])

    def one_step() -> None:
        engine.forward(cache, step, positions=200)
        cache.crop(200)

    one_step()
    step_ms = statistics.median(timed(one_step, engine.device)[1] for _ in range(15)) * 1e3
    x = torch.randn(1, engine.adapter.hidden_size, dtype=engine.dtype, device=engine.device)

    def cold_ms(head: Any) -> float:
        """The head after a full step, as in decoding: the step's weight traffic has evicted
        it from the caches (timed warm, a 16k-row head fits in L3 and looks 5x cheaper)."""
        times = []
        for _ in range(9):
            one_step()
            times.append(timed(lambda: engine.final_logits(x, head), engine.device)[1])
        return statistics.median(times) * 1e3

    head_ms = cold_ms(None)
    body = BODY_SHARE * (1.0 - head_ms / step_ms)
    rows = []
    sizes = candidate_sizes(vocab)
    for n, cov in zip(sizes, held_out_coverage(outputs, vocab, sizes, expected)):
        ms = cold_ms(engine.subset_head(ranked[:n], share=False)) if n < vocab else head_ms
        c = body + ms / step_ms
        rows.append({"n": n, "held_out_coverage": round(cov, 5), "head_ms": round(ms, 3),
                     "head_share_of_step": round(ms / step_ms, 4), "draft_cost_half_body": round(c, 4),
                     "score": round(cov / c, 4)})
    best = max(rows, key=lambda r: r["score"])
    return VocabCalibration(ranked, counts, prior.float(), best["n"], int(counts.sum()), rows, step_ms, head_ms, decode_s)


def artifact_tensors(res: Any) -> dict[str, torch.Tensor]:
    """What the artifact keeps: the head of the ranking (int32, which the loader widens), its first
    :func:`~selfspec_cli.methods.fr_spec.stored_ranks` ids (the whole ranking of a vocabulary that small; the
    loader puts the rest in token-id order), and the counts of the tokens the outputs held, sparse (ids and
    counts). The model's expected counts only broke ties, and the ranking holds their order. A 262,144-token
    vocabulary's file is 0.26 MB (1 MB with the whole ranking, 5.2 MB as dense int64 ranking, counts and
    float32 expected counts)."""
    seen = torch.nonzero(res.counts > 0).flatten()
    kept = stored_ranks(res.ranked_ids.numel(), res.n)
    return {"ranked_ids": res.ranked_ids[:kept].to(torch.int32), "counted_ids": seen.to(torch.int32),
            "counts": res.counts[seen].to(torch.int32)}


def run(job: OfflineJob) -> JsonObject:
    """Count the model's greedy output tokens, rank, choose the size by measurement; save the artifact."""
    engine = job.engine
    job.log(f"[dim]FR-Spec draft vocabulary: {count(len(job.prompt_ids), 'prompt')} x {count(job.gen.max_new_tokens, 'token')}, greedy, "
            f"vocabulary {engine.vocab_size}[/dim]")
    with job.progress() as bar:
        task = bar.add_task("calibrate fr-spec", total=len(job.prompt_ids), info="")
        res = calibrate_draft_vocab(engine, job.tokenizer, job.prompt_ids, job.gen,
                                    on_prompt=lambda i, n: bar.update(task, completed=i))
    prompts = {**job.prompts, "max_new_tokens": job.gen.max_new_tokens}
    thin = (f"the vocabulary was counted from {count(res.tokens, 'token')} (fewer than {MIN_TOKENS}: its held-out "
            f"coverage is known to worse than {COVERAGE_SE:.0%})" if res.tokens < MIN_TOKENS else None)
    out = job.destination(VOCAB, thin, "too-little-data")
    VOCAB.save(out, job.model, {"vocab_size": engine.vocab_size, **res.summary(), "prompts": prompts,
                                       "environment": job.environment(), "search_time_s": round(res.decode_s, 1)},
               artifact_tensors(res))
    for r in res.candidates:
        job.log(f"  n {r['n']:>6}: held-out coverage {r['held_out_coverage']:.4f}, head {r['head_ms']:.2f} ms "
                f"({r['head_share_of_step']:.1%} of a step), draft cost at half body {r['draft_cost_half_body']:.3f}")
    job.log(f"[bold]draft vocabulary: {res.n} of {engine.vocab_size} tokens ({count(res.tokens, 'token')} counted, "
            f"{int((res.counts > 0).sum())} distinct)[/bold]")
    job.log(f"wrote {out}")
    if thin:
        job.warn_throwaway(out, thin, "calibrate on more prompts and tokens (--num-prompts, --max-new-tokens)")
    return {"method": "fr-spec", "artifact": str(out), "too_little_data": thin is not None, **res.summary()}
