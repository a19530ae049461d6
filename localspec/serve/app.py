"""The ASGI app (Starlette): OpenAI-compatible routes over the scheduler.

Handlers never touch the llama.cpp context: they validate, tokenize (read-only on the
vocabulary), submit a Job, and await its events on an asyncio.Queue that the scheduler
thread fills through loop.call_soon_threadsafe. A watcher task per request cancels the
job when the client disconnects, so its slot and KV cells are freed at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from localspec.acceptance import logdb
from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, SamplingConfig
from localspec.core.errors import GrammarError
from localspec.core.grammar import check_grammar
from localspec.serve import protocol
from localspec.serve.protocol import ApiError, GenRequest
from localspec.serve.scheduler import (
    Failed,
    Finished,
    Job,
    QueueFull,
    Scheduler,
    Text,
    Unavailable,
)

log = logging.getLogger("localspec.serve")
_GONE = object()  # put on a request's queue when its client disconnects


@dataclass(frozen=True)
class ServeSettings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_limit: int = 4096  # a request asking more gets a 400
    default_max_tokens: int = 512  # when a request sets none (<= 0: until the context ends)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # defaults for unset fields
    log_generations: bool = True
    target_path: str | None = None


def create_app(scheduler: Scheduler, target: Model, settings: ServeSettings) -> Starlette:
    """The app; its lifespan starts and stops the scheduler thread."""
    api = _Api(scheduler, target, settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not scheduler.alive:
            scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            api.log_pool.shutdown(wait=True)

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ]
    handlers = {HTTPException: _http_error, Exception: _server_error}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


def _error(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _error(ApiError(exc.status_code, message, type=kind))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return _error(ApiError(500, "The server had an error while processing your request.",
                           type="server_error"))


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Api:
    def __init__(self, scheduler: Scheduler, target: Model, settings: ServeSettings) -> None:
        self.scheduler = scheduler
        self.target = target
        self.settings = settings
        self.metrics_ = scheduler.metrics
        self.log_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-log")

    # ----- plain routes -------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        snap = self.scheduler.snapshot()
        status = 200 if snap["alive"] else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable",
                             "model": self.settings.model_id, **snap}, status_code=status)

    async def metrics(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return _error(e)
        snap = self.scheduler.snapshot()
        gauges = {
            "up": ("1 while the scheduler thread runs.", float(snap["alive"])),
            "slots": ("Parallel sequences (--parallel).", snap["slots"]),
            "active_sequences": ("Requests holding a slot.", snap["active"]),
            "queued_requests": ("Requests waiting for a slot.", snap["queued"]),
            "speculation_enabled": ("1 while speculation is on.", float(snap["speculation"])),
            "spec_disable_by_batch_size": ("Speculation is off above this many active (-1: never).",
                                           snap["spec_disable_by_batch_size"]),
        }
        return PlainTextResponse(self.metrics_.render(gauges),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse(protocol.models_list(self.settings.model_id))

    async def model(self, request: Request) -> Response:
        try:
            self._auth(request)
        except ApiError as e:
            return _error(e)
        if request.path_params["model_id"] != self.settings.model_id:
            return _error(ApiError(404, f"The model '{request.path_params['model_id']}' does not exist",
                                   param="model", code="model_not_found"))
        return JSONResponse(protocol.models_list(self.settings.model_id)["data"][0])

    # ----- generation ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            self._auth(request)
            body = protocol.parse_json(await self._read_body(request))
            req = protocol.parse_chat(body) if kind == "chat" else protocol.parse_completion(body)
            # tokenizing a long prompt takes a while: keep the event loop free meanwhile
            prompt, prompt_text = await asyncio.to_thread(self._prompt, req)
            if req.grammar:
                await asyncio.to_thread(self._check_grammar, req.grammar)
            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            extra = (await asyncio.to_thread(self.target.tokenize, req.prediction, False, False)
                     if req.prediction else [])
            job = Job(prompt, self._sampling(req), self._gen(req),
                      sink=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), extra=extra)
            self.scheduler.submit(job)
        except ApiError as e:
            self.metrics_.request(kind, str(e.status))
            return _error(e)
        except QueueFull as exc:
            self.metrics_.request(kind, "429")
            return _error(ApiError(429, f"The server is busy: {exc}. Retry later.",
                                   type="rate_limit_error", code="queue_full"))
        except ClientDisconnect:  # gone while sending the body
            self.metrics_.request(kind, "cancelled")
            return Response(status_code=499)
        except Unavailable as exc:
            self.metrics_.request(kind, "503")
            return _error(ApiError(503, f"The server is unavailable: {exc}.", type="server_error"))
        watcher = asyncio.create_task(_watch_disconnect(request, job, queue))
        call = _Call(self, req, job, queue, watcher, prompt_text)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(call.stream(), media_type="text/event-stream", headers=headers)
        return await call.complete()

    def _auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header "
                                "using Bearer auth (Authorization: Bearer YOUR_KEY).")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_big = ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            parts.append(part)
        return b"".join(parts)

    def _prompt(self, req: GenRequest) -> tuple[list[int], str]:
        """Token ids for the request (chat template for chat) and its text for the log."""
        t = self.target
        if req.kind == "chat":
            text = t.apply_chat_template(req.messages)
            tokens = t.tokenize(text, add_special=True, parse_special=True)
        elif isinstance(req.prompt, str):
            text = req.prompt
            tokens = t.tokenize(text, add_special=True, parse_special=True)
        else:
            tokens = list(req.prompt or [])
            bad = [x for x in tokens if not 0 <= x < t.n_vocab]
            if bad:
                raise protocol.bad_request(f"Token id {bad[0]} is outside the vocabulary (0..{t.n_vocab - 1}).",
                                           "prompt", "invalid_value")
            text = ""
        limit = t.n_ctx_seq
        if not tokens:
            raise protocol.bad_request("The prompt is empty after tokenization.", "prompt", "invalid_value")
        if len(tokens) >= limit:
            raise protocol.bad_request(
                f"This model's maximum context length is {limit} tokens per slot. However, your "
                f"prompt is {len(tokens)} tokens. Please shorten it.",
                "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
        return tokens, text

    def _check_grammar(self, gbnf: str) -> None:
        """llama.cpp parses the grammar here, so a bad one is a 400, not a failed job."""
        try:
            check_grammar(self.target, gbnf)
        except GrammarError as exc:
            raise protocol.grammar_error(exc) from None

    def _sampling(self, req: GenRequest) -> SamplingConfig:
        d = self.settings.sampling
        pick = lambda v, default: default if v is None else v
        return SamplingConfig(temperature=pick(req.temperature, d.temperature),
                              top_k=pick(req.top_k, d.top_k), top_p=pick(req.top_p, d.top_p),
                              min_p=pick(req.min_p, d.min_p), seed=pick(req.seed, d.seed))

    def _gen(self, req: GenRequest) -> GenerationConfig:
        limit = self.settings.max_tokens_limit
        if req.max_tokens is not None and req.max_tokens > limit:
            param = "max_tokens"
            raise protocol.bad_request(f"'{param}' is {req.max_tokens}; this server allows at most {limit}.",
                                       param, "invalid_value")
        n = req.max_tokens if req.max_tokens is not None else self.settings.default_max_tokens
        n = min(n, limit) if n > 0 else limit
        return GenerationConfig(max_tokens=n, stop=req.stop, ignore_eos=req.ignore_eos, grammar=req.grammar)

    def log_generation(self, req: GenRequest, job: Job, stats: object, prompt_text: str, output: str) -> None:
        """Best effort, off the event loop: the acceptance log must never break serving."""
        if not self.settings.log_generations:
            return
        target = self.settings.target_path or str(self.target.path)
        spec = self.scheduler.cfg.spec

        def write() -> None:
            try:
                logdb.log_generation("serve", stats, target=target, draft=None, spec=spec,
                                     sampling=job.sampling, prompt_text=prompt_text, output_text=output)
            except Exception:
                log.debug("acceptance log failed", exc_info=True)
        try:
            self.log_pool.submit(write)
        except RuntimeError:  # shutting down
            pass


async def _watch_disconnect(request: Request, job: Job, queue: asyncio.Queue) -> None:
    """Wait for http.disconnect (the body is already read); then free the slot."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            queue.put_nowait(_GONE)
            return


class _Call:
    """One admitted request: turns the scheduler's events into a response or SSE."""

    def __init__(self, api: _Api, req: GenRequest, job: Job, queue: asyncio.Queue,
                 watcher: asyncio.Task, prompt_text: str) -> None:
        self.api = api
        self.req = req
        self.job = job
        self.queue = queue
        self.watcher = watcher
        self.prompt_text = prompt_text
        self.rid = protocol.new_id(req.kind)
        self.created = int(time.time())
        self.model = api.settings.model_id

    def _done(self, outcome: str) -> None:
        self.watcher.cancel()
        self.job.cancel()  # no-op when the scheduler already retired it
        self.api.metrics_.request(self.req.kind, outcome)

    async def complete(self) -> Response:
        parts: list[str] = []
        outcome = "cancelled"
        try:
            while True:
                ev = await self.queue.get()
                if ev is _GONE:
                    return Response(status_code=499)  # nobody is listening
                if isinstance(ev, Text):
                    parts.append(ev.text)
                elif isinstance(ev, Failed):
                    outcome = str(ev.status)
                    return _error(ApiError(ev.status, ev.message, type="server_error"))
                elif isinstance(ev, Finished):
                    outcome = "ok"
                    text = "".join(parts) + ev.text
                    self.api.log_generation(self.req, self.job, ev.stats, self.prompt_text, text)
                    return JSONResponse(protocol.response(self.req, self.rid, self.created, self.model,
                                                          text, ev.stats))
        finally:
            self._done(outcome)

    async def stream(self) -> AsyncIterator[str]:
        req, rid, created, model = self.req, self.rid, self.created, self.model
        parts: list[str] = []
        outcome = "cancelled"
        try:
            if req.kind == "chat":
                yield _sse(protocol.chunk(req, rid, created, model, "", role=True))
            while True:
                ev = await self.queue.get()
                if ev is _GONE:
                    return
                if isinstance(ev, Text):
                    parts.append(ev.text)
                    yield _sse(protocol.chunk(req, rid, created, model, ev.text))
                elif isinstance(ev, Failed):
                    outcome = str(ev.status)
                    yield _sse(ApiError(ev.status, ev.message, type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(ev, Finished):
                    outcome = "ok"
                    if ev.text:
                        parts.append(ev.text)
                        yield _sse(protocol.chunk(req, rid, created, model, ev.text))
                    reason = protocol.finish_reason(ev.stats.stop_reason)
                    yield _sse(protocol.chunk(req, rid, created, model, reason=reason))
                    if req.include_usage:
                        yield _sse(protocol.usage_chunk(req, rid, created, model, ev.stats))
                    yield "data: [DONE]\n\n"
                    self.api.log_generation(req, self.job, ev.stats, self.prompt_text, "".join(parts))
                    return
        finally:
            self._done(outcome)


def model_id_for(path: str | Path, alias: str | None = None) -> str:
    """The id /v1/models reports: the alias, else the GGUF file's stem."""
    return alias or Path(path).stem
