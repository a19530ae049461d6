"""/infill's prompt: llama-server's fill-in-the-middle layout with the model's own FIM
tokens (read from the GGUF by llama.cpp), token for token what llama-server builds
(tools/server's format_prompt_infill), so that the same request gets the same
completion from either server:

    [FIM_REP]myproject\\n                      (when the model has a repo token)
    [FIM_SEP]{filename}\\n{text}   per input_extra chunk (no separator token: a
                                              "--- snippet ---" line instead)
    [FIM_SEP]filename\\n
    [FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

The prefix keeps its last 3/4 of a batch, the suffix its first 1/4 (less the typed
prompt), and the extra chunks fill what the context leaves, newest last: the plugin
sends them oldest first, and the start of the prompt is what is cut.

Everything the middle may copy is in this prompt, the suffix last: the n-gram drafter
(which prefers the most recent occurrence) drafts from the suffix first, then from the
prefix and the other files.
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.core.backend import Model
from localspec.serve.llamacpp_schema import InfillBody
from localspec.serve.protocol import ApiError

# llama.cpp's chunk separator for models without a file-separator token
_SNIPPET = "\n\n--- snippet ---\n\n"


def fim_tokens(target: Model) -> dict[str, int]:
    """The model's FIM token ids, or a 400 naming what is missing."""
    fim = target.fim_tokens()
    missing = [name for key, name in (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))
               if fim[key] < 0]
    if missing:
        raise ApiError(400, f"Infill is not supported by this model: it has no fill-in-the-middle "
                            f"{', '.join(missing)} token (use a code model with FIM tokens, e.g. "
                            f"Qwen2.5-Coder).", type="not_supported_error", param="model",
                       code="infill_not_supported")
    return fim


def mixed(target: Model, value: str | Sequence[str | int], add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenize_mixed: a string, or a list of strings and token ids."""
    if isinstance(value, str):
        return target.tokenize(value, add_special, parse_special)
    out: list[int] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            out += target.tokenize(part, add_special and i == 0, parse_special)
        else:
            out.append(part)
    return out


def infill_prompt(target: Model, body: InfillBody, *, n_batch: int, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt tokens of an /infill request (see the module's docstring). The extra
    chunks get what the context leaves after `n_batch` and twice `n_predict` (this
    request's budget; llama-server uses its -n, -1 unless set)."""
    fim = fim_tokens(target)
    tok = lambda text: target.tokenize(text, add_special=False, parse_special=False)
    extra: list[int] = []
    if fim["rep"] >= 0:
        extra += [fim["rep"], *tok("myproject\n")]
    for chunk in body.input_extra:
        extra += [fim["sep"], *tok(chunk.filename + "\n")] if fim["sep"] >= 0 else tok(_SNIPPET)
        extra += tok(chunk.text)
    if fim["sep"] >= 0:
        extra += [fim["sep"], *tok("filename\n")]
    prefix = mixed(target, body.input_prefix, False, False)
    suffix = mixed(target, body.input_suffix, False, False)
    typed = target.tokenize(body.prompt, add_special=False, parse_special=True)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(typed))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim["pre"], *prefix[len(prefix) - n_prefix:], *typed]
    tail = [fim["suf"], *suffix[:n_suffix]]
    if target.add_bos:
        head.insert(0, target.bos)
    return [*extra[len(extra) - n_extra:], *head, *tail, fim["mid"]]
