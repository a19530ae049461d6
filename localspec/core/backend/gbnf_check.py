"""Bounds on a GBNF grammar, checked before llama.cpp's parser sees it.

llama.cpp's grammar code cannot be stopped once it runs, and some grammars take it down:
its parser recurses once per nested group with no depth limit (a 20,000-deep group is a
segfault); `x{5,3}` makes it generate rules until memory runs out; its left-recursion
check walks every path through shared rules (exponential), recursing once per rule that
begins with the next, and misses a rule that starts with itself through rules that only
match nothing, which then expands forever; a chain of rules each beginning with the next
costs its parse stacks the chain's length squared (45,000 of them: 72 s). Each
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
from collections import OrderedDict

from localspec.core.backend.gbnf_parse import (  # noqa: F401 - the bounds, in one place
    MAX_ELEMENTS,
    MAX_NESTING,
    MAX_REPETITION,
    MAX_RULES,
    Entry,
    Parser,
    Syntax,
    over,
)
from localspec.core.errors import GrammarError

MAX_GRAMMAR_BYTES = 1 << 20
MAX_STARTS = 1024  # ways one rule can begin: llama.cpp keeps a parse stack for each
MAX_CHECK_WORK = 2_000_000  # rule elements llama.cpp's left-recursion check reads
MAX_LEAD_DEPTH = 2 * MAX_NESTING  # rules beginning with rules beginning with...: a C recursion


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


def _leading(rules: list[list[Entry]], empty: list[bool]) -> list[list[int]]:
    """For each rule, the rules it can begin with, one per alternative and position:
    references before the first terminal, as long as those before them can be empty."""
    out = []
    for alts in rules:
        refs = []
        for _, lead, _, _ in alts:
            for c in lead:
                refs.append(c)
                if not empty[c]:
                    break
        out.append(refs)
    return out


def _nullable(rules: list[list[Entry]]) -> list[bool]:
    """Which rules can match nothing (through other rules too)."""
    n = len(rules)
    null = [False] * n
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # rule -> (rule, alt) that need it
    missing: dict[tuple[int, int], int] = {}
    ready = []
    for r, alts in enumerate(rules):
        for a, (_, lead, term, _) in enumerate(alts):
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


def _analyse(p: Parser, root: str) -> bool:
    """Whether llama.cpp then builds the parsed grammar (not with an undefined rule or
    without the root); GrammarError past a bound on left recursion, on the ways a rule
    can begin and on the work of llama.cpp's left-recursion check. The bounds hold
    either way: a rule never defined is read as one that matches nothing at all."""
    n = max([*p.symbols.values(), *p.rules, -1]) + 1
    rules = [p.rules.get(i, []) for i in range(n)]
    size = max(p.rules, default=-1) + 1  # llama.cpp's rules vector
    refs = {r for alts in p.rules.values() for a in alts for r in a[3]}
    builds = bool(p.rules) and root in p.symbols and all(i in p.rules for i in range(size)) and all(
        r in p.rules for r in refs)
    names = {i: s for s, i in p.symbols.items()}
    null = _nullable(rules)
    lead = _leading(rules, null)
    try:
        order = _postorder(n, lead)
    except _Cycle as c:
        raise GrammarError(f"invalid grammar: left recursion: rule '{names.get(c.rule, c.rule)}' can begin "
                           "with itself") from None
    starts = [0] * n  # terminals a rule can begin with, each a parse stack in llama.cpp
    depth = [0] * n  # rules inside rules at a rule's first terminal: that stack's length
    for r in order:
        depth[r] = 1 + max((depth[c] for c in lead[r]), default=0)
        if depth[r] > MAX_LEAD_DEPTH:
            raise over(f"rule '{names.get(r, r)}' begins with rules more than {MAX_LEAD_DEPTH} deep (each "
                       "begins with the next; llama.cpp copies the whole chain for every step into it)")
        total = 0
        for _, alead, _, _ in rules[r]:
            for c in alead:
                total += starts[c]
                if not null[c]:
                    break
            else:
                total += 1
        starts[r] = min(total, MAX_STARTS + 1)
        if starts[r] > MAX_STARTS:
            raise over(f"rule '{names.get(r, r)}' can begin in more than {MAX_STARTS} ways "
                        "(alternatives, with those of the rules it begins with)")
    _check_work(rules, _leading(rules, [any(a[0] == 0 for a in alts) for alts in rules]), order)
    return builds


def _check_work(rules: list[list[Entry]], lead: list[list[int]], order: list[int]) -> None:
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
        raise over(f"llama.cpp's left-recursion check would read more than {MAX_CHECK_WORK} rule "
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
        raise over(f"{len(raw)} bytes, at most {MAX_GRAMMAR_BYTES}")
    if verdict(text, root) == "ok":
        _checked[key] = None
        if len(_checked) > 64:
            _checked.popitem(last=False)


def verdict(text: str, root: str = "root") -> str:
    """What llama.cpp will make of `text`: "ok", "syntax" (its parser stops) or
    "refused" (parsed, then refused: an undefined rule, no root); GrammarError past a
    bound. Its checks are mirrored only as far as the bounds need: whether a `<piece>`
    is one token is llama.cpp's to say."""
    p = Parser(text.split("\0", 1)[0])  # llama.cpp reads a C string
    try:
        p.parse()
    except Syntax:
        return "syntax"
    return "ok" if _analyse(p, root) else "refused"
