"""The draft-verify core shared by the layer-skipping methods (Self-SD, SWIFT, ASD).

One round (:meth:`SelfSpeculative._round`), gpt-fast style:

1) draft: run the target with a skip set over its own KV cache, one token at a time
   from the pending token, until the draft budget is spent or the draft's
   confidence drops below the threshold (that last token is still kept);
2) roll back: crop every layer to the verified length (draft K/V is discarded, never
   copied);
3) verify: one full-depth forward over the pending token plus the drafts, as a chain
   or as SWIFT's candidate tree (top-k siblings per depth, chosen by confidence);
4) accept: an exact rule from :mod:`.verify`; keep the accepted K/V (crop for a
   chain, compact the accepted path for a tree).

Invariant between rounds: every emitted token except the newest (the *pending*
token) is in the cache, at every layer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from typing import Any

from ..config import GenerationConfig, SamplingConfig
from ..engine import Engine, ForwardOutput, KVCache
from ..engine.runner import ALL_ROWS
from ..engine.tree import tree_mask_from_parents, tree_positions
from .loop import DecodeResult, DecodeStats, TokenSink
from .sampling import make_generator, processed_probs, sample_from
from .verify import Verdict, verify_chain_greedy, verify_chain_sampling, verify_tree


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """How drafts are made and verified.

    ``max_draft``: at most this many draft tokens per round. ``threshold``: initial
    draft-exit threshold (stop after a token whose draft confidence is below it).
    ``adaptive``: Draft & Verify's adaptive threshold. ``tree``: SWIFT's dynamic
    verification; ``tree_topk`` maps confidence bins (upper bounds) to the number of
    candidates kept at a depth; ``tree_max_nodes`` caps the candidate nodes of one tree
    (None: no cap, the paper's GPU setting). On a CPU every verified row costs a few
    per cent of a step, so a large tree can cost more than it wins.
    """

    max_draft: int = 12
    threshold: float = 0.6
    adaptive: bool = True
    tree: bool = False
    tree_topk: tuple[tuple[float, int], ...] = ((0.5, 10), (0.8, 5), (0.95, 3), (1.0, 1))
    tree_max_nodes: int | None = None

    def topk_for(self, confidence: float) -> int:
        for upper, k in self.tree_topk:
            if confidence <= upper:
                return k
        return self.tree_topk[-1][1]


@dataclass(slots=True)
class AdaptiveThreshold:
    """Draft & Verify (Zhang et al. 2024) draft-exit threshold, carried across prompts:
    acceptance EMA ``m <- 0.5 m + 0.5 (accepted / drafted)``; candidate
    ``th' = th + 0.01`` if ``m < 0.9`` else ``th - 0.01`` (unchanged when the draft hit
    its length limit, since the threshold did not end it); ``th <- 0.9 th + 0.1 th'``."""

    value: float
    ema: float = 1.0
    target: float = 0.9
    step: float = 0.01

    def update(self, accepted: int, drafted: int, hit_limit: bool) -> None:
        if drafted == 0:
            return
        self.ema = 0.5 * self.ema + 0.5 * (accepted / drafted)
        if hit_limit:
            return
        cand = self.value + self.step if self.ema < self.target else self.value - self.step
        self.value = min(1.0, max(0.0, 0.9 * self.value + 0.1 * cand))


@dataclass(slots=True)
class Draft:
    tokens: list[int]  # chain: the drafts; tree: the candidate nodes
    parents: list[int] | None = None  # tree only (-1: child of the pending token)
    q_rows: torch.Tensor | None = None  # chain sampling: (k, V) draft distributions
    chain_len: int = 0  # draft forwards made
    hit_limit: bool = False


@dataclass(slots=True)
class RoundContext:
    cache: KVCache
    pos: int  # position of the pending token
    pending: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    stats: DecodeStats
    timings: dict[str, float] = field(default_factory=lambda: {"draft_s": 0.0, "verify_s": 0.0})


class SelfSpeculative:
    """Layer-skipping draft + full-model verify. Subclasses choose the skip sets."""

    def __init__(self, engine: Engine, draft: DraftConfig) -> None:
        self.engine = engine
        self.draft_cfg = draft
        self.threshold = AdaptiveThreshold(draft.threshold)

    # -- hooks -------------------------------------------------------------
    def skip_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        raise NotImplementedError

    needs_attn_cosine: bool = False  # ASD reads per-layer cosine similarities of the prompt

    def on_prefill(self, ctx: RoundContext, prompt: torch.Tensor, out: ForwardOutput) -> None:
        """Called after the prompt is cached (ASD chooses its skip set here)."""

    def after_round(self, ctx: RoundContext, draft: Draft, verdict: Verdict, emitted: list[int]) -> None:
        """Called after each verification (SWIFT's optimization step goes here)."""

    def describe(self) -> dict[str, Any]:
        """Method state reported in each prompt's ``stats`` (skip sets used, ...)."""
        attn, mlp = self.skip_sets()
        return {"skip_attn": sorted(attn), "skip_mlp": sorted(mlp), "draft_threshold": round(self.threshold.value, 4)}

    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        sink = TokenSink(cfg, getattr(self, "tokenizer", None))
        stats = self.decode(prompt_ids, cfg, sink)
        stats.extra.update(self.describe())
        return sink.result(stats)

    # -- decoding ----------------------------------------------------------
    def decode(self, prompt_ids: list[int], cfg: GenerationConfig, sink: TokenSink) -> DecodeStats:
        eng = self.engine
        stats = DecodeStats()
        gen = make_generator(cfg.sampling, eng.device)
        n = len(prompt_ids)
        cache = eng.new_cache(n + cfg.max_new_tokens + 2 * self.draft_cfg.max_draft + 32)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=eng.device)
        # 1) prefill
        out = eng.forward(cache, ids, positions=0, attn_cosine=self.needs_attn_cosine)
        first = self._select(out.logits[0], cfg.sampling, gen)
        stats.target_forwards += 1
        stats.accept_lengths.append(sink.push([first]))
        ctx = RoundContext(cache, n, first, cfg.sampling, gen, stats)
        self.on_prefill(ctx, ids, out)
        # 2) rounds
        while not sink.done:
            self._round(ctx, sink)
        stats.extra.update({k: round(v, 6) for k, v in ctx.timings.items()})
        return stats

    @staticmethod
    def _select(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
        if cfg.greedy:
            return int(logits.argmax())
        return sample_from(processed_probs(logits, cfg), gen)

    def _draft(self, ctx: RoundContext, budget: int) -> Draft:
        eng, dc = self.engine, self.draft_cfg
        skip_attn, skip_mlp = self.skip_sets()
        sampling = ctx.sampling
        tokens: list[int] = []
        parents: list[int] = []
        q_rows: list[torch.Tensor] = []
        tok, p = ctx.pending, ctx.pos
        chain_parent = -1
        max_k = max(k for _, k in dc.tree_topk)
        inp = torch.empty(1, dtype=torch.long, device=eng.device)
        steps, hit_limit = 0, True
        for _ in range(budget):
            inp[0] = tok
            logits = eng.forward(ctx.cache, inp, positions=p, skip_attn=skip_attn, skip_mlp=skip_mlp).logits[0]
            probs = logits.softmax(-1) if sampling.greedy else processed_probs(logits, sampling)
            steps += 1
            if dc.tree:
                # one top-k and one host sync: the top-1 probability picks how many siblings to keep
                values, indices = torch.topk(probs, min(max_k, probs.shape[-1]))
                values, indices = values.tolist(), indices.tolist()
                conf, d = values[0], indices[0]
                width = dc.topk_for(conf)
                if dc.tree_max_nodes is not None:
                    width = max(1, min(width, dc.tree_max_nodes - len(tokens)))
                top = indices[:width]
                first_idx = len(tokens)
                tokens.extend(top)
                parents.extend([chain_parent] * len(top))
                chain_parent = first_idx
                if dc.tree_max_nodes is not None and len(tokens) >= dc.tree_max_nodes:
                    break  # node budget spent (counts as the length limit: hit_limit stays True)
            elif sampling.greedy:
                conf_t, d_t = probs.max(-1)
                conf, d = float(conf_t), int(d_t)
                tokens.append(d)
            else:
                d = sample_from(probs, ctx.generator)
                q_rows.append(probs)
                conf = float(probs.max())
                tokens.append(d)
            tok, p = d, p + 1
            if conf < self.threshold.value:
                hit_limit = False
                break
        return Draft(tokens, parents if dc.tree else None, torch.stack(q_rows) if q_rows else None, steps, hit_limit)

    def _round(self, ctx: RoundContext, sink: TokenSink) -> None:
        eng = self.engine
        cache, pos = ctx.cache, ctx.pos
        # never draft more than can be emitted: a round emits at most drafts + 1 tokens
        budget = min(self.draft_cfg.max_draft, sink.remaining - 1)
        t0 = time.perf_counter()
        draft = self._draft(ctx, budget) if budget > 0 else Draft([])
        t1 = time.perf_counter()
        # 2) roll back the draft's K/V
        cache.crop(pos)
        # 3) verify with the full model
        inp = torch.tensor([ctx.pending, *draft.tokens], dtype=torch.long, device=eng.device)
        if draft.parents is None:
            logits = eng.forward(cache, inp, positions=pos, logits_rows=ALL_ROWS).logits
            if ctx.sampling.greedy:
                verdict = verify_chain_greedy(draft.tokens, logits)
            else:
                q = draft.q_rows if draft.q_rows is not None else logits.new_zeros(0, logits.shape[-1])
                verdict = verify_chain_sampling(draft.tokens, q, logits, ctx.sampling, ctx.generator)
            n = len(verdict.accepted)
            cache.crop(pos + 1 + n)
        else:
            parents = [-1] + [p + 1 for p in draft.parents]
            logits = eng.forward(
                cache, inp, positions=tree_positions(parents, pos, eng.device),
                tree_mask=tree_mask_from_parents(parents, eng.device), logits_rows=ALL_ROWS,
            ).logits
            verdict = verify_tree(draft.tokens, draft.parents, logits, ctx.sampling, ctx.generator)
            n = len(verdict.accepted)
            cache.compact([pos + 1 + i for i in verdict.accepted], pos + 1)
        t2 = time.perf_counter()
        # 4) emit and bookkeeping
        kept = sink.push(verdict.tokens)
        st = ctx.stats
        st.target_forwards += 1
        st.accept_lengths.append(kept)
        st.drafted_tokens += draft.chain_len
        st.accepted_draft_tokens += n
        ctx.timings["draft_s"] += t1 - t0
        ctx.timings["verify_s"] += t2 - t1
        if self.draft_cfg.adaptive and draft.chain_len:
            self.threshold.update(n, draft.chain_len, draft.hit_limit)
        ctx.pos = pos + 1 + n
        ctx.pending = verdict.tokens[-1]
        self.after_round(ctx, draft, verdict, verdict.tokens[:kept])
