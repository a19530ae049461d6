"""Continuous batching under concurrent clients, in-process: uvicorn in a thread on a
free loopback port, the real SmolLM2 GGUF, the official `openai` client.

- 8 concurrent greedy streams get exactly the text each gets alone, and all of them
  stream at once (none waits for another to finish);
- more clients than slots queue and all complete; past the queue: 429;
- a client that disconnects mid-stream frees its slot;
- a request that fails (in its drafter, or in the batched decode) fails alone;
- a request runs the engine's own round: the same tokens, rounds and stats as generate().
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from localspec.bench.workers import free_port

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from localspec.core.backend import Model
from localspec.core.config import (
    GenerationConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.drafters import NgramDrafter
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.engine import collect, generate
from localspec.core.errors import BackendError
from localspec.serve.app import ServeSettings, create_app
from localspec.serve.connections import ConnectionLimits, uvicorn_config
from localspec.serve.jobs import Failed, Finished, Job, Text
from localspec.serve.scheduler import Scheduler, SchedulerConfig

MAX_SLOTS = 8
PROMPTS = [
    "Count from one to ten in words.",
    "Write a Python function that reverses a string.",
    "Name three colours of the rainbow.",
    "What is the capital of France? Answer briefly.",
    "Write a haiku about the sea.",
    "List four farm animals, comma separated.",
    "Explain what a list is in Python in one sentence.",
    "Give a JSON object with keys a and b set to 1 and 2.",
]


SLOTS = MAX_SLOTS  # the sequences of the `model` fixture (conftest)
SLOT_CTX = 512  # cells per sequence of the `model` fixture (conftest)


class Server:
    """The app on uvicorn in a background thread (no signal handlers off the main thread),
    with a draft model for its slots when given one (test_serve_draft.py)."""

    client_timeout = 120  # seconds a request may take
    idle_timeout = 15  # seconds wait_idle() waits for every slot to be free

    def __init__(self, model: Model, drafter_factory=None, settings: ServeSettings | None = None,
                 draft: Model | None = None, limits: ConnectionLimits = ConnectionLimits(), **cfg) -> None:
        spec = cfg.pop("spec", SpecConfig(mode="ngram", draft_max=8))
        self.scheduler = Scheduler(model, SchedulerConfig(spec=spec, **cfg), drafter_factory=drafter_factory,
                                   draft=draft)
        settings = settings or ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=512)
        app = self.app = create_app(self.scheduler, model, settings)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # the connection limits `localspec serve` runs with (serve/connections.py)
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, limits,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self) -> openai.OpenAI:
        t = self.client_timeout
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=t,
                             http_client=httpx.Client(trust_env=False, verify=False, timeout=t))

    def async_client(self) -> openai.AsyncOpenAI:
        t = self.client_timeout
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=t,
                                  http_client=httpx.AsyncClient(trust_env=False, verify=False, timeout=t))

    def health(self) -> dict:
        return httpx.get(f"{self.base}/health", trust_env=False, verify=False).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", trust_env=False, verify=False).text

    def wait_idle(self, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (self.idle_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            h = self.health()
            if h["active"] == 0 and h["queued"] == 0:
                return h
            time.sleep(0.05)
        raise AssertionError(f"slots still busy: {self.health()}")


# A short system message: without one SmolLM2's template puts its own (17 tokens) in
# every prompt, a third of these prompts' prefill (~120 tok/s on one thread here)
SYSTEM = {"role": "system", "content": "Be brief."}


def _messages(p: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": p}]


async def _stream(client: openai.AsyncOpenAI, prompt: str, n: int, t0: float, **extra) -> dict:
    """One streaming chat request: its text and when its first and last piece came."""
    stream = await client.chat.completions.create(model="smol", messages=_messages(prompt), max_tokens=n,
                                                  temperature=0, stream=True, extra_body=extra or None)
    parts, first = [], None
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.monotonic() - t0
            parts.append(ch.choices[0].delta.content)
    return {"text": "".join(parts), "first": first, "last": time.monotonic() - t0}


async def _together(server: Server, prompts: list[str], n: int, **extra) -> list[dict]:
    client = server.async_client()
    t0 = time.monotonic()
    try:
        return await asyncio.gather(*(_stream(client, p, n, t0, **extra) for p in prompts))
    finally:
        await client.close()


def _alone(server: Server, prompts: list[str], n: int, **extra) -> list[str]:
    c = server.client()
    return [c.chat.completions.create(model="smol", messages=_messages(p), max_tokens=n, temperature=0,
                                      extra_body=extra or None).choices[0].message.content for p in prompts]


def test_eight_concurrent_streams_match_their_solo_text(model):
    n = 12
    # 8 slots; speculation on alone, off while more than 4 are active
    with Server(model, n_slots=8, spec_disable_by_batch_size=4) as server:
        # ignore_eos: every reply is n tokens long, so the 8 streams overlap for n steps
        solo = _alone(server, PROMPTS, n, ignore_eos=True)
        results = asyncio.run(_together(server, PROMPTS, n, ignore_eos=True))
        for prompt, alone, got in zip(PROMPTS, solo, results):
            assert got["text"] == alone, prompt
        # none starves: every stream had its first token before any stream ended, and
        # the server decoded all eight in one batch
        assert max(r["first"] for r in results) < min(r["last"] for r in results)
        snap = server.wait_idle()
        assert snap["speculation"] is True  # back on once load dropped
        metrics = httpx.get(f"{server.base}/metrics", trust_env=False, verify=False).text
        assert 'localspec_decode_steps_total{batch="8",speculation="off"}' in metrics
        assert "localspec_speculation_toggles_total 0" not in metrics


def test_more_clients_than_slots_queue_and_all_complete(model):
    n = 8
    prompts = PROMPTS[:4]  # twice the slots
    with Server(model, n_slots=2, queue_size=8, spec_disable_by_batch_size=-1) as server:
        solo = _alone(server, prompts, n)
        results = asyncio.run(_together(server, prompts, n))
        assert [r["text"] for r in results] == solo
        server.wait_idle()


def _hold_slot(server: Server, max_tokens: int = 400):
    """Open a long stream and read its first piece; returns (client, response, lines).
    Keep `lines` referenced: dropping a half-read iterator closes the connection."""
    h = httpx.Client(base_url=server.base, timeout=60, trust_env=False, verify=False)
    body = {"model": "smol", "messages": _messages("Tell me a long story."), "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    r = h.send(h.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: {") and '"content": ""' not in line:
            break
    return h, r, lines


def test_disconnecting_client_frees_its_slot(model):
    with Server(model, n_slots=1, queue_size=2, spec_disable_by_batch_size=-1) as server:
        h, r, _lines = _hold_slot(server)
        time.sleep(0.3)
        assert server.health()["active"] == 1
        r.close()
        h.close()  # the client goes away mid-stream
        server.wait_idle(timeout=10)
        out = server.client().chat.completions.create(model="smol", messages=_messages("Hi"), max_tokens=4)
        assert out.usage.completion_tokens >= 1
        metrics = httpx.get(f"{server.base}/metrics", trust_env=False, verify=False).text
        assert 'localspec_requests_total{endpoint="chat",outcome="cancelled"} 1' in metrics


def test_non_streaming_disconnect_also_frees_the_slot(model):
    with Server(model, n_slots=1, spec_disable_by_batch_size=-1) as server:
        body = {"model": "smol", "messages": _messages("Tell me a long story."), "max_tokens": 400,
                "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=1.5, trust_env=False, verify=False)
        server.wait_idle(timeout=10)


def test_queue_full_gives_429_then_recovers(model):
    with Server(model, n_slots=1, queue_size=1, spec_disable_by_batch_size=-1) as server:
        held = [_hold_slot(server)]  # holds the slot
        h2 = httpx.Client(base_url=server.base, timeout=60, trust_env=False, verify=False)
        body = {"model": "smol", "messages": _messages("Hello"), "max_tokens": 4, "stream": True}
        queued = h2.send(h2.build_request("POST", "/v1/chat/completions", json=body), stream=True)
        deadline = time.monotonic() + 10
        while server.health()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError):
            server.client().chat.completions.create(model="smol", messages=_messages("x"), max_tokens=2)
        for h, r, _ in held:
            r.close()
            h.close()
        text = "".join(line for line in queued.iter_lines())
        assert "[DONE]" in text  # the queued request ran once the slot was free
        queued.close()
        h2.close()
        server.wait_idle()


# ----- one failing request does not take the others down ------------------------------

BOOM = "Please explode now."


class _BoomDrafter(NgramDrafter):
    """Raises while drafting for prompts that carry the BOOM marker tokens."""

    def __init__(self, marker: list[int]) -> None:
        super().__init__(1, 4)
        self.marker = marker
        self.armed = False

    def begin(self, prompt) -> None:
        super().begin(prompt)
        m = self.marker
        self.armed = any(list(prompt[i:i + len(m)]) == m for i in range(len(prompt) - len(m) + 1))

    def draft(self, context, k):
        if self.armed:
            raise RuntimeError("drafter exploded")
        return super().draft(context, k)


def test_failing_drafter_fails_only_its_request(model):
    marker = model.tokenize(BOOM, add_special=False)[1:-1]

    def factory(spec: SpecConfig, sampling: SamplingConfig, extra: list[int]):
        return _BoomDrafter(marker)

    with Server(model, drafter_factory=factory, n_slots=4, spec_disable_by_batch_size=-1) as server:
        solo = _alone(server, PROMPTS[:3], 8)

        async def mixed():
            client = server.async_client()
            t0 = time.monotonic()
            try:
                return await asyncio.gather(*(_stream(client, p, 8, t0) for p in [*PROMPTS[:3], BOOM]),
                                            return_exceptions=True)
            finally:
                await client.close()

        *good, bad = asyncio.run(mixed())
        assert isinstance(bad, openai.APIError) and "exploded" in str(bad)
        assert [g["text"] for g in good] == solo
        with pytest.raises(openai.InternalServerError):
            server.client().chat.completions.create(model="smol", messages=_messages(BOOM), max_tokens=8)
        assert server.health()["status"] == "ok"
        assert _alone(server, PROMPTS[:1], 8) == solo[:1]
        server.wait_idle()


def test_failing_decode_is_isolated_to_its_request(model, monkeypatch):
    poison = 4242  # a token id only the bad request's prompt contains
    real = model.decode_multi

    def decode_multi(entries):
        if any(poison in toks for _, toks, _ in entries):
            raise BackendError("llama_decode failed with code -3")
        return real(entries)

    monkeypatch.setattr(model, "decode_multi", decode_multi)
    with Server(model, n_slots=4, spec_disable_by_batch_size=-1) as server:
        c = server.client()
        good_ids = model.tokenize("The quick brown fox", add_special=False)
        solo = c.completions.create(model="smol", prompt=good_ids, max_tokens=12, temperature=0).choices[0].text

        async def mixed():
            client = server.async_client()
            try:
                good = [client.completions.create(model="smol", prompt=good_ids, max_tokens=12, temperature=0)
                        for _ in range(2)]
                bad = client.completions.create(model="smol", prompt=[*good_ids, poison], max_tokens=12)
                return await asyncio.gather(*good, bad, return_exceptions=True)
            finally:
                await client.close()

        *good, bad = asyncio.run(mixed())
        assert isinstance(bad, openai.InternalServerError) and "code -3" in str(bad)
        assert [g.choices[0].text for g in good] == [solo, solo]
        assert server.health()["status"] == "ok"
        server.wait_idle()


# ----- one round for the engine and the server ------------------------------------


def test_a_request_runs_the_engines_round(model):
    # auto on its prior costs (no timing in its decisions), so both runs choose alike
    spec = SpecConfig(mode="auto", draft_max=12)
    sampling = SamplingConfig(temperature=0.0)
    gen = GenerationConfig(max_tokens=48, ignore_eos=True)

    def factory(spec: SpecConfig, sampling: SamplingConfig, extra: list[int]) -> AutoDrafter:
        return AutoDrafter(NgramDrafter(1, 4), None, None, k_max=12, learn_costs=False)

    prompt = model.tokenize("Repeat after me: red green blue, red green blue, red green blue, red")
    model.rewind(0)
    ids, text, stats = collect(generate(model, prompt, factory(spec, sampling, []), sampling=sampling,
                                        spec=spec, gen=gen))
    model.rewind(0)
    got: list[object] = []
    finished = threading.Event()

    def sink(ev: object) -> None:
        got.append(ev)
        if isinstance(ev, (Finished, Failed)):
            finished.set()

    sched = Scheduler(model, SchedulerConfig(n_slots=2, spec=spec, spec_disable_by_batch_size=-1),
                      drafter_factory=factory)
    sched.start()
    try:
        sched.submit(Job(prompt=prompt, sampling=sampling, gen=gen, sink=sink))
        assert finished.wait(120)
    finally:
        sched.stop()
    *pieces, done = got
    assert isinstance(done, Finished) and all(isinstance(p, Text) for p in pieces)
    assert "".join(p.text for p in pieces) + done.text == text
    assert sum(p.n_tokens for p in pieces) == len(ids) == done.stats.generated
    assert stats.drafted > 0 and stats.policy  # it speculated, and auto reported its choices
    for name in ("rounds", "draft_rounds", "drafted", "accepted", "drafted_by_pos", "accepted_by_pos",
                 "stop_reason", "policy", "prefill_tokens"):
        assert getattr(done.stats, name) == getattr(stats, name), name


def test_a_reply_or_failure_is_sent_once_its_slot_is_free(model):
    # a client that reads /health or /metrics right after its reply must not see its
    # request still active: the scheduler hands the last event over after the books
    marker = model.tokenize(BOOM, add_special=False)[1:-1]
    sched = Scheduler(model, SchedulerConfig(n_slots=2, spec=SpecConfig(mode="ngram", draft_max=4),
                                             spec_disable_by_batch_size=-1),
                      drafter_factory=lambda spec, sampling, extra: _BoomDrafter(marker))
    jobs: dict[str, Job] = {}
    seen: dict[str, tuple[str, bool]] = {}  # name -> (last event, still active when it came)
    ended = threading.Event()

    def sink_for(name: str):
        def sink(ev: object) -> None:  # on the scheduler thread
            if isinstance(ev, (Finished, Failed)):
                seen[name] = (type(ev).__name__, any(a.job is jobs[name] for a in sched.active))
                if len(seen) == len(jobs):
                    ended.set()
        return sink

    sched.start()
    try:
        for name, text in (("ok", PROMPTS[0]), ("boom", BOOM)):
            jobs[name] = Job(prompt=model.tokenize(text), sampling=SamplingConfig(temperature=0.0),
                             gen=GenerationConfig(max_tokens=6), sink=sink_for(name))
        for job in jobs.values():
            sched.submit(job)
        assert ended.wait(120)
    finally:
        sched.stop()
    assert seen == {"ok": ("Finished", False), "boom": ("Failed", False)}
