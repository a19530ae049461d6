"""Admission: who gets in, and what a request may ask for, before it takes a slot.

- auth: `--api-key` as a Bearer token (401 without it; compared in constant time)
- body: at most --max-body-bytes, by Content-Length or counted while reading (413)
- limits: at most --max-messages messages; max_tokens within --max-tokens-limit and,
  with the prompt, within a slot's context (400 context_length_exceeded, in OpenAI's
  words, as OpenAI and vLLM do rather than cutting the reply short)
- busy: a full wait queue is a 429, a draining or stopped server a 503, both with
  Retry-After (the official OpenAI clients wait that long before retrying)
- preparing: the work before a request can queue (body parse, validation, schema
  conversion, chat template, tokenizing) runs on a small pool off the event loop, and
  requests being prepared count against the wait queue (Preparation)
- drain: on SIGTERM the server stops admitting, gives admitted requests a grace period,
  then fails what is left with a 503, so every client gets an answer before exit
"""

from __future__ import annotations

import asyncio
import hmac
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request

from localspec.serve.defaults import MAX_MESSAGES  # noqa: F401  (re-exported: app's default)
from localspec.serve.jobs import Job, QueueFull, Unavailable
from localspec.serve.protocol import ApiError, bad_request

if TYPE_CHECKING:
    from localspec.serve.app import ServeSettings
    from localspec.serve.metrics import Metrics
    from localspec.serve.scheduler import Scheduler

PREPARE_WORKERS = 2
T = TypeVar("T")


class Refused(ApiError):
    """An error that carries response headers (Retry-After)."""

    def __init__(self, status: int, message: str, *, retry_after: int, **kw: str) -> None:
        super().__init__(status, message, **kw)
        self.headers = {"Retry-After": str(retry_after)}


def api_keys(setting: str | None) -> list[str]:
    """The keys of --api-key: one, or several separated by commas (as llama-server)."""
    return [k.strip() for k in (setting or "").split(",") if k.strip()]


def check_auth(request: Request, key: str | None) -> int | None:
    """401 unless the request carries `Authorization: Bearer <key>` (when keys are set);
    which of the keys it carried (its index), None when no key is set. Every key is
    compared, in constant time each, so the time taken does not say which matched."""
    keys = api_keys(key)
    if not keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header "
                            "using Bearer auth (Authorization: Bearer YOUR_KEY).")
    given = token.strip().encode()
    matched = [i for i, k in enumerate(keys) if hmac.compare_digest(given, k.encode())]
    if not matched:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return matched[0]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes (a declared
    Content-Length is refused before reading; a chunked body is counted as it comes)."""
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


def check_messages(n: int, limit: int) -> None:
    if n > limit:
        raise bad_request(f"Invalid 'messages': array too long. Expected an array with maximum length "
                          f"{limit}, but got an array with length {n} instead.",
                          "messages", "array_above_max_length")


def max_tokens(asked: int | None, n_prompt: int, n_ctx: int, kind: str, settings: ServeSettings) -> int:
    """The request's token budget. Asked for: it must be within --max-tokens-limit and
    fit the slot's context after the prompt. Not asked: the server's default, and the
    reply ends where the context does (finish_reason "length")."""
    limit = settings.max_tokens_limit
    if asked is None:
        n = settings.default_max_tokens
        return min(n, limit) if n > 0 else limit
    if asked > limit:
        shown = asked if asked < 10**12 else "too large"
        raise bad_request(f"'max_tokens' is {shown}; this server allows at most {limit}.",
                          "max_tokens", "invalid_value")
    if n_prompt + asked > n_ctx:
        where = "messages" if kind == "chat" else "prompt"
        raise bad_request(
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + asked} tokens ({n_prompt} in the {where}, {asked} in the completion). "
            f"Please reduce the length of the {where} or completion.", where, "context_length_exceeded")
    return asked


def queue_full(detail: str, snapshot: dict, metrics: Metrics) -> Refused:
    """429 with Retry-After: the queue's expected wait, from the mean request time so far."""
    mean = metrics.request_seconds / metrics.finished if metrics.finished else 1.0
    wait = mean * (snapshot["queued"] + 1) / max(1, snapshot["slots"])
    return Refused(429, f"The server is busy: {detail}. Retry later.", retry_after=min(60, max(1, math.ceil(wait))),
                   type="rate_limit_error", code="queue_full")


def unavailable(detail: str) -> Refused:
    return Refused(503, f"The server is unavailable: {detail}.", retry_after=5, type="server_error",
                   code="server_shutting_down" if "shutting down" in detail else "server_unavailable")


def submit(scheduler: Scheduler, job: Job, metrics: Metrics) -> None:
    """Queue `job`: a full queue is a 429 with Retry-After, a stopping scheduler a 503."""
    try:
        scheduler.submit(job)
    except QueueFull as exc:
        raise queue_full(str(exc), scheduler.snapshot(), metrics) from None
    except Unavailable as exc:
        raise unavailable(str(exc)) from None


class Drain:
    """Graceful shutdown: `begin()` (from the SIGTERM handler) stops admitting at once;
    after `grace_s` the scheduler stops and fails whatever still runs or waits with a 503."""

    def __init__(self, scheduler: Scheduler, grace_s: float) -> None:
        self.scheduler = scheduler
        self.grace_s = grace_s
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        if self._timer is not None:
            return
        self.scheduler.drain()
        self._timer = threading.Timer(self.grace_s, self.scheduler.stop)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Preparation:
    """A request's work before it can queue, on PREPARE_WORKERS threads: the event loop
    only reads bodies and streams replies, so one heavy request cannot stall /health or
    other clients. A request being prepared holds a place in the wait queue: when the
    queue has no room for it, it is a 429 before any of that work is done."""

    def __init__(self, workers: int = PREPARE_WORKERS) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="localspec-prepare")
        self.running = 0  # read and written on the event loop only

    async def run(self, scheduler: Scheduler, metrics: Metrics, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the pool, once the queue has room for one more request."""
        if self.running >= scheduler.room():
            snap = scheduler.snapshot()
            raise queue_full(f"{snap['active']} of {snap['slots']} slots are busy, {snap['queued']} requests are "
                             f"queued and {self.running} are being prepared", snap, metrics)
        self.running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.running -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
