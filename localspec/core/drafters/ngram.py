"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the
context's suffix. Pure Python, no llama_cpp; an index per n-gram size is kept
incrementally so a round costs O(ngram_max), not O(context).

Where a text to copy is given (an edit's file, a `prediction`), the drafter also follows
the copy it last drafted from, token by token (`_Follow`), across the places where the
output changes it. Where the output writes one token in place of one source token and
then goes on with the source after it (a rename: `lo` becomes `low`), the copy is drafted
again from there at once, without waiting for ngram_min new tokens to match, and the
substitution is learned: later drafts copy the source with it applied, once the output
has replaced that source token SURE times more often than kept it (till then a draft
stops before it). A draft copies past a change site seen before into the unchanged
stretch behind it. The target verifies every draft, so this changes only
what is proposed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.tuning import SURE

RUN_CAP = 1024  # how far back a match is extended to measure the run it continues


@dataclass
class NgramDraft(Draft):
    """A prompt-lookup draft, with where its copy stands (what auto's policy weighs)."""

    match_len: int = 0  # length of the matched suffix
    run_len: int = 0  # tokens before the draft that agree with its source


class NgramSource(Protocol):
    """What auto's policy needs of its n-gram drafter (NgramDrafter, or a test's stand-in)."""

    copying: bool  # whether a text to copy was given

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, context: Sequence[int], k: int) -> NgramDraft: ...


class _Index:
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


class _Follow:
    """The copy being followed: `index` holds the source, `q` is the source position of
    the next output token, `run` how many output tokens have agreed with it (learned
    substitutions agreeing; a substitution the next token confirms keeps the run, so
    the copy resumed after a rename is as old as it was: auto drafts it long at once),
    `pending` a mismatch (source token, output token) not confirmed yet."""

    __slots__ = ("index", "q", "run", "pending", "held")

    def __init__(self, index: _Index, q: int, run: int) -> None:
        self.index, self.q, self.run = index, q, run
        self.pending: tuple[int, int] | None = None
        self.held = 0  # the run before the pending mismatch


class _Substitutions:
    """Source token -> the tokens the output wrote in its place, with how often, and how
    often it was kept, learned from the copy followed (`_Follow`)."""

    def __init__(self) -> None:
        self.replaced: dict[int, dict[int, int]] = {}
        self.kept: dict[int, int] = {}

    def __call__(self, token: int) -> int | None:
        """The token the output is expected to write for source `token`, or None while
        that is unsure: it was replaced, but not SURE times more often than kept, nor
        kept SURE times more often (a draft stops before it, and the target's own token
        there, which the round yields anyway, adds to the evidence)."""
        seen = self.replaced.get(token)
        if not seen:
            return token
        out, n = max(seen.items(), key=lambda kv: kv[1])
        kept = self.kept.get(token, 0)
        if n >= kept + SURE:
            return out
        return token if kept >= n + SURE else None

    def copy(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` of the source as the output is expected to write them, up to the
        first unsure one."""
        out = []
        for t in tokens:
            u = self(t)
            if u is None:
                break
            out.append(u)
        return out

    def learn(self, source: int, output: int) -> None:
        if source == output:
            if source in self.replaced:
                self.kept[source] = self.kept.get(source, 0) + 1
            return
        seen = self.replaced.setdefault(source, {})
        seen[output] = seen.get(output, 0) + 1


class NgramDrafter(DrafterBase):
    """Longest suffix match from ngram_max down to ngram_min, most recent occurrence.

    `extra` is an optional second source (e.g. a file's tokens) searched after the
    context at each n-gram size.
    """

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, extra: Sequence[int] = (),
                 follow: bool = True) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.sizes = range(ngram_min, ngram_max + 1)
        self.extra = _Index(self.sizes)
        self.extra.extend(extra)
        self.ctx = _Index(self.sizes)
        self.follow = follow  # follow the copy of `extra` across changes (module docstring)
        self.subs = _Substitutions()
        self._follow: _Follow | None = None

    @property
    def copying(self) -> bool:
        """Whether a text to copy was given (`extra`: an edit's file, a `prediction`)."""
        return bool(self.extra.tokens)

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = _Index(self.sizes)
        self.ctx.extend(prompt)
        self._follow = None

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self.ctx.tokens)
        if n > len(context) or list(context[:n]) != self.ctx.tokens:
            self.begin(context)  # context was rewound or replaced: re-index
        else:
            for tok in context[n:]:
                self._advance(tok)
            self.ctx.extend(context[n:])

    def _advance(self, tok: int) -> None:
        """The output wrote `tok`: move the followed copy on, learning substitutions."""
        f = self._follow
        if f is None:
            return
        if f.q >= len(f.index.tokens):
            self._follow = None
            return
        src = f.index.tokens[f.q]
        if tok == src or tok in self.subs.replaced.get(src, ()):
            if f.pending is not None:  # the output went on with the source: a substitution,
                self.subs.learn(*f.pending)  # and the copy goes on: its run with it
                f.pending, f.run = None, f.held + 1
            self.subs.learn(src, tok)
            f.q += 1
            f.run += 1
        elif f.pending is None:  # taken for one token in place of one: resume after it
            f.pending, f.held = (src, tok), f.run
            f.q += 1
            f.run = 0
        else:  # not a one-for-one substitution: the n-gram lookup finds the copy again
            self._follow = None

    def draft(self, context: Sequence[int], k: int) -> NgramDraft:
        self._sync(context)
        if k <= 0:
            return NgramDraft(source=self.name)
        sub = self.subs if self.follow and self.copying else None
        found = self._lookup(context, sub)
        f = self._follow
        if sub is not None and f is not None and f.q < len(f.index.tokens) and (
                found is None or f.run >= found[3]) and f.pending is None:
            # the copy followed has held at least as long as the match (or there is none:
            # the output changed a token, and the next went on with the source after it)
            tokens = sub.copy(f.index.tokens[f.q : f.q + k])
            return NgramDraft(tokens=tokens, source=self.name, run_len=f.run)
        if found is None:
            return NgramDraft(source=self.name)
        index, start, n, run = found
        tokens = index.tokens[start : start + k]
        if sub is not None:
            if f is None or f.index is not index or f.q != start:
                self._follow = _Follow(index, start, run)
            tokens = sub.copy(tokens)
        return NgramDraft(tokens=list(tokens), source=self.name, match_len=n, run_len=run)

    def _lookup(self, context: Sequence[int], sub) -> tuple[_Index, int, int, int] | None:
        """(index, start, n, run) of the longest suffix match, most recent occurrence."""
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            suffix = tuple(context[len(context) - n :])
            for index in (self.ctx, self.extra):
                start = index.lookup(suffix)
                if start is not None and start < len(index.tokens):
                    return index, start, n, _run_len(index.tokens, start, context, n, sub)
        return None


def _run_len(source: Sequence[int], start: int, context: Sequence[int], n: int,
             sub=None) -> int:
    """How many tokens before `start` in `source` agree with the end of `context` (the
    matched n, extended backwards up to RUN_CAP): how long the copy has already held.
    `sub`: the learned substitutions, under which a replaced source token agrees."""
    limit = min(start, len(context), RUN_CAP)
    while n < limit and (source[start - n - 1] == context[-n - 1]
                         or (sub is not None and sub(source[start - n - 1]) == context[-n - 1])):
        n += 1
    return n
