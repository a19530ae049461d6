"""Bounds on a JSON schema, checked before jsonschema's metaschema check and
llama-cpp-python's converter see it.

Both recurse once per level of the schema (a schema ~150 levels deep is a RecursionError);
the converter writes a length or item bound out in full (`"minLength": 10000000` is
50 MB of grammar, `"maxLength": 20000` a group nested 20,000 deep, which llama.cpp's
parser cannot survive), reads a pattern's {m,n} the same way, and its work grows with
the cube of an object's optional properties and the square of rules whose names clash.
Read here without recursion; past a bound: GrammarError naming the keyword and where.
"""

from __future__ import annotations

from localspec.core.errors import GrammarError

MAX_SCHEMA_DEPTH = 64  # objects and arrays inside each other
MAX_SCHEMA_NODES = 1000  # objects and arrays in all
MAX_SCHEMA_BOUND = 1000  # minLength, maxLength, minItems, maxItems, and a pattern's {m,n}
MAX_OPTIONAL_PROPERTIES = 128  # properties an object may leave out (allOf merges its parts)
MAX_PATTERN_NESTING = 64  # groups inside groups in a pattern

_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems")
_DATA = ("enum", "const", "default", "examples")  # JSON values, not schemas


def _over(where: str, what: str) -> GrammarError:
    return GrammarError(f"JSON schema over this server's limits{f' at {where}' if where else ''}: {what}")


def check_schema_bounds(schema: object) -> None:
    """Raise GrammarError if `schema` is past a bound the checks and the converter need."""
    nodes = 0
    todo: list[tuple[object, int, str, bool]] = [(schema, 1, "", True)]
    while todo:
        node, depth, where, is_schema = todo.pop()
        if not isinstance(node, (dict, list)):
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise _over("", f"nested more than {MAX_SCHEMA_DEPTH} deep")
        if nodes > MAX_SCHEMA_NODES:
            raise _over("", f"more than {MAX_SCHEMA_NODES} objects and arrays")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        if isinstance(node, dict) and is_schema:
            _check_keywords(node, where)
        for key, value in items:
            data = not is_schema or key in _DATA and isinstance(node, dict)
            todo.append((value, depth + 1, f"{where}/{key}" if where else str(key), not data))


def _check_keywords(node: dict, where: str) -> None:
    for key in _BOUNDS:
        v = node.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_SCHEMA_BOUND:
            raise _over(where, f"{key} is {v if isinstance(v, int) else f'{v:g}'}, at most {MAX_SCHEMA_BOUND} (the grammar spells "
                               "every character or item out)")
    if isinstance(node.get("pattern"), str):
        _check_pattern(node["pattern"], where)
    optional = _optional_properties(node)
    if optional > MAX_OPTIONAL_PROPERTIES:
        raise _over(where, f"{optional} optional properties in one object, at most {MAX_OPTIONAL_PROPERTIES}")


def _optional_properties(node: dict) -> int:
    """Properties the converter treats as optional in the object `node` becomes (allOf
    merges its parts' properties into one object)."""
    parts = [node, *(p for p in node.get("allOf", ()) if isinstance(p, dict))] if isinstance(
        node.get("allOf"), list) else [node]
    n = 0
    for part in parts:
        props, required = part.get("properties"), part.get("required")
        if isinstance(props, dict):
            names = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
            n += sum(1 for k in props if k not in names)
        for alt in part.get("anyOf", ()) if isinstance(part.get("anyOf"), list) else ():
            if isinstance(alt, dict) and isinstance(alt.get("properties"), dict):
                n += len(alt["properties"])
    return n + (node.get("additionalProperties") not in (None, False))


def _check_pattern(pattern: str, where: str) -> None:
    """Read a pattern as the converter does: escapes, [classes], (groups), {m,n}."""
    depth, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            if depth > MAX_PATTERN_NESTING:
                raise _over(where, f"pattern groups nested more than {MAX_PATTERN_NESTING} deep")
        elif c == ")":
            depth -= 1
        elif c == "{":
            end = pattern.find("}", i)
            end = n if end < 0 else end
            for part in pattern[i + 1:end].split(","):
                try:
                    count = int(part.strip()) if part.strip() else 0
                except ValueError:
                    continue  # the converter says what is wrong with it
                if count > MAX_SCHEMA_BOUND:
                    raise _over(where, f"pattern repetition {pattern[i:end + 1]}: at most {MAX_SCHEMA_BOUND}")
            i = end
        i += 1
