"""A suffix index over token texts: where each n-gram occurred (n in ORDERS), so that a
draft can follow the most frequent continuation of the longest match, as SuffixDecoding
(arXiv 2411.04975) drafts from its suffix trees.

An n-gram is named by a 64-bit polynomial hash of its tokens read backwards from the
position after it (`keys`), which makes the query for every order one pass over the
context's last ORDERS[-1] tokens. Positions live in sorted numpy arrays (`_Level`: keys
sorted, positions ascending within a key, so the most recent occurrences come last),
built in bulk, plus a dict of the newest positions (`tail`) that is folded into a level
once it grows: adding a token costs a dict append per order, a lookup a binary search per
level and order, whatever the size. Texts are separated by SEP, which never matches a
real token, so no n-gram spans two texts and a continuation stops at a text's end.

Pure numpy, no llama_cpp. Used per generation (the context) and globally (the memory of
earlier outputs: drafters/memory.py, memory_store.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

ORDERS = (2, 3, 4, 8, 16, 32)  # n-gram lengths indexed; the longest match is one of them
SEP = -1  # between texts: hashes as 0, which no real token (>= 0, hashed as id + 1) does
PRIME = 0x9E3779B97F4A7C15  # odd, so a window's hash tells its length's leading token apart
MASK = (1 << 64) - 1
MASK32 = (1 << 32) - 1
MIX = 0xD6E8FEB86659FD93  # odd: multiplying carries every bit of a hash into the kept high half
TAIL_MAX = 4096  # newest positions kept in dicts before they are folded into a sorted level
BULK = 512  # a text this long is indexed in numpy at once, not through the dicts
OCC_CAP = 32  # occurrences followed per lookup: the most recent ones
_POW = [pow(PRIME, j, 1 << 64) for j in range(ORDERS[-1])]
_ORDER_SET = frozenset(ORDERS)


def query_keys(context: Sequence[int]) -> dict[int, int]:
    """{n: key of the context's last n tokens} for each n in ORDERS that fits."""
    out, h, n_max = {}, 0, min(len(context), ORDERS[-1])
    for j in range(n_max):
        h = (h + (int(context[-1 - j]) + 1) * _POW[j]) & MASK
        if j + 1 in _ORDER_SET:
            out[j + 1] = ((h * MIX) & MASK) >> 32
    return out


def window_keys(tokens: np.ndarray, start: int, end: int) -> dict[int, np.ndarray]:
    """{n: keys (uint32: a 64-bit hash's high half) of the n-grams ending just before
    each position in [start, end)} for each n in ORDERS, in one pass; position i's n-gram
    is tokens[i - n:i]. Windows reaching before the first token read SEP there, so they
    never match a context."""
    pad = ORDERS[-1]
    lo = max(0, start - pad)
    vals = np.zeros(pad + end - lo, dtype=np.uint64)
    vals[pad:] = (tokens[lo:end].astype(np.int64) + 1).astype(np.uint64)
    base = pad + start - lo  # index in vals of position `start`
    h = np.zeros(end - start, dtype=np.uint64)
    out: dict[int, np.ndarray] = {}
    with np.errstate(over="ignore"):
        for j in range(ORDERS[-1]):
            h += vals[base - 1 - j : base - 1 - j + end - start] * np.uint64(_POW[j])
            if j + 1 in _ORDER_SET:
                out[j + 1] = ((h * np.uint64(MIX)) >> np.uint64(32)).astype(np.uint32)
    return out


class _Level:
    """Sorted keys and their positions, per order, for positions [start, end)."""

    def __init__(self, start: int, end: int, keys: dict[int, np.ndarray], pos: dict[int, np.ndarray]) -> None:
        self.start, self.end, self.keys, self.pos = start, end, keys, pos

    @classmethod
    def build(cls, tokens: np.ndarray, start: int, end: int) -> _Level:
        keys, pos = {}, {}
        for n, k in window_keys(tokens, start, end).items():
            order = np.argsort(k, kind="stable")  # stable: positions ascend within a key
            keys[n], pos[n] = k[order], (order + start).astype(np.int32)
        return cls(start, end, keys, pos)

    @classmethod
    def merge(cls, a: _Level, b: _Level) -> _Level:
        """One level for two adjacent ones (a before b): a stable sort of two sorted runs
        is a linear merge, and keeps a's positions before b's within a key."""
        keys, pos = {}, {}
        for n in ORDERS:
            k = np.concatenate([a.keys[n], b.keys[n]])
            order = np.argsort(k, kind="stable")
            keys[n], pos[n] = k[order], np.concatenate([a.pos[n], b.pos[n]])[order]
        return cls(a.start, b.end, keys, pos)

    def find(self, n: int, key: int) -> np.ndarray:
        keys = self.keys[n]
        # the same dtype as the keys: a Python int would make numpy convert the whole array
        lo, hi = keys.searchsorted(np.array((key, key + 1 if key < MASK32 else key), dtype=np.uint32)).tolist()
        if key == MASK32:
            hi = len(keys)
        return self.pos[n][hi - OCC_CAP if hi - lo > OCC_CAP else lo:hi]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys.values()) + sum(a.nbytes for a in self.pos.values())


class SuffixIndex:
    """Token texts and where each n-gram of ORDERS occurred in them."""

    def __init__(self) -> None:
        self.buf = np.full(1024, SEP, dtype=np.int32)
        self.n = 0  # tokens held (texts and their separators)
        self.levels: list[_Level] = []  # covering [0, tail_start): the big one first
        self.tail_start = 0
        self.tail: dict[int, dict[int, list[int]]] = {n: {} for n in ORDERS}

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]

    def __len__(self) -> int:
        return self.n

    def extend(self, new: Iterable[int]) -> None:
        """Append tokens (a text, or a text's next part) and index the n-grams they end."""
        new = np.asarray(list(new) if not isinstance(new, np.ndarray) else new, dtype=np.int32)
        if not len(new):
            return
        start, end = self.n, self.n + len(new)
        if end > len(self.buf):
            grown = np.full(max(2 * len(self.buf), end + 1024), SEP, dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[start:end] = new
        self.n = end
        if end - self.tail_start > TAIL_MAX or end - start >= BULK:
            self._fold()
            return
        for i in range(start, end):  # a round's few tokens: Python beats numpy's call overhead
            for n, key in query_keys(self.buf[max(0, i - ORDERS[-1]):i].tolist()).items():
                self.tail[n].setdefault(key, []).append(i)

    def add_text(self, text: Sequence[int]) -> None:
        """A whole text, closed by a separator: nothing continues across its end."""
        self.extend([*text, SEP])

    def _fold(self) -> None:
        """Move the tail into a sorted level; merge levels once the newer outgrows a
        quarter of the older, so there are few levels and each token is re-sorted
        O(log size) times in all."""
        self.levels.append(_Level.build(self.buf, self.tail_start, self.n))
        while len(self.levels) > 1 and 4 * (self.levels[-1].end - self.levels[-1].start) > (
                self.levels[-2].end - self.levels[-2].start):
            b, a = self.levels.pop(), self.levels.pop()
            self.levels.append(_Level.merge(a, b))
        self.tail_start = self.n
        self.tail = {n: {} for n in ORDERS}

    def find(self, n: int, key: int) -> np.ndarray:
        """Positions just after the occurrences of the n-gram with this key (the next
        token's position), oldest first, the most recent OCC_CAP of them."""
        parts = [lv.find(n, key) for lv in self.levels]
        recent = self.tail[n].get(key)
        if recent:
            parts.append(np.asarray(recent[-OCC_CAP:], dtype=np.int32))
        parts = [p for p in parts if len(p)]
        if not parts:
            return np.zeros(0, dtype=np.int32)
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out[-OCC_CAP:]

    def following(self, positions: np.ndarray, k: int) -> np.ndarray:
        """Rows of the k tokens from each position (SEP past the end of what is held)."""
        at = positions[:, None] + np.arange(k)
        rows = self.buf.take(at, mode="clip")
        rows[at >= self.n] = SEP
        return rows

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes + sum(lv.nbytes for lv in self.levels)


def longest_match(indexes: Sequence[SuffixIndex], context: Sequence[int]) -> tuple[int, list[np.ndarray]]:
    """(n, positions per index): the longest n in ORDERS whose last-n-token n-gram of
    `context` occurs in any of `indexes`, and where it does in each; (0, []) if none."""
    keys = query_keys(context)
    orders = sorted(keys)
    best: tuple[int, list[np.ndarray]] = (0, [])
    lo, hi = 0, len(orders) - 1
    while lo <= hi:  # an n-gram that occurs ends where its suffixes occur: presence is monotone in n
        mid = (lo + hi) // 2
        n = orders[mid]
        found = [ix.find(n, keys[n]) for ix in indexes]
        if any(len(f) for f in found):
            best, lo = (n, found), mid + 1
        else:
            hi = mid - 1
    return best


def most_frequent(rows: np.ndarray, k: int, min_share: float) -> tuple[list[int], list[int]]:
    """Follow the rows (each a continuation, most recent last) token by token, taking the
    most frequent next token (ties: the most recent) and keeping the rows that agree;
    stop at a separator, after k tokens, or where the top choice's share of the rows
    still followed falls below min_share. Returns (tokens, support per token: how many
    rows continued with it)."""
    tokens: list[int] = []
    support: list[int] = []
    live = rows[:, :k].tolist()  # a few dozen short rows: plain Python beats numpy calls here
    for j in range(min(k, rows.shape[1])):
        col = [r[j] for r in live]
        first = col[-1]
        if col.count(first) == len(col):  # all agree: the common case in a repeated text
            tok, n = first, len(col)
        else:
            counts = Counter(col)
            n = max(counts.values())
            if n < min_share * len(col):
                break
            tok = next(t for t in reversed(col) if counts[t] == n)
            live = [r for r in live if r[j] == tok]
        if tok == SEP:
            break
        tokens.append(tok)
        support.append(n)
    return tokens, support
