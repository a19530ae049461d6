"""Tool calls in a model's reply, as OpenAI `tool_calls`, whole or streamed.

Each family writes its calls its own way; a `ToolFormat` says how (the text that opens
a call, the text that closes it, how to read the body), and `detect_format` picks one
from the chat template's source. Qwen2.5 and Hermes wrap each call in
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; Mistral writes
`[TOOL_CALLS][{...}, ...]` up to the end of the reply. Another family is one more entry.

`ToolCallParser` follows a reply as it is generated: content streams through at once,
except text that may be the start of a call's opening tag (held until it is not); a
call is emitted when its closing tag arrives (its name first, then its arguments, as
OpenAI's `delta.tool_calls`). Holding each call until it is whole keeps the stream
equal to the non-streamed answer, malformed calls included: a call whose body does not
parse is given back as content, in both. `parse_tool_calls` is the same parser run
over a whole reply.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from localspec.core.errors import UsageError


class ToolChoiceError(UsageError):
    """A tools / tool_choice request that cannot be honoured (the server answers 400)."""


# ----- formats -----------------------------------------------------------------------


def _name_and_arguments(obj: object) -> tuple[str, dict]:
    if not isinstance(obj, dict):
        raise ValueError("a tool call is a JSON object")
    key = "arguments" if "arguments" in obj else "parameters"  # (Llama 3 says parameters)
    if not isinstance(obj.get("name"), str) or key not in obj:
        raise ValueError("a tool call has a string 'name' and 'arguments'")
    args = obj[key]
    if isinstance(args, str):  # some models quote the arguments object
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return obj["name"], args


def _one_call(body: str) -> list[tuple[str, dict]]:
    return [_name_and_arguments(json.loads(body))]


def _call_list(body: str) -> list[tuple[str, dict]]:
    calls = json.loads(body)
    if not isinstance(calls, list) or not calls:
        raise ValueError("expected a JSON list of tool calls")
    return [_name_and_arguments(c) for c in calls]


@dataclass(frozen=True)
class Wrapper:
    """Text around a call's JSON: `start`, then the body, then `end` (None: the end of
    the reply). A `loose` wrapper also appears around other JSON (a ```json block), so
    a call in it counts only when it names one of the request's tools."""

    start: str
    end: str | None
    loose: bool = False


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls."""

    family: str
    wrappers: tuple[Wrapper, ...]  # the first is the family's own
    markers: tuple[str, ...]  # text in a chat template that identifies the family
    parse: Callable[[str], list[tuple[str, dict]]]  # body -> [(name, arguments)]; ValueError
    opening: str  # what the model writes before the first call's JSON object

    def prefix(self, name: str | None = None) -> str:
        """Text that, ending the prompt, makes the reply a call (to `name`, or to a
        function the model names): the opening, then the call's JSON up to its arguments,
        or without a name up to the name's first letter (after the opening alone a model
        may end its reply at once: Qwen2.5-Coder-1.5B does, asked to say hello)."""
        # no space after the colon: BPE spells " {" as one token, the model writes it
        head = json.dumps(name, ensure_ascii=False) + ', "arguments":' if name else '"'
        return self.opening + '{"name": ' + head


# Qwen2.5-Coder often answers a tool request with a ```json block holding the call
# (llama.cpp's Hermes parser accepted it too, for that model)
HERMES = ToolFormat("hermes", (Wrapper("<tool_call>", "</tool_call>"), Wrapper("```json", "```", loose=True)),
                    ("<tool_call>",), _one_call, "<tool_call>\n")
MISTRAL = ToolFormat("mistral", (Wrapper("[TOOL_CALLS]", None),), ("[TOOL_CALLS]",), _call_list, "[TOOL_CALLS][")
FORMATS: dict[str, ToolFormat] = {f.family: f for f in (HERMES, MISTRAL)}


def detect_format(template_source: str | None) -> ToolFormat:
    """The family whose markers the chat template contains; Hermes (the most common,
    and what ChatML-style models are trained on) when none matches."""
    for fmt in FORMATS.values():
        if template_source and all(m in template_source for m in fmt.markers):
            return fmt
    return HERMES


# ----- calls and stream events -------------------------------------------------------


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call: the first carries id and name, later ones
    argument text (OpenAI's `choices[0].delta.tool_calls[i]`)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        fn: dict = {"arguments": self.arguments}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        if self.name is not None:
            fn = {"name": self.name} | fn
        return out | {"function": fn}


Delta = ContentDelta | ToolCallDelta


# ----- the parser --------------------------------------------------------------------


@dataclass
class ToolCallParser:
    """Follows a reply piece by piece: `feed(text)` and `finish()` return the deltas now
    known. `calls` and `content` hold what has been emitted so far. `tool_names`: the
    request's tools (a loose wrapper's call must name one of them)."""

    fmt: ToolFormat = HERMES
    new_id: Callable[[], str] = new_call_id
    tool_names: Sequence[str] = ()
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _buf: str = ""
    _open: Wrapper | None = None  # the wrapper of the call being read
    _after_call: bool = False  # drop whitespace between a call and what follows
    _gap: str = ""  # whitespace before the open call: given back if it is no call

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        """The end of the reply: held text is content, an unclosed call is parsed."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._buf or (final and self._open):
            if self._open:
                if not self._close_call(out, final):
                    break
            elif not self._pass_content(out, final):
                break
        return out

    def _pass_content(self, out: list[Delta], final: bool) -> bool:
        """Emit content up to a call's opening text; True when one was found."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        found = [(i, w) for w in self.fmt.wrappers if (i := self._buf.find(w.start)) >= 0]
        if found:
            i, wrapper = min(found, key=lambda f: f[0])
            before = self._buf[:i].rstrip()
            self._gap = self._buf[len(before):i]
            self._emit_text(out, before)
            self._buf = self._buf[i + len(wrapper.start):]
            self._open = wrapper
            return True
        cut = len(self._buf) if final else _safe_end(self._buf, [w.start for w in self.fmt.wrappers])
        self._emit_text(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _close_call(self, out: list[Delta], final: bool) -> bool:
        """Parse the call once its closing text (or the end of the reply) is here."""
        wrapper, end = self._open, self._open.end
        at = _find_outside_strings(self._buf, end) if end else -1
        if at < 0 and not final:
            return False
        body, closing = (self._buf[:at], end) if at >= 0 else (self._buf, "")
        self._buf = self._buf[at + len(end):] if at >= 0 else ""
        self._open = None
        found = self._parse(body, wrapper)
        if not found:  # not a call after all: the text stays content, as it came
            self._emit_text(out, self._gap + wrapper.start + body + (closing or ""))
            return True
        for name, args in found:
            call = ToolCall(self.new_id(), name, json.dumps(args, ensure_ascii=False))
            index = len(self.calls)
            self.calls.append(call)
            out += [ToolCallDelta(index, "", call.id, name), ToolCallDelta(index, call.arguments)]
        self._after_call = True
        return True

    def _parse(self, body: str, wrapper: Wrapper) -> list[tuple[str, dict]]:
        try:
            found = self.fmt.parse(body.strip())
        except ValueError:  # json.JSONDecodeError included
            return []
        if wrapper.loose and not all(name in self.tool_names for name, _ in found):
            return []
        return found

    def _emit_text(self, out: list[Delta], text: str) -> None:
        if text:
            self.content += text
            out.append(ContentDelta(text))


def _safe_end(text: str, tags: Sequence[str]) -> int:
    """How much of `text` can be shown: not a tail that may begin one of `tags`, nor
    trailing whitespace (dropped if a call follows)."""
    cut = len(text)
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                cut = min(cut, len(text) - n)
                break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return cut


def _find_outside_strings(text: str, tag: str) -> int:
    """The first `tag` in `text` that is not inside a JSON string literal, or -1."""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif text.startswith(tag, i):
            return i
    return -1


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None when the reply is only tool calls (OpenAI's shape)
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES, tool_names: Sequence[str] = (),
                     new_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """A whole reply's content and tool calls (the stream parser, fed once)."""
    parser = ToolCallParser(fmt, new_id, tool_names)
    parser.feed(text)
    parser.finish()
    return ParsedReply(parser.content or None, parser.calls)


# ----- tool_choice -------------------------------------------------------------------


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool_choice, checked against its tools. `mode`: none (no calls are
    parsed), auto (the model decides), required (some call), function (this `name`)."""

    mode: str
    name: str | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def prefix(self, fmt: ToolFormat) -> str:
        """Text to end the prompt with so the model must call (empty for none/auto).
        Feed it to the ToolCallParser too: the reply continues it."""
        if self.mode == "required":
            return fmt.prefix()
        return fmt.prefix(self.name) if self.mode == "function" else ""


def tool_names(tools: Sequence[Mapping] | None) -> list[str]:
    """The function names of OpenAI `tools`; ToolChoiceError when one is malformed."""
    names = []
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            shape = '{"type": "function", "function": {"name": ...}}'
            raise ToolChoiceError(f"each tool must be {shape}, got {tool!r:.100}")
        names.append(fn["name"])
    return names


def resolve_tool_choice(tool_choice: object, tools: Sequence[Mapping] | None) -> ToolChoice:
    """OpenAI's tool_choice (None: auto with tools, none without), validated."""
    names = tool_names(tools)
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ToolChoiceError("tool_choice 'required' needs tools")
        return ToolChoice(tool_choice if names else "none")
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(fn, Mapping) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise ToolChoiceError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
    if fn["name"] not in names:
        listed = ", ".join(names) or "no tools"
        raise ToolChoiceError(f"tool_choice names function {fn['name']!r}, which is not among the tools ({listed})")
    return ToolChoice("function", fn["name"])
