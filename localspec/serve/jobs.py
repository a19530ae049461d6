"""What the HTTP side hands the scheduler (Job) and what a job's sink receives (Text,
Finished, Failed); QueueFull and Unavailable, what submit() raises (HTTP 429, 503)."""

from __future__ import annotations

import threading
import time
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


def loop_sink(call_soon_threadsafe: Callable[..., object], put: Callable[[object], None],
              whole: bool) -> Callable[[object], None]:
    """A job's sink that hands its events to an event loop (`call_soon_threadsafe` of the
    loop, `put` of the request's queue). A streamed reply wakes the loop per event; a
    reply sent `whole` keeps its Texts on the scheduler's side and wakes the loop once, at
    its Finished or Failed, with all of them in order: on 2 cores each wake-up is CPU
    taken from llama.cpp's threads, once per token."""
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
