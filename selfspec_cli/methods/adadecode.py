"""AdaDecode: adaptive layer parallelism with early predictions at intermediate heads
(Wei et al., ICML 2025, Algorithm 1), lossless.

Per input token ``x`` at position ``p`` the layers run in *segments* that end at head
layers. After a segment that ends at head layer ``k``, the head predicts the next
token; if its confidence exceeds ``threshold`` (and fewer than ``max_pending``
early tokens are unverified), the token is *predicted early*: ``x``'s residual rows
wait before layer ``k+1`` and the early token starts at layer 0 right away. Rows
that wait before a layer run it together with the next token that reaches it (one
batched call: the rows are always a contiguous suffix of the sequence, so a causal
block at the layer's own cache length is the right mask). When a token reaches the
last layer, every unverified early token is in its batch; the final logits of all
rows verify them in order:

* greedy: accept while the early token equals the final argmax; the first mismatch
  is replaced by the argmax, everything after it is dropped (caches cropped);
* sampling: the early token is a *deterministic* proposal (the head's top token of
  its processed distribution, taken when that probability exceeds the threshold),
  so it is accepted with probability ``p*(x0)`` and on rejection the replacement is
  drawn from ``p*`` without ``x0``, renormalised — speculative sampling with a
  one-hot draft. This is exactly the target's law. The paper's rule (accept with
  ``min(1, p*/p_i)``, resample from ``norm(max(0, p* - p_i))``) treats the gated
  proposal as if it were a sample of ``p_i`` and is biased; the sampling test runs
  it as a control and rejects it.
* if all are accepted the last row's final distribution gives one more token.

Invariants: every emitted token except the newest is in the cache at every layer
it has run; ``cache.lengths[s] == p - rows + 1`` when ``rows`` rows enter segment
``s``; after verification every layer holds exactly the accepted prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import GenerationConfig
from ..decoding.loop import DecodeResult, DecodeStats, TokenSink
from ..decoding.sampling import make_generator, processed_probs, select_token
from ..decoding.verify import Verdict, verify_chain_greedy, verify_chain_sampling
from ..engine import Engine
from ..engine.runner import ALL_ROWS
from ..errors import ConfigError
from ..heads.modules import LowRankHead, head_logits
from .base import Method


@dataclass(frozen=True, slots=True)
class AdaDecodeConfig:
    threshold: float = 0.5  # gamma; the paper uses 0.75 (App. D), see docs/early-exit.md for 0.5 here
    max_pending: int = 5  # most unverified early predictions (paper App. D)
    layers: tuple[int, ...] | None = None  # head layers used (default: every head of the artifact)

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"--adadecode-threshold must be in [0, 1], got {self.threshold}")
        if self.max_pending < 1:
            raise ConfigError(f"--adadecode-max-pending must be >= 1, got {self.max_pending}")


def proposal_law(head_probs: torch.Tensor, token: int) -> torch.Tensor:
    """The law the early token was drawn from, for speculative verification: a point
    mass, because the token is the head's top token taken when it passes the gate.
    (The paper uses ``head_probs`` here, which is biased; the sampling test's control
    patches this function to do that.)"""
    q = torch.zeros_like(head_probs)
    q[token] = 1.0
    return q


class AdaDecode(Method):
    name = "adadecode"
    lossless = True
    description = "AdaDecode: early predictions at trained intermediate heads, deferred deep layers, verification"

    def __init__(self, engine: Engine, tokenizer=None, *, heads: dict[int, LowRankHead],
                 config: AdaDecodeConfig = AdaDecodeConfig()) -> None:
        super().__init__(engine, tokenizer)
        L = engine.num_layers
        use = sorted(heads) if config.layers is None else sorted(config.layers)
        missing = [k for k in use if k not in heads]
        if missing:
            raise ConfigError(f"--adadecode-layers {missing} have no trained head (heads at {sorted(heads)})")
        bad = [k for k in use if not 0 <= k < L - 1]
        if bad:
            raise ConfigError(f"head layers {bad} are out of range for a {L}-layer model")
        self.config = config
        self.heads = {k: heads[k].to(engine.device, engine.dtype) for k in use}
        # segments [s, e): each ends after a head layer (e - 1) or at the last layer
        bounds = [0, *[k + 1 for k in use], L]
        self.segments = list(zip(bounds[:-1], bounds[1:]))

    def _head(self, layer: int, row: torch.Tensor) -> torch.Tensor:
        a = self.engine.adapter
        return head_logits(row, self.heads[layer], self.engine.lm_head, a.rms_eps)[0].float()  # (V,)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        eng, c = self.engine, self.config
        L = eng.num_layers
        sink = TokenSink(cfg, self.tokenizer)
        stats = DecodeStats()
        gen = make_generator(cfg.sampling, eng.device)
        greedy = cfg.sampling.greedy
        eos = set() if cfg.ignore_eos else set(cfg.eos_token_ids)
        n = len(prompt_ids)
        cache = eng.new_cache(n + cfg.max_new_tokens + c.max_pending + 2)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=eng.device)
        exits = {k: 0 for k in self.heads}

        # 1) prefill at full depth; its last row gives the first token exactly
        logits = eng.forward(cache, ids, positions=0).logits[0]
        token = select_token(logits, cfg.sampling, gen)
        stats.target_forwards += 1
        stats.accept_lengths.append(1)
        sink.push([token])
        waiting: dict[int, torch.Tensor] = {}  # segment start -> residual rows waiting to enter it
        early: list[int] = []  # unverified early tokens, in order (each was fed as an input)
        early_q: list[torch.Tensor] = []  # sampling: their proposal laws
        pos = n  # position of `token`, the next input
        while not sink.done:
            # 2) run the input token down the segments, joined by the rows waiting at each
            h = eng.embed(ids.new_tensor([token]))
            can_exit = len(early) < c.max_pending and len(early) + 2 <= sink.remaining and token not in eos
            exited = False
            for s, e in self.segments:
                if s in waiting:
                    h = torch.cat([waiting.pop(s), h])
                first = pos - h.shape[0] + 1
                assert cache.lengths[s] == first, (s, cache.lengths[s], first)
                out = eng.forward(cache, hidden=h, positions=first, start=s, end=e,
                                  logits_rows=ALL_ROWS if e == L else None)
                h = out.hidden
                if e == L or not can_exit:
                    continue
                # 3) early prediction at head layer e - 1
                head = self._head(e - 1, h[-1:])
                if greedy:
                    conf, guess = head.softmax(-1).max(-1)
                    q = None
                else:
                    q = processed_probs(head, cfg.sampling)
                    conf, guess = q.max(-1)
                if float(conf) > c.threshold:
                    guess = int(guess)
                    waiting[e] = torch.cat([waiting[e], h]) if e in waiting else h
                    early.append(guess)
                    if q is not None:
                        early_q.append(proposal_law(q, guess))
                    exits[e - 1] += 1
                    stats.drafted_tokens += 1
                    token, pos, exited = guess, pos + 1, True
                    break
            if exited:
                continue
            # 4) verify every pending early token with the final logits of all rows
            final = out.logits  # (len(early) + 1, V)
            assert final.shape[0] == len(early) + 1 and not waiting, (final.shape, len(early), list(waiting))
            if greedy:
                verdict: Verdict = verify_chain_greedy(early, final)
            else:
                q_draft = torch.stack(early_q) if early_q else final[:0]
                verdict = verify_chain_sampling(early, q_draft, final, cfg.sampling, gen)
            accepted = len(verdict.accepted)
            first = pos - len(early)
            # 5) rollback: drop the rejected tail at every layer
            cache.crop(first + accepted + 1)
            stats.target_forwards += 1
            stats.accepted_draft_tokens += accepted
            stats.accept_lengths.append(len(verdict.tokens))
            sink.push(verdict.tokens)
            token, pos = verdict.tokens[-1], first + accepted + 1
            early, early_q = [], []
        stats.extra["early_exits"] = {str(k): v for k, v in exits.items()}
        stats.extra["adadecode_threshold"] = c.threshold
        stats.extra["head_layers"] = sorted(self.heads)
        return sink.result(stats)
