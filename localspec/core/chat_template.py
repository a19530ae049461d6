"""Chat templates: the GGUF's own Jinja template, rendered the way llama.cpp's server
(`--jinja`) and Hugging Face transformers render it.

llama.cpp's built-in renderer (`Model.apply_chat_template`) knows each family's shape
but not its template: it drops the template's default system prompt (Qwen2.5's "You are
Qwen, created by Alibaba Cloud. ..."), and it has no tools or tool messages. Here the
template itself runs in a sandboxed Jinja2 environment with what HF and llama.cpp give
it: `messages`, `tools`, `add_generation_prompt`, `bos_token`/`eos_token`,
`raise_exception`, `strftime_now`, a `tojson` that spaces like Python's json.dumps, loop
controls. Messages are first normalised as llama-server normalises them (content always
a string, tool-call arguments as objects for templates that print them as JSON, a system
message folded into the first user turn for templates without a system role), so the
prompt text is the one llama-server renders for the same request. The template's time
and the size of what it builds are bounded (core/template_limits.py): a template past
them is refused with TemplateLimitError, never replaced by the fallback renderer; the
environment itself (HF's globals and filters, the bounds) is core/template_sandbox.py.

Pure Python: the backend hands over the template source and special-token texts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import jinja2

from localspec.core.template_sandbox import (
    TemplateError,
    TemplateLimitError,
    bounded,
    environment,
    output,
)

if TYPE_CHECKING:
    from localspec.core.backend import Model

log = logging.getLogger("localspec.chat_template")

# llama.cpp's template for models that carry none (common/chat.cpp CHATML_TEMPLATE_SRC)
CHATML = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class SpecialTokens:
    """What a template sees of the vocabulary. `add_bos`: the tokenizer adds BOS itself,
    so a template's leading `bos_token` is dropped from the text (as llama.cpp does)."""

    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    add_eos: bool = False


@dataclass(frozen=True)
class Caps:
    """What a template can show, found by rendering probes (as llama.cpp's caps check)."""

    system_role: bool = True
    tools: bool = False  # shows the request's tools to the model
    object_arguments: bool = False  # prints tool-call arguments as a JSON object
    string_content: bool = True  # shows a message whose content is a string
    typed_content: bool = False  # shows a message whose content is a list of typed parts
    tool_calls: bool = False  # shows an assistant turn's tool call
    parallel_tool_calls: bool = False  # shows both of two calls in one turn
    preserve_reasoning: bool = False  # shows an earlier assistant turn's reasoning_content
    reasoning_effort: bool = False  # reads a reasoning_effort variable

    def to_llama(self) -> dict[str, bool]:
        """The capabilities under llama-server's names (GET /props chat_template_caps)."""
        return {"supports_string_content": self.string_content, "supports_typed_content": self.typed_content,
                "supports_tools": self.tools, "supports_tool_calls": self.tool_calls,
                "supports_parallel_tool_calls": self.parallel_tool_calls,
                "supports_system_role": self.system_role, "supports_preserve_reasoning": self.preserve_reasoning,
                "supports_reasoning_effort": self.reasoning_effort, "supports_object_arguments": self.object_arguments}


_ENV = environment()


class ChatTemplate:
    """One compiled chat template. `render` raises TemplateError when the template
    cannot render the request (its own raise_exception, or a Jinja error)."""

    def __init__(self, source: str, tokens: SpecialTokens = SpecialTokens()) -> None:
        self.source = source
        self.tokens = tokens
        with bounded():  # compiling folds constants: it runs template code too
            try:
                self._template = _ENV.from_string(source)
            except jinja2.TemplateError as exc:
                raise TemplateError(f"the chat template does not compile: {exc}") from exc
            self.caps = _probe(self)

    def render(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool | None = None,
               **context: Any) -> str:
        """The prompt text: `messages` (OpenAI shape) and `tools` (OpenAI function tools)
        under this template, ending with the assistant turn's opening when asked. A
        conversation that ends with an assistant message (no tool calls) is continued:
        the prompt ends with that text, as llama-server's prefill does (None: decide
        so; False: close that message like any other)."""
        if continue_final_message is None:
            continue_final_message = _ends_with_reply(messages)
        if continue_final_message:
            return self._continue(messages, tools, context)
        msgs = normalize_messages(messages, self.caps, gpt_oss="<|channel|>" in self.source)
        variables = _globals(self.tokens) | context
        if tools:
            variables["tools"] = normalize_tools(tools)
        if add_generation_prompt:
            variables["add_generation_prompt"] = True
        text = self._render(msgs, variables)
        bos, eos = self.tokens.bos_token, self.tokens.eos_token
        if self.tokens.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]  # the tokenizer adds it: no double BOS
        if self.tokens.add_eos and eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    def _continue(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None, context: dict) -> str:
        """The earlier messages, the assistant turn's opening, then the final message's
        text (llama.cpp: the closed render plus what the opened one adds to it)."""
        head = list(messages[:-1])
        closed = self.render(head, tools=tools, add_generation_prompt=False, continue_final_message=False, **context)
        opened = self.render(head, tools=tools, add_generation_prompt=True, continue_final_message=False, **context)
        common = len(os.path.commonprefix([closed, opened]))
        return closed + opened[common:] + _text(messages[-1].get("content"))

    def _render(self, messages: list[dict], variables: dict) -> str:
        try:
            with bounded():
                return output(self._template.generate(messages=messages, **variables))
        except TemplateError:
            raise
        except Exception as exc:  # Jinja errors, and template bugs (TypeError, KeyError)
            raise TemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc


def _globals(tokens: SpecialTokens) -> dict:
    now = datetime.now()
    # llama-server also offers these two, and enable_thinking (true unless turned off)
    return {
        "bos_token": tokens.bos_token, "eos_token": tokens.eos_token,
        "enable_thinking": True,
        "datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"),
    }


def _ends_with_reply(messages: Sequence[Mapping]) -> bool:
    last = messages[-1] if messages else None
    return isinstance(last, Mapping) and last.get("role") == "assistant" and not last.get("tool_calls")


# ----- normalisation (llama.cpp common/chat.cpp, so prompts match llama-server's) -----


def normalize_messages(messages: Sequence[Mapping], caps: Caps = Caps(),
                       gpt_oss: bool = False) -> list[dict]:
    """OpenAI chat messages in the shape templates see under llama-server: role,
    content (a string, "" when null), then name, tool_call_id and tool_calls when
    present; tool-call arguments as objects where the template prints objects."""
    out = [_message(m, caps.object_arguments) for m in messages]
    if not gpt_oss:
        for m in out:
            if m["role"] == "developer":
                m["role"] = "system"
    if not caps.system_role and out and out[0]["role"] == "system":
        system = out.pop(0)
        if out:  # folded into the next message, as llama.cpp does
            out[0]["content"] = system["content"] + "\n" + out[0]["content"]
    return out


def _message(message: Mapping, object_arguments: bool) -> dict:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise TemplateError(f"a message needs a role: {message!r:.80}")
    if "content" not in message and "tool_calls" not in message:
        raise TemplateError("a message needs content or tool_calls")
    out: dict = {"role": message["role"], "content": _text(message.get("content"))}
    for key in ("reasoning_content", "name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, object_arguments) for c in message["tool_calls"]]
    return out


def _text(content: object) -> str:
    """A message's content as one string: parts joined by newlines (llama.cpp's rule
    for templates that take string content)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TemplateError(f"unsupported content part: {part!r:.80}")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise TemplateError(f"content must be a string or a list of parts, not {type(content).__name__}")


def _tool_call(call: Mapping, object_arguments: bool) -> dict:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or call.get("type", "function") != "function" or "name" not in fn:
        raise TemplateError(f"a tool call needs type 'function' and a function name: {call!r:.80}")
    args = fn.get("arguments", "{}")
    if object_arguments and isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise TemplateError(f"tool call arguments are not JSON: {exc}") from exc
    elif not object_arguments and not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False, separators=(",", ":"))  # nlohmann's dump()
    out: dict = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def normalize_tools(tools: Sequence[Mapping]) -> list[dict]:
    """OpenAI function tools as llama-server hands them to templates."""
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise TemplateError(f"a tool needs type 'function' and a function name: {tool!r:.80}")
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {},
        }})
    return out


# ----- capability probes -------------------------------------------------------------

_NEEDLE = "<system-needle>"
_USER = {"role": "user", "content": "User message"}


class _Watched(dict):
    """Tool-call arguments that note whether the template looked inside them (read a
    key, iterated, dumped as JSON): llama.cpp passes objects to such templates."""

    seen = False


def _watching(name: str) -> Any:
    method = getattr(dict, name)

    def watched(self: _Watched, *args: Any) -> Any:
        self.seen = True
        return method(self, *args)
    return watched


for _name in ("__getitem__", "get", "items", "keys", "values", "__iter__"):
    setattr(_Watched, _name, _watching(_name))


def _probe(tmpl: ChatTemplate) -> Caps:
    """Render small conversations, as llama.cpp's capability check does: does the
    template show a system message, string and typed content, the tools, one and two
    tool calls, earlier reasoning, and look inside tool-call arguments?"""
    system = _try(tmpl, [{"role": "system", "content": _NEEDLE}, _USER])
    string = _try(tmpl, [{"role": "user", "content": _NEEDLE}])
    typed = _try(tmpl, [{"role": "user", "content": [{"type": "text", "text": _NEEDLE}]}])
    tool = {"type": "function", "function": {
        "name": "tool_needle", "description": "Tool description",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
    listed = _try(tmpl, [_USER], tools=[tool])
    args = _Watched({"arg": "value"})

    def call(name: str, arguments: Any) -> dict:
        return {"type": "function", "id": "call00001", "function": {"name": name, "arguments": arguments}}

    def turn(calls: list[dict]) -> list[dict]:
        return [_USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
                {"role": "assistant", "content": "The tool response was 'tool response'"}, _USER]

    rendered = _try(tmpl, turn([call("tool_needle", args)]), tools=[tool])
    two = _try(tmpl, turn([call("call_needle_a", {"arg": "value"}), call("call_needle_b", {"arg": "value"})]),
               tools=[tool])
    thought = _try(tmpl, [_USER, {"role": "assistant", "content": "Answer", "reasoning_content": "thought_needle"},
                          _USER])
    return Caps(system_role=_NEEDLE in system, tools="tool_needle" in listed,
                object_arguments=bool(rendered) and args.seen,
                string_content=_NEEDLE in string, typed_content=_NEEDLE in typed,
                tool_calls="call_needle_a" in two, parallel_tool_calls="call_needle_b" in two,
                preserve_reasoning="thought_needle" in thought,
                reasoning_effort="reasoning_effort" in tmpl.source)


def _try(tmpl: ChatTemplate, messages: list[dict], **variables: Any) -> str:
    try:  # raw messages: the probe is what decides how to normalise them
        return tmpl._render(messages, _globals(tmpl.tokens) | variables)
    except TemplateLimitError:
        raise
    except TemplateError:
        return ""


# ----- the model's template, with llama.cpp's built-in renderer as the fallback -----


class TemplateSource(Protocol):
    """What rendering needs from a loaded model (core.backend.Model)."""

    bos: int
    eos: int
    add_bos: bool
    add_eos: bool

    def chat_template(self, name: str | None = None) -> str | None: ...

    def token_piece(self, token: int, special: bool = False) -> bytes: ...

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...


def special_tokens(model: TemplateSource) -> SpecialTokens:
    def text(token: int) -> str:
        return model.token_piece(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""
    return SpecialTokens(text(model.bos), text(model.eos), model.add_bos, model.add_eos)


_hostile: dict[str, TemplateLimitError] = {}


def compiled(source: str, tokens: SpecialTokens = SpecialTokens()) -> ChatTemplate:
    """A compiled template, cached (compiling and probing takes milliseconds); one that
    ran past the bounds is refused again at once."""
    if source in _hostile:
        raise _hostile[source]
    try:
        return _compiled(source, tokens)
    except TemplateLimitError as exc:
        _hostile[source] = exc
        raise


@lru_cache(maxsize=16)
def _compiled(source: str, tokens: SpecialTokens) -> ChatTemplate:
    return ChatTemplate(source, tokens)


def template_for(model: TemplateSource, tools: bool = False) -> ChatTemplate:
    """The model's chat template (its `tool_use` variant when tools are given and it has
    one; llama.cpp's ChatML when it carries none). Raises TemplateError if it does not
    compile."""
    source = (model.chat_template("tool_use") if tools else None) or model.chat_template()
    if not source or source == "chatml":
        source = CHATML
    return compiled(source, special_tokens(model))


def refuse_hostile(model: TemplateSource) -> None:
    """Compile and probe the model's templates now (serve does, at load): a hostile one
    raises TemplateLimitError there, before the server listens; one that merely fails
    is left to render_chat's fallback, as before."""
    for tools in (False, True):
        try:
            template_for(model, tools=tools)
        except TemplateLimitError:
            raise
        except TemplateError:
            pass


_warned: set[str] = set()


def render_chat(model: TemplateSource, messages: Sequence[Mapping], *,
                tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
                strict: bool = False, **context: Any) -> str:
    """The prompt text for `messages` under the model's own chat template: what
    llama-server renders with --jinja. When the template cannot render them, plain
    conversations fall back to llama.cpp's built-in renderer (with one warning per
    template); a request with tools or tool messages, or `strict`, raises TemplateError
    instead (the server's 400)."""
    try:
        return template_for(model, tools=bool(tools)).render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **context)
    except TemplateLimitError:
        raise  # a hostile template is refused, not worked around
    except TemplateError as exc:
        if strict or tools or not _plain(messages):
            raise
        key = model.chat_template() or ""
        if key not in _warned:
            _warned.add(key)
            log.warning("localspec: the model's chat template failed (%s); using llama.cpp's "
                        "built-in renderer", exc)
        return model.apply_chat_template([dict(m) for m in messages], add_generation_prompt)


def _plain(messages: Sequence[Mapping]) -> bool:
    """Messages the built-in renderer can show: system/user/assistant text only."""
    return all(isinstance(m, Mapping) and m.get("role") in ("system", "user", "assistant")
               and isinstance(m.get("content"), str) and not m.get("tool_calls") for m in messages)


def chat_prompt(model: Model, user: str, system: str | None = None) -> list[int]:
    """Tokens for one user message under the model's own chat template (the prompt
    llama-server renders with --jinja)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return model.tokenize(render_chat(model, messages), add_special=True, parse_special=True)
