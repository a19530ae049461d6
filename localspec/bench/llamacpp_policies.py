"""llama-server's own n-gram drafters, re-implemented for the replay, so a recorded edit
can be replayed through llama.cpp's policy on a CPU's verify curve as well as through
ours: how `localspec` compares with llama-server where no such machine is at hand.

They follow the vendored llama.cpp (llama-cpp-python 0.3.36, common/ngram-map.cpp and
common/speculative.cpp) line for line, with one simplification stated where it sits:

- `ngram-simple` (`--spec-type ngram-simple`): the last `size_n` tokens (the sampled one
  included) are looked up backwards in the context, the most recent earlier occurrence
  wins, and the `size_m` tokens after it are the draft; no draft from a match with fewer
  than `size_n` tokens after it. Nothing is learned, every round drafts.
- `ngram-mod` (`--spec-type ngram-mod`): a table from every `n_match`-gram of the context
  to the token after it (a later occurrence overwrites), filled from the prompt at the
  start and from the output in chunks of 32 tokens; a draft chains lookups up to `n_max`
  tokens and is dropped when the chain breaks before `n_min`; five rounds in a row that
  accept under a quarter of their draft reset the table. llama.cpp hashes the n-gram
  into 4M slots (collisions overwrite); a dict keyed by the n-gram has none, which can
  only make the replay's ngram-mod a little better than the real one.

Defaults are llama.cpp's (size_n 12, size_m 48; n_match 24, n_min 48, n_max 64).
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.core.drafters.base import Draft, DrafterBase


class NgramSimple(DrafterBase):
    """llama.cpp's `common_ngram_simple_draft`."""

    def __init__(self, size_n: int = 12, size_m: int = 48) -> None:
        self.size_n, self.size_m = size_n, size_m
        self.name = f"ngram-simple n{size_m}"
        self._pos: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self._pos, self._indexed = {}, 0

    def draft(self, context: Sequence[int], k: int) -> Draft:
        n = self.size_n
        tokens, cur_len = context[:-1], len(context) - 1  # llama.cpp: history + the sampled one
        if cur_len <= n + self.size_m + 1:
            return Draft()
        # index every n-gram start j <= cur_len - n - 1 (the search's range), in order
        for j in range(self._indexed, cur_len - n):
            self._pos.setdefault(tuple(tokens[j : j + n]), []).append(j)
        self._indexed = max(self._indexed, cur_len - n)
        starts = self._pos.get(tuple(context[-n:]), [])
        match = next((j for j in reversed(starts) if 0 < j <= cur_len - n - 1), 0)
        if match == 0:
            return Draft()
        copy = min(self.size_m, cur_len - (match + n))
        if copy < n:
            return Draft()
        return Draft(tokens=list(tokens[match + n : match + n + copy])[:k], source="ngram")


class NgramMod(DrafterBase):
    """llama.cpp's `common_speculative_impl_ngram_mod` for one sequence."""

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64) -> None:
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.name = f"ngram-mod n{n_max}"
        self._table: dict[tuple[int, ...], int] = {}
        self._i_last = self._n_draft_last = self._n_low = 0

    def _add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        for i in range(start, stop):
            self._table[tuple(tokens[i : i + self.n])] = tokens[i + self.n]

    def begin(self, prompt: Sequence[int]) -> None:
        self._table, self._i_last, self._n_draft_last, self._n_low = {}, 0, 0, 0
        if len(prompt) >= self.n:
            self._add(prompt, 0, len(prompt) - self.n)
            self._i_last = len(prompt) - self.n

    def draft(self, context: Sequence[int], k: int) -> Draft:
        n, tokens, cur_len = self.n, context[:-1], len(context) - 1
        self._n_draft_last = 0
        if cur_len < n:
            return Draft()
        if self._i_last + 32 < cur_len:  # new n-grams in chunks
            self._add(tokens, self._i_last, cur_len - n)
            self._i_last = cur_len - n
        window, out = list(context[-n:]), []
        for i in range(self.n_max):
            nxt = self._table.get(tuple(window[i : i + n]))
            if nxt is None:
                if i < self.n_min:
                    return Draft()
                break
            window.append(nxt)
            out.append(nxt)
        self._n_draft_last = len(out)
        return Draft(tokens=out[:k], source="ngram")

    def observe(self, n_draft: int, n_accept: int, verify_s: float, draft_s: float) -> None:
        if self._n_draft_last == 0:
            return
        if n_accept / self._n_draft_last < 0.25:
            self._n_low += 1
            if self._n_low >= 5:
                self._table, self._n_low, self._i_last = {}, 0, 0
        else:
            self._n_low = 0


def llamacpp_settings() -> list[DrafterBase]:
    """The llama-server settings a replay compares with: ngram-simple at draft lengths
    16 and 48 (its default), ngram-mod at its defaults."""
    return [NgramSimple(12, 16), NgramSimple(12, 48), NgramMod()]
