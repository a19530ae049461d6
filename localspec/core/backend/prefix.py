"""Prefix reuse over a KV cache record, shared by Model and the tests' fake model: the
one place that decides which of a sequence's cells a new context can keep (generate()'s
prefill, the model drafter, a server slot, the on-disk prefix store's warm-up)."""

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


class PrefixReuse:
    """Prefix reuse for anything that keeps a record per KV sequence (`seq_tokens(seq)`;
    sequence 0's is `cached`) and has `rewind(n_past, force, seq=)` and
    `decode(tokens, "last")`: Model, and the tests' fake model, so the engine tests run
    this code rather than a copy of it."""

    cached: list[int]

    def common_prefix(self, tokens: Sequence[int]) -> int:
        return shared_prefix(self.cached, tokens)

    def reuse_prefix(self, tokens: Sequence[int], *, seq: int = 0, redo_last: bool = False,
                     force: bool = False) -> int:
        """Keep the cells of sequence `seq` that hold the start of `tokens` and drop the
        rest; returns how many tokens were kept (tokens[kept:] are still to decode).
        `redo_last`: never keep the last token, whose logits the caller needs (it is
        decoded again). `force`: clear the cells past them even where the record has none."""
        keep = shared_prefix(self.seq_tokens(seq), tokens)
        if redo_last:
            keep = min(keep, len(tokens) - 1)
        self.rewind(keep, force, seq=seq)
        return keep

    def prefill(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `tokens`, reusing the shared prefix.

        Returns (logits row after the last token, number of tokens actually decoded).
        The last token is always decoded so its logits exist.
        """
        keep = self.reuse_prefix(tokens, redo_last=True)
        return self.decode(tokens[keep:], "last")[0], len(tokens) - keep
