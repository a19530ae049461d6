"""The llama.cpp fields OpenAI requests may carry (llama-server accepts them on
/v1/completions and /v1/chat/completions, and its clients send them). Accepted and
without effect here, where ignoring them is harmless: prompt caching is always on, a
request goes to the slot holding the longest start of its prompt (id_slot), the sampler
order and time limits are llama.cpp's own; chat_template_kwargs is used (the chat
template sees its variables, e.g. Qwen3's enable_thinking). schema.CommonBody has them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

Ignored = Any  # accepted with any value, without effect


class LlamaCppFields(BaseModel):
    """Fields llama.cpp clients add to OpenAI requests; only chat_template_kwargs is used."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    cache_prompt: bool | None = None
    n_probs: Ignored = None
    samplers: Ignored = None
    t_max_prompt_ms: Ignored = None
    t_max_predict_ms: Ignored = None
    id_slot: Ignored = None
    reasoning_format: Ignored = None
    timings_per_token: Ignored = None
    return_progress: Ignored = None
    post_sampling_probs: Ignored = None
    n_keep: Ignored = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
