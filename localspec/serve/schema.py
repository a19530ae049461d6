"""The OpenAI request bodies as pydantic models: /v1/chat/completions (ChatBody) and
/v1/completions (CompletionBody).

Strict: every field the OpenAI API defines for the endpoint is declared, and an unknown
field, a wrong JSON type (no "5" for 5, no true for 1) or an out-of-range value fails
validation at its location. Fields we understand but do not implement (n > 1, logprobs,
penalties, tools) accept only their default and otherwise fail as "unsupported", rather
than being silently ignored; implementing one means giving it a real type here.
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
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOPS = 4

# error types of our own (PydanticCustomError); the message is what follows the field name
UNSUPPORTED = "unsupported_parameter"  # a value we understand but do not implement
INVALID = "invalid_value"
WRONG_TYPE = "wrong_type"  # message: the expected type, e.g. "a string or an array of token ids"


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


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: str | None = None


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


class CommonBody(_Body):
    model: str
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


class ChatBody(CommonBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: _unsupported(False, "no logprobs") = None
    top_logprobs: _unsupported(0, "no logprobs") = None
    response_format: ResponseFormat | None = None
    tools: _unsupported([], "no tool calls") = None
    tool_choice: _unsupported("none", "no tool calls") = None
    parallel_tool_calls: Any = None
    functions: _unsupported([], "no function calls") = None
    function_call: _unsupported("none", "no function calls") = None
    metadata: Any = None
    store: _unsupported(False, "nothing is stored") = None
    service_tier: Any = None
    prediction: Prediction | None = None


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
    logprobs: _unsupported(0, "no logprobs") = None
    suffix: _unsupported("", "no suffix") = None
    best_of: _unsupported(1, "one choice per request") = None
