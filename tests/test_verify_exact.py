"""Exact tests of the verification rules in selfspec_cli/decoding/verify.py: no sampling noise.

The sampling rules are run for real, but their randomness is replaced by an enumerator that
drives them through every outcome of every random draw, each carrying its exact probability:

* ``torch.rand(n)`` (inside verify.py) returns a symbolic vector of n independent U[0,1)
  draws. Comparing it with the threshold tensor ``t`` the rule computed yields booleans whose
  two outcomes weigh P(U_i < t_i) = clamp(t_i, 0, 1) and its complement; each element is
  decided only when the rule reads it.
* ``sample_from(probs)`` (the name verify.py calls) enumerates every token v with the weight
  torch.multinomial gives it, probs[v] / sum(probs).

Summing the weights of all runs gives the exact law of the rule's output, which is compared
with the target's law (float64; the target rows are dyadic, so the float32 softmax reproduces
them exactly). The checker returns the largest deviation; broken variants of each rule, made
by tampering with the numbers the real code passes to its random draws, must show a large one.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache

import pytest
import torch

import selfspec_cli.decoding.verify as verify_mod
from selfspec_cli.config import SamplingConfig
from selfspec_cli.decoding.sampling import processed_probs
from selfspec_cli.decoding.verify import Verdict, verify_chain_greedy, verify_chain_sampling, verify_tree

SAMPLING = SamplingConfig(temperature=1.0)  # processed_probs == softmax(logits)
EXACT = 1e-9  # the real rules must match the target law to this
BROKEN = 1e-3  # a broken variant must deviate by more than this


def _rows(*rows: tuple[int, ...]) -> torch.Tensor:
    """Probability rows with denominator 16 (exactly representable, and chosen so that the
    float32 softmax of their logs gives them back exactly: checked by test_rows_are_exact)."""
    t = torch.tensor(rows, dtype=torch.float64) / 16
    assert torch.equal(t.sum(-1), torch.ones(len(rows), dtype=torch.float64))
    return t


# chain: position-only target rows p_1..p_6 and draft rows q_1..q_5 over V = 4 tokens
CHAIN_P = _rows((8, 3, 1, 4), (2, 5, 1, 8), (3, 8, 4, 1), (1, 2, 8, 5), (4, 1, 3, 8), (6, 8, 1, 1))
CHAIN_Q = torch.tensor([
    [0.10, 0.45, 0.30, 0.15],
    [0.40, 0.10, 0.25, 0.25],
    [0.25, 0.25, 0.25, 0.25],
    [0.05, 0.35, 0.20, 0.40],
    [0.30, 0.30, 0.10, 0.30],
], dtype=torch.float64)
CHAIN_Q = CHAIN_Q / CHAIN_Q.sum(-1, keepdim=True)
V = CHAIN_P.shape[1]

# tree of deterministic candidates: root -> {a, b}; a -> {c, d}; b -> {e}; c -> {f}
#                a  b  c  d  e  f
TREE_TOKENS = [1, 3, 0, 2, 1, 3]
TREE_PARENTS = [-1, -1, 0, 0, 1, 2]
# row 0: the pending token's prediction; row 1 + i: node i's (prefix-dependent target rows)
TREE_ROWS = _rows((1, 8, 2, 5), (5, 2, 8, 1), (3, 8, 4, 1), (4, 1, 3, 8), (8, 3, 1, 4), (2, 2, 4, 8), (6, 1, 8, 1))
# the target after prefixes that leave the tree (used only to complete outputs to a fixed length)
OFF_TREE_ROWS = _rows((3, 3, 5, 5), (8, 2, 3, 3), (1, 8, 6, 1))


def test_rows_are_exact():
    """Precondition of the 1e-9 comparisons: processed_probs(log p) == p bit for bit, and every
    row is a proper distribution with full support (non-degenerate)."""
    for rows in (CHAIN_P, TREE_ROWS, OFF_TREE_ROWS):
        assert torch.equal(processed_probs(rows.log(), SAMPLING).double(), rows)
        assert (rows > 0).all() and (rows < 1).all()
    assert len({tuple(r) for r in CHAIN_P.tolist()}) == len(CHAIN_P)
    assert len({tuple(r) for r in TREE_ROWS.tolist()}) == len(TREE_ROWS)  # the tree harness finds rows by value
    assert (CHAIN_Q > 0).all() and all(not torch.equal(CHAIN_Q[i], CHAIN_P[i]) for i in range(len(CHAIN_Q)))


# ---------------------------------------------------------------------------------------------
# enumeration of a function's random choices


class Enumerator:
    """Runs a function once per outcome of its random choices (depth-first, by replay).

    Inside the function, ``choose(options)`` picks one ``(value, weight)``; ``outcomes(fn)``
    yields ``(fn(), product of the chosen weights)`` for every combination of choices.
    Options of weight 0 are dropped (they contribute nothing to any law)."""

    def __init__(self) -> None:
        self._stack: list[list] = []  # per choice point: [options, index of the current option]
        self._depth = 0
        self.weight = 1.0

    def choose(self, options: list[tuple[object, float]]) -> object:
        options = [(v, float(w)) for v, w in options if w > 0]
        assert options, "a random draw with no possible outcome"
        if self._depth < len(self._stack):
            entry = self._stack[self._depth]
            assert entry[0] == options, "the rule is not deterministic given its random draws"
        else:
            entry = [options, 0]
            self._stack.append(entry)
        self._depth += 1
        value, w = entry[0][entry[1]]
        self.weight *= w
        return value

    def outcomes(self, fn: Callable[[], object]):
        while True:
            self._depth, self.weight = 0, 1.0
            result = fn()
            assert self._depth == len(self._stack), "a replayed run made fewer random draws"
            yield result, self.weight
            while self._stack and self._stack[-1][1] + 1 == len(self._stack[-1][0]):
                self._stack.pop()
            if not self._stack:
                return
            self._stack[-1][1] += 1


class _LazyBits:
    """The boolean vector ``U >= t`` (or ``U < t``); element i is drawn when first read."""

    def __init__(self, n: int, read: Callable[[int], bool]) -> None:
        self._n, self._read, self._memo = n, read, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> bool:
        i = range(self._n)[i]
        if i not in self._memo:
            self._memo[i] = self._read(i)
        return self._memo[i]

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def tolist(self) -> "_LazyBits":
        return self


class _SymbolicUniform:
    """Stands for ``torch.rand(n)``: n independent U[0,1) draws that are never materialised."""

    def __init__(self, n: int, draw: Callable[[int, float], bool]) -> None:
        self._n, self._draw = n, draw  # draw(i, t_i) -> whether U_i >= t_i

    def _compare(self, t, upper: bool) -> _LazyBits:
        ts = torch.as_tensor(t).double().flatten().tolist()
        ts = ts * self._n if len(ts) == 1 else ts
        assert len(ts) == self._n, "compared with a threshold of the wrong size"
        return _LazyBits(self._n, lambda i: self._draw(i, ts[i]) == upper)

    # U >= t and U > t have the same probability (and so do U < t and U <= t)
    def __ge__(self, t):
        return self._compare(t, True)

    __gt__ = __ge__

    def __lt__(self, t):
        return self._compare(t, False)

    __le__ = __lt__


class _TorchWithSymbolicRand:
    """verify.py's ``torch``, except that ``rand`` returns a _SymbolicUniform."""

    def __init__(self, rand: Callable[[int], _SymbolicUniform]) -> None:
        self._rand = rand

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def rand(self, *size, generator=None, device=None, dtype=None):
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self._rand(math.prod(dims))


def _multinomial_options(probs: torch.Tensor) -> list[tuple[int, float]]:
    """Every outcome of torch.multinomial(probs, 1) with its probability."""
    probs = probs.double()
    assert probs.dim() == 1 and torch.isfinite(probs).all() and (probs >= 0).all() and probs.sum() > 0, probs
    w = probs / probs.sum()
    return [(v, float(w[v])) for v in range(len(w))]


# ---------------------------------------------------------------------------------------------
# the exactness checker


def law_deviation(law: dict[tuple[int, ...], float], target: Callable[[tuple[int, ...]], list[float]],
                  depth: int) -> float:
    """Largest absolute deviation between a verifier's output law and the target's.

    ``law``: emitted token tuple -> probability. ``target(prefix)``: the target's next-token
    probabilities after ``prefix``. Checks, in float64:

    1. the total mass is 1;
    2. for every prefix y the output reaches with positive probability, the law of the token
       emitted after y, given that the output reaches past y, is ``target(y)``;
    3. the joint law: completing each output to ``depth`` tokens with draws from the target
       gives exactly the target's autoregressive law of ``depth`` tokens,
       prod_j target(y[:j])[y_j] (a verification step followed by plain decoding is
       indistinguishable from plain decoding).
    """
    target = lru_cache(maxsize=None)(target)
    dev = abs(sum(law.values()) - 1.0)

    reach: dict[tuple[int, ...], float] = defaultdict(float)
    nxt: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0] * V)
    for x, w in law.items():
        for j in range(len(x)):
            reach[x[:j]] += w
            nxt[x[:j]][x[j]] += w
    for y, r in reach.items():
        if r > 1e-12:
            dev = max(dev, max(abs(nxt[y][v] / r - target(y)[v]) for v in range(V)))

    completed: dict[tuple[int, ...], float] = defaultdict(float)
    for x, w in law.items():
        assert len(x) <= depth
        for tail in itertools.product(range(V), repeat=depth - len(x)):
            y, pw = x, w
            for t in tail:
                pw *= target(y)[t]
                y = (*y, t)
            completed[y] += pw
    for y in itertools.product(range(V), repeat=depth):
        want = math.prod(target(y[:j])[y[j]] for j in range(depth))
        dev = max(dev, abs(completed.get(y, 0.0) - want))
    return dev


# ---------------------------------------------------------------------------------------------
# chain rule (speculative sampling)


class ChainHarness:
    """Runs the real verify_chain_sampling under enumerated randomness. Subclasses tamper with
    the numbers the rule hands to its random draws to model broken rules."""

    def __init__(self, monkeypatch, p: torch.Tensor = CHAIN_P, q: torch.Tensor = CHAIN_Q) -> None:
        self.p, self.q = p, q
        self.enum = Enumerator()
        monkeypatch.setattr(verify_mod, "torch", _TorchWithSymbolicRand(self._rand))
        monkeypatch.setattr(verify_mod, "sample_from", self._sample_from)

    # tamper points (identity: the real rule)
    def verifier_q(self, k: int) -> torch.Tensor:
        """The laws the verifier is told the drafts came from (the real ones: self.q)."""
        return self.q[:k]

    def threshold(self, i: int, d_i: int, t: float) -> float:
        return t

    def sample_probs(self, i: int, probs: torch.Tensor) -> torch.Tensor:
        """``i``: index of the rejected draft, or k for the bonus draw."""
        return probs

    def _rand(self, n: int) -> _SymbolicUniform:
        self.n_rand += 1
        return _SymbolicUniform(n, self._bit)

    def _bit(self, i: int, t: float) -> bool:
        a = min(max(self.threshold(i, self.draft[i], t), 0.0), 1.0)  # P(U_i < t)
        high = self.enum.choose([(True, 1.0 - a), (False, a)])
        self.high[i] = high
        return high

    def _sample_from(self, probs: torch.Tensor, generator) -> int:
        self.n_samples += 1
        i = min((j for j, h in self.high.items() if h), default=len(self.draft))
        return self.enum.choose(_multinomial_options(self.sample_probs(i, probs)))

    def law(self, k: int) -> tuple[dict[tuple[int, ...], float], list[float]]:
        """Exact law of the emitted tokens for draft length k, the draft sampled from q_1..q_k;
        also the probability of each outcome n = number accepted (n < k: rejection at n)."""
        logits = self.p[: k + 1].log()
        q = self.q[:k]
        law: dict[tuple[int, ...], float] = defaultdict(float)
        branch = [0.0] * (k + 1)
        for d in itertools.product(range(V), repeat=k):
            wd = math.prod(float(q[i, d[i]]) for i in range(k))
            if wd == 0.0:
                continue  # a draft that is never proposed (restricted draft vocabulary)

            def run(d=d) -> Verdict:
                self.draft, self.high, self.n_rand, self.n_samples = d, {}, 0, 0
                verdict = verify_chain_sampling(list(d), self.verifier_q(k), logits, SAMPLING, None)
                assert self.n_rand <= 1 and self.n_samples == 1
                return verdict

            for verdict, w in self.enum.outcomes(run):
                n = len(verdict.accepted)
                assert verdict.accepted == list(range(n)) and len(verdict.tokens) == n + 1
                assert tuple(verdict.tokens[:n]) == d[:n]
                law[tuple(verdict.tokens)] += wd * w
                branch[n] += wd * w
        return law, branch

    def deviation(self, k: int) -> float:
        law, _ = self.law(k)
        return law_deviation(law, lambda y: self.p[len(y)].tolist(), k + 1)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5])
def test_chain_sampling_law_is_exactly_the_target(monkeypatch, k):
    h = ChainHarness(monkeypatch)
    law, branch = h.law(k)
    # every branch is exercised: rejection at each index 0..k-1, and full acceptance + bonus
    assert all(b > 1e-3 for b in branch), branch
    assert law_deviation(law, lambda y: CHAIN_P[len(y)].tolist(), k + 1) <= EXACT
    # the first emitted token alone is distributed as p_1
    first = [sum(w for x, w in law.items() if x[0] == v) for v in range(V)]
    assert max(abs(a - b) for a, b in zip(first, CHAIN_P[0].tolist())) <= EXACT


def test_chain_sampling_deterministic_draft_is_exact(monkeypatch):
    """q = one_hot(d): the draft's own (deterministic) token; the rule is still exact."""
    k = 3
    for d in [(0, 1, 2), (3, 3, 0), (1, 0, 3)]:
        q = torch.nn.functional.one_hot(torch.tensor(d), V).double()
        h = ChainHarness(monkeypatch, q=q)
        logits = CHAIN_P[: k + 1].log()
        law: dict[tuple[int, ...], float] = defaultdict(float)

        def run(d=d) -> Verdict:
            h.draft, h.high, h.n_rand, h.n_samples = d, {}, 0, 0
            return verify_chain_sampling(list(d), q, logits, SAMPLING, None)

        for verdict, w in h.enum.outcomes(run):
            law[tuple(verdict.tokens)] += w
        assert law_deviation(law, lambda y: CHAIN_P[len(y)].tolist(), k + 1) <= EXACT


class ResidualIsP(ChainHarness):
    """Bug: on rejection, sample p_i instead of norm(max(p_i - q_i, 0))."""

    def sample_probs(self, i, probs):
        return self.p[i] if i < len(self.draft) else probs


class AcceptWithP(ChainHarness):
    """Bug: accept with probability p_i(d_i), forgetting to divide by q_i(d_i)."""

    def threshold(self, i, d_i, t):
        return float(self.p[i, d_i])


class AcceptWithQOverP(ChainHarness):
    """Bug: the ratio upside down, min(1, q_i(d_i) / p_i(d_i))."""

    def threshold(self, i, d_i, t):
        return min(1.0, float(self.q[i, d_i] / self.p[i, d_i]))


class BonusFromLastDraftRow(ChainHarness):
    """Bug: after full acceptance, the bonus token is drawn from p_k instead of p_{k+1}."""

    def sample_probs(self, i, probs):
        k = len(self.draft)
        return self.p[k - 1] if i == k and k > 0 else probs


class UnclampedRatio(ChainHarness):
    """Not a bug: accepting when U < p/q without the min(1, .) is the same rule, since
    P(U < t) = min(1, t) for a uniform U; the checker must NOT flag it."""

    def threshold(self, i, d_i, t):
        return float(self.p[i, d_i] / self.q[i, d_i])


@pytest.mark.parametrize("broken", [ResidualIsP, AcceptWithP, AcceptWithQOverP, BonusFromLastDraftRow])
@pytest.mark.parametrize("k", [1, 3])
def test_chain_checker_catches_broken_rules(monkeypatch, broken, k):
    assert ChainHarness(monkeypatch).deviation(k) <= EXACT
    assert broken(monkeypatch).deviation(k) > BROKEN


# AdaDecode: an early token is the head's top token, taken deterministically (no sampling)
ADA_HEADS = CHAIN_Q  # the heads' laws at draft positions 1..5
ADA_DRAFT = ADA_HEADS.argmax(-1)  # the tokens they draft


class AdaDecodeHarness(ChainHarness):
    """The drafts are the heads' top tokens (q: point masses on them); the verifier is told the
    law AdaDecode hands it, ``proposal_law(head law, token)``, or, with ``papers_rule``, the
    head's whole law (the paper's rule, which test_adadecode's chi-square control also rejects)."""

    def __init__(self, monkeypatch, papers_rule: bool = False) -> None:
        from selfspec_cli.methods import adadecode as ada

        super().__init__(monkeypatch, q=torch.nn.functional.one_hot(ADA_DRAFT, V).double())
        self.told = ADA_HEADS if papers_rule else torch.stack(
            [ada.proposal_law(ADA_HEADS[i], int(ADA_DRAFT[i])) for i in range(len(ADA_HEADS))])

    def verifier_q(self, k: int) -> torch.Tensor:
        return self.told[:k]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_adadecode_proposal_law_is_exact_and_the_papers_rule_is_not(monkeypatch, k):
    """The exact counterpart of tests/test_adadecode.py's chi-square pair (marked slow): AdaDecode's
    proposal law (selfspec_cli.methods.adadecode.proposal_law) through the real chain rule gives the
    target's law exactly; the paper's rule deviates from it by 0.23 (k = 1) to 0.58 (k = 5)."""
    assert AdaDecodeHarness(monkeypatch).deviation(k) <= EXACT
    assert AdaDecodeHarness(monkeypatch, papers_rule=True).deviation(k) > BROKEN


# FR-Spec: drafts restricted to a draft vocabulary S; their laws are zero outside S
SUBSET = [0, 2]
RESTRICTED_Q = torch.zeros_like(CHAIN_Q)
RESTRICTED_Q[:, SUBSET] = CHAIN_Q[:, SUBSET] / CHAIN_Q[:, SUBSET].sum(-1, keepdim=True)


class VerifierToldTheFullLaw(ChainHarness):
    """Bug: drafts sampled from the law restricted to S, but the verifier handed the
    unrestricted softmax (what the draft would have been without the subset)."""

    def verifier_q(self, k):
        return CHAIN_Q[:k]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_restricted_draft_vocabulary_is_exact(monkeypatch, k):
    h = ChainHarness(monkeypatch, q=RESTRICTED_Q)
    law, branch = h.law(k)
    assert all(b > 1e-3 for b in branch), branch  # rejection at every index and full acceptance occur
    assert law_deviation(law, lambda y: CHAIN_P[len(y)].tolist(), k + 1) <= EXACT
    # tokens outside S are never drafted, yet emitted with their target probability
    first = [sum(w for x, w in law.items() if x[0] == v) for v in range(V)]
    assert max(abs(a - b) for a, b in zip(first, CHAIN_P[0].tolist())) <= EXACT


@pytest.mark.parametrize("k", [1, 3])
def test_restricted_vocabulary_checker_catches_the_wrong_law(monkeypatch, k):
    assert VerifierToldTheFullLaw(monkeypatch, q=RESTRICTED_Q).deviation(k) > BROKEN


def test_chain_checker_accepts_the_unclamped_ratio(monkeypatch):
    assert UnclampedRatio(monkeypatch).deviation(3) <= EXACT


# ---------------------------------------------------------------------------------------------
# tree rule (sample-then-match over deterministic candidates)


def _children(tokens, parents) -> dict[int, dict[int, int]]:
    ch: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        ch.setdefault(p, {}).setdefault(t, i)
    return ch


TREE_CHILDREN = _children(TREE_TOKENS, TREE_PARENTS)


def _tree_node(prefix: tuple[int, ...]) -> int | None:
    """The tree node a prefix leads to (-1: the root), or None once it leaves the tree."""
    node = -1
    for t in prefix:
        node = TREE_CHILDREN.get(node, {}).get(t)
        if node is None:
            return None
    return node


def tree_target(prefix: tuple[int, ...]) -> list[float]:
    node = _tree_node(prefix)
    if node is not None:
        return TREE_ROWS[node + 1].tolist()
    return OFF_TREE_ROWS[sum((j + 1) * t for j, t in enumerate(prefix)) % len(OFF_TREE_ROWS)].tolist()


def _tree_depth() -> int:
    def depth(i):
        return 1 if TREE_PARENTS[i] < 0 else 1 + depth(TREE_PARENTS[i])
    return max(depth(i) for i in range(len(TREE_TOKENS)))


class TreeHarness:
    """Runs the real verify_tree under enumerated draws of ``sample_from``; ``pick`` is the
    tamper point (identity: the real rule)."""

    def __init__(self, monkeypatch) -> None:
        self.enum = Enumerator()
        monkeypatch.setattr(verify_mod, "sample_from", self._sample_from)

    def pick(self, row: int, x: int) -> int:
        return x

    def probs_for(self, row: int) -> torch.Tensor:
        return TREE_ROWS[row]

    def _sample_from(self, probs: torch.Tensor, generator) -> int:
        rows = [r for r in range(len(TREE_ROWS)) if torch.equal(probs.double(), TREE_ROWS[r])]
        assert len(rows) == 1, "sampled a vector that is not one of the target rows"
        return self.enum.choose([(self.pick(rows[0], v), w) for v, w in _multinomial_options(self.probs_for(rows[0]))])

    def law(self) -> tuple[dict[tuple[int, ...], float], dict[int, float], dict[int, float]]:
        """Output law, plus P(node accepted) and P(output stops at node) for every node (-1: root)."""
        logits = TREE_ROWS.log()
        law: dict[tuple[int, ...], float] = defaultdict(float)
        accepted: dict[int, float] = defaultdict(float)
        stops: dict[int, float] = defaultdict(float)

        def run() -> Verdict:
            return verify_tree(TREE_TOKENS, TREE_PARENTS, logits, SAMPLING, None)

        for verdict, w in self.enum.outcomes(run):
            path = verdict.accepted
            assert all(TREE_PARENTS[n] == (path[j - 1] if j else -1) for j, n in enumerate(path)), path
            assert verdict.tokens[:-1] == [TREE_TOKENS[n] for n in path] and len(verdict.tokens) == len(path) + 1
            law[tuple(verdict.tokens)] += w
            for n in path:
                accepted[n] += w
            stops[path[-1] if path else -1] += w
        return law, accepted, stops

    def deviation(self) -> float:
        return law_deviation(self.law()[0], tree_target, _tree_depth() + 1)


def test_tree_sampling_law_is_exactly_the_target(monkeypatch):
    law, accepted, stops = TreeHarness(monkeypatch).law()
    # every node is reached and every node (and the root) is a possible stopping point
    assert all(accepted[n] > 1e-3 for n in range(len(TREE_TOKENS))), accepted
    assert all(stops[n] > 1e-3 for n in range(-1, len(TREE_TOKENS))), stops
    # the acceptance-optimal property: P(accept a root child) = sum of p over the root's children
    root_children = sum(TREE_ROWS[0, t] for t in TREE_CHILDREN[-1])
    assert abs(sum(accepted[n] for n in TREE_CHILDREN[-1].values()) - float(root_children)) <= EXACT
    assert law_deviation(law, tree_target, _tree_depth() + 1) <= EXACT


class MostLikelyChild(TreeHarness):
    """Bug: whenever the draw lands on any child, move to the most likely child."""

    def pick(self, row, x):
        ch = TREE_CHILDREN.get(row - 1, {})
        return max(ch, key=lambda t: TREE_ROWS[row, t]) if x in ch else x


class RootRowEverywhere(TreeHarness):
    """Bug: every node's draw uses the pending token's row (row 0) instead of its own."""

    def probs_for(self, row):
        return TREE_ROWS[0]


class ArgmaxOffTree(TreeHarness):
    """Bug: when the draw leaves the tree, emit the target's argmax instead of the draw."""

    def pick(self, row, x):
        return x if x in TREE_CHILDREN.get(row - 1, {}) else int(TREE_ROWS[row].argmax())


@pytest.mark.parametrize("broken", [MostLikelyChild, RootRowEverywhere, ArgmaxOffTree])
def test_tree_checker_catches_broken_rules(monkeypatch, broken):
    assert TreeHarness(monkeypatch).deviation() <= EXACT
    assert broken(monkeypatch).deviation() > BROKEN


def test_tree_greedy_follows_the_argmax():
    """Greedy tree verification: follow the target argmax while it is a child; emit it at the first miss."""
    greedy = SamplingConfig(temperature=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(len(TREE_ROWS), V, generator=g, dtype=torch.float64)
        got = verify_tree(TREE_TOKENS, TREE_PARENTS, logits, greedy, None)
        node, want_nodes = -1, []
        while True:
            row = logits[node + 1].tolist()
            x = max(range(V), key=row.__getitem__)
            nxt = TREE_CHILDREN.get(node, {}).get(x)
            if nxt is None:
                break
            want_nodes.append(nxt)
            node = nxt
        assert got.accepted == want_nodes and got.tokens == [*(TREE_TOKENS[n] for n in want_nodes), x]


# ---------------------------------------------------------------------------------------------
# greedy chain rule


def greedy_chain_failures(rule: Callable[[list[int], torch.Tensor], Verdict]) -> list[tuple[int, int]]:
    """(k, mismatch index) cases where ``rule`` differs from plain greedy decoding: for
    k = 1..5 and every mismatch index j = 0..k-1 (and j = k: all match), the draft equals the
    argmax everywhere except at j, so the rule must accept exactly j tokens and emit the argmax
    at j (the correction, or the bonus when j = k)."""
    failures = []
    g = torch.Generator().manual_seed(1)
    vocab = 7
    for k in range(1, 6):
        for j in range(k + 1):
            logits = torch.randn(k + 1, vocab, generator=g, dtype=torch.float64)
            best = [max(range(vocab), key=row.__getitem__) for row in logits.tolist()]
            draft = best[:k]
            if j < k:
                draft[j] = (best[j] + 1 + j) % vocab  # anything but the argmax; later tokens still match
            v = rule(draft, logits)
            if v.accepted != list(range(j)) or v.tokens != [*best[:j], best[j]]:
                failures.append((k, j))
    return failures


def test_chain_greedy_accepts_the_longest_argmax_prefix():
    assert greedy_chain_failures(verify_chain_greedy) == []


def test_chain_greedy_equals_tree_greedy_on_a_chain():
    greedy = SamplingConfig(temperature=0.0)

    def as_tree(draft, logits):
        return verify_tree(draft, list(range(-1, len(draft) - 1)), logits, greedy, None)

    assert greedy_chain_failures(as_tree) == []


@pytest.mark.parametrize("broken", [
    # bug: correction/bonus from the row after the right one
    lambda d, logits: verify_chain_greedy(d, logits.roll(-1, dims=0)),
    # bug: on a mismatch, emit the draft token instead of the target's argmax
    lambda d, logits: (lambda v: v if len(v.accepted) == len(d) else
                       Verdict(v.accepted, [*v.tokens[:-1], d[len(v.accepted)]]))(verify_chain_greedy(d, logits)),
    # bug: the bonus token is dropped after full acceptance
    lambda d, logits: (lambda v: Verdict(v.accepted, v.tokens[: len(d)]) if len(v.accepted) == len(d) else v)(
        verify_chain_greedy(d, logits)),
])
def test_greedy_checker_catches_broken_rules(broken):
    assert greedy_chain_failures(broken) != []
