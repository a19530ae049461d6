"""A mirror of llama.cpp's GBNF parser (llama_grammar_parser), iterative where llama.cpp
recurses, that builds no grammar: each rule is kept as its alternatives' sizes and the
rules they begin with, which is all gbnf_check.py's bounds need. The bounds that hold
while parsing (nesting, rules, expanded elements, {m,n}) are checked here as it goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from localspec.core.errors import GrammarError

MAX_NESTING = 1024  # groups inside groups: one C stack frame pair each in llama.cpp's parser
MAX_RULES = 50_000  # named, grouped and made by repetitions
MAX_ELEMENTS = 1_000_000  # after repetitions are expanded (x{m,n} copies x up to n times)
MAX_REPETITION = 2000  # llama.cpp's own bound on m and n in {m,n}

_ESC = r'\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[tnr\\"\[\]-])'
_ESCAPE = re.compile(_ESC)
_LITERAL = re.compile(rf'(?:{_ESC}|[^"\\])*"')  # after the opening quote
_CLASS = re.compile(rf'\^?(?:{_ESC}|[^\]\\])*\]')  # after the opening bracket
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_INT = re.compile(r"[0-9]+")
_TOKEN_ID = re.compile(r"<\[([0-9]+)\]>")
_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_U64 = 2**64 - 1


class Syntax(Exception):
    """The mirror cannot parse the text here: neither can llama.cpp (it says why)."""


def over(what: str) -> GrammarError:
    return GrammarError(f"grammar over this server's limits: {what}")


# An entry of a sequence, and an alternative of a rule: (elements, the rule references
# before its first terminal, whether it has a terminal, every rule reference in it)
Entry = tuple[int, tuple[int, ...], bool, tuple[int, ...]]
EMPTY: Entry = (0, (), False, ())


def _combine(entries: list[Entry]) -> Entry:
    size = sum(e[0] for e in entries)
    refs = tuple(r for e in entries for r in e[3])
    lead: list[int] = []
    for e in entries:
        lead.extend(e[1])
        if e[2]:
            return size, tuple(lead), True, refs
    return size, tuple(lead), False, refs


def _ref(rule: int) -> Entry:
    return 1, (rule,), False, (rule,)


def _chars(body: str) -> int:
    """How many characters llama.cpp reads in a literal's or class's body."""
    return len(body) - sum(len(m) - 1 for m in _ESCAPE.findall(body))


@dataclass
class _Frame:
    """One rule or group being parsed (llama.cpp: one parse_alternates call)."""

    rule_id: int
    nested: bool
    n_before: int = 0  # symbols before the group opened (llama.cpp's n_prev_rules for it)
    alts: list[Entry] = field(default_factory=list)
    seq: list[Entry] = field(default_factory=list)
    last: int = 0  # where the last symbol starts in seq (== len(seq): none yet)
    n_prev: int = 1

    def end_alt(self) -> None:
        self.alts.append(_combine(self.seq))
        self.seq, self.last, self.n_prev = [], 0, 1


class Parser:
    """llama.cpp's llama_grammar_parser, statement for statement where it matters, with
    rule contents reduced to Entry."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.symbols: dict[str, int] = {}
        self.rules: dict[int, list[Entry]] = {}
        self.elements = 0

    def space(self, pos: int, newline_ok: bool) -> int:
        return (_SPACE_NL if newline_ok else _SPACE).match(self.text, pos).end()

    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generate(self, base: str) -> int:
        nid = len(self.symbols)
        self.symbols[f"{base}_{nid}"] = nid
        if nid >= MAX_RULES:
            raise over(f"more than {MAX_RULES} rules (groups and repetitions make rules too)")
        return nid

    def grow(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise over(f"more than {MAX_ELEMENTS} elements once its repetitions are expanded")

    def add_rule(self, rule_id: int, alts: list[Entry]) -> None:
        self.grow(len(alts))  # an ALT between alternatives, an END after the last
        self.rules[rule_id] = alts

    def parse(self) -> None:
        t, n = self.text, len(self.text)
        pos = self.space(0, True)
        while pos < n:
            m = _NAME.match(t, pos)
            if not m:
                raise Syntax
            name = m.group()
            rule_id = self.symbol(name)
            pos = self.space(m.end(), False)
            if not t.startswith("::=", pos):
                raise Syntax
            pos = self.alternates(self.space(pos + 3, True), name, rule_id)
            if t.startswith("\r\n", pos):
                pos += 2
            elif pos < n and t[pos] in "\r\n":
                pos += 1
            elif pos < n:
                raise Syntax
            pos = self.space(pos, True)
        if len(self.symbols) > MAX_RULES:
            raise over(f"more than {MAX_RULES} rules")

    def alternates(self, pos: int, name: str, rule_id: int) -> int:
        """parse_alternates with its recursion into groups kept on a list."""
        t, n = self.text, len(self.text)
        open_: list[_Frame] = []
        f = _Frame(rule_id, nested=False)
        while True:
            pos = self.sequence(pos, f, name)
            c = t[pos] if pos < n else ""
            if c == "(":
                pos = self.space(pos + 1, True)
                before = len(self.symbols)
                open_.append(f)
                if len(open_) > MAX_NESTING:
                    raise over(f"groups nested more than {MAX_NESTING} deep")
                f = _Frame(self.generate(name), nested=True, n_before=before)
                continue
            if c == "|":
                f.end_alt()
                pos = self.space(pos + 1, True)
                continue
            f.end_alt()
            self.add_rule(f.rule_id, f.alts)
            if not open_:
                return pos
            if c != ")":
                raise Syntax
            parent = open_.pop()
            parent.n_prev = max(1, len(self.symbols) - f.n_before)
            parent.last = len(parent.seq)
            parent.seq.append(_ref(f.rule_id))
            self.grow(1)
            pos = self.space(pos + 1, parent.nested)
            f = parent

    def sequence(self, pos: int, f: _Frame, name: str) -> int:
        """parse_sequence up to its end, or to a group's opening (the caller opens it)."""
        t, n = self.text, len(self.text)
        while pos < n:
            c = t[pos]
            if c in '"[':
                m = (_LITERAL if c == '"' else _CLASS).match(t, pos + 1)
                if not m:
                    raise Syntax
                body = t[pos + 1:m.end() - 1]
                k = _chars(body[1:] if c == "[" and body.startswith("^") else body)
                f.last, f.n_prev = len(f.seq), 1
                if k:
                    f.seq.append((k, (), True, ()))
                    self.grow(k)
                pos = self.space(m.end(), f.nested)
            elif c in "<!":
                pos = self.token(pos + (c == "!"))
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append((1, (), True, ()))
                self.grow(1)
                pos = self.space(pos, f.nested)
            elif _NAME.match(c):
                m = _NAME.match(t, pos)
                ref = self.symbol(m.group())
                pos = self.space(m.end(), f.nested)
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append(_ref(ref))
                self.grow(1)
            elif c == "(":
                return pos
            elif c == ".":
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append((1, (), True, ()))
                self.grow(1)
                pos = self.space(pos + 1, f.nested)
            elif c in "*+?":
                pos = self.space(pos + 1, f.nested)
                self.repeat(f, name, 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{":
                pos = self.braces(pos, f, name)
            else:
                break
        return pos

    def token(self, pos: int) -> int:
        """The end of <[id]> or <piece> (whether a piece is one token is llama.cpp's to say)."""
        t = self.text
        if not t.startswith("<", pos):
            raise Syntax
        if t.startswith("<[", pos):
            m = _TOKEN_ID.match(t, pos)
            if not m or int(m.group(1)) > 0xFFFFFFFF:
                raise Syntax
            return m.end()
        end = t.find(">", pos + 1)
        if end < 0:
            raise Syntax
        return end + 1

    def braces(self, pos: int, f: _Frame, name: str) -> int:
        t, nested = self.text, f.nested
        pos = self.space(pos + 1, nested)
        m = _INT.match(t, pos)
        if not m:
            raise Syntax
        lo, hi = int(m.group()), None
        pos = self.space(m.end(), nested)
        if t.startswith("}", pos):
            hi = lo
        elif t.startswith(",", pos):
            pos = self.space(pos + 1, nested)
            if m := _INT.match(t, pos):
                hi = int(m.group())
                pos = self.space(m.end(), nested)
            if not t.startswith("}", pos):
                raise Syntax
        else:
            raise Syntax
        pos = self.space(pos + 1, nested)
        if lo > _U64 or (hi is not None and hi > _U64) or lo > MAX_REPETITION:
            raise Syntax  # llama.cpp refuses these itself
        shown = f"{{{lo},{'' if hi is None else hi}}}"
        if hi is not None and hi < lo:
            raise over(f"{shown} in rule '{name}': the maximum is below the minimum")
        if hi is not None and hi != _U64 and hi > MAX_REPETITION:
            raise over(f"{shown} in rule '{name}': at most {MAX_REPETITION} repetitions")
        self.repeat(f, name, lo, None if hi == _U64 else hi)
        return pos

    def repeat(self, f: _Frame, name: str, lo: int, hi: int | None) -> None:
        """handle_repetitions: the last symbol S becomes S x lo, then a chain of
        optional rules for the rest (one rule `S'* ::= S S' |` when unbounded)."""
        if f.last == len(f.seq):
            raise Syntax  # nothing to repeat
        prev = _combine(f.seq[f.last:])
        total = hi if hi is not None and hi > 0 else max(lo, 1)
        if f.n_prev * total > MAX_REPETITION:
            raise Syntax
        del f.seq[f.last:]
        self.grow(prev[0] * (lo - 1))
        f.seq.extend([prev] * lo)
        last_rec = 0
        for i in range(1 if hi is None else hi - lo):
            rid = self.generate(name)
            alt = _combine([prev, _ref(rid if hi is None else last_rec)]) if i or hi is None else prev
            self.grow(alt[0])
            self.add_rule(rid, [alt, EMPTY])
            last_rec = rid
        if hi is None or hi > lo:
            f.seq.append(_ref(last_rec))
            self.grow(1)
        f.n_prev *= total


