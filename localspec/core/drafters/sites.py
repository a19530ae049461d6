"""An edit's instruction can foretell where a Python file changes without saying what
is written there: "Add type hints to the signatures of fnmatch and translate" changes
those signatures after each parameter that has no annotation and before each missing
`-> T`; "Add a docstring to every function that lacks one" inserts text before the
first statement of each such body. `sites` finds those places (character offsets in
the file: the change goes in before that character). The n-gram drafter stops a draft
copying the file before each (ngram.py): a draft past one would be rejected there and
its tokens after it wasted, and on a CPU where a long verify costs many one-token times
that is most of what drafting an edit loses against an oracle. A site where the model
keeps the file as it was costs one round's worth of draft length, never a wrong
output: the target verifies every draft.

Which functions: the instruction's names of functions (or classes: their methods)
defined in the file, else every function. `self` and `cls` get no site; nor does a
parameter already annotated, a signature that already has `-> T`, or a body that
already has a docstring. A file that is not Python, or does not parse, has none.

Comments above fields ("a one-line comment above every field") get no sites: the 1.5B
coder model put docstrings after the fields instead, and stopping at each field cost
11% of that edit's replayed speedup (docs/measurements.md).
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import tokenize

_HINTS = re.compile(r"\b(?:type[\s-]*hints?|type\s+annotations?|annotations?|annotate|typing)\b", re.IGNORECASE)
_DOCS = re.compile(r"\b(?:add|write|give|document)\b.*\bdocstrings?\b|\bdocstrings?\b.*\b(?:add|write)",
                   re.IGNORECASE | re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMPLICIT = frozenset({"self", "cls"})


def sites(text: str, instruction: str, filename: str | None = None) -> list[int]:
    """Where the instruction's type hints or docstrings go into the Python `text` (sorted
    character offsets); [] where it adds neither or the text is not Python."""
    hints, docs = _HINTS.search(instruction) is not None, _DOCS.search(instruction) is not None
    if not (hints or docs) or (filename and not filename.endswith((".py", ".pyi"))):
        return []
    try:
        tree = ast.parse(text)
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, ValueError, tokenize.TokenError):
        return []
    lines = io.StringIO(text).readlines()  # split at "\n" only, as ast and tokenize count
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(row: int, col: int) -> int:  # tokenize's (row, col in characters)
        return starts[row - 1] + col

    def byte_offset(row: int, col: int) -> int:  # ast's (row, col in UTF-8 bytes)
        return starts[row - 1] + len(lines[row - 1].encode()[:col].decode(errors="ignore"))

    out: list[int] = []
    for fn in _chosen(tree, instruction):
        if hints:
            out += [byte_offset(a.end_lineno, a.end_col_offset) for a in _params(fn)
                    if a.annotation is None and a.arg not in _IMPLICIT]
            if fn.returns is None and (close := _close_paren(toks, fn)) is not None:
                out.append(offset(*close) + 1)  # after the `)`
        if docs and ast.get_docstring(fn, clean=False) is None:
            first = fn.body[0]
            if first.lineno > fn.lineno:  # `def f(): return 1` on one line: no place
                out.append(byte_offset(first.lineno, first.col_offset))  # its indent kept
    return sorted(set(out))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
            *([a.kwarg] if a.kwarg else [])]


def _chosen(tree: ast.AST, instruction: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions the instruction names (the methods of a class it names), else all."""
    words = set(_NAME.findall(instruction))
    fns, named = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fns.append(node)
            if node.name in words:
                named.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in words:
            named += [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    chosen = named or fns
    return sorted({id(f): f for f in chosen}.values(), key=lambda f: (f.lineno, f.col_offset))


def _close_paren(toks: list[tokenize.TokenInfo], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int] | None:
    """(row, col) of the `)` that closes `fn`'s parameters: where `-> T` goes."""
    i = next((i for i, t in enumerate(toks) if t.start == (fn.lineno, fn.col_offset)), None)
    if i is None:
        return None
    depth = 0
    for t in toks[i:]:
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
            if depth == 0:
                return t.start
    return None


def at_tokens(pieces: list[bytes], text: str, offsets: list[int] | tuple[int, ...]) -> list[int]:
    """The tokens (positions in `pieces`, the tokens of `text`) that hold each of the
    character `offsets`: a change that goes in there splits or precedes that token. []
    where the pieces do not spell `text` (a tokenizer that adds or drops text)."""
    raw = text.encode()
    if b"".join(pieces) != raw:
        return []
    ends, n = [], 0
    for piece in pieces:
        n += len(piece)
        ends.append(n)
    out = []
    for off in offsets:
        b = len(text[:off].encode())
        i = bisect.bisect_right(ends, b)  # the first token ending after byte b
        if i < len(pieces):
            out.append(i)
    return sorted(set(out))
