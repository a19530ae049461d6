"""Per-token logprobs in OpenAI's two shapes: chat's `choices[].logprobs.content[]`
(token, logprob, bytes, top_logprobs) and the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset).

The engine reports, for each emitted token, its log-probability under the target's raw
distribution at that position: the log-softmax of the logits row the token was checked
against (a drafted token's row in the verify batch included), before temperature,
top-k, top-p or min-p, as llama-server (`n_probs`) and OpenAI report them. Here token
ids become text and bytes.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from localspec.core.backend import Model
from localspec.core.events import TokenLogprob

FLOOR = -9999.0  # OpenAI's value for "practically impossible" (JSON has no -Infinity)


def token_string(piece: bytes) -> str:
    """A token's text; a piece that is not whole UTF-8 (part of a character) is written
    as OpenAI writes it: bytes:\\xe2\\x80."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class LogprobWriter:
    """Formats one request's logprobs, a chunk's tokens at a time (the legacy shape's
    text_offset runs on from chunk to chunk). `offset`: where the reply starts in the
    text the offsets count (OpenAI: after the prompt)."""

    def __init__(self, model: Model, kind: str, offset: int = 0) -> None:
        self.model = model
        self.kind = kind
        self.offset = offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, lps: Sequence[TokenLogprob]) -> dict:
        return self._chat(lps) if self.kind == "chat" else self._legacy(lps)

    def _piece(self, token: int) -> bytes:
        return self.model.token_piece(token, special=True)

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self._piece(token)
        return {"token": token_string(piece), "logprob": max(logprob, FLOOR), "bytes": list(piece)}

    def _chat(self, lps: Sequence[TokenLogprob]) -> dict:
        content = [self._entry(lp.token, lp.logprob) | {"top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                   for lp in lps]
        return {"content": content, "refusal": None}

    def _legacy(self, lps: Sequence[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = token_string(self._piece(lp.token))
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp.logprob, FLOOR))
            # OpenAI: the chosen token is always among them (up to n + 1 entries)
            top = {token_string(self._piece(i)): max(v, FLOOR) for i, v in lp.top}
            out["top_logprobs"].append(top | {text: max(lp.logprob, FLOOR)})
            out["text_offset"].append(self.offset)
            self.offset += len(self._decoder.decode(self.model.token_piece(lp.token)))
        return out
