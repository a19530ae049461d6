"""The request bodies of llama-server's own endpoints (/infill, /completion, /tokenize,
/detokenize) as pydantic models, and the llama.cpp fields OpenAI requests may carry.

llama-server reads the fields it knows and ignores the rest, and the clients written
for it (llama.vim, llama.vscode, scripts) send whatever their version knew: these
bodies are as lenient about unknown fields (extra="ignore") but as strict as the
OpenAI bodies about the type of every field they declare, so a wrong type is still a
400 naming the field. Fields declared `Ignored` are accepted and have no effect here:
llama.cpp's sampler chain order (`samplers`), prompt caching (always on), the prompt
time limit, slot pinning (a request goes to the slot holding the longest start of its
prompt), per-token probabilities and reasoning parsing.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from localspec.serve.llamacpp_fields import Ignored
from localspec.serve.schema import INVALID, MAX_STOPS, WRONG_TYPE, Integer


def _stops(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


class NativeBody(BaseModel):
    """What /completion and /infill share: llama.cpp's generation parameters."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)

    n_predict: Annotated[Integer, Field(ge=-1)] = -1  # -1: the server's default
    max_tokens: Annotated[Integer, Field(ge=-1)] | None = None  # llama.cpp's alias of n_predict
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_k: Annotated[Integer, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[Integer, Field(ge=-1, le=2**32 - 1)] | None = None  # -1 (llama.cpp): random
    stop: Annotated[list[str], Field(max_length=MAX_STOPS), BeforeValidator(_stops)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    n_indent: Annotated[Integer, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[float, Field(ge=0)] = 0
    response_fields: list[str] | None = None  # reply only these (paths like "timings/prompt_n")
    return_tokens: bool | None = None
    cache_prompt: bool | None = None
    samplers: Ignored = None
    t_max_prompt_ms: Ignored = None
    id_slot: Ignored = None
    n_probs: Ignored = None
    model: Ignored = None


def _mixed(v: Any) -> Any:
    # llama.cpp: a string, token ids, or a list mixing strings and token ids
    if isinstance(v, str):
        return v
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], list):
        v = v[0]  # one prompt given as a list of one
    if isinstance(v, list) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v):
        return v
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        raise PydanticCustomError(INVALID, "one prompt per request")
    raise PydanticCustomError(WRONG_TYPE, "a string, an array of token ids, or an array of both")


Mixed = Annotated[Any, BeforeValidator(_mixed)]  # str | list[str | int]


class CompletionNative(NativeBody):
    prompt: Mixed


class ExtraChunk(BaseModel):
    """One piece of context from another file (llama.vim's ring buffer)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    text: str
    filename: str = "tmp"


class InfillBody(NativeBody):
    input_prefix: Mixed
    input_suffix: Mixed
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # what was typed since the prefix (llama.vim's "middle")


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    content: Mixed = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    tokens: list[Integer] = Field(default_factory=list)
