"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the
context's suffix. Pure Python, no llama_cpp; an index per n-gram size is kept
incrementally so a round costs O(ngram_max), not O(context)."""

from __future__ import annotations

from collections.abc import Sequence

from localspec.drafters.base import Draft, DrafterBase


class _NgramIndex:
    """n-gram -> position just after its most recent occurrence, for one token list."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.tokens: list[int] = []
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}

    def extend(self, new: Sequence[int]) -> None:
        for tok in new:
            end = len(self.tokens)  # position of `tok`: n-grams ending before it map here
            for n in self.sizes:
                if end >= n:
                    self.last[n][tuple(self.tokens[end - n : end])] = end
            self.tokens.append(tok)

    def lookup(self, suffix: tuple[int, ...]) -> int | None:
        return self.last[len(suffix)].get(suffix)


class NgramDrafter(DrafterBase):
    """Longest suffix match from ngram_max down to ngram_min, most recent occurrence.

    `extra` is an optional second source (e.g. a file's tokens) searched after the
    context at each n-gram size.
    """

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, extra: Sequence[int] = ()) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.sizes = range(ngram_min, ngram_max + 1)
        self.extra = _NgramIndex(self.sizes)
        self.extra.extend(extra)
        self.ctx = _NgramIndex(self.sizes)

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = _NgramIndex(self.sizes)
        self.ctx.extend(prompt)

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self.ctx.tokens)
        if n > len(context) or list(context[:n]) != self.ctx.tokens:
            self.begin(context)  # context was rewound or replaced: re-index
        else:
            self.ctx.extend(context[n:])

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self._sync(context)
        if k <= 0:
            return Draft(source=self.name)
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            suffix = tuple(context[len(context) - n :])
            for index in (self.ctx, self.extra):
                start = index.lookup(suffix)
                if start is not None:
                    tokens = index.tokens[start : start + k]
                    if tokens:
                        return Draft(tokens=list(tokens), source=self.name, match_len=n)
        return Draft(source=self.name)
