"""SpecEE: speculative early exiting (Xu et al., ISCA 2025) in autoregressive decoding.
LOSSY: an exited token is emitted without running the deeper layers, so the output
can differ from plain decoding (``lossless = False``; measure it with ``evaluate``).

Per input token ``x`` at position ``p``:

1. run the layers up to the drafter layer ``k0``; the drafter is the shallowest
   trained AdaDecode head (one head evaluation, about the cost of one LM-head
   GEMV) and its top-4 are the *speculative tokens* for the next position — no
   separate draft model (the paper uses an EAGLE head, which we do not have);
2. at every *scheduled* predictor layer ``l`` (>= k0, <= L-2) build the 12 features
   of :func:`~selfspec_cli.heads.modules.specee_features` from the normalised state
   at ``l`` and at ``l - 1`` (computed the same way as in training: the change is
   always against the immediately preceding layer, never against the previous
   *scheduled* layer, which is the reference code's train/inference mismatch);
3. if the layer's predictor fires (sigmoid > threshold), verify against the full
   vocabulary: the argmax of the LM head on the normalised state must be one of the
   speculative tokens; if so, exit and emit that argmax;
4. otherwise continue; at the last layer emit the final argmax.

Scheduling (paper §5.3): the offline subset (``selfspec calibrate --method specee``)
united with the online window: each of the last ``online_window`` (5) exit layers
``x`` of this prompt adds ``x-2 .. x+2``. History is per prompt (the reference keeps
one global list forever).

KV of the skipped layers (``kv_mode``):

* ``empty`` — the paper's behaviour: an exited token writes no K/V in layers > l, so
  later tokens never see it there (per-layer cache lengths diverge);
* ``deferred`` — KV-preserving: the exited token's remaining layers run later,
  batched with the next token that reaches them (AdaDecode's deferral, without
  verification), so every layer's cache ends up as full decoding of this output
  would have made it. At most ``max_pending`` tokens wait.

``evaluate`` also runs a full-depth shadow decoder teacher-forced on the emitted
tokens, and reports the share of early exits that picked the token the full model
would have picked at that step, the share of all tokens that agree, and the share
of the output identical to plain greedy decoding up to the first divergence.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..config import GenerationConfig
from ..decoding.loop import DecodeResult, DecodeStats, TokenSink
from ..engine import Engine
from ..engine.runner import LAST_ROW
from ..errors import ConfigError
from ..heads.modules import NUM_SPEC_TOKENS, ExitPredictor, LowRankHead, exit_probability, head_logits, specee_features
from .base import Method

KV_MODES = ("empty", "deferred")


@dataclass(frozen=True, slots=True)
class SpecEEConfig:
    kv_mode: str = "deferred"
    threshold: float | None = None  # predictor decision threshold; None: the artifact's per-layer ones (paper: 0.5)
    online_window: int = 5  # N last exits (paper: 5)
    online_radius: int = 2  # +-2 layers (paper)
    max_pending: int = 5  # deferred mode: most tokens whose deep layers wait
    evaluate: bool = False

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ConfigError(f"--specee-kv-mode must be one of {', '.join(KV_MODES)}; got '{self.kv_mode}'")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"--specee-threshold must be in [0, 1], got {self.threshold}")


class SpecEE(Method):
    name = "specee"
    lossless = False
    description = "SpecEE (LOSSY): speculative early exit with per-layer predictors and two-level scheduling"

    def __init__(self, engine: Engine, tokenizer=None, *, drafter_layer: int, drafter: LowRankHead,
                 predictors: dict[int, ExitPredictor], offline_layers: list[int],
                 config: SpecEEConfig = SpecEEConfig(), thresholds: dict[int, float] | None = None) -> None:
        super().__init__(engine, tokenizer)
        L = engine.num_layers
        if not 0 <= drafter_layer < L - 1:
            raise ConfigError(f"drafter layer {drafter_layer} is out of range for a {L}-layer model")
        self.config = config
        self.k0 = drafter_layer
        self.drafter = drafter.to(engine.device, engine.dtype)
        self.predictors = {l: p.to(engine.device, torch.float32) for l, p in predictors.items() if drafter_layer <= l <= L - 2}
        self.offline = frozenset(l for l in offline_layers if l in self.predictors)
        per_layer = thresholds or {}
        self.thresholds = {l: (config.threshold if config.threshold is not None else per_layer.get(l, 0.5))
                           for l in self.predictors}

    def _active(self, history: deque[int]) -> set[int]:
        r = self.config.online_radius
        online = {x + d for x in history for d in range(-r, r + 1)}
        return set(self.offline) | {l for l in online if l in self.predictors}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        if not cfg.sampling.greedy:
            raise ConfigError("specee decodes greedily, as the paper does; use --temperature 0")
        eng, c = self.engine, self.config
        a = eng.adapter
        L, k0 = eng.num_layers, self.k0
        sink = TokenSink(cfg, self.tokenizer)
        stats = DecodeStats()
        n = len(prompt_ids)
        cache = eng.new_cache(n + cfg.max_new_tokens + c.max_pending + 2)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=eng.device)
        deferred = c.kv_mode == "deferred"
        history: deque[int] = deque(maxlen=c.online_window)
        exits = {l: 0 for l in self.predictors}
        checks = verifications = failed_verifications = 0
        layers_run = 0
        # evaluation: a full-depth shadow decoder fed the same tokens
        shadow = eng.new_cache(n + cfg.max_new_tokens + 1) if c.evaluate else None
        ev = {"exits": 0, "exits_agree": 0, "tokens": 0, "tokens_agree": 0, "first_divergence": None}

        # 1) prefill at full depth
        logits = eng.forward(cache, ids, positions=0).logits[0]
        if shadow is not None:
            eng.forward(shadow, ids, positions=0, logits_rows=None)
        token = int(logits.argmax())
        stats.target_forwards += 1
        stats.accept_lengths.append(1)
        sink.push([token])
        waiting: dict[int, torch.Tensor] = {}
        pos = n
        while not sink.done:
            ref = None
            if shadow is not None:
                ref = int(eng.forward(shadow, ids.new_tensor([token]), positions=pos).logits[0].argmax())
            active = self._active(history)
            pending = sum(v.shape[0] for v in waiting.values())
            can_exit = pending < c.max_pending
            stops = {k0} | (active if can_exit else set())
            bounds = sorted({0, L} | {l + 1 for l in stops} | set(waiting))
            h = eng.embed(ids.new_tensor([token]))
            prev_last: torch.Tensor | None = None  # current row after the previous segment's last layer
            spec = spec_rows = None
            exit_layer, new_token = None, None
            for s, e in zip(bounds[:-1], bounds[1:]):
                # 2) run a segment, joined by the rows waiting before it (deferred mode)
                if s in waiting:
                    h = torch.cat([waiting.pop(s), h])
                l = e - 1
                want_prev = l in active and l - 1 >= max(k0, s)
                out = eng.forward(cache, hidden=h, positions=pos - h.shape[0] + 1, start=s, end=e,
                                  output_hidden=(l - 1,) if want_prev else (), logits_rows=LAST_ROW if e == L else None)
                layers_run += e - s
                h_prev = out.hidden_at[l - 1][-1:] if want_prev else prev_last
                h = out.hidden
                prev_last = h[-1:]
                if e == L:
                    break
                if l == k0:  # 3) the drafter: the shallowest head's top-4 are the speculative tokens
                    spec = head_logits(prev_last, self.drafter, self.engine.lm_head, a.rms_eps)[0].topk(NUM_SPEC_TOKENS).indices
                    spec_rows = a.lm_head[spec]  # (4, d)
                if not can_exit or l not in active:
                    continue
                # 4) predictor on [s, q, dq] at this layer; the change is against layer l - 1
                rows = prev_last if l == k0 else torch.cat([h_prev, prev_last])
                z = torch.nn.functional.rms_norm(rows, (rows.shape[-1],), a.final_norm, a.rms_eps)
                s_all = torch.nn.functional.linear(z, spec_rows).float()  # (1 or 2, 4)
                feats = specee_features(s_all[-1:], None if l == k0 else s_all[:1])
                checks += 1
                if float(exit_probability(feats, self.predictors[l])) <= self.thresholds[l]:
                    continue
                # 5) verification over the full vocabulary
                verifications += 1
                best = int(eng.final_logits(prev_last)[0].argmax())
                if best in spec.tolist():
                    exit_layer, new_token = l, best
                    break
                failed_verifications += 1
            if exit_layer is None:
                new_token = int(out.logits[0].argmax())
                history.append(L - 1)
            else:
                history.append(exit_layer)
                exits[exit_layer] += 1
                if deferred:  # the rest of this token's layers run with the next token that reaches them
                    e = exit_layer + 1
                    waiting[e] = torch.cat([waiting[e], h]) if e in waiting else h
                # empty mode: layers > exit_layer never get this token's K/V
            if ref is not None:
                ev["tokens"] += 1
                ev["tokens_agree"] += int(new_token == ref)
                if exit_layer is not None:
                    ev["exits"] += 1
                    ev["exits_agree"] += int(new_token == ref)
                if new_token != ref and ev["first_divergence"] is None:
                    ev["first_divergence"] = len(sink.tokens)
            stats.target_forwards += 1
            stats.accept_lengths.append(1)
            sink.push([new_token])
            token, pos = new_token, pos + 1
        steps = max(1, stats.target_forwards - 1)
        total_exits = sum(exits.values())
        stats.extra.update({
            "lossless": False,
            "kv_mode": c.kv_mode,
            "early_exits": {str(k): v for k, v in exits.items() if v},
            "exit_rate": total_exits / steps,
            "mean_layers_run_per_token": layers_run / steps,
            "predictor_checks": checks,
            "verifications": verifications,
            "failed_verifications": failed_verifications,
            "drafter_layer": k0,
            "offline_layers": sorted(self.offline),
            "thresholds": {str(k): v for k, v in self.thresholds.items()},
        })
        if c.evaluate:
            out_len = len(sink.tokens)
            first_div = ev["first_divergence"]
            stats.extra["evaluation"] = {
                "early_exits": ev["exits"],
                "early_exit_agreement": ev["exits_agree"] / ev["exits"] if ev["exits"] else None,
                "token_agreement": ev["tokens_agree"] / ev["tokens"] if ev["tokens"] else None,
                "identical_prefix_tokens": out_len if first_div is None else first_div,
                "identical_prefix_share": 1.0 if first_div is None else first_div / max(1, out_len),
            }
        return sink.result(stats)
