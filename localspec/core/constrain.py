"""The target's choice under a grammar: numpy over the Grammar interface (allows,
allowed, allowed_all, accept; core/backend/grammar.py), with no llama_cpp here.

The constrained distribution is defined once: forbidden tokens' logits are -inf, then
the usual filters (sampling.py) apply. Plain constrained decoding and speculative
verification both read it through this module, which is what keeps them equal (greedy)
or equal in distribution (sampled, with the lossless accept rule).

Cost: asking the grammar about the whole vocabulary is the expensive call (every
token's text against the grammar's stacks: ~70-200 ms for 150k tokens on a CPU, ~1 us
a token), so the argmax is asked alone first (~10-40 us), then the best 16, 256,
4096... candidates, and the whole vocabulary only when too few of them are allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from localspec.core.config import SamplingConfig
from localspec.core.errors import GrammarError
from localspec.core.sampling import probs_from_logits

FIRST_LOOK = 16  # candidates asked first, at least (4x what is needed)
DEAD_END = "the grammar allows no token of this vocabulary here"


class GrammarLike(Protocol):
    def allows(self, token: int) -> bool: ...
    def allowed(self, ids: np.ndarray) -> np.ndarray: ...
    def allowed_all(self) -> np.ndarray: ...
    def accept(self, token: int) -> None: ...


def top_allowed(logits: np.ndarray, grammar: GrammarLike, n: int) -> np.ndarray:
    """The ids of the n highest-logit tokens the grammar allows, best first (fewer when
    fewer are allowed). The m best candidates are asked (m growing 16-fold) before the
    whole vocabulary. Exact: when n allowed tokens are found among the m best, no token
    outside them can outrank them."""
    m = max(4 * n, FIRST_LOOK)
    while m < len(logits):
        best = np.argpartition(-logits, m - 1)[:m]
        best = best[np.argsort(-logits[best], kind="stable")]
        ok = best[grammar.allowed(best)]
        if len(ok) >= n:
            return ok[:n]
        m *= 16
    allowed = np.flatnonzero(grammar.allowed_all())
    return allowed[np.argsort(-logits[allowed], kind="stable")[:n]]


def constrained_argmax(logits: np.ndarray, grammar: GrammarLike) -> int:
    """The argmax among allowed tokens: the plain argmax when allowed (one cheap check)."""
    best = int(logits.argmax())
    if grammar.allows(best):
        return best
    top = top_allowed(logits, grammar, 1)
    if not len(top):
        raise GrammarError(DEAD_END)
    return int(top[0])


def constrained_probs(logits: np.ndarray, grammar: GrammarLike, cfg: SamplingConfig) -> np.ndarray:
    """probs_from_logits of the row with forbidden tokens at -inf. With top-k on, only
    the k best allowed tokens can survive the filters, so only they are looked up."""
    if 0 < cfg.top_k < len(logits):
        keep = top_allowed(logits, grammar, cfg.top_k)
    else:
        keep = np.flatnonzero(grammar.allowed_all())
    if not len(keep):
        raise GrammarError(DEAD_END)
    masked = np.full_like(logits, -np.inf)
    masked[keep] = logits[keep]
    return probs_from_logits(masked, cfg)


class GrammarRows:
    """Verification rows under the grammar: row i is choose(rows[i]) in the grammar state
    after draft[:i]. The accept rules read rows in order and read row i + 1 only after
    accepting draft[i], so asking for a row advances the grammar over the draft tokens
    before it: the state follows exactly the accepted tokens and never rolls back. A
    drafted token the grammar forbids is never the constrained argmax and has p = 0, so
    it is rejected by either rule."""

    def __init__(self, rows: np.ndarray, draft: Sequence[int], grammar: GrammarLike,
                 choose: Callable[[np.ndarray, GrammarLike], object]) -> None:
        self.rows, self.draft, self.grammar, self.choose = rows, draft, grammar, choose
        self.n_accepted = 0  # draft tokens the grammar has advanced over
        self.cache: dict[int, object] = {}

    def advance(self, n: int) -> None:
        """Accept draft[:n] into the grammar (those not yet accepted)."""
        for tok in self.draft[self.n_accepted : n]:
            self.grammar.accept(tok)
        self.n_accepted = max(self.n_accepted, n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        if i not in self.cache:
            self.advance(i)
            self.cache[i] = self.choose(self.rows[i], self.grammar)
        return self.cache[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))
