"""llama-server's own endpoints, in its shapes: POST /completion and /infill (whole or
streamed as `data: {...}` lines without a closing [DONE]), /tokenize, /detokenize,
/apply-template, GET /props and /slots (read-only).

A /completion or /infill request is a Job like any other: the scheduler puts it in the
slot holding the longest start of its prompt and speculates on it under the server's
policy; only the body and the reply differ. The reply carries llama.cpp's fields
(content, stop_type, truncated, tokens_cached, timings with the draft counters), and
`response_fields` narrows it to the paths asked for, keyed by the path
("timings/prompt_n"), as llama-server does for llama.vim.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localspec import __version__
from localspec.core.backend import llama_cpp_version
from localspec.core.chat_template import TemplateError, template_for
from localspec.core.config import GenerationConfig, SamplingConfig
from localspec.core.events import GenerationStats, StopReason
from localspec.serve import admission, protocol
from localspec.serve.app import _GONE, KEEP_ALIVE, _Api, _error, _EventStream, _watch_disconnect
from localspec.serve.infill import infill_prompt, mixed
from localspec.serve.jobs import Failed, Finished, Job, Text, loop_sink
from localspec.serve.llamacpp_schema import (
    CompletionNative,
    DetokenizeBody,
    InfillBody,
    NativeBody,
    TokenizeBody,
)
from localspec.serve.protocol import ApiError
from localspec.serve.tools import request_prompt

# /infill's prefix and suffix windows are parts of llama-server's batch (-b, 2048 by
# default; here at most half a slot's context, so that the extra chunks keep room)
LLAMA_SERVER_N_BATCH = 2048
# llama-server's placeholder for an image/audio part in a prompt: random per process,
# pinned by LLAMA_MEDIA_MARKER (we take no media, but clients read the field).
_MEDIA_MARKER = os.environ.get("LLAMA_MEDIA_MARKER") or f"<__media_{secrets.token_hex(16)}__>"


def _template_caps(model) -> dict[str, bool]:
    """The chat template's capabilities under llama-server's names (its tool_use variant
    when the model has one, as llama-server takes the more expressive one); {} when the
    template does not compile."""
    try:
        return template_for(model, tools=True).caps.to_llama()
    except TemplateError:
        return {}


_STOP_TYPE = {StopReason.EOS: "eos", StopReason.STOP: "word", StopReason.LENGTH: "limit",
              StopReason.CONTEXT: "limit", StopReason.TIME: "limit", StopReason.INDENT: "limit"}
# localspec's own field: which limit ended it
_STOPPED_BY = {StopReason.TIME: "t_max_predict_ms", StopReason.INDENT: "n_indent",
               StopReason.LENGTH: "n_predict", StopReason.CONTEXT: "context",
               StopReason.STOP: "stop", StopReason.EOS: "eos"}


def routes(api: _Api) -> list[Route]:
    n = Native(api)
    return [
        Route("/completion", n.completion, methods=["POST"]),
        Route("/completions", n.completion, methods=["POST"]),
        Route("/infill", n.infill, methods=["POST"]),
        Route("/tokenize", n.tokenize, methods=["POST"]),
        Route("/detokenize", n.detokenize, methods=["POST"]),
        Route("/apply-template", n.apply_template, methods=["POST"]),
        Route("/props", n.props, methods=["GET"]),
        Route("/slots", n.slots, methods=["GET"]),
    ]


def timings(stats: GenerationStats, predicted: int) -> dict:
    """llama.cpp's `timings` object; draft_n and draft_n_accepted when it speculated."""
    prompt_ms, gen_ms = stats.prefill_s * 1000, stats.decode_s * 1000
    out = {
        "cache_n": stats.restored_tokens,
        "prompt_n": stats.prefill_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.prefill_tokens if stats.prefill_tokens else 0.0,
        "prompt_per_second": 1000 * stats.prefill_tokens / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted,
        "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / predicted if predicted else 0.0,
        "predicted_per_second": 1000 * predicted / gen_ms if gen_ms > 0 else 0.0,
    }
    if stats.drafted:
        out["draft_n"], out["draft_n_accepted"] = stats.drafted, stats.accepted
    return out


def pick_fields(paths: list[str], body: dict) -> dict:
    """llama.cpp's json_get_nested_values: {"a/b": body["a"]["b"], ...}, paths that exist."""
    out = {}
    for path in paths:
        cur: object = body
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def _budget(b: NativeBody, default: int, limit: int) -> int:
    """The tokens a request may generate: n_predict (or max_tokens), -1 the server's
    default (-n; <= 0 there: the limit), never past --max-tokens-limit; 0 caches the
    prompt and generates nothing."""
    asked = b.n_predict if b.max_tokens is None else b.max_tokens
    if asked == 0:
        return 0
    n = asked if asked > 0 else default if default > 0 else limit
    return min(n, limit)


class Native:
    def __init__(self, api: _Api) -> None:
        self.api = api

    # ----- plain routes ---------------------------------------------------------------

    async def _body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        self.api._auth(request)
        raw = await admission.read_body(request, self.api.settings.max_body_bytes)
        return protocol._validate(model, protocol.parse_json(raw))

    async def tokenize(self, request: Request) -> Response:
        try:
            b = await self._body(request, TokenizeBody)
        except ApiError as e:
            return _error(e)
        t = self.api.target
        tokens = await asyncio.to_thread(mixed, t, b.content, b.add_special, b.parse_special)
        if not b.with_pieces:
            return JSONResponse({"tokens": tokens})
        out = []
        for tok in tokens:
            raw = t.token_piece(tok)
            try:
                piece: object = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama.cpp: the bytes when the piece is not valid UTF-8
            out.append({"id": tok, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, request: Request) -> Response:
        try:
            b = await self._body(request, DetokenizeBody)
            self._check_ids(b.tokens, "tokens")
        except ApiError as e:
            return _error(e)
        return JSONResponse({"content": self.api.target.detokenize(b.tokens)})

    async def apply_template(self, request: Request) -> Response:
        try:
            self.api._auth(request)
            body = protocol.parse_json(await admission.read_body(request, self.api.settings.max_body_bytes))
            req = protocol.parse_chat(body)
            text, _ = await asyncio.to_thread(request_prompt, self.api.target, req)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"prompt": text})

    async def props(self, request: Request) -> Response:
        try:
            self.api._auth(request)
        except ApiError as e:
            return _error(e)
        a, t, s = self.api, self.api.target, self.api.settings.sampling
        params = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                  "seed": -1 if s.seed is None else s.seed, "n_predict": a.settings.default_max_tokens,
                  "max_tokens": a.settings.default_max_tokens,
                  "speculative.types": a.scheduler.cfg.spec.mode,
                  "speculative.n_max": a.scheduler.cfg.spec.draft_max,
                  "speculative.n_min": a.scheduler.cfg.spec.draft_min}
        piece = lambda tok: t.token_piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""
        caps = await asyncio.to_thread(_template_caps, t)
        tool_use = t.chat_template("tool_use")
        return JSONResponse({
            "default_generation_settings": {"params": params, "n_ctx": t.n_ctx_seq},
            "total_slots": a.scheduler.cfg.n_slots,
            "model_alias": a.settings.model_id,
            "model_ftype": t.ftype(),
            "model_path": a.settings.target_path or str(t.path),
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": _MEDIA_MARKER,
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "ui": False, "ui_settings": {},
            "chat_template": t.chat_template() or "",
            "chat_template_caps": caps,
            "bos_token": piece(t.bos), "eos_token": piece(t.eos),
            "build_info": f"localspec {__version__} (llama-cpp-python {llama_cpp_version()})",
            "is_sleeping": False,
            "cors_proxy_enabled": False,
            "infill": t.fim_tokens()["mid"] >= 0,
        } | ({"chat_template_tool_use": tool_use} if tool_use else {}))

    async def slots(self, request: Request) -> Response:
        try:
            self.api._auth(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse(self.api.scheduler.slots())

    def _check_ids(self, tokens: list, param: str) -> None:
        n = self.api.target.n_vocab
        bad = [x for x in tokens if isinstance(x, int) and not 0 <= x < n]
        if bad:
            raise protocol.bad_request(f"Token id {bad[0]} is outside the vocabulary (0..{n - 1}).",
                                       param, "invalid_value")

    # ----- generation -----------------------------------------------------------------

    async def completion(self, request: Request) -> Response:
        def prompt(b: CompletionNative) -> tuple[list[int], str]:
            self._check_ids(b.prompt if isinstance(b.prompt, list) else [], "prompt")
            tokens = mixed(self.api.target, b.prompt, True, True)
            return tokens, b.prompt if isinstance(b.prompt, str) else ""
        return await self._generate(request, CompletionNative, prompt, "completion")

    async def infill(self, request: Request) -> Response:
        def prompt(b: InfillBody) -> tuple[list[int], str]:
            for part in (b.input_prefix, b.input_suffix):
                self._check_ids(part if isinstance(part, list) else [], "input_prefix")
            t = self.api.target
            n = _budget(b, self.api.settings.default_max_tokens, self.api.settings.max_tokens_limit)
            tokens = infill_prompt(t, b, n_batch=min(LLAMA_SERVER_N_BATCH, t.n_ctx_seq // 2),
                                   n_ctx=t.n_ctx_seq, n_predict=n)
            return tokens, ""
        return await self._generate(request, InfillBody, prompt, "infill")

    async def _generate(self, request: Request, model: type[NativeBody],
                        build: Callable[[NativeBody], tuple[list[int], str]], kind: str) -> Response:
        api = self.api
        try:
            if api.scheduler.draining:
                raise admission.unavailable("the server is shutting down")
            b = await self._body(request, model)
            tokens, text = await asyncio.to_thread(build, b)
            limit = api.target.n_ctx_seq
            if not tokens:
                raise protocol.bad_request("The prompt is empty after tokenization.", "prompt", "invalid_value")
            if len(tokens) >= limit:
                raise ApiError(400, f"the request exceeds the available context size ({len(tokens)} "
                                    f"prompt tokens, {limit} per slot)", type="exceed_context_size_error",
                               param="prompt", code="context_length_exceeded")
            n = _budget(b, api.settings.default_max_tokens, api.settings.max_tokens_limit)
            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            gen = GenerationConfig(max_tokens=max(1, n), stop=tuple(s for s in b.stop or () if s),
                                   ignore_eos=bool(b.ignore_eos), n_indent=b.n_indent,
                                   t_max_predict_ms=b.t_max_predict_ms)
            job = Job(tokens, self._sampling(b), gen,
                      sink=loop_sink(loop.call_soon_threadsafe, queue.put_nowait, not b.stream))
            admission.submit(api.scheduler, job, api.metrics_)
        except ApiError as e:
            api.metrics_.request(kind, str(e.status))
            return _error(e)
        except ClientDisconnect:
            api.metrics_.request(kind, "cancelled")
            return Response(status_code=499)
        api.metrics_.generation_started(kind)
        watcher = asyncio.create_task(_watch_disconnect(request, job, queue))
        call = _NativeCall(api, kind, b, job, queue, watcher, prompt_only=(n == 0), prompt_text=text)
        if b.stream:
            return _EventStream(call)
        return await call.complete()

    def _sampling(self, b: NativeBody) -> SamplingConfig:
        d = self.api.settings.sampling
        pick = lambda v, default: default if v is None else v
        seed = None if b.seed is None or b.seed < 0 else b.seed
        return SamplingConfig(temperature=pick(b.temperature, d.temperature), top_k=pick(b.top_k, d.top_k),
                              top_p=pick(b.top_p, d.top_p), min_p=pick(b.min_p, d.min_p),
                              seed=pick(seed, d.seed))


class _NativeCall:
    """One admitted /completion or /infill: the scheduler's events as llama.cpp's reply.
    `prompt_only` (n_predict 0: llama.vim's cache warm-up) caches the prompt and replies
    with no content."""

    def __init__(self, api: _Api, kind: str, body: NativeBody, job: Job, queue: asyncio.Queue,
                 watcher: asyncio.Task, *, prompt_only: bool, prompt_text: str) -> None:
        self.api, self.kind, self.body, self.job, self.queue = api, kind, body, job, queue
        self.watcher = watcher
        self.prompt_only = prompt_only
        self.prompt_text = prompt_text
        self.parts: list[str] = []
        self.n_tokens = 0
        self.outcome = "cancelled"
        self._settled = False

    def done(self) -> None:
        if self._settled:
            return
        self._settled = True
        self.watcher.cancel()
        self.job.cancel()
        self.api.metrics_.request(self.kind, self.outcome)
        ended = {"ok": "finished", "cancelled": "cancelled"}.get(self.outcome, "failed")
        self.api.metrics_.generation_ended(self.kind, ended)

    async def _next(self, timeout: float | None) -> object:
        try:
            ev = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
        except asyncio.TimeoutError:
            return None
        if isinstance(ev, Failed):
            self.outcome = str(ev.status)
        elif isinstance(ev, Finished):
            self.outcome = "ok"
        return ev

    def partial(self, text: str) -> dict:
        return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": self.job.slot,
                "tokens_predicted": self.n_tokens, "tokens_evaluated": len(self.job.prompt)}

    def final(self, content: str, stats: GenerationStats) -> dict:
        predicted = 0 if self.prompt_only else stats.generated
        text = "".join(self.parts) + content
        body = {
            "index": 0, "content": content, "tokens": [], "id_slot": self.job.slot, "stop": True,
            "model": self.api.settings.model_id,
            "tokens_predicted": predicted, "tokens_evaluated": stats.prompt_tokens,
            "generation_settings": {"n_predict": self.job.gen.max_tokens, "temperature": self.job.sampling.temperature,
                                    "top_k": self.job.sampling.top_k, "top_p": self.job.sampling.top_p,
                                    "min_p": self.job.sampling.min_p, "stop": list(self.job.gen.stop),
                                    "n_indent": self.job.gen.n_indent,
                                    "t_max_predict_ms": self.job.gen.t_max_predict_ms,
                                    "speculative.types": stats.drafter},
            "prompt": self.prompt_text,
            "has_new_line": "\n" in text,
            "truncated": stats.stop_reason == StopReason.CONTEXT,
            "stop_type": _STOP_TYPE.get(stats.stop_reason, "none"),
            "stopping_word": "",
            # the slot's cells after the reply: the prompt and every token but the last
            "tokens_cached": stats.prompt_tokens + max(0, predicted - 1),
            "stopped_by": _STOPPED_BY.get(stats.stop_reason, ""),
            "timings": timings(stats, predicted),
        }
        fields = self.body.response_fields
        return pick_fields(fields, body) if fields else body

    async def complete(self) -> Response:
        try:
            while True:
                ev = await self._next(None)
                if ev is _GONE:
                    return Response(status_code=499)
                if isinstance(ev, Text):
                    self.parts.append(ev.text)
                elif isinstance(ev, Failed):
                    return _error(ApiError(ev.status, ev.message, type="server_error"))
                elif isinstance(ev, Finished):
                    content = "" if self.prompt_only else "".join(self.parts) + ev.text
                    self.parts = []
                    return JSONResponse(self.final(content, ev.stats))
        finally:
            self.done()

    async def stream(self) -> AsyncIterator[str]:
        line = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
        keep_alive = self.api.settings.sse_keepalive_s
        try:
            while True:
                ev = await self._next(keep_alive if keep_alive > 0 else None)
                if ev is None:
                    yield KEEP_ALIVE
                elif ev is _GONE:
                    return
                elif isinstance(ev, Text):
                    self.n_tokens += ev.n_tokens
                    if ev.text and not self.prompt_only:
                        self.parts.append(ev.text)
                        yield line(self.partial(ev.text))
                elif isinstance(ev, Failed):
                    yield line(ApiError(ev.status, ev.message, type="server_error").body())
                    return
                elif isinstance(ev, Finished):
                    if ev.text and not self.prompt_only:
                        self.parts.append(ev.text)
                        yield line(self.partial(ev.text))
                    yield line(self.final("", ev.stats))
                    return
        finally:
            self.done()
