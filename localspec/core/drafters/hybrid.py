"""N-gram when the context has a match, else the draft model."""

from __future__ import annotations

from collections.abc import Sequence

from localspec.core.drafters.base import Draft, Drafter, DrafterBase, constrain


class HybridDrafter(DrafterBase):
    name = "hybrid"

    def __init__(self, ngram: Drafter, model: Drafter) -> None:
        self.ngram = ngram
        self.model = model

    def begin(self, prompt: Sequence[int]) -> None:
        self.ngram.begin(prompt)
        self.model.begin(prompt)

    def constrain(self, grammar: object | None) -> None:
        constrain(self.ngram, grammar)
        constrain(self.model, grammar)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        found = self.ngram.draft(context, k)
        return found if found.tokens else self.model.draft(context, k)
