"""An edit's instruction that renames something foretells the edit: the file with the
names replaced where they are code (`predict`). The n-gram drafter copies that
prediction instead of the file, so a rename is drafted before the target has written it
even once, instead of breaking a long draft at its first site and stopping drafts at
the next ones until the change has been seen twice.

Renames are read ("Rename the class Item to Product", "rename foo to bar",
"rename the parameters lo and hi to low and high"): what they change is certain where
the old name is code. Where it is prose (a comment, a docstring, a string that is not
the name alone) the model may or may not follow, so the prediction keeps the file's
text there and the drafter learns from the output what it does with such places, as
without a prediction. Which parts of a file are code comes from pygments' lexer for the
file's name; a file no lexer knows (or a file read from stdin) is taken as code
throughout. Replacements of quoted text ("Replace `print(` with `log(`", "change all
occurrences of "localhost" to "0.0.0.0"") are made first, wherever the text occurs;
settings (settings.py) after the renames. The target verifies every draft: a wrong prediction costs a rejected draft,
never a wrong output.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Sequence
from typing import NamedTuple

from localspec.core.drafters import settings, sites

_NAME = r"[`'\"]?([A-Za-z_][A-Za-z0-9_]*)[`'\"]?"
_NAME_ALONE = re.compile(r"[\"']?[A-Za-z_][A-Za-z0-9_]*[\"']?")  # a string token holding a name alone
# words between "rename" and the names: what kind of thing is renamed
_KINDS = frozenset("""
the a an class classes function functions method methods variable variables var vars
parameter parameters param params argument arguments arg args field fields attribute
attributes attr attrs property properties constant constants key keys module modules
type types enum enums struct structs interface interfaces identifier identifiers symbol
symbols name names member members column columns global globals local locals
""".split())
_LIST_SEP = re.compile(r"\s*,\s*(?:and\s+)?|\s+and\s+")
_TO = re.compile(r"\s+(?:to|as|into|->|→)\s+|\s*(?:->|→)\s*")
_RENAME = re.compile(r"\brenam(?:e|ing)\b", re.IGNORECASE)
_QUOTED = r"(`[^`\n]+`|\"[^\"\n]+\"|'[^'\n]+')"
_REPLACE = re.compile(r"\b(?:replace|change)\s+(?:(?:all|every|each)\s+)?(?:(?:the\s+)?(?:occurrences?|instances?"
                      r"|uses?|calls?|mentions?)\s+of\s+)?(?:the\s+)?" + _QUOTED
                      + r"\s+(?:with|to|by|into|->|→)\s+" + _QUOTED, re.IGNORECASE)


def replacements(instruction: str) -> list[tuple[str, str]]:
    """The (old, new) texts an instruction replaces file-wide, both quoted in it ("Replace
    `a` with `b`"); one narrowed to some places ("in the tests") is not read."""
    return [(m.group(1)[1:-1], m.group(2)[1:-1]) for m in _REPLACE.finditer(instruction)
            if m.group(1)[1:-1] != m.group(2)[1:-1] and settings.whole_file(instruction[m.end():])]


def _names(phrase: str) -> list[str] | None:
    """`a`, `a and b`, `a, b and c` (names, optionally quoted) -> the names; None for
    anything else."""
    parts = _LIST_SEP.split(phrase.strip())
    out = []
    for p in parts:
        m = re.fullmatch(_NAME, p.strip())
        if m is None:
            return None
        out.append(m.group(1))
    return out or None


def parse(instruction: str) -> list[tuple[str, str]]:
    """The (old, new) name pairs an instruction renames; [] where it renames nothing
    this reader is sure of. Each "rename [the kind] OLD[, OLD2 and OLD3] to NEW[, ...]"
    clause counts, up to the end of its sentence; the lists must be as long as each
    other, and an old name must not be an English word of the kind list."""
    pairs: list[tuple[str, str]] = []
    for m in _RENAME.finditer(instruction):
        rest = re.split(r"(?<=[^\s.])\.(?:\s|$)|[;\n]", instruction[m.end():], maxsplit=1)[0]
        words = rest.split()
        while words and words[0].lower() in _KINDS:  # "rename the class ..."
            words.pop(0)
        clause = " ".join(words)
        split = _TO.split(clause, maxsplit=1)
        if len(split) != 2:
            continue
        old = _names(split[0])
        # the new names end where the clause goes on in words ("... to low everywhere")
        tail, new = split[1].split(), None
        for end in range(len(tail), 0, -1) if old else ():
            new = _names(" ".join(tail[:end]).rstrip(",;:"))
            if new is not None and len(new) == len(old):
                break
            new = None
        if new is not None:
            pairs += [(o, n) for o, n in zip(old, new) if o != n and o.lower() not in _KINDS]
    return pairs


class _Prose:
    """A file's prose: `pos in prose` where a position is inside one of its spans."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans, self.starts = spans, [s for s, _ in spans]

    def __contains__(self, pos: object) -> bool:
        i = bisect.bisect_right(self.starts, pos) - 1
        return i >= 0 and self.spans[i][0] <= pos < self.spans[i][1]


def _prose_spans(text: str, filename: str | None) -> _Prose | None:
    """The file's prose by pygments' lexer for its name: comments, and strings other
    than a name alone (`__all__`'s entries, a JSON key are code); none where no lexer
    knows the file; None where the lexer failed on it (no prediction then: an edit never
    fails for want of one)."""
    from pygments.lexers import get_lexer_for_filename
    from pygments.token import Comment, String
    from pygments.util import ClassNotFound

    try:
        lexer = get_lexer_for_filename(filename or "", stripnl=False, ensurenl=False)
    except ClassNotFound:
        return _Prose([])
    try:
        return _Prose([(start, start + len(value)) for start, kind, value in lexer.get_tokens_unprocessed(text)
                       if kind in Comment or (kind in String and _NAME_ALONE.fullmatch(value) is None)])
    except Exception:  # a third-party lexer's bug on an odd file
        return None


class Renaming(NamedTuple):
    """A file as an instruction's replacements, renames and settings leave it (`text`),
    the old names (`old`: where the prediction kept one, in prose, the drafter stops
    before it until the output has shown what it does there), and where in `text` the
    instruction changes it with text it does not give (`sites`: sites.py; a draft stops
    before each)."""

    text: str
    old: tuple[str, ...]
    sites: tuple[int, ...] = ()


def _rename(text: str, pairs: list[tuple[str, str]], prose: _Prose) -> str | None:
    """`text` with the renames made where the old names are code (whole words, case as
    written); None where no old name occurs as code."""
    new = dict(pairs)
    pattern = re.compile(r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, sorted(new, key=len, reverse=True)))
                         + r")(?![A-Za-z0-9_])")
    out, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() in prose:
            continue  # prose: the model decides, the drafter learns what it did
        out += [text[pos:m.start()], new[m.group(0)]]
        pos = m.end()
    return "".join(out) + text[pos:] if pos else None


def predict(text: str, instruction: str, filename: str | None = None) -> Renaming | None:
    """`text` as the instruction's replacements, renames and settings (settings.py)
    leave it where they touch code (a replacement: wherever its text occurs), and the
    sites of the changes it foretells without their text (sites.py); None where the
    instruction foretells nothing in this text."""
    pairs, swaps, wanted = parse(instruction), replacements(instruction), settings.parse(instruction)
    if not pairs and not swaps and not wanted:
        where = tuple(sites.sites(text, instruction, filename))
        return Renaming(text, (), where) if where else None
    original = text
    for old, new in swaps:  # a word as a whole word, other text wherever it occurs
        text = re.sub(r"(?<!\w)" + re.escape(old) + r"(?!\w)" if re.fullmatch(r"\w+", old) else re.escape(old),
                      lambda m, new=new: new, text)
    prose = _prose_spans(text, filename)
    if prose is None:
        return None
    renamed = _rename(text, pairs, prose) if pairs else None
    if renamed is not None:
        text = renamed
        if wanted:  # the renames moved the prose
            prose = _prose_spans(text, filename) or _Prose([])
    text = settings.apply(text, wanted, prose, filename) or text
    where = tuple(sites.sites(text, instruction, filename))
    if text == original and not where:
        return None
    return Renaming(text, tuple(o for o, _ in pairs) if renamed is not None else (), where)


class Predicted:
    """Where a prediction stands for a text the prompt holds: a position in the prompt's
    copy of the `original` -> the same place in the `prediction` (difflib's alignment
    of the two). Inside a stretch the prediction changes there is no such place: the
    output wrote the original's tokens there, not the predicted ones."""

    def __init__(self, original: Sequence[int], prediction: Sequence[int]) -> None:
        self.original = list(original)
        ops = difflib.SequenceMatcher(None, self.original, list(prediction), autojunk=False).get_opcodes()
        self.ops = [(i1, i2, j1, tag == "equal") for tag, i1, i2, j1, _ in ops]
        self.changed = any(not equal for *_, equal in self.ops)  # whether it differs at all
        self.starts = [op[0] for op in self.ops]
        self.copy = (0, 0, 0)  # (prompt position, original position, length) of the copy

    def locate(self, prompt: Sequence[int]) -> None:
        """Find the prompt's copy of the original (its longest stretch)."""
        m = difflib.SequenceMatcher(None, list(prompt), self.original, autojunk=False).find_longest_match()
        self.copy = (m.a, m.b, m.size)

    def moved(self, pos: int) -> int | None:
        """The prediction's position for prompt position `pos`, or None."""
        a, b, size = self.copy
        if not a <= pos < a + size:
            return None
        o = pos - a + b
        i1, _, j1, equal = self.ops[bisect.bisect_right(self.starts, o) - 1]
        if equal:
            return j1 + o - i1
        return j1 if o == i1 else None
