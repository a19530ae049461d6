"""The serve soak's load and its checks: many clients at once, a third of them walking
away (cut off at a random moment, closed after k chunks, half a body, never read), then
proof that nothing was lost: no 5xx, each completed reply the text the same request gets
alone, every slot free with no KV cells, /metrics balanced. scripts/soak_serve.py runs it
against a server (its own or --url), tests/test_serve_soak.py in-process. Needs httpx
(the `test` extra).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

REPEAT = "alpha beta gamma delta epsilon " * 6  # the n-gram drafter finds spans to copy
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
PROMPTS = [
    "List the days of the week, one per line.",
    "Write a Python function that reverses a string.",
    f"Repeat this exactly: {REPEAT}",
    "Name three colours of the rainbow.",
]
POEM = "Roses are red,\nViolets are blue,\nSugar is sweet,\nAnd so are you."


@dataclass(frozen=True)
class Spec:
    """One distinct request (its greedy text is fixed); streaming does not change it."""

    kind: str  # chat | completion
    prompt: str
    max_tokens: int
    prediction: str | None = None
    ignore_eos: bool = True

    def body(self, stream: bool) -> dict:
        b: dict = {"model": "m", "max_tokens": self.max_tokens, "temperature": 0, "stream": stream,
                   "ignore_eos": self.ignore_eos}
        if stream:
            b["stream_options"] = {"include_usage": True}
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
            if self.prediction:
                b["prediction"] = {"type": "content", "content": self.prediction}
        else:
            b["prompt"] = self.prompt
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def specs(max_tokens: int) -> list[Spec]:
    out = [Spec("chat", p, max_tokens) for p in PROMPTS]
    out += [Spec("completion", CODE, max_tokens), Spec("completion", REPEAT, max_tokens),
            Spec("completion", "The capital of France is", max_tokens, ignore_eos=False)]
    out += [Spec("chat", f"Repeat this poem:\n{POEM}", max_tokens, prediction=POEM),
            Spec("chat", f"Repeat this exactly: {REPEAT}", max_tokens, prediction=REPEAT)]
    return out


FAULTS = ("cut", "after_chunks", "half_body", "no_read")


@dataclass
class Result:
    spec: Spec
    stream: bool
    fault: str | None
    status: int | None = None  # None: the client left before a status came
    text: str | None = None
    tokens: int = 0
    error: str | None = None


# ----- one request -----------------------------------------------------------------


async def _send(http: httpx.AsyncClient, spec: Spec, stream: bool, res: Result, max_chunks: int | None) -> None:
    """Send the request; read a reply (streamed pieces joined), or only max_chunks pieces."""
    if not stream:
        r = await http.post(spec.path, json=spec.body(False))
        res.status = r.status_code
        body = r.json()
        if r.status_code == 200:
            choice = body["choices"][0]
            res.text = choice["message"]["content"] if spec.kind == "chat" else choice["text"]
            res.tokens = body["usage"]["completion_tokens"]
        else:
            res.error = body["error"]["message"]
        return
    async with http.stream("POST", spec.path, json=spec.body(True)) as r:
        res.status = r.status_code
        parts, n = [], 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                res.error = obj["error"]["message"]
                return
            if obj.get("usage"):
                res.tokens = obj["usage"]["completion_tokens"]
            for ch in obj["choices"]:
                parts.append((ch["delta"].get("content") if spec.kind == "chat" else ch["text"]) or "")
            n += 1
            if max_chunks is not None and n >= max_chunks:
                return  # leaving the block closes the connection mid-stream
        res.text = "".join(parts)


async def _raw(base: str, spec: Spec, stream: bool, half: bool, key: str | None) -> None:
    """A request on a bare socket: half a body then close, or all of it and never read."""
    u = urlsplit(base)
    _reader, writer = await asyncio.open_connection(u.hostname, u.port)
    body = json.dumps(spec.body(stream)).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST {spec.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + (body[: len(body) // 2] if half else body))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    await writer.wait_closed()


async def one(http: httpx.AsyncClient, base: str, key: str | None, spec: Spec, stream: bool,
              fault: str | None, rng: random.Random) -> Result:
    res = Result(spec, stream, fault)
    if fault in ("half_body", "no_read"):
        await _raw(base, spec, stream, fault == "half_body", key)
        return res
    chunks = rng.randint(1, max(1, spec.max_tokens // 2)) if fault == "after_chunks" else None
    task = asyncio.ensure_future(_send(http, spec, stream, res, chunks))
    if fault == "cut":
        await asyncio.wait([task], timeout=rng.uniform(0.0, 1.5))
        task.cancel()  # httpx closes the connection, wherever the request was
        await asyncio.gather(task, return_exceptions=True)
    else:
        await task
    return res


# ----- the load ---------------------------------------------------------------------


@dataclass
class Load:
    base: str
    key: str | None = None
    clients: int = 16
    requests: int = 4  # per client (ignored when duration is set)
    duration: float | None = None
    max_tokens: int = 24
    seed: int = 0
    fault_share: float = 1 / 3
    results: list[Result] = field(default_factory=list)
    alone: dict = field(default_factory=dict)  # each request's greedy text with nothing else running


def _http(load: Load) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {load.key}"} if load.key else {}
    return httpx.AsyncClient(base_url=load.base, headers=headers, timeout=300, trust_env=False, verify=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def _client(load: Load, i: int, pool: list[Spec], t_end: float | None) -> None:
    rng = random.Random(load.seed * 1000 + i)
    async with _http(load) as http:
        n = 0
        while (time.monotonic() < t_end) if t_end else n < load.requests:
            spec = rng.choice(pool)
            fault = rng.choice(FAULTS) if rng.random() < load.fault_share else None
            stream = fault == "after_chunks" or rng.random() < 0.5
            try:
                load.results.append(await one(http, load.base, load.key, spec, stream, fault, rng))
            except httpx.HTTPError as exc:
                load.results.append(Result(spec, stream, fault, error=f"{type(exc).__name__}: {exc}"))
            n += 1


async def alone(load: Load, pool: list[Spec]) -> dict[Spec, str]:
    """Each request's greedy text with nothing else running."""
    out = {}
    async with _http(load) as http:
        for spec in pool:
            res = Result(spec, False, None)
            await _send(http, spec, False, res, None)
            assert res.status == 200, f"{spec}: {res.status} {res.error}"
            out[spec] = res.text
    return out


async def soak(load: Load, pool: list[Spec], n_slots: int) -> float:
    """Run every client to the end, then one last wave that fills every slot with a
    stream its client leaves after two chunks (so the last user of each slot is one
    that left: its cells must go too); returns the wall time."""
    t0 = time.monotonic()
    t_end = t0 + load.duration if load.duration else None
    await asyncio.gather(*(_client(load, i, pool, t_end) for i in range(load.clients)))
    long = Spec("chat", PROMPTS[0], 4 * load.max_tokens)
    wave = [Result(long, True, "after_chunks") for _ in range(n_slots)]
    async with _http(load) as http:
        await asyncio.gather(*(_send(http, long, True, res, 2) for res in wave))
    load.results += wave
    return time.monotonic() - t0


# ----- the checks -------------------------------------------------------------------


def metrics(base: str, key: str | None) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=30, trust_env=False, verify=False).text
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


def wait_idle(base: str, timeout: float = 30) -> dict:
    """/health once no slot is busy and nothing waits (cancelled work is dropped at the
    scheduler's next step); the last answer if that never happens."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{base}/health", timeout=30, trust_env=False, verify=False).json()
        idle = h["active"] == 0 and h["queued"] == 0 and not any(h.get("kv_tokens", []))
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


def _delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def check(results: list[Result], texts: dict[Spec, str], health: dict, before: dict, after: dict) -> list[str]:
    """What went wrong, one line each (empty: the server held)."""
    problems = []
    for r in results:
        what = f"{r.spec.kind} {'stream' if r.stream else 'plain'} fault={r.fault} {r.spec.prompt[:30]!r}"
        if r.status is not None and r.status >= 500 or (r.error and r.status == 200):
            problems.append(f"{what}: server error {r.status}: {r.error}")
        elif r.fault is None and r.status != 429 and (r.status != 200 or r.text is None):
            problems.append(f"{what}: no reply ({r.status}: {r.error})")
        if r.text is not None and r.text != texts[r.spec]:
            problems.append(f"{what}: text differs from alone:\n  got   {r.text!r}\n  alone {texts[r.spec]!r}")
    if health.get("status") != "ok" or health["active"] or health["queued"]:
        problems.append(f"server not idle afterwards: {health}")
    if any(health.get("kv_tokens", [1])):
        problems.append(f"KV cells left in slots: {health.get('kv_tokens')}")
    for kind in ("chat", "completion"):
        started = _delta(after, before, "localspec_requests_started_total", endpoint=kind)
        ended = {o: _delta(after, before, "localspec_requests_ended_total", endpoint=kind, outcome=o)
                 for o in ("finished", "cancelled", "failed")}
        if started != sum(ended.values()) or ended["failed"]:
            problems.append(f"/metrics for {kind}: started {started:g} != ended {ended}")
        done = sum(1 for r in results if r.text is not None and r.spec.kind == kind)
        if ended["finished"] < done:
            problems.append(f"/metrics for {kind}: {ended['finished']:g} finished < {done} completed")
    return problems


def summary(load: Load, wall: float, alone_s: float, before: dict, after: dict, alone_tokens: float) -> dict:
    tokens = _delta(after, before, "localspec_generation_tokens_total")
    faults = {f: sum(1 for r in load.results if r.fault == f) for f in FAULTS}
    return {"clients": load.clients, "requests": len(load.results),
            "completed": sum(1 for r in load.results if r.text is not None),
            "refused_busy": sum(1 for r in load.results if r.status == 429), "faults": faults,
            "tokens": int(tokens), "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 1),
            "alone_tok_s": round(alone_tokens / alone_s, 1) if alone_s else None}


def run(load: Load) -> tuple[dict, list[str]]:
    """Alone texts, then the load, then the checks: (summary, problems)."""
    pool = specs(load.max_tokens)
    m0 = metrics(load.base, load.key)
    t0 = time.monotonic()
    texts = load.alone = asyncio.run(alone(load, pool))
    alone_s = time.monotonic() - t0
    m1 = metrics(load.base, load.key)
    n_slots = httpx.get(f"{load.base}/health", timeout=30, trust_env=False, verify=False).json()["slots"]
    wall = asyncio.run(soak(load, pool, n_slots))
    health = wait_idle(load.base)
    m2 = metrics(load.base, load.key)
    problems = check(load.results, texts, health, m1, m2)
    alone_tokens = _delta(m1, m0, "localspec_generation_tokens_total")
    return summary(load, wall, alone_s, m1, m2, alone_tokens), problems
