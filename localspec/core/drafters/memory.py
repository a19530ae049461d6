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
from typing import NamedTuple

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
    MEMORY_REENTRY_BREAKS,
    MEMORY_REENTRY_PRIOR,
    MEMORY_REENTRY_SKIP,
    MEMORY_REENTRY_YOUNG,
    MEMORY_SMOOTH,
)

# bins: (match length row, support column); the last row holds young re-entries (MemoryModel)
N_ROWS = len(MEMORY_LEN_EDGES) + 1
N_BINS = N_ROWS * len(MEMORY_COUNT_EDGES)


@dataclass
class MemoryDraft(Draft):
    """A draft recalled from earlier outputs, with the evidence auto's policy weighs."""

    match_len: int = 0  # length of the matched suffix (as followed: MemoryModel.offer)
    support: list[int] = field(default_factory=list)  # occurrences agreeing on each token
    reentry: bool = False  # it takes up a copy of the same text where the copy broke just before


def _prior() -> np.ndarray:
    first = np.asarray([*MEMORY_PRIOR_LEN, MEMORY_REENTRY_PRIOR])
    miss = (1.0 - first)[:, None] * np.asarray(MEMORY_PRIOR_MISS)[None, :]
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


def _origin(hits: list[tuple[SuffixIndex, np.ndarray]], rows: np.ndarray, first: int) -> tuple[int, int]:
    """(index id, position) of the most recent occurrence whose continuation is the draft's."""
    at = int(np.flatnonzero(rows[:, 0] == first)[-1])
    for ix, pos in hits:
        if at < len(pos):
            return id(ix), int(pos[at])
        at -= len(pos)
    raise AssertionError("a draft's first token follows one of the occurrences")


class _Track:
    """One candidate being followed: context position of its first token, its tokens and
    their support, the length of the match at its first token, how many positions have
    agreed so far, and the last bin it counted in."""

    __slots__ = ("pos", "tokens", "support", "age", "done", "bin", "origin", "reentry")

    def __init__(self, pos: int, tokens: list[int], support: list[int], age: int,
                 origin: tuple[int, int] | None, reentry: bool) -> None:
        self.pos, self.tokens, self.support, self.age, self.done, self.bin = pos, tokens, support, age, 0, -1
        self.origin, self.reentry = origin, reentry  # (index id, position there of its first token)


class Break(NamedTuple):
    """Where a followed candidate broke: the context position of the token it got wrong,
    and where in its source text the token it had there sits (index id, position)."""

    pos: int
    origin: tuple[int, int]

    def resumed_by(self, pos: int, origin: tuple[int, int]) -> bool:
        """Whether a candidate for `pos` from `origin` takes the same text up again a few
        tokens on, on both sides: what a template does after its slot (a function's
        name, a path) took another value than last time."""
        return (origin[0] == self.origin[0] and 0 <= pos - self.pos <= MEMORY_REENTRY_SKIP
                and 0 <= origin[1] - self.origin[1] <= MEMORY_REENTRY_SKIP)


class MemoryModel:
    """Acceptance of a memory draft's tokens by (match length, support) bin, learned in
    hindsight: every candidate is followed against the tokens the target goes on to
    produce until it breaks (for greedy decoding what verifying it would accept).

    A copy of an earlier text that breaks at a slot (another name, another path) often
    goes on a few tokens later: the next match is then short, 2-4 tokens, but it takes up
    the same text just after where the copy broke. Such a re-entry is weighed apart from
    other young matches while it is young (younger than MEMORY_REENTRY_YOUNG), in a row
    of its own (`bins`): in a session of templated replies it holds as often as a long
    match, while a 2-token match elsewhere mostly does not."""

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
        self.broke: deque[Break] = deque(maxlen=MEMORY_REENTRY_BREAKS)  # the latest breaks

    @staticmethod
    def bins(match_len: int, support: Sequence[int], reentry: bool = False) -> np.ndarray:
        """Each drafted token's bin: the match it continues (match_len + its position)
        and how many occurrences agreed on it; a young re-entry's in the last row."""
        lengths = match_len + np.arange(len(support))
        lb = np.clip(np.searchsorted(MEMORY_LEN_EDGES, lengths, side="right") - 1, 0, None)
        if reentry:
            lb = np.where(lengths < MEMORY_REENTRY_YOUNG, N_ROWS - 1, lb)
        cb = np.searchsorted(MEMORY_COUNT_EDGES, np.asarray(support), side="right") - 1
        return lb * len(MEMORY_COUNT_EDGES) + np.clip(cb, 0, None)

    def rates(self, bins: np.ndarray) -> np.ndarray:
        """Acceptance of each drafted token, given the ones before it."""
        est = (self.accepted + MEMORY_SMOOTH * self.prior) / (self.reached + MEMORY_SMOOTH)
        return est[bins]

    def reset(self, n_context: int) -> None:
        self.tracks, self.seen = [], n_context
        self.broke.clear()

    def offer(self, pos: int, tokens: list[int], support: list[int], match_len: int,
              origin: tuple[int, int] | None = None) -> tuple[int, bool]:
        """A candidate for context position `pos` onwards, drafted or not, whose first
        token comes from `origin` (index id, position). Returns the length of its match
        and whether it is a re-entry (class docstring). The length is the n-gram found
        (one of suffix.ORDERS), or longer where the candidate continues one followed
        since earlier, which is then followed further instead of counted twice: the
        lookup finds at most ORDERS' lengths, and a copy that has held for 7 tokens, or
        30, would otherwise be judged as a 4- or 16-token match all along."""
        for t in self.tracks:
            off = pos - t.pos
            if 0 <= off <= t.done and t.tokens[off:off + len(tokens)] == tokens[: len(t.tokens) - off]:
                if off + len(tokens) > len(t.tokens):
                    t.tokens, t.support = t.tokens[:off] + tokens, t.support[:off] + support
                return max(match_len, t.age + off), t.reentry
        reentry = origin is not None and any(b.resumed_by(pos, origin) for b in self.broke)
        self.tracks.append(_Track(pos, list(tokens), list(support), match_len, origin, reentry))
        return match_len, reentry

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
                b = int(self.bins(t.age + i, t.support[i : i + 1], t.reentry)[0])
                if b != t.bin:  # a candidate enters this bin: older ones weigh less
                    self.reached[b] *= MEMORY_DECAY
                    self.accepted[b] *= MEMORY_DECAY
                    t.bin = b
                hit = context[p] == t.tokens[i]
                self.reached[b] += 1.0
                self.accepted[b] += hit
                if not hit:
                    if t.origin is not None:
                        self.broke.append(Break(p, (t.origin[0], t.origin[1] + i)))
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
        hits = [(ix, pos) for ix, pos in zip(sources, found) if len(pos)]
        rows = np.concatenate([ix.following(pos, k) for ix, pos in hits])
        tokens, support = most_frequent(rows, k, MEMORY_MIN_SHARE)
        if not tokens:
            return MemoryDraft(source=self.name)
        n, reentry = self.model.offer(len(context), tokens, support, n, _origin(hits, rows, tokens[0]))
        return MemoryDraft(tokens=tokens, source=self.name, match_len=n, support=support, reentry=reentry)

    def rates(self, draft: MemoryDraft) -> np.ndarray:
        """Acceptance of each of the draft's tokens, given the ones before."""
        return self.model.rates(MemoryModel.bins(draft.match_len, draft.support, draft.reentry))

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
