"""The OpenAI request bodies as pydantic models: /v1/chat/completions (ChatBody) and
/v1/completions (CompletionBody).

Strict: every field the OpenAI API defines for the endpoint is declared, and an unknown
field, a wrong JSON type (no "5" for 5, no true for 1) or an out-of-range value fails
validation at its location. Fields we understand but do not implement (n > 1,
penalties, logit_bias) accept only their default and otherwise fail as "unsupported",
rather than being silently ignored; implementing one means giving it a real type here.
A check that concerns one field of an object but runs on the whole object (a message's
fields depend on its role) names the field in its error's context (`field`).
protocol.py turns a failure into OpenAI's 400 error body and a valid body into the
GenRequest the app consumes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)
from pydantic_core import PydanticCustomError

from localspec.serve.llamacpp_fields import LlamaCppFields

MAX_STOPS = 4

# error types of our own (PydanticCustomError); the message is what follows the field name
UNSUPPORTED = "unsupported_parameter"  # a value we understand but do not implement
INVALID = "invalid_value"
WRONG_TYPE = "wrong_type"  # message: the expected type, e.g. "a string or an array of token ids"
MAX_TOP_LOGPROBS = 20


def _integral(v: Any) -> Any:
    # JSON has one number type: 3.0 is an integer, 3.5 is not
    return int(v) if isinstance(v, float) and v.is_integer() else v


Integer = Annotated[int, BeforeValidator(_integral)]


def _unsupported(default: Any, what: str) -> Any:
    """A known field whose only supported value is its default (or null, or empty)."""
    def check(v: Any) -> None:
        if v is None or v == default or (isinstance(default, (list, dict)) and not v):
            return None
        raise PydanticCustomError(UNSUPPORTED, f"not supported by this server ({what})")
    return Annotated[Any, AfterValidator(check)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


# ----- message content ---------------------------------------------------------------


class TextPart(_Body):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if not isinstance(v, dict) or v.get("type") != "text":
            raise PydanticCustomError(UNSUPPORTED, "only text content parts are supported")
        return v


def _parts(v: Any) -> Any:
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise PydanticCustomError(WRONG_TYPE, "a string or an array of content parts")
    return v


# a string, or text parts (a string is read as one part)
Content = Annotated[list[TextPart], BeforeValidator(_parts)]


def text_of(content: list[TextPart]) -> str:
    return "".join(p.text for p in content)


def _at(field: str, kind: str, message: str, **context: str) -> PydanticCustomError:
    """An error about `field` of the object being validated (protocol.py locates it)."""
    return PydanticCustomError(kind, message, {"field": field, **context})


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(_Body):
    """A tool call in an assistant message of the conversation so far."""

    id: str
    type: Literal["function"]
    function: FunctionCall


ROLES = ("system", "developer", "user", "assistant", "tool")


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None  # null only in an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="before")
    @classmethod
    def _fields_of_role(cls, v: Any) -> Any:
        if not isinstance(v, dict) or v.get("role") not in ROLES:
            return v  # the field checks report it
        role = v["role"]
        for key, owner in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if v.get(key) is not None and role != owner:
                raise _at(key, "extra_forbidden", "only in a message with role {owner}", owner=owner)
        if role == "tool" and v.get("tool_call_id") is None:
            raise _at("tool_call_id", "missing", "a tool message answers a tool call")
        if v.get("content") is None and not (role == "assistant" and v.get("tool_calls")):
            if "content" not in v:
                raise _at("content", "missing", "required")
            raise _at("content", WRONG_TYPE, "a string or an array of content parts")
        return v


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


def _unique_names(tools: list[Tool]) -> list[Tool]:
    seen: set[str] = set()  # a set: a request may carry thousands of tools
    for t in tools:
        if t.function.name in seen:
            raise PydanticCustomError(INVALID, "function names must be unique ({name} twice)",
                                      {"name": repr(t.function.name)})
        seen.add(t.function.name)
    return tools


class StreamOptions(_Body):
    include_usage: bool | None = None


class JsonSchemaFormat(_Body):
    """response_format.json_schema: the JSON Schema the reply must validate against
    (always enforced by a grammar, whatever `strict` says)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(INVALID, "json_schema is required with type 'json_schema', "
                                               "and only with it")
        return self


class Prediction(_Body):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat (a draft source)."""

    type: Literal["content"]
    content: Content

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if isinstance(v, dict) and (v.get("type") != "content" or set(v) - {"type", "content"}):
            raise PydanticCustomError(INVALID, 'expected {"type": "content", "content": ...}')
        return v


# ----- the bodies --------------------------------------------------------------------


def _stops(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


Stop = Annotated[list[str], Field(max_length=MAX_STOPS), BeforeValidator(_stops)]


class CommonBody(_Body, LlamaCppFields):
    model: str | None = None  # optional, as in llama-server: there is one model
    max_tokens: Annotated[Integer, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: _unsupported(1, "one choice per request") = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Annotated[Integer, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: _unsupported(0, "no penalties") = None
    frequency_penalty: _unsupported(0, "no penalties") = None
    logit_bias: _unsupported({}, "no logit bias") = None
    user: Any = None
    # extensions (llama.cpp server spellings)
    top_k: Annotated[Integer, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    ignore_eos: bool | None = None
    memory: bool | None = None  # false: neither drafted from this server's memory nor added to it


TopLogprobs = Annotated[Integer, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class ChatBody(CommonBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], AfterValidator(_unique_names)] | None = None
    tool_choice: Any = None  # checked against the tools by toolcalls.resolve_tool_choice
    parallel_tool_calls: bool | None = None
    functions: _unsupported([], "no function calls") = None
    function_call: _unsupported("none", "no function calls") = None
    metadata: Any = None
    store: _unsupported(False, "nothing is stored") = None
    service_tier: Any = None
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise _at("top_logprobs", INVALID, "needs logprobs: true")
        return self


def _prompt(v: Any) -> Any:
    # OpenAI accepts a string, an array of strings, tokens, or arrays of tokens; one prompt here
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise PydanticCustomError(INVALID, "must not be empty")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise PydanticCustomError(UNSUPPORTED, "batch prompts are not supported, one prompt per request")
    raise PydanticCustomError(WRONG_TYPE, "a string or an array of token ids")


class CompletionBody(CommonBody):
    prompt: Annotated[Any, AfterValidator(_prompt)]  # str | list[int] once valid
    echo: _unsupported(False, "no echo") = None
    logprobs: TopLogprobs | None = None  # the legacy shape: this many alternatives per token
    suffix: _unsupported("", "no suffix") = None
    best_of: _unsupported(1, "one choice per request") = None
