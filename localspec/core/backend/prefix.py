"""Prefix reuse over a KV cache record, shared by Model and the tests' fake model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    first = int(differ.argmax())
    return first if differ[first] else n


class PrefixCache:
    """Prefix reuse for anything that keeps `cached` (what its KV cache holds) and has
    `rewind(n_past)` and `decode(tokens, "last")`: Model, and the tests' fake model, so
    the engine tests run this code rather than a copy of it."""

    cached: list[int]

    def common_prefix(self, tokens: Sequence[int]) -> int:
        return shared_prefix(self.cached, tokens)

    def prefill(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `tokens`, reusing the shared prefix.

        Returns (logits row after the last token, number of tokens actually decoded).
        The last token is always decoded so its logits exist.
        """
        keep = min(self.common_prefix(tokens), len(tokens) - 1)
        self.rewind(keep)
        return self.decode(tokens[keep:], "last")[0], len(tokens) - keep
