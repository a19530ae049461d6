"""The OpenAI wire format: request validation, response bodies, error bodies.

Requests are validated by the pydantic models in schema.py; the first failure becomes
a 400 with `param` naming the field (the official client surfaces it as
BadRequestError) and `code` saying what is wrong: unknown_parameter,
missing_required_parameter, invalid_type, invalid_value or unsupported_parameter (a
field we understand but do not implement: n > 1, penalties). A valid body becomes a
GenRequest, its tool_choice resolved against its tools. No llama_cpp and no HTTP here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import ErrorDetails, from_json

from localspec.core.backend import JSON_GBNF, json_schema_grammar
from localspec.core.engine import GenerationStats
from localspec.core.errors import GrammarError
from localspec.core.events import TRUNCATED
from localspec.core.toolcalls import ToolChoice, ToolChoiceError, resolve_tool_choice
from localspec.serve import schema

BodyT = TypeVar("BodyT", bound=schema.CommonBody)


class ApiError(Exception):
    """An error to return as OpenAI's {"error": {...}} body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ----- parsed request ---------------------------------------------------------------


@dataclass(frozen=True)
class GenRequest:
    """A validated /v1/completions or /v1/chat/completions body. Sampling fields left
    None take the server's defaults (its --temp, --top-k, ... options)."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: str | list[int] | None = None  # completion: text or token ids
    # chat: {"role", "content"} with content a string (None beside tool_calls), plus
    # "tool_calls" (OpenAI's shape) in assistant and "tool_call_id" in tool messages
    messages: list[dict] = field(default_factory=list)
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    prediction: str | None = None  # chat: predicted output, a second n-gram draft source
    tools: list[dict] = field(default_factory=list)  # chat: OpenAI function tools
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))  # resolved against the tools
    parallel_tool_calls: bool = True
    logprobs: int | None = None  # per-token logprobs with this many alternatives; None: off
    grammar: str | None = None  # chat: response_format as GBNF the reply must follow
    memory: bool = True  # drafted from the memory of earlier replies (per API key), and added to it
    template_kwargs: dict = field(default_factory=dict)  # chat: chat_template_kwargs, for the template


# ----- validation: pydantic models (schema.py) -> GenRequest, or a 400 ----------------


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400.

    pydantic-core's parser (jiter), not json.loads: it refuses nesting past a fixed
    depth instead of recursing into a RecursionError, refuses invalid UTF-8 and lone
    surrogates (which the tokenizer could not encode), integers too long to convert,
    and NaN/Infinity (not JSON), each with a ValueError naming line and column."""
    try:
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def parse_completion(body: dict) -> GenRequest:
    """Validate a /v1/completions body."""
    b = _validate(schema.CompletionBody, body)
    return _common("completion", b, prompt=b.prompt, max_tokens=b.max_tokens, logprobs=b.logprobs)


def parse_chat(body: dict) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    b = _validate(schema.ChatBody, body)
    prediction = schema.text_of(b.prediction.content) if b.prediction else None
    tools = [t.model_dump(exclude_none=True) for t in b.tools or ()]
    try:
        choice = resolve_tool_choice(b.tool_choice, tools)
    except ToolChoiceError as exc:
        raise bad_request(f"Invalid value for 'tool_choice': {exc}.", "tool_choice", "invalid_value") from None
    return _common("chat", b, messages=[_message(m) for m in b.messages], prediction=prediction,
                   max_tokens=b.max_completion_tokens or b.max_tokens, tools=tools, tool_choice=choice,
                   parallel_tool_calls=b.parallel_tool_calls is not False,
                   logprobs=(b.top_logprobs or 0) if b.logprobs else None,
                   grammar=_grammar(b.response_format), template_kwargs=_template_kwargs(b))


# names render_chat gives the template itself: chat_template_kwargs cannot replace them
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "strict", "model"}


def _template_kwargs(b: schema.ChatBody) -> dict:
    kw = b.chat_template_kwargs or {}
    bad = next((k for k in kw if k in _TEMPLATE_OWN or not k.isidentifier()), None)
    if bad is not None:
        raise bad_request(f"Invalid value for 'chat_template_kwargs': {bad!r} cannot be set.",
                          "chat_template_kwargs", "invalid_value")
    return dict(kw)


def _message(m: schema.Message) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role,
           "content": None if m.content is None else schema.text_of(m.content)}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _grammar(fmt: schema.ResponseFormat | None) -> str | None:
    """response_format as GBNF: None for text, any JSON object for json_object (and a
    json_schema without a schema), else the schema's grammar; a schema we cannot use is
    a 400 naming response_format."""
    if fmt is None or fmt.type == "text":
        return None
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        return JSON_GBNF
    try:
        return json_schema_grammar(spec.schema_)
    except GrammarError as exc:
        raise grammar_error(exc, spec.name) from None


def grammar_error(exc: GrammarError, name: str | None = None) -> ApiError:
    what = f"response_format '{name}'" if name else "response_format"
    return bad_request(f"Invalid schema for {what}: {exc}", "response_format", "invalid_value")


def _common(kind: str, b: schema.CommonBody, **extra: Any) -> GenRequest:
    return GenRequest(
        kind=kind, model=b.model or "", stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        stop=tuple(s for s in b.stop or () if s), temperature=b.temperature, top_p=b.top_p,
        top_k=b.top_k, min_p=b.min_p, seed=b.seed, ignore_eos=bool(b.ignore_eos),
        memory=b.memory is not False, **extra,
    )


def _validate(model: type[BodyT], body: dict) -> BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # one error, as OpenAI reports: unknown fields first, then missing ones, then the rest
        errors = sorted(exc.errors(), key=lambda e: _RANK.get(e["type"], 2))
        raise _api_error(errors[0]) from None


_RANK = {"extra_forbidden": 0, "missing": 1}
_NO_INPUT = {schema.INVALID, "too_short", "too_long"}  # messages that already say enough
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "a boolean", "list_type": "an array", "model_type": "an object",
             "dict_type": "an object"}


def _api_error(err: ErrorDetails) -> ApiError:
    """A pydantic error as OpenAI's 400: `param` is the field's path, e.g. messages[0].role."""
    loc, kind, msg, value = err["loc"], err["type"], err["msg"], err.get("input")
    at = (err.get("ctx") or {}).get("field")  # an object's check about one of its fields
    if at is not None:
        loc, value = (*loc, at), value.get(at) if isinstance(value, dict) else None
    param = _param(loc)
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
        parent = _param(loc[:-1])
        return bad_request(f"Unrecognized field in '{parent}': {loc[-1]}", parent, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind in _EXPECTED or kind == schema.WRONG_TYPE:
        want = _EXPECTED.get(kind, msg)
        return bad_request(f"Invalid type for '{param}': expected {want}, but got {_type_name(value)}.",
                           param, "invalid_type")
    if kind == schema.UNSUPPORTED:
        return bad_request(f"'{param}': {msg}.", param, "unsupported_parameter")
    got = "" if kind in _NO_INPUT else f", got {json.dumps(value, default=str)[:80]}"
    return bad_request(f"Invalid value for '{param}': {msg}{got}.", param, "invalid_value")


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(v), "number")


# ----- responses ------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def finish_reason(stop_reason: str, tool_calls: bool = False) -> str:
    """The engine's stop reason in OpenAI's vocabulary ("tool_calls" when the reply
    ended, not cut, with calls in it)."""
    if stop_reason in TRUNCATED:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(stats: GenerationStats) -> dict:
    """OpenAI usage plus a `speculation` extension with this request's draft stats."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        # the prompt's start the slot already held (a previous request's): not prefilled
        "prompt_tokens_details": {"cached_tokens": stats.restored_tokens},
        "speculation": {
            "drafter": stats.drafter,
            "rounds": stats.rounds,
            "draft_rounds": stats.draft_rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance": round(stats.acceptance, 4),
            "mean_accepted": round(stats.mean_accepted, 3),
            "tokens_per_round": round(stats.tokens_per_round, 3),
            "acceptance_by_pos": [round(a, 4) for a in stats.acceptance_by_pos()],
            "prefill_s": round(stats.prefill_s, 4),
            "decode_s": round(stats.decode_s, 4),
            "tokens_per_s": round(stats.tokens_per_s, 2),
        },
    }


def response(req: GenRequest, rid: str, created: int, model: str, text: str | None,
             stats: GenerationStats, *, tool_calls: list[dict] | None = None,
             logprobs: dict | None = None) -> dict:
    """The non-streaming body (chat: `text` is None when the reply is only tool calls)."""
    reason = finish_reason(stats.stop_reason, bool(tool_calls))
    if req.kind == "chat":
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage(stats)}


def chunk(req: GenRequest, rid: str, created: int, model: str, text: str | None = None, *,
          reason: str | None = None, role: bool = False, tool_calls: list[dict] | None = None,
          logprobs: dict | None = None) -> dict:
    """One streaming chunk (a delta for chat, a text piece for completions)."""
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: GenRequest, rid: str, created: int, model: str, stats: GenerationStats) -> dict:
    """The final chunk when stream_options.include_usage is set: no choices, usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(stats)}


def models_list(model_id: str, owned_by: str = "localspec") -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model",
                                        "created": int(time.time()), "owned_by": owned_by}]}
