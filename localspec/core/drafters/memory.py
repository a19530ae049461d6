"""Drafting from memory: what this machine wrote before (and any corpus given with
`--lookup`), beside the current context, drafting the most frequent continuation of the
longest match (suffix.py).

`Memory` holds one user's earlier texts on one vocabulary, bounded in tokens (the oldest
dropped first), plus static corpora that are never dropped. `MemoryDrafter` drafts from
a Memory and from the generation's own context, and says how sure it is: each drafted
token carries the length of the match it continues and how many earlier occurrences
agreed on it. A finished generation is remembered with the part of its prompt that is
new to the memory (`Memory.remember`): a later output often copies an earlier prompt
(the same module given to 'write tests for F', a tool result restated), and the end of
the prompt leads into the output, so a repeated request drafts from its first token.
`MemoryModel` turns those into acceptance rates, learned in hindsight from
every candidate (drafted or not) as copy_age.py does for n-grams, so `auto` weighs a memory
draft like any other; its counts are kept in the profile. At the end of a generation
its prompt and output join the Memory (`finished`), unless the memory is read-only for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.drafters.suffix import ORDERS, SEP, SuffixIndex, longest_match, most_frequent
from localspec.core.tuning import (
    MEMORY_COUNT_EDGES,
    MEMORY_DECAY,
    MEMORY_KEEP,
    MEMORY_LEN_EDGES,
    MEMORY_MAX_TOKENS,
    MEMORY_MIN_SHARE,
    MEMORY_PRIOR_LEN,
    MEMORY_PRIOR_MISS,
    MEMORY_PROMPT_MAX,
    MEMORY_RECENT_PROMPTS,
    MEMORY_SMOOTH,
)

N_BINS = len(MEMORY_LEN_EDGES) * len(MEMORY_COUNT_EDGES)


@dataclass
class MemoryDraft(Draft):
    """A draft recalled from earlier outputs, with the evidence auto's policy weighs."""

    match_len: int = 0  # length of the matched suffix
    support: list[int] = field(default_factory=list)  # occurrences agreeing on each token


def _prior() -> np.ndarray:
    miss = (1.0 - np.asarray(MEMORY_PRIOR_LEN))[:, None] * np.asarray(MEMORY_PRIOR_MISS)[None, :]
    return (1.0 - miss).ravel()


class Memory:
    """Earlier texts of one user (token ids of one vocabulary), newest kept within
    `max_tokens`, and static corpora (never dropped). `prompts`: whether a generation's
    prompt is remembered beside its output (`remember`)."""

    def __init__(self, max_tokens: int = MEMORY_MAX_TOKENS, corpora: Sequence[Sequence[int]] = (),
                 prompts: bool = True, static: SuffixIndex | None = None, keep: bool = True) -> None:
        self.max_tokens = max_tokens
        self.prompts = prompts
        self.keep = keep  # False: the static corpora only, nothing generated is remembered
        self.recent: deque[np.ndarray] = deque(maxlen=MEMORY_RECENT_PROMPTS)  # prompts remembered lately
        self.texts = SuffixIndex()
        # `static`: corpora indexed once and shared (read only) by several memories
        self.static = static if static is not None else static_index(corpora)
        self.added = 0  # texts added since this memory was made

    def add(self, text: Sequence[int]) -> None:
        """Remember a text; drop the oldest ones once past the bound."""
        if not len(text) or not self.keep:
            return
        self.texts.add_text(text[-self.max_tokens + 1 :] if len(text) >= self.max_tokens else text)
        self.added += 1
        if len(self.texts) > self.max_tokens:
            self._drop_oldest()

    def remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Remember a generation as one text: the output, after its prompt from where the
        prompt stops repeating a recent one (a system prompt, a conversation so far is
        not stored again), at most MEMORY_PROMPT_MAX tokens of it and at least the last
        ORDERS[-1] (they lead into the output). Without `prompts`, the output alone."""
        if not self.keep:
            return
        if not self.prompts:
            self.add(output)
            return
        p = np.asarray(prompt, dtype=np.int32)
        start = max((_shared_start(p, r) for r in self.recent), default=0)
        start = max(min(start, len(p) - ORDERS[-1]), len(p) - MEMORY_PROMPT_MAX, 0)
        self.recent.append(p)
        self.add([*p[start:].tolist(), *output])

    def _drop_oldest(self) -> None:
        """Keep the newest texts within MEMORY_KEEP of the bound (whole texts: cut after a SEP)."""
        tokens = self.texts.tokens
        cut = len(tokens) - int(MEMORY_KEEP * self.max_tokens)
        seps = np.flatnonzero(tokens[cut:] == SEP)
        start = cut + int(seps[0]) + 1 if len(seps) else len(tokens)
        kept = SuffixIndex()
        kept.extend(tokens[start:].copy())
        self.texts = kept

    def indexes(self) -> list[SuffixIndex]:
        """What a draft is looked up in, oldest evidence first."""
        return [ix for ix in (self.static, self.texts) if len(ix)]

    def __len__(self) -> int:
        return len(self.texts) + len(self.static)


def static_index(corpora: Sequence[Sequence[int]]) -> SuffixIndex:
    """Static corpora (--lookup) as one index, which memories may share."""
    index = SuffixIndex()
    for text in corpora:
        index.add_text(text)
    return index


def _shared_start(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class _Track:
    __slots__ = ("pos", "tokens", "bins", "done")

    def __init__(self, pos: int, tokens: list[int], bins: np.ndarray) -> None:
        self.pos, self.tokens, self.bins, self.done = pos, tokens, bins, 0


class MemoryModel:
    """Acceptance of a memory draft's tokens by (match length, support) bin, learned in
    hindsight: every candidate is followed against the tokens the target goes on to
    produce until it breaks (for greedy decoding what verifying it would accept)."""

    def __init__(self, stored: dict | None = None) -> None:
        self.reached = np.zeros(N_BINS)
        self.accepted = np.zeros(N_BINS)
        if stored:
            try:
                reached = np.asarray(stored["reached"], dtype=float)
                accepted = np.asarray(stored["accepted"], dtype=float)
                if reached.shape == accepted.shape == (N_BINS,):
                    self.reached, self.accepted = reached, np.minimum(accepted, reached)
            except (KeyError, TypeError, ValueError):
                pass  # a profile from another layout: start from the prior
        self.prior = _prior()
        self.tracks: list[_Track] = []
        self.seen = 0

    @staticmethod
    def bins(match_len: int, support: Sequence[int]) -> np.ndarray:
        """Each drafted token's bin: the match it continues (match_len + its position)
        and how many occurrences agreed on it."""
        lengths = match_len + np.arange(len(support))
        lb = np.searchsorted(MEMORY_LEN_EDGES, lengths, side="right") - 1
        cb = np.searchsorted(MEMORY_COUNT_EDGES, np.asarray(support), side="right") - 1
        return np.clip(lb, 0, None) * len(MEMORY_COUNT_EDGES) + np.clip(cb, 0, None)

    def rates(self, bins: np.ndarray) -> np.ndarray:
        """Acceptance of each drafted token, given the ones before it."""
        est = (self.accepted + MEMORY_SMOOTH * self.prior) / (self.reached + MEMORY_SMOOTH)
        return est[bins]

    def reset(self, n_context: int) -> None:
        self.tracks, self.seen = [], n_context

    def offer(self, pos: int, tokens: list[int], bins: np.ndarray) -> None:
        """A candidate for context position `pos` onwards, drafted or not; one that
        continues a candidate followed since earlier is not counted twice."""
        for t in self.tracks:
            off = pos - t.pos
            if 0 <= off <= t.done and t.tokens[off:off + len(tokens)] == tokens[: len(t.tokens) - off]:
                return
        self.tracks.append(_Track(pos, list(tokens), bins))

    def settle(self, context: Sequence[int]) -> None:
        """Score the followed candidates against the tokens produced since last time."""
        n = len(context)
        if n <= self.seen:
            self.seen = n
            return
        keep = []
        for t in self.tracks:
            for p in range(max(self.seen, t.pos + t.done), min(n, t.pos + len(t.tokens))):
                i = p - t.pos
                b = t.bins[i]
                if i == 0 or b != t.bins[i - 1]:  # a candidate enters this bin: older ones weigh less
                    self.reached[b] *= MEMORY_DECAY
                    self.accepted[b] *= MEMORY_DECAY
                hit = context[p] == t.tokens[i]
                self.reached[b] += 1.0
                self.accepted[b] += hit
                if not hit:
                    break
                t.done += 1
            else:
                if t.done < len(t.tokens):
                    keep.append(t)
        self.tracks = keep
        self.seen = n

    def to_dict(self) -> dict:
        """The counts, for the profile."""
        return {"reached": [round(float(x), 3) for x in self.reached],
                "accepted": [round(float(x), 3) for x in self.accepted]}


class MemoryDrafter(DrafterBase):
    """Most frequent continuation of the longest match in the memory and the context.

    `memory`: earlier texts (None: the context alone); `learn`: whether this
    generation's output joins the memory at its end. `rates(draft)` is how sure it is,
    learned by `model` (shared by the generations of one process when given)."""

    name = "memory"

    def __init__(self, memory: Memory | None, *, learn: bool = True, model: MemoryModel | None = None,
                 on_finish: Callable[[Sequence[int]], None] | None = None) -> None:
        self.memory = memory
        self.learn = learn
        self.model = model if model is not None else MemoryModel()
        self.on_finish = on_finish  # where a finished output goes (default: memory.remember, with its prompt)
        self.ctx = SuffixIndex()
        self.prompt_len = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = SuffixIndex()
        self.ctx.extend(prompt)
        self.prompt_len = len(prompt)
        self.model.reset(len(prompt))

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self.ctx)
        if n > len(context) or (n and context[n - 1] != self.ctx.tokens[n - 1]):
            self.ctx = SuffixIndex()  # rewound or replaced: index it again
            self.ctx.extend(context)
        elif n < len(context):
            self.ctx.extend(context[n:])

    def draft(self, context: Sequence[int], k: int) -> MemoryDraft:
        self._sync(context)
        self.model.settle(context)
        if k <= 0:
            return MemoryDraft(source=self.name)
        sources = [*(self.memory.indexes() if self.memory is not None else ()), self.ctx]
        n, found = longest_match(sources, context)
        if not n:
            return MemoryDraft(source=self.name)
        rows = [ix.following(pos, k) for ix, pos in zip(sources, found) if len(pos)]
        tokens, support = most_frequent(np.concatenate(rows) if len(rows) > 1 else rows[0], k, MEMORY_MIN_SHARE)
        if not tokens:
            return MemoryDraft(source=self.name)
        draft = MemoryDraft(tokens=tokens, source=self.name, match_len=n, support=support)
        self.model.offer(len(context), tokens, MemoryModel.bins(n, support))
        return draft

    def rates(self, draft: MemoryDraft) -> np.ndarray:
        """Acceptance of each of the draft's tokens, given the ones before."""
        return self.model.rates(MemoryModel.bins(draft.match_len, draft.support))

    def finished(self, tokens: Sequence[int]) -> None:
        """The generation ended with context `tokens`: its prompt and output join the memory."""
        if not self.learn or self.memory is None:
            return
        output = list(tokens[self.prompt_len :])
        if self.on_finish is not None:
            self.on_finish(output)
        else:
            self.memory.remember(tokens[: self.prompt_len], output)

    def report(self) -> dict:
        return {}
