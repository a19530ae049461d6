"""The sandbox chat templates run in, and bounds on what a template may cost: a GGUF's
template is code from whoever made the file, and jinja2's sandbox keeps it from
Python's internals but not from running forever or filling memory.

Within `bounded()` (compiling a template, probing it, rendering a prompt):

- time: past a deadline a watchdog raises in the rendering thread; jinja2 templates
  compile to Python, so the exception lands in a loop of any shape
  (`{% for i in range(100000) %}{% for j in range(100000) %}...`);
- size: every operation that can build a value far larger than its operands (`*`, `**`,
  `%` and `+`, `~`, str methods and filters that pad, indent, replace or format) is
  estimated before it runs and refused past MAX_CHARS; every intercepted result and the
  rendered output are charged to a budget of BUDGET characters (a list element counts
  8), so a template can neither emit nor build gigabytes.

A template past a bound raises TemplateLimitError, which no fallback hides: the
template is hostile or broken, and the user is told so.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localspec.core.errors import UsageError

MAX_SECONDS = 5.0  # compiling and probing a template, or rendering one prompt
MAX_CHARS = 32 * 2**20  # one value, and the rendered prompt
BUDGET = 8 * MAX_CHARS  # everything one render builds
_MAX_POW_BITS = 1 << 16


class TemplateError(UsageError):
    """The chat template cannot render this request (the server answers 400)."""


class TemplateLimitError(TemplateError):
    """The chat template ran past a time or size bound."""


class _State(threading.local):
    deadline = math.inf
    left = math.inf
    depth = 0


_state = _State()


def _limit(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"the chat template {what}: it is hostile or broken, and localspec will not run it")


class _Expired(BaseException):
    """Raised in a rendering thread by its watchdog. A BaseException, so that no
    `except Exception` on the way (jinja2's or a filter's) swallows it."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in that thread at its next bytecode (None: drop one still pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc else None)


@contextmanager
def bounded(seconds: float | None = None) -> Iterator[None]:
    """Run a template's compile, probes or render under the bounds (nested calls share
    the outermost's deadline and budget).

    The deadline is a watchdog timer that raises in this thread when it passes: Python
    delivers it between bytecodes, in the template's own loops as anywhere else, and it
    costs nothing until then (a sys.settrace deadline made rendering 3-4x slower)."""
    if _state.depth:
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    seconds = MAX_SECONDS if seconds is None else seconds
    me, lock, watch = threading.get_ident(), threading.Lock(), {"on": True, "fired": False}

    def expire() -> None:
        with lock:
            if watch["on"]:
                watch["fired"] = True
                _raise_in(me, _Expired)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    _state.deadline, _state.left, _state.depth = time.monotonic() + seconds, BUDGET, 1
    timer.start()
    try:
        yield
    except _Expired:
        raise _limit(f"ran longer than {seconds:g} s") from None
    finally:
        timer.cancel()
        while True:  # the watchdog may fire as the work ends: never let it out of here
            try:
                with lock:
                    watch["on"] = False
                    if watch["fired"]:
                        _raise_in(me, None)
                break
            except _Expired:
                continue
        _state.deadline, _state.left, _state.depth = math.inf, math.inf, 0


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return 8 * len(value)
    return 0


def _charge(n: int) -> None:
    """Refuse a value of `n` characters past the bounds, else count it."""
    if n > MAX_CHARS:
        raise _limit(f"would build a value of {n:,} characters (at most {MAX_CHARS:,})")
    _state.left -= n
    if _state.left < 0:
        raise _limit(f"built more than {BUDGET:,} characters")


def output(chunks: Iterator[str]) -> str:
    """The rendered text of a template's generate(), charged as it comes."""
    parts, total = [], 0
    for chunk in chunks:
        if time.monotonic() > _state.deadline:  # a second line, should the watchdog's raise be lost
            raise _limit(f"ran longer than {MAX_SECONDS:g} s")
        total += len(chunk)
        if total > MAX_CHARS:
            raise TemplateLimitError(f"the chat template rendered more than {MAX_CHARS:,} characters, "
                                     "more than any model's context holds")
        _charge(len(chunk))
        parts.append(chunk)
    return "".join(parts)


_NUMBERS = re.compile(r"\d+")


def _formatted(fmt: str, args: Any) -> int:
    """An upper bound on `fmt % args` or `fmt.format(*args)`: its text, its arguments and
    every width or precision written in it (or passed to a `*`)."""
    values = (list(args) if isinstance(args, (tuple, list)) else list(args.values()) if isinstance(args, dict)
              else [args])
    widths = sum(int(n) if len(n) < 12 else 10**12 for n in _NUMBERS.findall(fmt))
    return len(fmt) + widths + sum(_size(v) + _int(v) + 32 for v in values)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0


def _str_estimate(name: str, s: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on the size of str method `name` on `s` (or of the like filter)."""
    a = list(args) + list(kwargs.values())
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(s), _int(a[0]) if a else 0)
    if name == "expandtabs":
        return len(s) * max(1, _int(a[0]) if a else 8)
    if name == "replace" and len(a) >= 2:
        old, new = _size(a[0]), _size(a[1])
        return len(s) + (len(s) + 1) * max(0, new - old) if new > old else len(s)
    if name == "indent":  # the filter: width (an int or a str) per line
        width = a[0] if a else 4
        return len(s) + (s.count("\n") + 1) * (_size(width) or _int(width))
    if name == "wordwrap":
        return len(s) * (1 + max((_size(x) for x in a if isinstance(x, str)), default=1))
    if name in ("format", "format_map"):
        return _formatted(s, kwargs or (a[0] if name == "format_map" and a else tuple(args)))
    if name == "translate" and a and isinstance(a[0], dict):
        return len(s) * max([1, *(_size(v) for v in a[0].values())])
    if name == "join" and a and isinstance(a[0], list):  # `s` is the separator
        return len(s) * len(a[0]) + sum(_size(x) or 32 for x in a[0])
    return 0


def _binop_estimate(op: str, left: Any, right: Any) -> int:
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > _MAX_POW_BITS:
                raise _limit(f"would compute a number of more than {_MAX_POW_BITS:,} bits")
            return 0
        if isinstance(left, int):
            left, right = right, left
        return _size(left) * _int(right) if _size(left) else 0
    if op == "+":
        return _size(left) + _size(right)
    if op == "%" and isinstance(left, str):
        return _formatted(left, right)
    if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right * abs(left).bit_length() > _MAX_POW_BITS:
            raise _limit(f"would compute a number of more than {_MAX_POW_BITS:,} bits")
    return 0


class _Codegen(CodeGenerator):
    """`a ~ b` through the environment, so a concatenation is charged like `+`."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the module's size bounds on its operations."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _Codegen

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.globals.pop("lipsum", None)  # lipsum(10**6, ...) writes without bound
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _charge(_binop_estimate(operator, left, right))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # a str method, or the sandbox's wrapper of str.format around one
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                args = (_listed(args[0]), *args[1:])
            _charge(_str_estimate(name, owner, args, kwargs))
        result = super().call(__context, __obj, *args, **kwargs)
        _charge(_size(result))
        return result

    def bounded_concat(self, values: tuple) -> str:
        texts = [v if isinstance(v, str) else str(v) for v in values]
        _charge(sum(map(len, texts)))
        return "".join(texts)

    def add_filter(self, name: str, f: Callable) -> None:
        self.filters[name] = _bounded_filter(name, f)


def _listed(values: Any) -> list:
    """An iterable as a list, charged (a generator's length is known only so)."""
    items = values if isinstance(values, list) else list(values)
    _charge(_size(items))
    return items


def _bounded_filter(name: str, f: Callable) -> Callable:
    """A filter whose result is estimated (for the expanding ones) and charged."""
    passes = getattr(f, "jinja_pass_arg", None) is not None  # context/env comes first

    @wraps(f)
    def bounded_filter(*args: Any, **kwargs: Any) -> Any:
        rest = args[1:] if passes else args
        if name == "join" and rest:  # value|join(d): the items, then d between them
            items = _listed(rest[0])
            args = (*args[:len(args) - len(rest)], items, *rest[1:])
            sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
            _charge(_str_estimate("join", sep if isinstance(sep, str) else "", (items,), {}))
        elif rest and isinstance(rest[0], str):
            if name == "format":
                _charge(_formatted(rest[0], kwargs or tuple(rest[1:])))
            else:
                _charge(_str_estimate(name, rest[0], tuple(rest[1:]), kwargs))
        result = f(*args, **kwargs)
        _charge(_size(result))
        return result
    return bounded_filter


# ----- the environment ---------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marker: renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson sorts keys and escapes HTML; templates expect json.dumps (HF)
    if len(indent) > 16 if isinstance(indent, str) else (indent or 0) > 16:  # repeated on every line
        raise _limit(f"asks tojson for an indent of {indent!r:.20}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys, default=_json_list)


def _json_list(value: object) -> list:
    """tojson of a Jinja filter's result (`tools | map(...)` is a generator)."""
    if isinstance(value, Iterable):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def environment() -> BoundedSandbox:
    """The sandbox chat templates compile in: what HF transformers and llama.cpp give
    them (tojson as json.dumps, raise_exception, strftime_now, loop controls, the
    generation tag), under the bounds."""
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.add_filter("tojson", _tojson)
    # no autoescaping here, so `safe` only makes Markup, and Markup + str escapes the
    # str ("x"|safe + t|tojson gives &#34;): llama.cpp's engine has no such thing
    env.add_filter("safe", lambda value: value)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
