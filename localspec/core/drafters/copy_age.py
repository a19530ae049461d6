"""How long copied runs last: acceptance of an n-gram draft's tokens by the age of the
copy they continue.

An n-gram draft copies what followed an earlier occurrence of the context's suffix. Its
*age* is how many tokens before the draft already agree with that source (the matched
suffix, extended backwards). A run that has held for 200 tokens (an edit copying an
unchanged function) is very likely to hold for the next one; a 2-token match in prose is
not (docs/measurements.md: how often copies break by age). So the model is a hazard by
age: a(t) = P(the next token still agrees | the run has agreed for t tokens), in
log-spaced age bins; the i-th token of a draft of age A is accepted with a(A + i),
given the ones before it were. Counts in a bin fade as new runs reach it (the last few
dozen runs at each age decide): a rare age keeps its evidence as long as a common one.

Counts come from hindsight: every candidate the n-gram drafter offers, drafted or not,
is followed against the tokens the target goes on to produce, one position at a time,
until it breaks (for greedy decoding exactly what verifying it would have accepted). A
new candidate that continues a followed one (same alignment) extends it instead of
being counted twice.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from localspec.core.tuning import (
    AGE_CAP,
    COPY_PRIOR,
    EDGES,
    OPEN_BIN_WIDTH,
    PREDICTED_PRIOR,
    PRIOR,
    RUN_DECAY,
    RUN_SMOOTH,
)

_BIN = np.clip(np.searchsorted(EDGES, np.arange(AGE_CAP + 1), side="right") - 1, 0, None)
# a bin's weight of prior evidence, in tokens: RUN_SMOOTH runs crossing its width
_PSEUDO = RUN_SMOOTH * np.diff([*EDGES, EDGES[-1] + OPEN_BIN_WIDTH])


def age_bin(age: int) -> int:
    """The bin of EDGES that a run of this age falls in."""
    return int(_BIN[min(age, AGE_CAP)])


class RunAgeEstimate(NamedTuple):
    """a(t) = P(the next token still agrees | the run has agreed for t tokens), by age bin."""

    by_bin: np.ndarray  # one rate per bin of EDGES, non-decreasing in age

    def rates(self, age: int, k: int) -> np.ndarray:
        """Acceptance of each of k drafted tokens, given the ones before, for a draft
        whose run has agreed for `age` tokens."""
        ages = np.minimum(np.arange(age, age + k), AGE_CAP)
        return self.by_bin[_BIN[ages]]


class _Track:
    """One candidate being followed: context position of its first token, its tokens,
    its age at that first token, and how many positions have agreed so far."""

    __slots__ = ("pos", "tokens", "age", "done", "bin")

    def __init__(self, pos: int, tokens: list[int], age: int) -> None:
        self.pos, self.tokens, self.age, self.done = pos, tokens, age, 0
        self.bin = -1  # the last age bin it has counted in


class CopyAge:
    """Acceptance by run age, learned in hindsight from every n-gram candidate."""

    def __init__(self, counts: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        # (reached, accepted) by age bin, updated in place: generations given the same
        # `counts` (a server's requests, auto.Learned) learn from each other's runs
        self.reached, self.accepted = counts if counts is not None else self.fresh_counts()
        self.tracks: list[_Track] = []
        self.seen = 0  # context length already scored
        self._est: RunAgeEstimate | None = None
        self.prior = PRIOR

    @staticmethod
    def fresh_counts() -> tuple[np.ndarray, np.ndarray]:
        """Counts that have seen no run yet."""
        return np.zeros(len(EDGES)), np.zeros(len(EDGES))

    def reset(self, n_context: int, copying: bool = False, predicted: bool = False) -> None:
        """A new generation: follow nothing yet; counts carry over (same traffic). The
        prior is COPY_PRIOR where the generation is expected to copy a given text, and
        PREDICTED_PRIOR where that text is a prediction of it (an edit's foretold changes made)."""
        self.tracks, self.seen = [], n_context
        prior = (PREDICTED_PRIOR if predicted else COPY_PRIOR) if copying else PRIOR
        if prior is not self.prior:
            self.prior, self._est = prior, None

    def estimate(self) -> RunAgeEstimate:
        """a(t) per age bin: the counts plus RUN_SMOOTH runs' worth of the prior in each bin
        (evidence is weighed in runs, not tokens: one run through a 64-token bin without
        a break says little about a 1% hazard), then made non-decreasing in age (pool
        adjacent violators): a run that has held longer is not more likely to break, so
        a bin that saw no break by chance is pooled with its neighbours instead of
        promising runs that never end."""
        if self._est is None:
            hits = self.accepted + _PSEUDO * np.asarray(self.prior)
            seen = self.reached + _PSEUDO
            rates = hits / seen
            if not (rates[:-1] > rates[1:]).any():  # non-decreasing already: nothing to pool
                self._est = RunAgeEstimate(rates)
                return self._est
            blocks: list[list[float]] = []  # [hits, seen, bins] pooled, rates increasing
            for h, n in zip(hits, seen):
                blocks.append([h, n, 1])
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    h2, n2, c2 = blocks.pop()
                    blocks[-1] = [blocks[-1][0] + h2, blocks[-1][1] + n2, blocks[-1][2] + c2]
            self._est = RunAgeEstimate(np.repeat([h / n for h, n, _ in blocks], [c for _, _, c in blocks]))
        return self._est

    def rates(self, age: int, k: int) -> np.ndarray:
        """RunAgeEstimate.rates, on the current estimate."""
        return self.estimate().rates(age, k)

    def offer(self, pos: int, tokens: list[int], age: int) -> int:
        """A candidate for context position `pos` onwards (drafted or not). Returns its
        age: the given one, or longer where it continues a run followed since earlier
        (a drafter need not know how long its source has agreed)."""
        for t in self.tracks:
            off = pos - t.pos
            if 0 <= off <= t.done and t.tokens[off:] == tokens[: len(t.tokens) - off]:
                if off + len(tokens) > len(t.tokens):
                    t.tokens = t.tokens[:off] + tokens  # the same run, followed further
                return max(age, t.age + off)
        self.tracks.append(_Track(pos, list(tokens), max(age, 1)))
        return max(age, 1)

    def settle(self, context) -> None:
        """Score the followed candidates against the tokens produced since last time."""
        n = len(context)
        if n <= self.seen:
            self.seen = n
            return
        self._est = None
        keep = []
        for t in self.tracks:
            for p in range(max(self.seen, t.pos + t.done), min(n, t.pos + len(t.tokens))):
                b = _BIN[min(t.age + p - t.pos, AGE_CAP)]
                if b != t.bin:  # a run enters this bin: older runs' counts there weigh less
                    self.reached[b] *= RUN_DECAY
                    self.accepted[b] *= RUN_DECAY
                    t.bin = b
                hit = context[p] == t.tokens[p - t.pos]
                self.reached[b] += 1.0
                self.accepted[b] += hit
                if not hit:
                    break
                t.done += 1
            else:
                if t.done < len(t.tokens):
                    keep.append(t)
        self.tracks = keep
        self.seen = n
