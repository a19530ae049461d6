"""Draft with a small model of the same family. Its KV cache follows the context by
prefix reuse: each round it rewinds to what it shares with the context and decodes
only the new tokens (the accepted ones and the target's correction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import SamplingConfig
from localspec.core.drafters.base import Draft, DrafterBase
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

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # synced lazily by prefix reuse in draft()

    def draft(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or len(context) + k > self.model.n_ctx:
            return Draft(source=self.name)
        logits, _ = self.model.prefill(context)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            if self.p_min > 0.0 and _top_prob(logits) < self.p_min:
                break  # the draft is unsure: verifying further tokens would be waste
            if self.sampling.greedy:
                tok = int(np.argmax(logits))
            else:
                q = probs_from_logits(logits, self.sampling)
                tok = sample(q, self.rng)
                rows.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self.model.decode([tok], "last")[0]
        probs = np.stack(rows) if rows else None
        return Draft(tokens=tokens, probs=probs, source=self.name)
