"""The prompt cache (llama-server's --cache-ram): KV states of slots, kept in memory after
their slot was given to another request, so a prompt seen before prefills only what is new
even when no slot still holds it.

A slot keeps its last request's prompt and reply for the next request to start from
(serve/slots.py), but with more distinct prompts than slots, a prompt comes back after its
slot was taken: then the slot's cells are gone and the prompt is prefilled again, where
llama-server restores it from its prompt cache. Prefill is what a request waits for
before its first token, and it costs every other slot its step: on 2 EPYC cores
(AVX-512) SmolLM2-135M decodes an 8-token chunk in 25 ms, one token in 7.5 ms.

As the scheduler places a request in a slot:
- find(prompt, held): an entry holding a longer start of the prompt than the slot will
  (`held`, its own cells or another slot's copied);
- keep(model, slot, kept): before the slot's cells are overwritten, save them when the
  request keeps less than half of them (llama-server's rule), unless an entry already
  holds them;
- restore(model, slot, entry, prompt): the entry found loaded into the slot. An entry stays after a restore (the
  request keeps only the prompt's start of it); the least recently used entries go
  first once the cache is past its size.
All of it runs on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localspec.core.backend import Model, shared_prefix


@dataclass(eq=False)  # found and removed by identity
class _Entry:
    tokens: np.ndarray
    data: bytearray


class PromptCache:
    """At most `limit_bytes` of saved slot states (None: no limit)."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit = limit_bytes
        self.entries: list[_Entry] = []  # least recently used first
        self.saves = 0
        self.restores = 0
        self.restored_tokens = 0

    @property
    def size(self) -> int:
        return sum(len(e.data) for e in self.entries)

    def keep(self, model: Model, seq: int, kept: int) -> bool:
        """Save slot `seq`'s cells before a request that keeps only `kept` of them takes
        it (when that is less than half). Returns whether it saved."""
        tokens = model.seq_tokens(seq)
        if not tokens or 2 * kept >= len(tokens):
            return False
        if any(len(e.tokens) >= len(tokens) and shared_prefix(e.tokens, tokens) == len(tokens)
               for e in self.entries):
            return False  # an entry holds all of it already
        data = model.state_bytes(seq)
        if self.limit is not None and len(data) > self.limit:
            return False
        # an entry this one holds all of is no longer needed
        self.entries = [e for e in self.entries if shared_prefix(e.tokens, tokens) < len(e.tokens)]
        self.entries.append(_Entry(np.asarray(tokens, dtype=np.int32), data))
        self.saves += 1
        while self.limit is not None and self.size > self.limit:
            self.entries.pop(0)
        return True

    def find(self, prompt: Sequence[int], held: int) -> _Entry | None:
        """The entry holding the longest start of `prompt`, when it holds more of it than
        the `held` tokens the slot would start from (the prompt's last token is decoded
        again in any case); None when none does."""
        useful = lambda n: min(n, len(prompt) - 1)
        best, best_n = None, held
        for e in self.entries:
            n = shared_prefix(e.tokens, prompt)
            if useful(n) > useful(best_n):
                best, best_n = e, n
        return best

    def restore(self, model: Model, seq: int, entry: _Entry, prompt: Sequence[int]) -> int:
        """Load `entry` (found by find()) into slot `seq`. Returns how many tokens of
        `prompt` the slot then holds, 0 when nothing was loaded."""
        if entry not in self.entries:  # dropped by a keep() since
            return 0
        self.entries.remove(entry)
        if model.load_state(entry.data, entry.tokens.tolist(), seq=seq) == 0:
            return 0  # llama.cpp refused it: it would be refused again
        self.entries.append(entry)  # the most recently used
        n = shared_prefix(entry.tokens, prompt)
        self.restores += 1
        self.restored_tokens += n
        return n

    def snapshot(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.size, "limit_bytes": self.limit,
                "saves": self.saves, "restores": self.restores, "restored_tokens": self.restored_tokens}
