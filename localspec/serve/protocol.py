"""The OpenAI wire format: request validation, response bodies, error bodies.

Validation is explicit and table-driven: every field the OpenAI API defines for the
endpoint is known; an unknown field, a wrong type or an out-of-range value is a 400 with
`param` naming the field (the official client surfaces it as BadRequestError). Fields we
understand but do not implement (n > 1, logprobs, penalties, tools) are rejected with a
message saying so, rather than silently ignored. No llama_cpp and no HTTP here.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localspec.core.engine import GenerationStats

MAX_STOPS = 4
CHAT_ROLES = {"system", "developer", "user", "assistant"}


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
    messages: list[dict] = field(default_factory=list)  # chat: {"role", "content"} strings
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


# ----- field checkers: (value, name) -> normalised value, or raise ApiError ----------

Check = Callable[[Any, str], Any]


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(v), "number")


def _wrong(name: str, want: str, v: Any) -> ApiError:
    return bad_request(f"Invalid type for '{name}': expected {want}, but got {_type_name(v)}.", name,
                       "invalid_type")


def _integer(lo: int | None = None, hi: int | None = None, nullable: bool = True) -> Check:
    def check(v: Any, name: str) -> Any:
        if v is None and nullable:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise _wrong(name, "an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}.", name,
                              "invalid_value")
        return v
    return check


def _number(lo: float, hi: float) -> Check:
    def check(v: Any, name: str) -> Any:
        if v is None:
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise _wrong(name, "a number", v)
        if not lo <= v <= hi:
            raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}.", name,
                              "invalid_value")
        return float(v)
    return check


def _boolean(v: Any, name: str) -> Any:
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _wrong(name, "a boolean", v)
    return v


def _string(v: Any, name: str) -> Any:
    if not isinstance(v, str):
        raise _wrong(name, "a string", v)
    return v


def _any(v: Any, name: str) -> Any:
    return v


def _only(default: Any, what: str) -> Check:
    """A known field whose only supported value is its default (or null)."""
    def check(v: Any, name: str) -> Any:
        if v is None or v == default or (isinstance(default, (list, dict)) and not v):
            return None
        raise bad_request(f"'{name}' is not supported by this server ({what}).", name,
                          "unsupported_parameter")
    return check


def _stop(v: Any, name: str) -> Any:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _wrong(name, "a string or an array of strings", v)
    if len(v) > MAX_STOPS:
        raise bad_request(f"'{name}' takes at most {MAX_STOPS} sequences.", name, "invalid_value")
    return tuple(s for s in v if s)


def _stream_options(v: Any, name: str) -> Any:
    if v is None:
        return False
    if not isinstance(v, dict):
        raise _wrong(name, "an object", v)
    unknown = set(v) - {"include_usage"}
    if unknown:
        raise bad_request(f"Unrecognized field in '{name}': {min(unknown)}", name)
    return _boolean(v.get("include_usage"), f"{name}.include_usage")


def _response_format(v: Any, name: str) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _wrong(name, "an object", v)
    if v.get("type", "text") != "text":
        raise bad_request(f"'{name}' type {v.get('type')!r} is not supported (text only).", name,
                          "unsupported_parameter")
    return None


def _prediction(v: Any, name: str) -> Any:
    # OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _wrong(name, "an object", v)
    if v.get("type") != "content" or set(v) - {"type", "content"}:
        raise bad_request(f"'{name}' must be {{\"type\": \"content\", \"content\": ...}}.", name,
                          "invalid_value")
    return _content(v.get("content"), f"{name}.content")


COMMON: dict[str, Check] = {
    "model": _string,
    "max_tokens": _integer(1, None),
    "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0),
    "n": _only(1, "one choice per request"),
    "stream": _boolean,
    "stream_options": _stream_options,
    "stop": _stop,
    "seed": _integer(-(2**63), 2**63 - 1),
    "presence_penalty": _only(0, "no penalties"),
    "frequency_penalty": _only(0, "no penalties"),
    "logit_bias": _only({}, "no logit bias"),
    "user": _any,
    # extensions (llama.cpp server spellings)
    "top_k": _integer(0, None),
    "min_p": _number(0.0, 1.0),
    "ignore_eos": _boolean,
}
CHAT: dict[str, Check] = {
    **COMMON,
    "messages": _any,  # checked by _messages
    "max_completion_tokens": _integer(1, None),
    "logprobs": _only(False, "no logprobs"),
    "top_logprobs": _only(0, "no logprobs"),
    "response_format": _response_format,
    "tools": _only([], "no tool calls"),
    "tool_choice": _only("none", "no tool calls"),
    "parallel_tool_calls": _any,
    "functions": _only([], "no function calls"),
    "function_call": _only("none", "no function calls"),
    "metadata": _any,
    "store": _only(False, "nothing is stored"),
    "service_tier": _any,
    "prediction": _prediction,
}
COMPLETION: dict[str, Check] = {
    **COMMON,
    "prompt": _any,  # checked by _prompt
    "echo": _only(False, "no echo"),
    "logprobs": _only(0, "no logprobs"),
    "suffix": _only("", "no suffix"),
    "best_of": _only(1, "one choice per request"),
}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def _fields(body: dict, table: dict[str, Check], required: tuple[str, ...]) -> dict:
    for name in body:
        if name not in table:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name,
                              "unknown_parameter")
    for name in required:
        if body.get(name) is None:
            raise bad_request(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
    return {name: table[name](body[name], name) for name in body}


def _common(kind: str, f: dict, **extra: Any) -> GenRequest:
    return GenRequest(
        kind=kind, model=f["model"], stream=f.get("stream", False),
        include_usage=f.get("stream_options", False), stop=f.get("stop", ()),
        temperature=f.get("temperature"), top_p=f.get("top_p"), top_k=f.get("top_k"),
        min_p=f.get("min_p"), seed=f.get("seed"), ignore_eos=f.get("ignore_eos", False),
        **extra,
    )


def parse_completion(body: dict) -> GenRequest:
    """Validate a /v1/completions body."""
    f = _fields(body, COMPLETION, ("model", "prompt"))
    return _common("completion", f, prompt=_prompt(body["prompt"]), max_tokens=f.get("max_tokens"))


def parse_chat(body: dict) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    f = _fields(body, CHAT, ("model", "messages"))
    max_tokens = f.get("max_completion_tokens") or f.get("max_tokens")
    return _common("chat", f, messages=_messages(body["messages"]), max_tokens=max_tokens,
                   prediction=f.get("prediction"))


def _prompt(v: Any) -> str | list[int]:
    # OpenAI accepts a string, an array of strings, tokens, or arrays of tokens; one prompt here
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise bad_request("One prompt per request: batch prompts are not supported.", "prompt",
                          "unsupported_parameter")
    raise _wrong("prompt", "a string or an array of token ids", v)


def _content(v: Any, name: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{name}[{i}]': only text content parts are supported.",
                                  f"{name}[{i}]", "unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise _wrong(name, "a string or an array of content parts", v)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list):
        raise _wrong("messages", "an array", v)
    if not v:
        raise bad_request("'messages' must contain at least one message.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _wrong(name, "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"'{name}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
                              f"{name}.role", "invalid_value")
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            raise bad_request(f"Unrecognized field in '{name}': {min(unknown)}", name,
                              "unknown_parameter")
        if "content" not in m:
            raise bad_request(f"Missing required parameter: '{name}.content'.", f"{name}.content",
                              "missing_required_parameter")
        content = _content(m["content"], f"{name}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ----- responses ------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def finish_reason(stop_reason: str) -> str:
    """The engine's stop reason in OpenAI's vocabulary."""
    return "length" if stop_reason in ("length", "context") else "stop"


def usage(stats: GenerationStats) -> dict:
    """OpenAI usage plus a `speculation` extension with this request's draft stats."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
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


def response(req: GenRequest, rid: str, created: int, model: str, text: str,
             stats: GenerationStats) -> dict:
    """The non-streaming body."""
    reason = finish_reason(stats.stop_reason)
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage(stats)}


def chunk(req: GenRequest, rid: str, created: int, model: str, text: str | None = None, *,
          reason: str | None = None, role: bool = False) -> dict:
    """One streaming chunk (a delta for chat, a text piece for completions)."""
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
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
