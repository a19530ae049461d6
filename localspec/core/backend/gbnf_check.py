"""Bounds on a GBNF grammar, checked before llama.cpp's parser sees it.

llama.cpp's grammar code cannot be stopped once it runs, and some grammars take it down:
its parser recurses once per nested group with no depth limit (a 20,000-deep group is a
segfault); `x{5,3}` makes it generate rules until memory runs out; its left-recursion
check walks every path through shared rules (exponential), and misses a rule that starts
with itself through rules that only match nothing, which then expands forever. Each
parse stack it keeps is matched against every candidate token, so a rule that can begin
in many ways makes every step slow.

So the text is read here first, by a mirror of llama.cpp's parser (iterative: no
recursion) that builds no grammar, only what the bounds need: nesting depth, rules,
elements after repetitions are expanded, the ways each rule can begin, the elements the
left-recursion check would read. Past a bound: GrammarError (exit 2 in `run`, HTTP 400
in the server). Text the mirror cannot parse is left to llama.cpp, whose parser stops at
the same place with its own message.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from localspec.core.errors import GrammarError

MAX_GRAMMAR_BYTES = 1 << 20
MAX_NESTING = 1024  # groups inside groups: one C stack frame pair each in llama.cpp's parser
MAX_RULES = 50_000  # named, grouped and made by repetitions
MAX_ELEMENTS = 1_000_000  # after repetitions are expanded (x{m,n} copies x up to n times)
MAX_REPETITION = 2000  # llama.cpp's own bound on m and n in {m,n}
MAX_STARTS = 1024  # ways one rule can begin: llama.cpp keeps a parse stack for each
MAX_CHECK_WORK = 2_000_000  # rule elements llama.cpp's left-recursion check reads

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


class _Syntax(Exception):
    """The mirror cannot parse the text here: neither can llama.cpp (it says why)."""


def _over(what: str) -> GrammarError:
    return GrammarError(f"grammar over this server's limits: {what}")


# An entry of a sequence, and an alternative of a rule: (elements, the rule references
# before its first terminal, whether it has a terminal)
_Entry = tuple[int, tuple[int, ...], bool]
_EMPTY: _Entry = (0, (), False)


def _combine(entries: list[_Entry]) -> _Entry:
    size = sum(e[0] for e in entries)
    lead: list[int] = []
    for e in entries:
        lead.extend(e[1])
        if e[2]:
            return size, tuple(lead), True
    return size, tuple(lead), False


def _chars(body: str) -> int:
    """How many characters llama.cpp reads in a literal's or class's body."""
    return len(body) - sum(len(m) - 1 for m in _ESCAPE.findall(body))


@dataclass
class _Frame:
    """One rule or group being parsed (llama.cpp: one parse_alternates call)."""

    rule_id: int
    nested: bool
    n_before: int = 0  # symbols before the group opened (llama.cpp's n_prev_rules for it)
    alts: list[_Entry] = field(default_factory=list)
    seq: list[_Entry] = field(default_factory=list)
    last: int = 0  # where the last symbol starts in seq (== len(seq): none yet)
    n_prev: int = 1

    def end_alt(self) -> None:
        self.alts.append(_combine(self.seq))
        self.seq, self.last, self.n_prev = [], 0, 1


class _Parser:
    """llama.cpp's llama_grammar_parser, statement for statement where it matters, with
    rule contents reduced to _Entry."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.symbols: dict[str, int] = {}
        self.rules: dict[int, list[_Entry]] = {}
        self.referenced: set[int] = set()
        self.elements = 0

    def space(self, pos: int, newline_ok: bool) -> int:
        return (_SPACE_NL if newline_ok else _SPACE).match(self.text, pos).end()

    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generate(self, base: str) -> int:
        nid = len(self.symbols)
        self.symbols[f"{base}_{nid}"] = nid
        if nid >= MAX_RULES:
            raise _over(f"more than {MAX_RULES} rules (groups and repetitions make rules too)")
        return nid

    def grow(self, n: int) -> None:
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise _over(f"more than {MAX_ELEMENTS} elements once its repetitions are expanded")

    def add_rule(self, rule_id: int, alts: list[_Entry]) -> None:
        self.grow(len(alts))  # an ALT between alternatives, an END after the last
        self.rules[rule_id] = alts

    def parse(self) -> None:
        t, n = self.text, len(self.text)
        pos = self.space(0, True)
        while pos < n:
            m = _NAME.match(t, pos)
            if not m:
                raise _Syntax
            name = m.group()
            rule_id = self.symbol(name)
            pos = self.space(m.end(), False)
            if not t.startswith("::=", pos):
                raise _Syntax
            pos = self.alternates(self.space(pos + 3, True), name, rule_id)
            if t.startswith("\r\n", pos):
                pos += 2
            elif pos < n and t[pos] in "\r\n":
                pos += 1
            elif pos < n:
                raise _Syntax
            pos = self.space(pos, True)
        if len(self.symbols) > MAX_RULES:
            raise _over(f"more than {MAX_RULES} rules")

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
                    raise _over(f"groups nested more than {MAX_NESTING} deep")
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
                raise _Syntax
            parent = open_.pop()
            parent.n_prev = max(1, len(self.symbols) - f.n_before)
            parent.last = len(parent.seq)
            parent.seq.append((1, (f.rule_id,), False))
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
                    raise _Syntax
                body = t[pos + 1:m.end() - 1]
                k = _chars(body[1:] if c == "[" and body.startswith("^") else body)
                f.last, f.n_prev = len(f.seq), 1
                if k:
                    f.seq.append((k, (), True))
                    self.grow(k)
                pos = self.space(m.end(), f.nested)
            elif c in "<!":
                pos = self.token(pos + (c == "!"))
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append((1, (), True))
                self.grow(1)
                pos = self.space(pos, f.nested)
            elif _NAME.match(c):
                m = _NAME.match(t, pos)
                ref = self.symbol(m.group())
                self.referenced.add(ref)
                pos = self.space(m.end(), f.nested)
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append((1, (ref,), False))
                self.grow(1)
            elif c == "(":
                return pos
            elif c == ".":
                f.last, f.n_prev = len(f.seq), 1
                f.seq.append((1, (), True))
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
            raise _Syntax
        if t.startswith("<[", pos):
            m = _TOKEN_ID.match(t, pos)
            if not m or int(m.group(1)) > 0xFFFFFFFF:
                raise _Syntax
            return m.end()
        end = t.find(">", pos + 1)
        if end < 0:
            raise _Syntax
        return end + 1

    def braces(self, pos: int, f: _Frame, name: str) -> int:
        t, nested = self.text, f.nested
        pos = self.space(pos + 1, nested)
        m = _INT.match(t, pos)
        if not m:
            raise _Syntax
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
                raise _Syntax
        else:
            raise _Syntax
        pos = self.space(pos + 1, nested)
        if lo > _U64 or (hi is not None and hi > _U64) or lo > MAX_REPETITION:
            raise _Syntax  # llama.cpp refuses these itself
        shown = f"{{{lo},{'' if hi is None else hi}}}"
        if hi is not None and hi < lo:
            raise _over(f"{shown} in rule '{name}': the maximum is below the minimum")
        if hi is not None and hi != _U64 and hi > MAX_REPETITION:
            raise _over(f"{shown} in rule '{name}': at most {MAX_REPETITION} repetitions")
        self.repeat(f, name, lo, None if hi == _U64 else hi)
        return pos

    def repeat(self, f: _Frame, name: str, lo: int, hi: int | None) -> None:
        """handle_repetitions: the last symbol S becomes S x lo, then a chain of
        optional rules for the rest (one rule `S'* ::= S S' |` when unbounded)."""
        if f.last == len(f.seq):
            raise _Syntax  # nothing to repeat
        prev = _combine(f.seq[f.last:])
        total = hi if hi is not None and hi > 0 else max(lo, 1)
        if f.n_prev * total > MAX_REPETITION:
            raise _Syntax
        del f.seq[f.last:]
        self.grow(prev[0] * (lo - 1))
        f.seq.extend([prev] * lo)
        last_rec = 0
        for i in range(1 if hi is None else hi - lo):
            rid = self.generate(name)
            alt = _combine([prev, (1, (rid if hi is None else last_rec,), False)]) if i or hi is None else prev
            self.grow(alt[0])
            self.add_rule(rid, [alt, _EMPTY])
            last_rec = rid
        if hi is None or hi > lo:
            f.seq.append((1, (last_rec,), False))
            self.grow(1)
        f.n_prev *= total


# ----- after parsing: llama.cpp's checks, and what its parse stacks will cost -----------


def _postorder(n: int, children: list[list[int]]) -> list[int]:
    """Rule ids, each after every rule it leads to; GrammarError on a cycle."""
    state, order = [0] * n, []
    for root in range(n):
        if state[root]:
            continue
        state[root] = 1
        stack = [(root, iter(children[root]))]
        while stack:
            node, it = stack[-1]
            for c in it:
                if state[c] == 1:
                    raise _Cycle(c)
                if state[c] == 0:
                    state[c] = 1
                    stack.append((c, iter(children[c])))
                    break
            else:
                stack.pop()
                state[node] = 2
                order.append(node)
    return order


class _Cycle(Exception):
    def __init__(self, rule: int) -> None:
        self.rule = rule


def _leading(rules: list[list[_Entry]], empty: list[bool]) -> list[list[int]]:
    """For each rule, the rules it can begin with, one per alternative and position:
    references before the first terminal, as long as those before them can be empty."""
    out = []
    for alts in rules:
        refs = []
        for _, lead, _ in alts:
            for c in lead:
                refs.append(c)
                if not empty[c]:
                    break
        out.append(refs)
    return out


def _nullable(rules: list[list[_Entry]]) -> list[bool]:
    """Which rules can match nothing (through other rules too)."""
    n = len(rules)
    null = [False] * n
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # rule -> (rule, alt) that need it
    missing: dict[tuple[int, int], int] = {}
    ready = []
    for r, alts in enumerate(rules):
        for a, (_, lead, term) in enumerate(alts):
            if term:
                continue
            missing[r, a] = len(lead)
            for c in lead:
                waiting[c].append((r, a))
            if not lead:
                ready.append(r)
    while ready:
        r = ready.pop()
        if null[r]:
            continue
        null[r] = True
        for key in waiting[r]:
            missing[key] -= 1
            if missing[key] == 0:
                ready.append(key[0])
    return null


def _analyse(p: _Parser, root: str) -> bool:
    """False where llama.cpp refuses the parsed grammar itself (an undefined rule, no
    root); GrammarError past a bound on left recursion, on the ways a rule can begin
    and on the work of llama.cpp's left-recursion check."""
    if not p.rules or root not in p.symbols:
        return False
    n = max(p.rules) + 1
    if any(i not in p.rules for i in range(n)) or any(r not in p.rules for r in p.referenced):
        return False
    rules = [p.rules[i] for i in range(n)]
    names = {i: s for s, i in p.symbols.items()}
    null = _nullable(rules)
    lead = _leading(rules, null)
    try:
        order = _postorder(n, lead)
    except _Cycle as c:
        raise GrammarError(f"invalid grammar: left recursion: rule '{names.get(c.rule, c.rule)}' can begin "
                           "with itself") from None
    starts = [0] * n  # terminals a rule can begin with, each a parse stack in llama.cpp
    for r in order:
        total = 0
        for _, alead, _ in rules[r]:
            for c in alead:
                total += starts[c]
                if not null[c]:
                    break
            else:
                total += 1
        starts[r] = min(total, MAX_STARTS + 1)
        if starts[r] > MAX_STARTS:
            raise _over(f"rule '{names.get(r, r)}' can begin in more than {MAX_STARTS} ways "
                        "(alternatives, with those of the rules it begins with)")
    _check_work(rules, _leading(rules, [any(a[0] == 0 for a in alts) for alts in rules]), order)
    return True


def _check_work(rules: list[list[_Entry]], lead: list[list[int]], order: list[int]) -> None:
    """llama.cpp's left-recursion check reads a whole rule, then each rule it can begin
    with, again for every path there (it memoises nothing): bound what it reads."""
    cost = [0] * len(rules)
    for r in order:  # lead here is a subset of the edges order was made from
        cost[r] = min(sum(a[0] for a in rules[r]) + len(rules[r]) + sum(cost[c] for c in lead[r]),
                      MAX_CHECK_WORK + 1)
    seen, total = [False] * len(rules), 0
    for r in range(len(rules)):
        if seen[r]:
            continue
        total += cost[r]
        todo = [r]
        while todo:
            x = todo.pop()
            if not seen[x]:
                seen[x] = True
                todo.extend(lead[x])
    if total > MAX_CHECK_WORK:
        raise _over(f"llama.cpp's left-recursion check would read more than {MAX_CHECK_WORK} rule "
                    "elements (rules reached by many paths)")


_checked: OrderedDict[bytes, None] = OrderedDict()  # digests of texts that passed


def check_gbnf(text: str, root: str = "root") -> None:
    """Raise GrammarError if `text` is past a bound llama.cpp's grammar code needs kept;
    a text that passes is remembered (the server checks a grammar, then builds it)."""
    try:
        raw = text.encode()
    except UnicodeEncodeError:
        raise GrammarError("invalid grammar: it is not valid UTF-8 text") from None
    key = hashlib.blake2b(raw + b"\0" + root.encode(), digest_size=16).digest()
    if key in _checked:
        _checked.move_to_end(key)
        return
    if len(raw) > MAX_GRAMMAR_BYTES:
        raise _over(f"{len(raw)} bytes, at most {MAX_GRAMMAR_BYTES}")
    if verdict(text, root) == "ok":
        _checked[key] = None
        if len(_checked) > 64:
            _checked.popitem(last=False)


def verdict(text: str, root: str = "root") -> str:
    """What llama.cpp will make of `text`: "ok", "syntax" (its parser stops) or
    "refused" (parsed, then refused: an undefined rule, no root); GrammarError past a
    bound. Its checks are mirrored only as far as the bounds need: whether a `<piece>`
    is one token is llama.cpp's to say."""
    p = _Parser(text.split("\0", 1)[0])  # llama.cpp reads a C string
    try:
        p.parse()
    except _Syntax:
        return "syntax"
    return "ok" if _analyse(p, root) else "refused"
