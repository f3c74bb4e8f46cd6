"""The last stderr line of ``generate`` (and what it adds before it): what the call measured, and only
labelled as such what it did not.

Invariants (issue 50):

* every figure on the line before ``ar predicted`` is this call's own measurement: the tokens, the
  prefill's seconds, the **decoding pace after each prefill** (tokens/s over the decode only: the
  tokens after each prefill's first over the seconds after its prefill), the rounds that drafted
  and the drafted tokens accepted;
* ``generate`` runs one method, so ``ar`` never ran in the same call: a comparison with ``ar`` is
  always an **estimate**, said so on the line with the stored T(1), how many readings its median is
  over and the store's age; ``selfspec bench`` is what measures ``ar`` beside a method. The store's
  T(1) is a median refreshed deliberately (not by every call), and a bare forward: an ``ar`` step
  also samples and commits, and the machine's pace moves from minute to minute. So where the call
  had :data:`PLAIN_ROUNDS` rounds or more that drafted nothing (each one an ``ar`` step: its verify
  forward, sampling and commit), the stored costs are **scaled by what those rounds took against
  the stored T(1) at their contexts**, in this process, in this minute: the estimate then moves with
  the machine as the method's own pace does, and their ratio does not. With fewer, the stored costs
  as they are;
* a lossless speculative method that drafted in no round of the call says so once, on one line,
  with the reason its cost model gives (:func:`no_draft_note`): it decoded as ``ar`` does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..decoding.output import OutputRecord
from ..errors import count

PLAIN_ROUNDS = 16  # rounds that drafted nothing, from which they scale ar's estimate to this process


def age_text(seconds: float) -> str:
    """``seconds`` as a short age: ``42 s``, ``3.5 min``, ``2.0 h``, ``1.5 d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


@dataclass
class Pace:
    """The summary line's figures, summed over records: the tokens and wall time, per turn its decoding after the
    prefill (the tokens after the prefill's one, the seconds after its prefill) with the context it began at,
    the prefill's seconds and tokens, and the rounds after each prefill: how many drafted, the drafted tokens
    and those accepted; the last cost model a proposer reported (its ``stats.cost_model``)."""

    records: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decoded: list[tuple[int, int, float]] = field(default_factory=list)  # (context, tokens, seconds) per turn
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    rounds: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    cost_model: dict[str, Any] | None = None
    plain_rounds: int = 0  # rounds that drafted nothing: count, verify seconds, the stored T(1) at their contexts
    plain_s: float = 0.0
    plain_t1_s: float = 0.0

    def add(self, rec: OutputRecord) -> None:
        self.records += 1
        self.tokens += rec.new_tokens
        self.seconds += rec.wall_time_s
        for turn in rec.all_turns():
            st = turn.stats
            prefill = st.prefill_s
            if prefill is not None:
                self.prefill_s += prefill
                self.prompt_tokens += turn.prompt_tokens
                if turn.new_tokens > 1:
                    self.decoded.append((turn.prompt_tokens, turn.new_tokens - 1, turn.wall_time_s - prefill))
            rounds = max(0, len(st.accept_lengths or []) - 1)  # the rounds after the prefill
            self.rounds += rounds
            self.draft_rounds += round((st.draft_round_share or 0.0) * rounds)
            self.drafted += st.drafted_tokens or 0
            self.accepted += st.accepted_draft_tokens or 0
            if isinstance(st.extra.get("cost_model"), dict):  # the drafter's description of its cost model
                self.cost_model = st.extra["cost_model"]
            plain = st.plain_rounds
            if plain is not None and plain.stored_t1_s:
                self.plain_rounds += plain.count
                self.plain_s += plain.verify_s
                self.plain_t1_s += plain.stored_t1_s

    def line(self, curve: Any = None, store: dict[str, Any] | None = None, drafts: bool = True) -> str:
        """The measured figures, then (given ``curve``, the stored verify curve the method planned with, and
        ``store``, :func:`~selfspec_cli.decoding.cost_store.describe` of it) ``ar``'s pace for the same tokens
        at the same contexts predicted from it (one stored T(1) per token, at its context), labelled so.
        ``drafts``: say the rounds that drafted (a speculative method)."""
        out = f"{count(self.tokens, 'token')} in {self.seconds:.1f} s"
        n, secs = sum(d[1] for d in self.decoded), sum(d[2] for d in self.decoded)
        if n == 0 or secs <= 0:  # nothing after a prefill: the one figure there is
            return out + f", {self.tokens / max(self.seconds, 1e-9):.1f} tok/s with the prefill (nothing decoded after it)"
        out += (f": prefill {self.prefill_s:.1f} s ({count(self.prompt_tokens, 'prompt token')}), then decoding "
                f"{n / secs:.1f} tok/s (tokens/s over the decode only: {count(n, 'token')} in {secs:.2f} s)")
        if drafts and self.rounds:
            out += f"; drafted in {self.draft_rounds} of {count(self.rounds, 'round')}"
            if self.drafted:
                out += f", {self.accepted / self.drafted:.0%} of {count(self.drafted, 'drafted token')} accepted"
        if curve is None:
            return out
        ar_s = sum(curve.t1_at(ctx + i) for ctx, k, _ in self.decoded for i in range(k))
        kept = ""
        if store and store.get("stored"):
            kept = (f", median of {count(store['t1_samples'], 'reading')}, stored {age_text(store['age_s'])} ago"
                    f"{'' if store.get('settled') else ', still being refined by each call'}")
        costs = f"this machine's stored costs (T(1) {curve.t1_s * 1e3:.1f} ms{kept})"
        if self.plain_rounds >= PLAIN_ROUNDS and self.plain_t1_s > 0:
            scale = self.plain_s / self.plain_t1_s
            ar_s *= scale
            costs += (f" scaled by this call's {self.plain_rounds} rounds that drafted nothing, each an ar step, which "
                      f"took {scale:.2f}x them")
        return (out + f"; ar ESTIMATED, not run: {n / ar_s:.1f} tok/s for the same tokens at their contexts from "
                      f"{costs}, so about {ar_s / secs:.2f}x (selfspec bench measures ar beside it)")


def no_draft_note(method: str, pace: Pace, best_gain: float | None, paper_drafting: bool) -> str | None:
    """The one line for a lossless speculative method that drafted in none of its rounds (None when it drafted,
    or ran no round): it decoded as ``ar`` does, and why, from its cost model (``pace.cost_model``) and
    ``best_gain``, the best expected gain of drafting its planner predicts (None: not known)."""
    if pace.rounds == 0 or pace.draft_rounds:
        return None
    cm = pace.cost_model or {}
    if "c" in cm:  # a layer-skip or quantized drafter's planner
        gain = f"the best draft length gains {best_gain:.2f}x a plain step; " if best_gain is not None else ""
        why = (f"its cost model predicts no draft pays on this machine ({gain}a draft step costs {cm['c']:.2f} of a plain "
               f"step, first-token acceptance {cm.get('prior', float('nan')):.2f}, round overhead "
               f"{cm.get('round_overhead', 0.0):+.2f} step); `selfspec profile --predict {method}` shows the same prediction")
    elif cm:  # prompt lookup's planners, one per n-gram length
        why = "no n-gram draft of the context was predicted to pay (its planners' acceptance and this machine's verify cost)"
    elif method in ("pld", "auto"):
        why = "no n-gram of the prompt or of the output so far repeated, and no other draft was predicted to pay"
    else:
        why = "its cost gate found no draft whose accepted tokens pay for making and checking it on this machine"
    return (f"selfspec: note: {method} drafted in none of its {count(pace.rounds, 'round')}, so it decoded as ar does: "
            f"{why}" + ("; --paper-drafting drafts as the paper does, whatever it costs" if paper_drafting else ""))
