"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the
context's suffix. Pure Python, no llama_cpp; an index per n-gram size is kept
incrementally so a round costs O(ngram_max), not O(context).

Where a text to copy is given (an edit's file, a `prediction`), the drafter also follows
the copy it last drafted from, token by token (`_Follow`), across the places where the
output changes it. Where the output writes one token in place of one source token and
then goes on with the source after it (a rename: `lo` becomes `low`), the copy is drafted
again from there at once, without waiting for ngram_min new tokens to match, and the
substitution is learned: later drafts copy the source with it applied once the output's
last SURE tokens for that source token were that replacement, and as it was once they
were the token kept (till then a draft stops before it). A longer change (tokens
inserted, or a few replaced by others) is learned where the output goes on with the
source after it, and drafted once made SURE times more often than not (`_Rules`: what
was written in place of what, between which two source tokens). A draft copies past a
change site seen before into the unchanged stretch behind it. Where the output begins a
change seen at that kind of place before (once is not sure: the draft stopped before
it), the rest of it and the source after it are drafted (the source only where it was
made after the same source token: after another, what follows it is a guess), and its
end is the known one, not where its tokens happen to recur in the source (a field added
to each line of a JSON list: the copy stays on the source's next line, not on the
output's earlier one, which goes on with the wrong name); once it is written in full,
the copy goes on after it at once, not two tokens later. A replacement made after one
source token also stops a draft where the same tokens come after another (a line's `"},`
after another value), until the output has kept such a place SURE times. Given the
tokens' texts (`text`), a draft also stops before a source token that holds a word the
output renamed elsewhere in another token ("(lo" and "'lo" once " lo" became " low"),
until the output has kept that token SURE times: a rename reaches every spelling of its
word, and a draft broken there costs all the tokens drafted past it. With the texts, the
copy is also followed where the output writes the source's text in other pieces (`)`
then `:\n` for `):\n`, `.''` `')\n\n` for `.'` `''` `)\n\n`: a model tokenizes what it
writes otherwise than the file was tokenized), or begins a change inside a source token
(`)`, ` -> str`, `:\n`): the copy goes on after that token, as old as it was, once the
output has written the rest of its text; till then a match elsewhere is not drafted,
the target decides. A change also ends where the output's token is the end of the
source token it began in or of the next one (`: str) -> bool:\n` for `):\n`). A match
in the output's own earlier text (a docstring begun like one above it) is drafted but not
followed: the copy followed stays the given text's, taken up as old as it was where the
output goes on with it. A copy held for a
while and left for longer new text (a docstring inserted, longer than any change learned
as a rule, while a match elsewhere was followed or none) is taken up again where it was
left once the output's last two tokens are the text there, not at a younger match of
them elsewhere; as old as it was where the instruction foretold the new text (sites.py).
The target verifies every draft, so this changes only what is proposed.

A copy of the context itself that reaches the context's end, where the context ends in
three periods of a loop (a small model repeating a line, a run of equal rows), goes on
repeating the loop up to k tokens, as an overlapping copy does, instead of stopping at
the end of the context (a draft of one period).

Given a `prediction` of the output (an edit's file with the changes its instruction
foretells made: renames.py), the drafter copies it in place of the file: a match in the
prompt's copy of the file is taken up at the same place of the prediction, and the old
names it kept (in prose) are unsure until the output has shown what it does there."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.drafters.renames import Predicted
from localspec.core.tuning import BREAK_SPAN, PARK_MIN_RUN, PARK_SPAN, REWRITE_SPAN, SURE

RUN_CAP = 1024  # how far back a match is extended to measure the run it continues
_NO_BREAKS = (-2 * BREAK_SPAN - 2, -BREAK_SPAN - 1)  # two breaks too far apart to count
_WORD = re.compile(r"\W*(\w+)\W*")


def word_of(text: str) -> str | None:
    """The one word a token's text holds, without the spaces and punctuation around it
    (" lo", "(lo" and "'lo" hold "lo"; " long" holds "long"), or None."""
    m = _WORD.fullmatch(text)
    return m.group(1) if m else None


@dataclass
class NgramDraft(Draft):
    """A prompt-lookup draft, with where its copy stands (what auto's policy weighs)."""

    match_len: int = 0  # length of the matched suffix
    run_len: int = 0  # tokens before the draft that agree with its source
    own: bool = False  # copying a given text, the draft copies the output's own earlier text instead


class NgramSource(Protocol):
    """What auto's policy needs of its n-gram drafter (NgramDrafter, or a test's stand-in)."""

    copying: bool  # whether a text to copy was given
    predicting: bool  # ... and whether it is a prediction of the output (renames.py)

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

    __slots__ = ("index", "q", "run", "pending", "held", "changed", "q0", "rest", "split", "ruled")

    def __init__(self, index: _Index, q: int, run: int) -> None:
        self.index, self.q, self.run = index, q, run
        self.ruled = -1  # where a known change was just written in full (an insertion stays at its place)
        self.pending: tuple[int, int] | None = None
        self.held = 0  # the run before the pending mismatch
        # a change longer than one for one: the output's tokens since it began at source
        # position q0, until the output goes on with the source (`_Rules`)
        self.changed: list[int] | None = None
        self.q0 = 0
        # the output wrote the start of source token q's text in other tokens (`)` of
        # `):\n`): `rest` is the text of it still to come, `split` the output's tokens so far
        self.rest: str | None = None
        self.split: list[int] = []


@dataclass
class _Parked:
    """A copy the output left after following it for a while: its source, the position
    it was left at, how long it had held, and the context length when it was left."""

    index: _Index
    q: int
    held: int
    at: int


class _Substitutions:
    """Source token -> the tokens the output wrote in its place, and what it wrote there
    the last SURE times (a replacement, or the token kept), learned from the copy followed
    (`_Follow`). With the tokens' texts (`word`: token -> the word it holds), the words of
    replaced source tokens are `renamed`, and a source token never replaced that holds one
    is unsure until kept SURE times."""

    def __init__(self, word: Callable[[int], str | None] | None = None) -> None:
        self.replaced: dict[int, set[int]] = {}
        self.word = word
        self.renamed: set[str] = set()
        self.last: dict[int, tuple[int, ...]] = {}  # source token -> the output's last SURE tokens for it

    def __call__(self, token: int) -> int | None:
        """The token the output is expected to write for source `token`, or None while
        that is unsure: the output replaced it, and its last SURE times there did not all
        write the same (a replacement, or the token kept). The last times decide, not all
        of them: a name renamed in one function (`add(self, item)` made `product`) may be
        kept in the next (`for item in ...`), and there a draft stops before it instead
        of breaking at every place until the count turns. A draft that stops costs the
        round's length; the target's own token there adds to the evidence."""
        last = self.last.get(token, ())
        if token not in self.replaced:
            if self.renamed and self.word(token) in self.renamed and len(last) < SURE:
                return None  # its word was renamed in another token: the target decides
            return token
        if len(last) >= SURE and len(set(last)) == 1:
            return last[0]
        return None

    def learn(self, source: int, output: int) -> None:
        if source == output:
            if source in self.replaced or (self.renamed and self.word(source) in self.renamed):
                self._saw(source, output)
            return
        self.replaced.setdefault(source, set()).add(output)
        self._saw(source, output)
        if self.word is not None and (w := self.word(source)) is not None and w != self.word(output):
            self.renamed.add(w)

    def _saw(self, source: int, output: int) -> None:
        """The output's last SURE tokens written for `source`."""
        self.last[source] = (*self.last.get(source, ()), output)[-SURE:]


class _Rule:
    """Between source token `a` and `b`, the output writes `y` in place of `s`."""

    __slots__ = ("s", "b", "y", "seen", "kept", "kept_like")

    def __init__(self, s: tuple[int, ...], b: int, y: tuple[int, ...]) -> None:
        self.s, self.b, self.y, self.seen, self.kept = s, b, y, 1, 0
        self.kept_like = 0  # where the same tokens came after another token, kept as they were

    @property
    def sure(self) -> bool:
        return self.seen >= self.kept + SURE

    @property
    def dropped(self) -> bool:
        return self.kept >= self.seen + SURE


class _Rules:
    """Changes longer than one token for one (an inserted parameter type, a field added
    to every line of a JSON list, a name grown by two tokens), learned where the output
    goes on with the source after one (at most REWRITE_SPAN source tokens on), keyed by
    the source token before them, with how often each was made and how often the source
    was kept where it could have been."""

    def __init__(self) -> None:
        self.by_left: dict[int, list[_Rule]] = {}
        self.by_first: dict[int, list[_Rule]] = {}  # replacements, by the first token replaced

    def at(self, src: Sequence[int], p: int) -> _Rule | None:
        """The rule made most often that fits source position p, unless dropped."""
        best = None
        for r in self.by_left.get(src[p - 1], ()) if p > 0 else ():
            end = p + len(r.s)
            if (not r.dropped and end < len(src) and src[end] == r.b
                    and tuple(src[p:end]) == r.s and (best is None or r.seen > best.seen)):
                best = r
        return best

    def like(self, src: Sequence[int], p: int) -> _Rule | None:
        """A replacement made after another source token that fits at p (the same source
        tokens, the same one after them): `"},` closing a line that ends in another
        value. Only until the output kept such a place SURE times: an edit that changes
        some of the places does not stop every draft at the others."""
        for r in self.by_first.get(src[p], ()):
            end = p + len(r.s)
            if r.kept_like < SURE and not r.dropped and end < len(src) and src[end] == r.b \
                    and tuple(src[p:end]) == r.s:
                return r
        return None

    def site(self, src: Sequence[int], p: int) -> _Rule | None:
        """The rule at p: made after this source token (`at`), else one made after another (`like`)."""
        return self.at(src, p) or self.like(src, p)

    def learn(self, a: int, s: tuple[int, ...], b: int, y: tuple[int, ...]) -> None:
        rules = self.by_left.setdefault(a, [])
        for r in rules:
            if (r.s, r.b, r.y) == (s, b, y):
                r.seen += 1
                return
        rules.append(_Rule(s, b, y))
        if s:
            self.by_first.setdefault(s[0], []).append(rules[-1])


class NgramDrafter(DrafterBase):
    """Longest suffix match from ngram_max down to ngram_min, most recent occurrence.

    `extra` is an optional second source (e.g. a file's tokens) searched after the
    context at each n-gram size; `text` (token -> its text), where given, lets a copy
    followed across a rename stop before other spellings of the renamed word.
    """

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, extra: Sequence[int] = (),
                 follow: bool = True, text: Callable[[int], str] | None = None,
                 prediction: Sequence[int] | None = None, renamed: Sequence[str] = (),
                 unsure: Collection[int] = ()) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.sizes = range(ngram_min, ngram_max + 1)
        self.extra = _Index(self.sizes)
        # a prediction of the output (the file with an instruction's foretold changes
        # made: renames.py) is copied in place of `extra`; a match in the prompt's copy of
        # `extra` is taken up at the same place of the prediction
        self.extra.extend(prediction if prediction else extra)
        self._predicted = Predicted(extra, prediction) if prediction else None
        # positions of the prediction before which the instruction foretells a change of
        # unknown text (sites.py): a draft copying it stops there
        self.unsure = frozenset(unsure) if prediction else frozenset()
        self.ctx = _Index(self.sizes)
        self.follow = follow  # follow the copy of `extra` across changes (module docstring)
        texts: dict[int, str] = {}
        words: dict[int, str | None] = {}

        def piece(token: int) -> str:
            if token not in texts:
                texts[token] = text(token)
            return texts[token]

        def word(token: int) -> str | None:
            if token not in words:
                words[token] = word_of(piece(token))
            return words[token]

        self._text = piece if text is not None else None
        self.subs = _Substitutions(word if text is not None else None)
        if text is not None:  # the old names a prediction kept (prose): the target decides
            self.subs.renamed.update(renamed)
        self.rules = _Rules()
        self._follow: _Follow | None = None
        self._parked: _Parked | None = None
        self._n_prompt = 0  # where the output begins in `ctx`
        self._broke = _NO_BREAKS  # context lengths at the output's last two breaks (`_left`)

    @property
    def predicting(self) -> bool:
        """Whether the text copied is a prediction of the output that differs from the
        file (renames.py): not where only the sites of changes are foretold (sites.py)."""
        return self._predicted is not None and self._predicted.changed

    @property
    def copying(self) -> bool:
        """Whether a text to copy was given (`extra`: an edit's file, a `prediction`)."""
        return bool(self.extra.tokens)

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = _Index(self.sizes)
        self.ctx.extend(prompt)
        self._n_prompt = len(prompt)
        self._follow = self._parked = None
        self._broke = _NO_BREAKS
        if self._predicted is not None:
            self._predicted.locate(prompt)

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self.ctx.tokens)
        if n > len(context) or list(context[:n]) != self.ctx.tokens:
            self.begin(context)  # context was rewound or replaced: re-index
        else:
            for tok in context[n:]:
                self._advance(tok)
                self.ctx.extend((tok,))
                if self._parked is not None:
                    self._resume()

    def _advance(self, tok: int) -> None:
        """The output wrote `tok`: move the followed copy on, learning substitutions."""
        f = self._follow
        if f is None:
            return
        src = f.index.tokens
        if f.changed is not None:
            self._changing(f, tok)
            return
        if f.q >= len(src):
            self._follow = None
            return
        if f.rest is not None:
            self._splitting(f, tok)
            return
        if f.pending is None:
            self._left(src, f.q, f.ruled, tok)
        if tok == src[f.q] and f.pending is None and f.q != f.ruled:
            if (r := self.rules.at(src, f.q)) is not None:
                r.kept += 1  # a rule's place, where the output kept the source
            elif (r := self.rules.like(src, f.q)) is not None:
                r.kept_like += 1
        if tok == src[f.q] or tok in self.subs.replaced.get(src[f.q], ()):
            if f.pending is not None:  # the output went on with the source: a substitution,
                self.subs.learn(*f.pending)  # and the copy goes on: its run with it
                f.pending, f.run = None, f.held + 1
            self.subs.learn(src[f.q], tok)
            f.q += 1
            f.run += 1
        elif f.pending is None and (r := self.rules.site(src, f.q)) is not None and r.y[:1] == (tok,) \
                and len(r.y) > 1:  # a change seen here before begins again: follow it as one
            f.changed, f.q0, f.held = [tok], f.q, f.run
        elif f.pending is None and (w := self._walk(src, f.q, None, tok)) is not None:
            f.held = f.run  # the source's text in other pieces (`)` of `):\n`, `.''` of `.'` `''`)
            f.q, f.rest, f.split, f.run = *w, [tok] if w[1] is not None else [], f.run + 1
        elif f.pending is None:  # taken for one token in place of one: resume after it
            f.pending, f.held = (src[f.q], tok), f.run
            f.q += 1
            f.run = 0
        else:  # more than one for one: watch for the output going on with the source
            f.changed, f.q0, f.pending = [f.pending[1], tok], f.q - 1, None

    def _left(self, src: Sequence[int], q: int, ruled: int, tok: int) -> None:
        """The output wrote `tok` where the copy followed is at source position q: where a
        draft of it would have had another token there (not stopped before it: nothing
        foretold a change), a break."""
        drafted, _ = self._copy(src, q, 1, ruled=ruled)
        if drafted and drafted[0] != tok:
            self._broke = (self._broke[1], len(self.ctx.tokens))

    def _aged(self, run: int) -> int:
        """A copy's age as drafted: its run, but where the output broke from the copy it
        followed twice within BREAK_SPAN tokens where nothing foretold it, no more than the
        tokens since the later break. A rename made once leaves the copy as old as it was;
        an output that keeps leaving it (a file rewritten line by line in other words) is
        no such thing: its copies last as briefly as its stretches between changes,
        however far back a match reaches or a copy was followed."""
        b1, b2 = self._broke
        return min(run, len(self.ctx.tokens) - b2) if b2 - b1 <= BREAK_SPAN else run

    def _wordy(self, tokens: Sequence[int]) -> bool:
        """Whether the tokens' text holds a letter or digit (or their texts are not known):
        two tokens of only spaces and quotes (an indent, a docstring's quotes) recur everywhere,
        and a copy taken up where they recur in the source is taken up by chance."""
        return self._text is None or any(ch.isalnum() for t in tokens for ch in self._text(t))

    def _walk(self, src: Sequence[int], q: int, rest: str | None, tok: int) -> tuple[int, str | None] | None:
        """Where output token `tok`'s text leaves the copy of `src` from token q (`rest`: the
        text of src[q] still to come, None for all of it), as (q, rest) again; None where
        its text is not the source's there (or the tokens' texts are not known). The same
        text in other pieces: `)` of `):\n` leaves rest `:\n`, `.''` of `.'` `''` leaves `'`."""
        if self._text is None:
            return None
        t = self._text(tok)
        while t:
            if q >= len(src):
                return None
            piece = self._text(src[q]) if rest is None else rest
            if not piece or t.startswith(piece):
                t, q, rest = t[len(piece):], q + 1, None
            elif piece.startswith(t):
                return q, piece[len(t):]
            else:
                return None
        return q, rest

    def _splitting(self, f: _Follow, tok: int) -> None:
        """The output goes on inside source token q: with the rest of its text and maybe
        more of the source (the copy goes on, as old as it was), or with a change begun
        inside it (`)` then ` -> str` where the source has `):\n`): followed as a change of
        that token that ends where the output writes the rest of its text."""
        w = self._walk(f.index.tokens, f.q, f.rest, tok)
        if w is not None:
            f.split = [*f.split, tok] if w[0] == f.q else ([tok] if w[1] is not None else [])
            f.q, f.rest, f.run = *w, f.run + 1
        else:
            f.changed, f.q0 = [*f.split, tok], f.q
            f.run, f.split = 0, []

    def _changing(self, f: _Follow, tok: int) -> None:
        """A change longer than one for one goes on, or ends where the output's last two
        tokens go on with the source at most REWRITE_SPAN tokens after where it began:
        then it is learned as a rule and the copy goes on, as old as it was. Past
        REWRITE_SPAN + 2 output tokens the n-gram lookup has to find the copy again."""
        src, out = f.index.tokens, f.changed
        out.append(tok)
        if f.rest is not None:  # begun inside source token q0: it ends with the rest of its text
            if self._text(tok) == f.rest:
                self._rejoin(f, f.q0 + 1, out, f.q0 + 1)
                return
        r = self.rules.site(src, f.q0)
        if r is not None and tuple(out) == r.y:  # a change seen here before, written in full
            self._rejoin(f, f.q0 + len(r.s), r.y, f.q0 + len(r.s))
            f.ruled = f.q
            return
        if r is not None and len(out) < len(r.y) and tuple(out) == r.y[: len(out)]:
            return  # ... under way: its end is known, not guessed
        for m in range(min(REWRITE_SPAN, len(src) - f.q0 - 2) + 1):
            p = f.q0 + m
            if out[-2] == src[p] and out[-1] == src[p + 1] and (m == 0 or self._wordy(out[-2:])):
                self._rejoin(f, p, out[:-2], p + 2)
                return
        if self._text is not None and len(t := self._text(tok)) >= 2 and t.strip():
            for p in range(f.q0, min(f.q0 + 2, len(src) - 1)):
                if self._text(src[p]).endswith(t) and tok != src[p]:  # ends inside another piece of text
                    self._rejoin(f, p + 1, out, p + 1)
                    return
        if len(out) > REWRITE_SPAN + 2:
            self._park(f)
            self._follow = None

    def _rejoin(self, f: _Follow, end: int, y: Sequence[int], q: int) -> None:
        """The change begun at source position q0 ends: the output wrote `y` in place of
        the source up to `end` (learned as a rule between the tokens around them), and the
        copy goes on from q, as old as it was."""
        src = f.index.tokens
        if f.q0 > 0 and end < len(src):
            self.rules.learn(src[f.q0 - 1], tuple(src[f.q0 : end]), src[end], tuple(y))
        f.q, f.run, f.changed, f.rest = q, f.held + len(f.changed), None, None

    def _park(self, f: _Follow | None) -> None:
        """Remember an old copy the output left (a docstring inserted, a line replaced)
        where it left it, to take it up again there (`_resume`)."""
        if f is None:
            return
        if f.changed is not None:
            q, held = f.q0, f.held
        elif f.pending is not None:
            q, held = f.q - 1, f.held
        else:
            q, held = f.q, (f.held if f.rest is not None else f.run)
        if held >= PARK_MIN_RUN and q < len(f.index.tokens):
            self._parked = _Parked(f.index, q, held, len(self.ctx.tokens))

    def _resume(self) -> None:
        """The output goes on with a copy it left (`_park`) at most REWRITE_SPAN source
        tokens after where it left it (its last two tokens, holding a letter or digit,
        are the source's there; the indent before the place left counts): the copy is
        followed from there again, unless the one followed now is older. Left where the
        instruction foretold new text (a site: sites.py), it is as old as it was: the
        output was to come back there. Left elsewhere, its age is what the output's tokens
        show (a break nobody foretold is seldom the last: the 1.5B writing a docstring
        after every field of held-out config.py)."""
        pk, ctx = self._parked, self.ctx.tokens
        if len(ctx) - pk.at > PARK_SPAN:
            self._parked = None
            return
        src, tail = pk.index.tokens, ctx[-2:]
        if len(ctx) - pk.at < 2 or not self._wordy(tail):
            return
        for p in range(max(0, pk.q - 1), min(pk.q + REWRITE_SPAN, len(src) - 2) + 1):
            if src[p] == tail[0] and src[p + 1] == tail[1]:
                f = self._follow
                if f is None or f.run < pk.held or f.pending is not None or f.changed is not None:
                    foretold = self._unsure_in(src, max(0, pk.q - 1), 3)
                    run = pk.held + 2 if foretold else _run_len(src, p + 2, ctx, 2, self.subs)
                    self._follow = _Follow(pk.index, p + 2, run)
                self._parked = None
                return

    def _unsure_in(self, src: Sequence[int], p: int, n: int) -> bool:
        """Whether the prediction's tokens p..p+n (at least p) hold a site of a foretold
        change of unknown text (sites.py): a rule learned elsewhere applied there is a
        guess, not a copy."""
        return src is self.extra.tokens and any(q in self.unsure for q in range(p, p + max(1, n)))

    def _copy(self, src: Sequence[int], p: int, k: int, ruled: int = -1) -> tuple[list[int], int]:
        """Up to k tokens of `src` from p as the output is expected to write them: the
        learned rules and substitutions applied, up to the first unsure one; and the
        source position the copy reached."""
        out: list[int] = []  # `ruled`: where a rule was just applied (an insertion stays at its position)
        unsure = self.unsure if src is self.extra.tokens else ()  # (one lookup per token)
        while len(out) < k and p < len(src):
            r = self.rules.at(src, p) if p != ruled else None
            if r is None and p != ruled and (p in unsure or self.rules.like(src, p) is not None):
                break  # changed after another token, or foretold to change here: the target decides
            if r is not None:
                if not r.sure:
                    break
                out += r.y
                if self._unsure_in(src, p, len(r.s)):  # the rule's text where the instruction's is unknown: a guess
                    return out[:k], p + len(r.s)
                p += len(r.s)
                ruled = p
                continue
            u = self.subs(src[p])
            if u is None:
                break
            out.append(u)
            p += 1
        return out[:k], p

    def draft(self, context: Sequence[int], k: int) -> NgramDraft:
        self._sync(context)
        if k <= 0:
            return NgramDraft(source=self.name)
        sub = self.subs if self.follow and self.copying else None
        found = self._lookup(context, sub)
        f = self._follow
        # the copy followed has held at least as long as the match (or there is none: the
        # output changed a token, and the next went on with the source after it)
        holds = (sub is not None and f is not None and f.pending is None and f.changed is None
                 and (found is None or f.run >= found[3]))
        if holds and f.rest is not None:
            return NgramDraft(source=self.name)  # inside a source token the output split: the target decides
        if holds and f.q < len(f.index.tokens):
            tokens, end = self._copy(f.index.tokens, f.q, k, ruled=f.ruled)
            tokens = self._looped(f.index, f.q, end, f.run, tokens, k)
            return NgramDraft(tokens=tokens, source=self.name, run_len=self._aged(f.run), own=self._own(f.index, f.q))
        if sub is not None and f is not None and f.changed is not None:
            redo = self._redo(f, k, found)
            if redo is not None:
                return redo
        if found is None:
            return NgramDraft(source=self.name)
        index, start, n, run = found
        own = self._own(index, start)
        if sub is not None:
            # the copy followed is the given text's: a match in the output's own text (a
            # docstring begun like one above) is drafted, not followed across changes
            if not own and (f is None or (f.changed is None and (f.index is not index or f.q != start))):
                self._park(f)
                self._follow = _Follow(index, start, run)
            tokens, end = self._copy(index.tokens, start, k)
        else:
            tokens = index.tokens[start : start + k]
            end = start + len(tokens)
        tokens = self._looped(index, start, end, run, tokens, k)
        return NgramDraft(tokens=list(tokens), source=self.name, match_len=n, run_len=self._aged(run), own=own)

    def _own(self, index: _Index, start: int) -> bool:
        """Whether a draft from `start` of `index` copies the output's own earlier text
        where a text to copy is given (an edit's model writing a docstring like the one it
        wrote above): such a copy breaks as often as any n-gram match does, not as rarely
        as a copy of the file."""
        return self.copying and index is self.ctx and start >= self._n_prompt

    def _redo(self, f: _Follow, k: int, found: tuple[_Index, int, int, int] | None) -> NgramDraft | None:
        """Where the output has begun a change seen at this kind of source position before
        (a rule, sure or not yet: the draft stopped before it), the rest of that change and,
        where it was made after this same source token, the source after it; None where
        the change written so far is no known one, or where the n-gram match `found` does
        not go on with that change (it copies something else that matches better)."""
        src, out = f.index.tokens, f.changed
        r = self.rules.site(src, f.q0)
        if r is None or r.dropped or tuple(r.y[: len(out)]) != tuple(out) or len(r.y) <= len(out):
            return None
        left = r.y[len(out):]
        if found is not None:
            index, start = found[0], found[1]
            if tuple(index.tokens[start : start + len(left)]) != left:
                return None
        rest = []
        # the source after it, where the change was made after this source token and the
        # instruction foretells no text of unknown content here; else what follows the
        # change is a guess (made after another token: `-> bool` learned at fnmatch, and
        # `_compile_pattern` returns `re.Pattern`): the target decides
        if self.rules.at(src, f.q0) is r and not self._unsure_in(src, f.q0, len(r.s)):
            rest, _ = self._copy(src, f.q0 + len(r.s), k, ruled=f.q0 + len(r.s))
        return NgramDraft(tokens=[*r.y[len(out):], *rest][:k], source=self.name, run_len=self._aged(f.held))

    def _looped(self, index: _Index, start: int, end: int, run: int, tokens: Sequence[int],
                k: int) -> Sequence[int]:
        """`tokens`, copied from `start` to `end` of `index`, gone on to k tokens where they
        copy the context up to its end and the context ends in a loop: its last `period`
        tokens (from `start`) repeat the two periods before them (`run`, the tokens before
        `start` that agree with the context's end, covers both: three periods in all, as a
        model repeating itself or a run of equal rows gives). Then the copy goes on with
        the repetition it is part of, as a copy that overlaps itself does."""
        period = len(index.tokens) - start
        if (index is self.ctx and 0 < len(tokens) < k and end == len(index.tokens)
                and run >= 2 * period):
            return (list(tokens) * (k // len(tokens) + 1))[:k]
        return tokens

    def _lookup(self, context: Sequence[int], sub) -> tuple[_Index, int, int, int] | None:
        """(index, start, n, run) of the longest suffix match, most recent occurrence."""
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            suffix = tuple(context[len(context) - n :])
            for index in (self.ctx, self.extra):
                start = index.lookup(suffix)
                if index is self.ctx and start is not None and self._predicted is not None:
                    moved = self._predicted.moved(start)
                    if moved is not None:  # in the prompt's copy of the file: the prediction
                        index, start = self.extra, moved
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
