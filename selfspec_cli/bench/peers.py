"""Outside peers, run on the very same model object through Hugging Face ``generate``.

They are wrapped to the ``generate(prompt_ids, cfg) -> DecodeResult`` call of
selfspec's methods, so the bench times every contender with one timer.

``generate`` returns no acceptance statistics. For the assisted peers they are recovered
by instrumenting the candidate generator of each call: every
``update_candidate_strategy(input_ids, scores, num_matches)`` call is one verification
forward of the target that added ``num_matches + 1`` tokens (already cut at EOS and
``max_new_tokens`` by ``generate``), and ``get_candidates`` says how many tokens were
drafted for it. A step log of plain greedy ``generate`` is one token per forward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import GenerationConfig
from ..decoding.output import DecodeResult, DecodeStats, TokenSink
from ..errors import ConfigError

PEERS: dict[str, str] = {
    "hf": "Hugging Face generate, greedy",
    "hf-static": "Hugging Face generate, greedy, with its static cache (compiled on a GPU: transformers' auto-compile)",
    "hf-pld": "Hugging Face prompt lookup decoding (prompt_lookup_num_tokens=10, max_matching_ngram_size=2)",
    "hf-early-exit": "Hugging Face assistant_early_exit drafting (LayerSkip-style; the model's own first layers)",
    "hf-assisted": "Hugging Face assisted generation with --assistant-model (same tokenizer)",
}


def _log_steps(gen: Any, drafted: list[int], matches: list[int]) -> Any:
    """Wraps one candidate generator instance to log drafted and matched tokens per forward."""
    get_candidates, update = gen.get_candidates, gen.update_candidate_strategy

    def get_candidates_logged(input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        cand, logits = get_candidates(input_ids, *args, **kwargs)
        drafted.append(int(cand.shape[1] - input_ids.shape[1]))
        return cand, logits

    def update_logged(input_ids: torch.Tensor, scores: torch.Tensor, num_matches: Any):
        matches.append(int(num_matches))
        return update(input_ids, scores, num_matches)

    gen.get_candidates = get_candidates_logged
    gen.update_candidate_strategy = update_logged
    return gen


class HFGenerate:
    """``model.generate(do_sample=False, **generate_kwargs)`` on the bench's model."""

    lossless = True

    def __init__(self, model: torch.nn.Module, name: str = "hf", assisted: bool = True, **generate_kwargs: Any) -> None:
        self.model = model
        self.name = name
        self.kwargs = generate_kwargs
        self.assisted = assisted and bool(generate_kwargs)  # drafts: its steps are logged from the candidate generator

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], cfg: GenerationConfig) -> DecodeResult:
        if not cfg.sampling.greedy:
            raise ConfigError(f"the {self.name} peer is benchmarked greedy only; drop --temperature")
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        drafted, matches = [], []  # per verification forward of an assisted peer
        if self.assisted:  # log drafted and matched tokens
            original: Callable[..., Any] = self.model._get_candidate_generator
            self.model._get_candidate_generator = lambda *a, **k: _log_steps(original(*a, **k), drafted, matches)
        try:
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=cfg.max_new_tokens,
                                      eos_token_id=None if cfg.ignore_eos else list(cfg.eos_token_ids) or None,
                                      pad_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else 0, **self.kwargs)
        finally:
            if self.assisted:
                del self.model._get_candidate_generator  # back to the class method
        sink = TokenSink(GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_token_ids=cfg.eos_token_ids,
                                          ignore_eos=cfg.ignore_eos))
        sink.push(out[0, len(prompt_ids):].tolist())
        # plain greedy generate: one token per forward (and no drafts)
        lengths = [m + 1 for m in matches] if self.assisted else [1] * len(sink.tokens)
        stats = DecodeStats(target_forwards=len(lengths), accept_lengths=lengths,
                            drafted_tokens=sum(drafted[: len(lengths)]), accepted_draft_tokens=sum(matches))
        # nothing drafted at all (e.g. no n-gram match): still report the counts
        stats.drafts_counted = self.assisted
        return sink.result(stats)


def make_peer(name: str, model: torch.nn.Module, *, early_exit_layer: int | None = None,
              assistant: torch.nn.Module | None = None) -> HFGenerate:
    if name == "hf":
        return HFGenerate(model, "hf")
    if name == "hf-static":
        return HFGenerate(model, name, assisted=False, cache_implementation="static")
    if name == "hf-pld":
        return HFGenerate(model, name, prompt_lookup_num_tokens=10, max_matching_ngram_size=2)
    if name == "hf-early-exit":
        num_layers = int(model.config.num_hidden_layers)
        layer = early_exit_layer if early_exit_layer is not None else max(1, num_layers // 2)
        if not 1 <= layer < num_layers:
            raise ConfigError(f"--early-exit-layer must be in 1..{num_layers - 1} for this {num_layers}-layer model, got {layer}")
        return HFGenerate(model, name, assistant_early_exit=layer)
    if name == "hf-assisted":
        if assistant is None:
            raise ConfigError("hf-assisted needs a second model with the same tokenizer; pass --assistant-model DIR")
        return HFGenerate(model, name, assistant_model=assistant)
    raise ConfigError(f"unknown peer '{name}'; choose one of: {', '.join(PEERS)}")
