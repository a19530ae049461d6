"""Draft with a small model of the same family. Its KV cache follows the context by
prefix reuse: each round it rewinds to what it shares with the context and decodes
only the new tokens (the accepted ones and the target's correction).

Under an output grammar it drafts within it (a clone of the generation's grammar,
advanced over its own draft): the target would reject anything else, and q is then
the constrained distribution the tokens were really drawn from, as the lossless rule
needs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import SamplingConfig
from localspec.core.constrain import GrammarLike, constrained_argmax, constrained_probs
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.errors import GrammarError
from localspec.core.sampling import probs_from_logits, sample


def _top_prob(logits: np.ndarray) -> float:
    # the untempered softmax's largest probability: 1 / sum(exp(l - max))
    return float(1.0 / np.exp(logits - logits.max()).sum())


class ModelDrafter(DrafterBase):
    name = "model"

    def __init__(self, model: Model, sampling: SamplingConfig, p_min: float = 0.0) -> None:
        self.model = model
        self.sampling = sampling
        self.p_min = p_min
        seed = None if sampling.seed is None else sampling.seed + 1
        self.rng = np.random.default_rng(seed)
        self.grammar = None  # the generation's output grammar (constrain())

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # synced lazily by prefix reuse in draft()

    def constrain(self, grammar: GrammarLike | None) -> None:
        self.grammar = grammar

    def draft(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or len(context) + k > self.model.n_ctx:
            return Draft(source=self.name)
        logits, _ = self.model.prefill(context)
        grammar = self.grammar.clone() if self.grammar is not None else None
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        try:
            for i in range(k):
                if self.p_min > 0.0 and _top_prob(logits) < self.p_min:
                    break  # the draft is unsure: verifying further tokens would be waste
                tok, q = self._choose(logits, grammar)
                tokens.append(tok)
                if q is not None:
                    rows.append(q)
                if i + 1 < k:
                    if grammar is not None:
                        grammar.accept(tok)
                    logits = self.model.decode([tok], "last")[0]
        except GrammarError:
            pass  # a dead end for the grammar: the draft so far stands
        finally:
            if grammar is not None:
                grammar.close()
        probs = np.stack(rows) if rows else None
        return Draft(tokens=tokens, probs=probs, source=self.name)

    def _choose(self, logits: np.ndarray, grammar: GrammarLike | None) -> tuple[int, np.ndarray | None]:
        """The draft token and q, the distribution it was drawn from (None: argmax)."""
        if self.sampling.greedy:
            return (int(np.argmax(logits)) if grammar is None else constrained_argmax(logits, grammar)), None
        q = (probs_from_logits(logits, self.sampling) if grammar is None
             else constrained_probs(logits, grammar, self.sampling))
        return sample(q, self.rng), q
