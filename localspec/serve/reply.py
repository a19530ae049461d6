"""One request's answer in OpenAI's shape, whole or streamed: the scheduler's text
pieces (with their tokens' logprobs) in; content, tool calls and logprobs out.

A request whose tool calls are read (serve/tools.py's ToolPlan) sends its text through
a ToolCallParser, streamed or not, so the streamed deltas reassemble to the call the
whole reply gives: content at once, except what may open a call; a call's id and name,
then its arguments, once the call is closed. Its finish_reason is "tool_calls" when
the reply has a call and was not cut short.
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.core.backend import Model
from localspec.core.events import GenerationStats, TokenLogprob
from localspec.core.toolcalls import ContentDelta, Delta, ToolCallDelta
from localspec.serve import protocol
from localspec.serve.logprobs import LogprobWriter
from localspec.serve.protocol import GenRequest
from localspec.serve.tools import ToolPlan


class Reply:
    def __init__(self, req: GenRequest, rid: str, created: int, model_id: str, target: Model,
                 plan: ToolPlan | None, prompt_text: str) -> None:
        self.req = req
        self.head = (rid, created, model_id)
        self.parser = plan.parser() if plan else None
        self.parallel = plan.parallel if plan else True
        self.logprobs = None
        if req.logprobs is not None:
            prompt = prompt_text or (target.detokenize(req.prompt) if isinstance(req.prompt, list) else "")
            self.logprobs = LogprobWriter(target, req.kind, 0 if req.kind == "chat" else len(prompt))
        self.parts: list[str] = []
        self.lps: list[TokenLogprob] = []

    @property
    def text(self) -> str:
        """What the model wrote so far (the log's output)."""
        return "".join(self.parts)

    # ----- whole -----------------------------------------------------------------------

    def add(self, text: str, lps: Sequence[TokenLogprob]) -> None:
        self.parts.append(text)
        self.lps.extend(lps)

    def body(self, tail: str, stats: GenerationStats) -> dict:
        """The non-streaming body, once the generation is done (`tail`: held-back text)."""
        self.parts.append(tail)
        logprobs = self.logprobs(self.lps) if self.logprobs else None
        if self.parser is None:
            return protocol.response(self.req, *self.head, self.text, stats, logprobs=logprobs)
        self.parser.feed(self.text)
        self.parser.finish()
        calls = [c.to_openai() for c in self.parser.calls][: None if self.parallel else 1]
        content = self.parser.content or (None if calls else "")
        return protocol.response(self.req, *self.head, content, stats, tool_calls=calls, logprobs=logprobs)

    # ----- streamed --------------------------------------------------------------------

    def opening(self) -> list[dict]:
        return [self._chunk("", role=True)] if self.req.kind == "chat" else []

    def piece(self, text: str, lps: Sequence[TokenLogprob]) -> list[dict]:
        """The chunks for one piece of text (and its tokens' logprobs)."""
        self.parts.append(text)
        logprobs = self.logprobs(lps) if self.logprobs and lps else None
        if self.parser is None:
            return [self._chunk(text, logprobs=logprobs)] if text or logprobs else []
        return self._deltas(self.parser.feed(text), logprobs)

    def closing(self, tail: str, stats: GenerationStats) -> list[dict]:
        """The last chunks: held-back text, what the parser still held, finish_reason
        and, when asked, usage."""
        out = self.piece(tail, ()) if tail else []
        if self.parser is not None:
            out += self._deltas(self.parser.finish(), None)
        calls = bool(self.parser and self.parser.calls)
        out.append(self._chunk(reason=protocol.finish_reason(stats.stop_reason, calls)))
        if self.req.include_usage:
            out.append(protocol.usage_chunk(self.req, *self.head, stats))
        return out

    def _chunk(self, text: str | None = None, **kw: object) -> dict:
        return protocol.chunk(self.req, *self.head, text, **kw)

    def _deltas(self, deltas: Sequence[Delta], logprobs: dict | None) -> list[dict]:
        """A chunk per delta; the piece's logprobs ride on the first (or on an empty
        delta of their own when the parser holds the piece's text back)."""
        out = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                out.append(self._chunk(d.text))
            elif isinstance(d, ToolCallDelta) and (self.parallel or d.index == 0):
                out.append(self._chunk(tool_calls=[d.to_openai()]))
        if logprobs is not None:
            if out:
                out[0]["choices"][0]["logprobs"] = logprobs
            else:
                out.append(self._chunk(logprobs=logprobs))
        return out
