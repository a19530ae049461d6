"""An edit's instruction that sets a key's value foretells the edit too: "Set debug to
false", "set LOG_LEVEL to "debug" in every service", "increase every port by 1000".
`apply` writes the new value wherever the key is assigned one as code (`"key": value`,
`key: value`, `key = value`, `key=value`), in the style of the value it replaces: the
same quotes, `True` where the file writes `True`, a number kept a number. renames.predict
applies these after the renames, so the n-gram drafter copies a config edit's new
values before the target has written the first of them.

Only what is certain is read: one key (a name), one value (a quoted string, a number,
a boolean, null, or one word), and a change of a number by a whole number. An
instruction that narrows the change to some places ("in the auth service") is not read:
the prediction would be wrong everywhere else. A wrong prediction costs rejected drafts,
never a wrong output: the target verifies every draft.
"""

from __future__ import annotations

import re
from collections.abc import Container
from typing import NamedTuple

_KEY = r"[`'\"]?([A-Za-z_][A-Za-z0-9_.-]*?)[`'\"]?"
_VALUE = r"(\"[^\"\n]*\"|'[^'\n]*'|`[^`\n]*`|-?\d+(?:\.\d+)?|[A-Za-z_][A-Za-z0-9_.-]*)"
_SET = re.compile(r"\bset\s+(?:the\s+)?(?:value\s+of\s+)?(?:(?:key|field|option|setting)\s+)?"
                  + _KEY + r"\s+to\s+" + _VALUE + r"(?=[\s,;.!)]|$)", re.IGNORECASE)
_CHANGE = re.compile(r"\b(increase|increment|raise|bump|decrease|decrement|lower|reduce)\s+"
                     r"(?:(?:every|all|each|the)\s+)?(?:(?:of\s+)?the\s+)?" + _KEY + r"\s+by\s+(\d+)\b",
                     re.IGNORECASE)
_ADD = re.compile(r"\badd\s+(?:(?:a|an|the)\s+)?(?:new\s+)?(?:(?:key|field|entry|property|member)\s+)?"
                  + _KEY + r"\s*(?::|=|\s+with\s+(?:the\s+)?value\s+|\s+set\s+to\s+)\s*" + _VALUE
                  + r"\s+to\s+(?:every|all|each)\s+(?:of\s+the\s+)?([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)
# what may follow the change in its sentence and keep it whole-file
_EVERYWHERE = re.compile(r"^(?:\s*(?:in|for|of|on|across|throughout)\s+(?:every|all|each|any)\b"
                         r"|\s*(?:everywhere|throughout|globally)\b|\s*(?:and|[,;.!]|$))", re.IGNORECASE)
_LITERAL = r"(\"(?:[^\"\\\n]|\\.)*\"|'(?:[^'\\\n]|\\.)*'|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b|[A-Za-z_][A-Za-z0-9_.-]*)"
_WORDS = {"true", "false", "null", "none", "yes", "no", "on", "off"}


class Setting(NamedTuple):
    """One key's new value (`value`, as the instruction wrote it), change (`by`), or a
    new key with that value in every JSON object of a kind (`within`: "service" for the
    objects under a "services" key)."""

    key: str
    value: str | None = None
    by: int = 0
    within: str = ""


def whole_file(rest: str) -> bool:
    """Whether what follows a change in the instruction leaves it file-wide."""
    return _EVERYWHERE.match(rest) is not None


def parse(instruction: str) -> list[Setting]:
    """The settings an instruction makes file-wide; [] where it makes none this reader
    is sure of."""
    out = []
    for m in _SET.finditer(instruction):
        if whole_file(instruction[m.end():]):
            out.append(Setting(m.group(1), value=m.group(2)))
    for m in _CHANGE.finditer(instruction):
        if whole_file(instruction[m.end():]):
            sign = -1 if m.group(1).lower() in ("decrease", "decrement", "lower", "reduce") else 1
            out.append(Setting(m.group(2), by=sign * int(m.group(3))))
    out += [Setting(m.group(1), value=m.group(2), within=m.group(3)) for m in _ADD.finditer(instruction)]
    return out


def _objects(text: str) -> list[tuple[int, int, str | None]] | None:
    """(open, close, key) of each object in a JSON text, `key` the one it (or the array
    holding it) is the value of; None where the brackets do not pair."""
    stack: list[tuple[str, int, str | None]] = []
    out, last, key, i = [], None, None, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            last, i = text[i + 1:j], j + 1
            continue
        if c == ":":
            key = last
        elif c in "{[":
            stack.append((c, i, key if not stack or stack[-1][0] == "{" else stack[-1][2]))
            key = None
        elif c in "}]":
            if not stack or "{[".index(stack[-1][0]) != "}]".index(c):
                return None
            kind, start, held = stack.pop()
            if kind == "{":
                out.append((start, i, held))
            key = None
        elif c == ",":
            key = None
        i += 1
    return out if not stack else None


def _added(text: str, objects: list[tuple[int, int, str | None]], setting: Setting) -> list[tuple[int, str]]:
    """(position, text) insertions that add the setting's key to each of the JSON text's
    `objects` (`_objects`) it names, after the last member and in the object's own layout."""
    kind = setting.within.lower().rstrip("s")
    value = setting.value if setting.value[:1] != "'" else '"' + setting.value[1:-1] + '"'
    out = []
    for start, close, held in objects:
        body = text[start + 1:close]
        if held is None or held.lower().rstrip("s") != kind or not body.strip() \
                or re.search(r'"' + re.escape(setting.key) + r'"\s*:', body):
            continue
        end = start + 1 + len(body.rstrip())  # after the last member
        colon = re.search(r'"\s*:(\s*)', body)
        member = f'"{setting.key}":{colon.group(1) if colon else " "}{value}'
        if "\n" in body:
            line = text[text.rfind("\n", 0, end) + 1:end]
            member = "\n" + line[:len(line) - len(line.lstrip())] + member
        else:
            member = " " + member
        out.append((end, "," + member))
    return out


def _render(setting: Setting, old: str, python: bool) -> str | None:
    """The new literal in the old one's style; None where it cannot be said."""
    if setting.by:
        quote = old[0] if old[:1] in "\"'" else ""
        digits = old[1:-1] if quote else old
        if not re.fullmatch(r"-?\d+", digits):
            return None
        return f"{quote}{int(digits) + setting.by}{quote}"
    value = setting.value
    quoted = value[:1] in "\"'`"
    bare = value[1:-1] if quoted else value
    if old[:1] in "\"'":
        return old[0] + bare + old[0]
    if quoted and not re.fullmatch(r"-?\d+(?:\.\d+)?|[A-Za-z_][A-Za-z0-9_.-]*", bare):
        return '"' + bare + '"'
    if bare.lower() in _WORDS:
        if old.lower() in _WORDS:  # the file's own spelling of its booleans
            return bare.capitalize() if old[:1].isupper() else bare.lower()
        if python:
            return {"true": "True", "false": "False", "null": "None", "none": "None"}.get(bare.lower(), bare)
        return {"none": "null"}.get(bare.lower(), bare.lower())
    if quoted and not re.fullmatch(r"-?\d+(?:\.\d+)?", bare) and not old[:1].isalpha():
        return '"' + bare + '"'  # a number's place given a word: a string
    return bare


def apply(text: str, wanted: list[Setting], prose: Container[int], filename: str | None = None) -> str | None:
    """`text` with the `wanted` settings (`parse`) made where a key is assigned a value
    as code (a key at a position `in prose` is left alone), and the added keys where the
    text is JSON (by its name, or its first character where it has none); None where
    nothing changes."""
    name = (filename or "").lower()
    python = name.endswith((".py", ".pyi", ".pyw"))
    is_json = name.endswith((".json", ".jsonc", ".json5")) or (not name and text.lstrip()[:1] in ("{", "["))
    adds = [s for s in wanted if s.within]
    objects = (_objects(text) or []) if adds and is_json else []
    inserts = [add for s in adds for add in _added(text, objects, s)]
    settings = {s.key: s for s in wanted if not s.within}
    for key, s in list(settings.items()):  # "every port" or "all ports"
        if key.endswith("s") and len(key) > 2:
            settings.setdefault(key[:-1], s)
    if not settings and not inserts:
        return None
    keys = "|".join(map(re.escape, sorted(settings, key=len, reverse=True)))
    pattern = re.compile(r"(?<![A-Za-z0-9_.-])([\"']?)(" + keys + r")\1(\s*[:=]\s*)(?![=])" + _LITERAL)
    edits = [(pos, pos, new) for pos, new in inserts]
    for m in pattern.finditer(text) if settings else ():
        if m.start(2) in prose:  # the key itself: a lexer may split its quotes off
            continue
        if python and bool(m.group(1)) == ("=" in m.group(3)):
            continue  # Python: `"key": v` and `key = v` set a key; `key: int` annotates
        new = _render(settings[m.group(2)], m.group(4), python)
        if new is None or new == m.group(4):
            continue
        edits.append((m.start(4), m.end(4), new))
    out, pos = [], 0
    for start, end, new in sorted(edits):
        out += [text[pos:start], new]
        pos = end
    return "".join(out) + text[pos:] if edits else None
