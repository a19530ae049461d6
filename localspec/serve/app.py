"""The ASGI app (Starlette): OpenAI-compatible routes over the scheduler.

Handlers never touch the llama.cpp context: they read the body, have it validated,
rendered and tokenized (read-only on the vocabulary) on the preparation pool
(admission.Preparation), submit a Job, and await its events on an asyncio.Queue that the scheduler
thread fills through loop.call_soon_threadsafe. A watcher task per request cancels the
job when the client disconnects, so its slot and KV cells are freed at the next step.
"""

from __future__ import annotations

import asyncio
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
from starlette.types import Receive, Scope, Send

from localspec.acceptance import logdb
from localspec.core.backend import Model, check_grammar
from localspec.core.config import GenerationConfig, SamplingConfig
from localspec.core.drafters.memory import Memory
from localspec.core.drafters.suffix import SuffixIndex
from localspec.core.errors import GrammarError
from localspec.core.tuning import MEMORY_MAX_TOKENS as MEMORY_TOKENS
from localspec.serve import admission, guard, protocol
from localspec.serve.jobs import Failed, Finished, Job, Text, loop_sink
from localspec.serve.protocol import ApiError, GenRequest
from localspec.serve.reply import Reply
from localspec.serve.scheduler import Scheduler
from localspec.serve.tools import ToolPlan, request_prompt

log = logging.getLogger("localspec.serve")
_GONE = object()  # put on a request's queue when its client disconnects


@dataclass(frozen=True)
class ServeSettings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = admission.MAX_MESSAGES  # a chat request with more gets a 400
    max_tokens_limit: int = 4096  # a request asking more gets a 400
    default_max_tokens: int = 512  # when a request sets none (<= 0: until the context ends)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # defaults for unset fields
    log_generations: bool = True
    target_path: str | None = None
    host: str = "127.0.0.1"  # the bound address: a Host header may name it (serve/guard.py)
    allowed_hosts: tuple[str, ...] = ()  # more Host names to answer (--allowed-host)
    cors_origins: tuple[str, ...] = ()  # origins a browser may read replies from (--cors-origin)
    sse_keepalive_s: float = 5.0  # a stream with nothing to send for this long gets a comment
    memory: bool = True  # draft from earlier replies (one memory per API key), --no-memory: off
    memory_tokens: int = MEMORY_TOKENS  # each memory's bound, the oldest replies dropped first
    lookup: SuffixIndex | None = None  # --lookup corpora, indexed once, drafted from by every key


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
            api.preparation.close()
            api.log_pool.shutdown(wait=True)

    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
    ]
    from localspec.serve import native  # llama-server's own endpoints (it imports this module)

    routes += native.routes(api)
    handlers = {HTTPException: _http_error, Exception: _server_error}
    middleware = guard.middleware(settings.host, settings.allowed_hosts, settings.cors_origins)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware)
    app.state.api = api  # its memories, for inspection
    return app


def _error(e: ApiError) -> JSONResponse:
    headers = dict(getattr(e, "headers", {}))  # Retry-After on 429 and 503
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
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


# An SSE comment: clients and the official SDKs skip it; proxies and clients with an
# idle timeout see the stream alive while the request waits in the queue or prefills
KEEP_ALIVE = ": keep-alive\n\n"
_QUIET = object()  # no event within the keep-alive interval


@dataclass(frozen=True)
class _Prepared:
    """A request ready to queue (_Api._prepare)."""

    req: GenRequest
    prompt: list[int]
    prompt_text: str
    plan: ToolPlan | None
    gen: GenerationConfig
    extra: list[int]  # the prediction's tokens


class _Api:
    def __init__(self, scheduler: Scheduler, target: Model, settings: ServeSettings) -> None:
        self.scheduler = scheduler
        self.target = target
        self.settings = settings
        self.metrics_ = scheduler.metrics
        self.log_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-log")
        self.memories: dict[int | None, Memory] = {}  # by API key (its index in --api-key)
        self.preparation = admission.Preparation()

    # ----- plain routes -------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        snap = self.scheduler.snapshot()
        state = "unavailable" if not snap["alive"] else "draining" if snap["draining"] else "ok"
        return JSONResponse({"status": state, "model": self.settings.model_id, **snap,
                             "speed": self.metrics_.speed()},
                            status_code=200 if state == "ok" else 503)

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
            if self.scheduler.draining:
                raise admission.unavailable("the server is shutting down")
            who = self._auth(request)
            raw = await admission.read_body(request, self.settings.max_body_bytes)
            prep = await self.preparation.run(self.scheduler, self.metrics_, self._prepare, raw, kind)
            req = prep.req
            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            job = Job(prep.prompt, self._sampling(req), prep.gen,
                      sink=loop_sink(loop.call_soon_threadsafe, queue.put_nowait, not req.stream), extra=prep.extra,
                      memory=self._memory(who) if req.memory else None)
            admission.submit(self.scheduler, job, self.metrics_)
        except ApiError as e:
            self.metrics_.request(kind, str(e.status))
            return _error(e)
        except ClientDisconnect:  # gone while sending the body
            self.metrics_.request(kind, "cancelled")
            return Response(status_code=499)
        self.metrics_.generation_started(kind)
        watcher = asyncio.create_task(_watch_disconnect(request, job, queue))
        call = _Call(self, req, job, queue, watcher, prep.prompt_text, prep.plan)
        if req.stream:
            return _EventStream(call)
        return await call.complete()

    def _auth(self, request: Request) -> int | None:
        return admission.check_auth(request, self.settings.api_key)

    def _memory(self, who: int | None) -> Memory | None:
        """The memory of the caller's API key (one for all when no keys are set): one
        user's replies never draft for another; the --lookup corpora draft for all (with
        --no-memory, they alone). Made on first use; drafted from and added to on the
        scheduler thread only."""
        lookup = self.settings.lookup
        if not self.settings.memory:
            who = None  # one corpus-only memory: it holds nobody's text
            if lookup is None:
                return None
        memory = self.memories.get(who)
        if memory is None:
            memory = self.memories.setdefault(who, Memory(self.settings.memory_tokens, static=lookup,
                                                          keep=self.settings.memory))
        return memory

    def _prepare(self, raw: bytes, kind: str) -> _Prepared:
        """Everything a request needs before it can queue, on the preparation pool (a
        worker thread): the body parsed and validated, the messages counted before they
        are validated one by one, the prompt rendered and tokenized, the token budget,
        the grammar checked by llama.cpp, the prediction tokenized. Raises ApiError."""
        body = protocol.parse_json(raw)
        if isinstance(body.get("messages"), list):
            admission.check_messages(len(body["messages"]), self.settings.max_messages)
        req = protocol.parse_chat(body) if kind == "chat" else protocol.parse_completion(body)
        prompt, prompt_text, plan = self._prompt(req)
        n = admission.max_tokens(req.max_tokens, len(prompt), self.target.n_ctx_seq, kind, self.settings)
        if req.grammar:
            self._check_grammar(req.grammar)
        gen = GenerationConfig(max_tokens=n, stop=req.stop, ignore_eos=req.ignore_eos,
                               logprobs=req.logprobs, grammar=req.grammar)
        return _Prepared(req, prompt, prompt_text, plan, gen, self._prediction(req))

    def _prediction(self, req: GenRequest) -> list[int]:
        """The prediction's tokens (a draft source the scheduler indexes): at most a
        slot's context, the most a reply can repeat of it."""
        if not req.prediction:
            return []
        tokens = self.target.tokenize(req.prediction, False, False)
        limit = self.target.n_ctx_seq
        if len(tokens) > limit:
            raise protocol.bad_request(f"'prediction' is {len(tokens)} tokens; a reply here is at most {limit} "
                                       "tokens (a slot's context), so at most that much can be predicted.",
                                       "prediction", "invalid_value")
        return tokens


    def _prompt(self, req: GenRequest) -> tuple[list[int], str, ToolPlan | None]:
        """Token ids for the request (chat: the model's chat template), its text for the
        log, and how to read tool calls from the reply (chat with tools)."""
        t = self.target
        plan = None
        if req.kind == "chat":
            text, plan = request_prompt(t, req)
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
        return tokens, text, plan

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

    def log_generation(self, req: GenRequest, job: Job, stats: object, prompt_text: str, output: str) -> None:
        """Best effort, off the event loop: the acceptance log must never break serving."""
        if not self.settings.log_generations:
            return
        target = self.settings.target_path or str(self.target.path)
        spec, draft = self.scheduler.cfg.spec, self.scheduler.draft
        draft_path = str(draft.path) if draft is not None else None

        def write() -> None:
            try:
                logdb.log_generation("serve", stats, target=target, draft=draft_path, spec=spec,
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
    """One admitted request: turns the scheduler's events into a response or SSE.
    `outcome` follows the events; done() settles the request once, however it ends."""

    def __init__(self, api: _Api, req: GenRequest, job: Job, queue: asyncio.Queue,
                 watcher: asyncio.Task, prompt_text: str, plan: ToolPlan | None) -> None:
        self.api = api
        self.req = req
        self.job = job
        self.queue = queue
        self.watcher = watcher
        self.prompt_text = prompt_text
        self.rid = protocol.new_id(req.kind)
        self.created = int(time.time())
        self.model = api.settings.model_id
        self.reply = Reply(req, self.rid, self.created, self.model, api.target, plan, prompt_text)
        self.outcome = "cancelled"  # until the scheduler says otherwise
        self._settled = False

    def done(self) -> None:
        if self._settled:
            return
        self._settled = True
        self.watcher.cancel()
        self.job.cancel()  # no-op when the scheduler already retired it
        metrics = self.api.metrics_
        metrics.request(self.req.kind, self.outcome)
        ended = {"ok": "finished", "cancelled": "cancelled"}.get(self.outcome, "failed")
        metrics.generation_ended(self.req.kind, ended)

    async def _next(self, timeout: float | None = None) -> object:
        """The next event (_QUIET when none comes within `timeout`); a Failed or a
        Finished settles the outcome."""
        if not self.queue.empty() or timeout is None:
            ev = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
        else:
            try:
                ev = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                return _QUIET
        if isinstance(ev, Failed):
            self.outcome = str(ev.status)
        elif isinstance(ev, Finished):
            self.outcome = "ok"
        return ev

    async def complete(self) -> Response:
        try:
            while True:
                ev = await self._next()
                if ev is _GONE:
                    return Response(status_code=499)  # nobody is listening
                if isinstance(ev, Text):
                    self.reply.add(ev.text, ev.logprobs)
                elif isinstance(ev, Failed):
                    return _error(ApiError(ev.status, ev.message, type="server_error"))
                elif isinstance(ev, Finished):
                    body = self.reply.body(ev.text, ev.stats)
                    self.api.log_generation(self.req, self.job, ev.stats, self.prompt_text, self.reply.text)
                    return JSONResponse(body)
        finally:
            self.done()

    async def stream(self) -> AsyncIterator[str]:
        try:
            for ch in self.reply.opening():
                yield _sse(ch)
            keep_alive = self.api.settings.sse_keepalive_s
            while True:
                ev = await self._next(keep_alive if keep_alive > 0 else None)
                if ev is _QUIET:
                    yield KEEP_ALIVE
                    continue
                if ev is _GONE:
                    return
                if isinstance(ev, Text):
                    for ch in self.reply.piece(ev.text, ev.logprobs):
                        yield _sse(ch)
                elif isinstance(ev, Failed):
                    yield _sse(ApiError(ev.status, ev.message, type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(ev, Finished):
                    closing = list(self.reply.closing(ev.text, ev.stats))
                    self.api.log_generation(self.req, self.job, ev.stats, self.prompt_text, self.reply.text)
                    for ch in closing:
                        yield _sse(ch)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            self.done()


class _EventStream(StreamingResponse):
    """The SSE response of a call. Its event generator is closed as the response ends,
    however it ends (the client gone mid-write, the task cancelled at shutdown), so the
    call is settled then, not whenever the suspended generator is garbage-collected
    (and a generator that never started would never run its `finally`)."""

    def __init__(self, call: _Call) -> None:
        self.events = call.stream()
        super().__init__(self.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # runs the generator's finally if it started
            self.call.done()


def model_id_for(path: str | Path, alias: str | None = None) -> str:
    """The id /v1/models reports: the alias, else the GGUF file's stem."""
    return alias or Path(path).stem
