"""Prefix reuse over a KV cache record, shared by Model and the tests' fake model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PrefixCache:
    """Prefix reuse for anything that keeps `cached` (what its KV cache holds) and has
    `rewind(n_past)` and `decode(tokens, "last")`: Model, and the tests' fake model, so
    the engine tests run this code rather than a copy of it."""

    cached: list[int]

    def common_prefix(self, tokens: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            n += 1
        return n

    def prefill(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `tokens`, reusing the shared prefix.

        Returns (logits row after the last token, number of tokens actually decoded).
        The last token is always decoded so its logits exist.
        """
        keep = min(self.common_prefix(tokens), len(tokens) - 1)
        self.rewind(keep)
        return self.decode(tokens[keep:], "last")[0], len(tokens) - keep
