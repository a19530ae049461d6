"""What the HTTP side hands the scheduler (Job) and what a job's sink receives (Text,
Finished, Failed); QueueFull and Unavailable, what submit() raises (HTTP 429, 503);
Outbox, how the events reach the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from localspec.core.config import GenerationConfig, SamplingConfig
from localspec.core.events import GenerationStats, TokenLogprob


@dataclass(frozen=True)
class Text:
    """New text for the client (may span several accepted tokens), and those tokens'
    logprobs when the request asked for them (GenerationConfig.logprobs)."""

    text: str
    n_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    stats: GenerationStats
    text: str  # held-back text released at the end


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500


class QueueFull(Exception):
    """Every slot is busy and the wait queue is full (HTTP 429)."""


class Unavailable(Exception):
    """The scheduler is stopping or has died (HTTP 503)."""


@dataclass
class Job:
    prompt: list[int]
    sampling: SamplingConfig
    gen: GenerationConfig
    sink: Callable[[object], None]  # called from the scheduler thread
    extra: list[int] = field(default_factory=list)  # a second n-gram source (predicted output)
    memory: object | None = None  # the caller's Memory (drafters/memory.py): drafted from, added to
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    slot: int = -1  # the KV sequence the scheduler gave it (llama.cpp's id_slot)
    task: int = -1  # the scheduler's running number for it (llama.cpp's id_task)

    def cancel(self) -> None:
        """Thread-safe: the scheduler frees the job's slot at its next step."""
        self.cancelled.set()

    def emit(self, event: object) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - the receiver is gone (event loop closed): stop generating
            self.cancel()


def _gil_held_write() -> Callable[[int, bytes, int], int] | None:
    """libc's write(2) called with the GIL held (ctypes.PyDLL), where there is one."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):
        return None
    write.argtypes, write.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t
    return write


_WRITE = _gil_held_write()


class Outbox:
    """Events from the scheduler thread to one event loop, with one wake-up for all that
    arrive together: the first event posted since the loop last drained writes a byte to
    a pipe the loop watches; the ones after it (the other requests' tokens of the same
    step) only queue. `post(fn, *args)` is call_soon_threadsafe's shape.

    The byte is written with the GIL held. os.write (and call_soon_threadsafe's socket
    send) releases the GIL around the system call, the loop thread wakes inside that
    window and takes it, and the scheduler thread then waits for the loop's whole turn
    before it can start the next decode (with the scheduler's flush just before each
    decode, docs/measurements.md). Written with the GIL held, the loop runs its turn
    while the next llama_decode runs (which releases the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[Callable[..., object], tuple]] = deque()
        self.armed = False  # a byte is written and not drained yet
        self._r = self._w = -1
        r = w = -1
        try:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            loop.add_reader(r, self._drain)
        except (NotImplementedError, OSError, AttributeError):  # a loop without add_reader
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
            return
        self._r, self._w = r, w

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Thread-safe: run fn(*args) on the loop, in the order posted."""
        if self._w < 0:
            self.loop.call_soon_threadsafe(fn, *args)
            return
        self.items.append((fn, args))
        if not self.armed:
            self.armed = True
            try:
                if _WRITE is not None:
                    _WRITE(self._w, b"\0", 1)
                else:
                    os.write(self._w, b"\0")
            except OSError:  # the pipe is full: the loop has a byte to wake on already
                pass

    def _drain(self) -> None:
        self.armed = False  # first: an event posted from here on writes a new byte
        try:
            os.read(self._r, 4096)
        except OSError:
            pass
        while self.items:
            fn, args = self.items.popleft()
            fn(*args)

    def close(self) -> None:
        """On the loop, once the scheduler thread has stopped: what is still queued runs."""
        if self._r < 0:
            return
        self.loop.remove_reader(self._r)
        r, w, self._r, self._w = self._r, self._w, -1, -1
        os.close(r)
        os.close(w)
        while self.items:
            fn, args = self.items.popleft()
            fn(*args)


def loop_sink(call_soon_threadsafe: Callable[..., object], put: Callable[[object], None],
              whole: bool) -> Callable[[object], None]:
    """A job's sink that hands its events to an event loop (`call_soon_threadsafe` of the
    loop or an Outbox's post, `put` of the request's queue). A streamed reply hands over
    each event; a reply sent `whole` keeps its Texts on the scheduler's side and hands
    them over once, at its Finished or Failed, all of them in order: on 2 cores each
    wake-up is CPU taken from llama.cpp's threads."""
    if not whole:
        return lambda ev: call_soon_threadsafe(put, ev)
    held: list[Text] = []

    def put_all(events: list[object]) -> None:
        for ev in events:
            put(ev)

    def sink(ev: object) -> None:
        if isinstance(ev, Text):
            held.append(ev)
            return
        events = [*held, ev]
        held.clear()
        call_soon_threadsafe(put_all, events)

    return sink
