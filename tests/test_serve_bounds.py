"""No request takes `localspec serve` down (issue 27.1): the real server in a subprocess
(a regression that crashes it fails these tests, not the test worker), a neighbour
stream running beside the bad requests.

- schemas that crashed llama.cpp's parser or hung its checks, schemas past the bounds,
  20,000 tools, 130,000 messages, a prediction longer than a slot: a 400 each, the server
  alive, /health fine, the neighbour's text what it is alone, every slot idle after;
- hypothesis-generated schemas (deep, wide, huge bounds, odd patterns), tool arrays,
  predictions and stop lists: a 200 or a 4xx error object, never a 500 or a crash;
- in-process: the work before admission runs on the preparation pool, not the event
  loop, and checking tool names is linear in their number.
"""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grammar_limits import ISSUE_SCHEMAS
from test_serve import start_server, stop_server
from test_serve_faults import CHAT, _refused

from localspec.serve import protocol

TINY = [{"role": "user", "content": "a"}]  # 130,000 of them fit the 4 MiB body limit
NEIGHBOUR = {"model": "m", "messages": [{"role": "user", "content": "Count from one to forty in words."}],
             "max_tokens": 160, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def served(smol_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("bounds-home")
    proc, base = start_server(smol_path, home, "--parallel", "2", "-c", "1024", "--no-log")
    yield proc, base
    stop_server(proc)


def _stream(base: str, body: dict, out: list) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300, trust_env=False) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    out.append(json.loads(line[6:]))
    t = threading.Thread(target=run)
    t.start()
    return t


def _text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def _post(base: str, body: dict | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return httpx.post(f"{base}/v1/chat/completions", content=raw, timeout=300, trust_env=False,
                      headers={"Content-Type": "application/json"})


def _idle(base: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        h = httpx.get(f"{base}/health", timeout=30, trust_env=False).json()
        if h["status"] == "ok" and h["active"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def _schema(schema: dict) -> dict:
    return {"model": "m", "messages": CHAT, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
            for i in range(n)]


BAD = {
    **{f"schema: {k}": (_schema(s), "response_format") for k, (s, _) in ISSUE_SCHEMAS.items()},
    "20,000 tools": ({"model": "m", "messages": CHAT, "max_tokens": 4, "tools": _tools(20_000)}, None),
    "130,000 messages": ({"model": "m", "messages": TINY * 130_000, "max_tokens": 4}, "messages"),
    "a prediction longer than a slot": ({"model": "m", "messages": CHAT, "max_tokens": 4,
                                         "prediction": {"type": "content", "content": "word " * 50_000}},
                                        "prediction"),
}


def test_bad_requests_beside_a_neighbour_stream(served):
    proc, base = served
    alone: list = []
    _stream(base, NEIGHBOUR, alone).join()
    beside: list = []
    t = _stream(base, NEIGHBOUR, beside)
    while not beside:
        time.sleep(0.01)
    for name, (body, param) in BAD.items():
        err = _refused(_post(base, body), (400,))
        assert param is None or err["param"] == param, (name, err)
        assert proc.poll() is None, name
        assert httpx.get(f"{base}/health", timeout=30, trust_env=False).json()["status"] == "ok", name
    assert t.is_alive()  # the bad requests went in while it streamed
    t.join()
    assert _text(beside) == _text(alone) and len(_text(alone)) > 100
    _idle(base)


def test_messages_are_counted_before_they_are_validated(served):
    """130,000 messages are a 400 for their number, not after validating each one (the
    one with a bad role is never looked at)."""
    _, base = served
    messages = TINY * 130_000
    messages[5] = {"role": "bogus", "content": "x"}
    err = _refused(_post(base, {"model": "m", "messages": messages}), (400,))
    assert err["code"] == "array_above_max_length", err


# ----- fuzzing: schemas, grammars through schemas, tools, predictions, stop lists ------

_name = st.text("abcxyz_", min_size=1, max_size=6)
_bound = st.one_of(st.integers(0, 50), st.integers(900, 1100), st.integers(10**6, 10**12), st.floats(0, 1e300))
_pattern = st.one_of(
    st.lists(st.sampled_from(["a", "b", "[a-z]", ".", "(", ")", "|", "*", "+", "?", "{2}", "{0,5}", "{3,1}",
                              "{0,20000}", "{1,}", "\\d", "\\", "[", "]", "{", "}", "^", "$"]), max_size=12)
    .map(lambda p: "^" + "".join(p) + "$"),
    st.integers(0, 300).map(lambda n: "^" + "(" * n + "a" + ")" * n + "$"),
)
_leaf_schema = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object", "array")]),
    st.builds(lambda k, v: {"type": "string", k: v}, st.sampled_from(["minLength", "maxLength"]), _bound),
    st.builds(lambda p: {"type": "string", "pattern": p}, _pattern),
    st.lists(st.text(max_size=5), min_size=1, max_size=5).map(lambda vs: {"enum": vs}),
)


def _compound(kids):
    return st.one_of(
        st.builds(lambda i, k, v: {"type": "array", "items": i, k: v}, kids,
                  st.sampled_from(["minItems", "maxItems"]), _bound),
        st.dictionaries(_name, kids, max_size=4).map(lambda p: {"type": "object", "properties": p}),
        st.lists(kids, min_size=1, max_size=4).map(lambda a: {"anyOf": a}),
    )


_schemas = st.one_of(
    st.recursive(_leaf_schema, _compound, max_leaves=10),
    st.integers(1, 300).map(lambda n: _nest(n)),
    st.integers(100, 300).map(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                         for i in range(n)}}),
)


def _nest(n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "array", "items": s}
    return s


@st.composite
def fuzzed(draw) -> dict:
    body: dict = {"model": "m", "messages": CHAT, "max_tokens": draw(st.integers(1, 4))}
    for part in draw(st.lists(st.sampled_from(["schema", "tools", "prediction", "stop"]), min_size=1, max_size=2,
                              unique=True)):
        if part == "schema":
            body.update(_schema(draw(_schemas)))
        elif part == "tools":
            names = draw(st.lists(st.sampled_from(["a", "b", "c", "x" * 65, "bad name", ""]), max_size=6))
            n = draw(st.sampled_from([0, 0, 3000]))
            body["tools"] = [{"type": "function", "function": {"name": x}} for x in names] + _tools(n)
        elif part == "prediction":
            body["prediction"] = {"type": "content", "content": draw(st.sampled_from(
                ["", "hi", "word " * 2000, "\x00" * 10, "<|im_end|>" * 20]))}
        else:
            body["stop"] = draw(st.one_of(st.text(max_size=8), st.lists(st.sampled_from(
                ["", "a", "\n", "x" * 5000, "<|im_end|>"]), max_size=6)))
    return body


def test_fuzzed_schemas_tools_predictions_and_stops(served):
    proc, base = served
    beside: list = []
    t = _stream(base, NEIGHBOUR, beside)
    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fuzzed())
    def one(body: dict) -> None:
        r = _post(base, body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code != 200:
            _refused(r, (400,))
        assert proc.poll() is None

    one()
    t.join()
    alone: list = []
    _stream(base, NEIGHBOUR, alone).join()
    assert _text(beside) == _text(alone)
    print("fuzz statuses:", seen)
    assert seen.get(400, 0) > 10 and seen.get(200, 0) > 5
    _idle(base)


# ----- in-process: where the work runs, and how it grows -----------------------------


def test_checking_tool_names_is_linear():
    def timed(n: int) -> float:
        body = {"model": "m", "messages": CHAT, "tools": _tools(n)}
        best = float("inf")
        gc.disable()  # full collections over many objects would make any work look superlinear
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                protocol.parse_chat(body)
                best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
        return best

    small, large = timed(2000), timed(20_000)
    assert large < 40 * small, (small, large)  # 10x the tools: ~10x the time (quadratic: ~100x)


def test_requests_are_prepared_off_the_event_loop(smol_path, monkeypatch):
    from test_serve_concurrency import Server

    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    where: list[str] = []
    parse_chat = protocol.parse_chat

    def spy(body: dict):
        where.append(threading.current_thread().name)
        return parse_chat(body)

    monkeypatch.setattr(protocol, "parse_chat", spy)
    m = Model(ModelConfig(path=smol_path, n_ctx=512, n_seq_max=1, n_threads=1))
    try:
        with Server(m, n_slots=1) as server:
            r = httpx.post(f"{server.base}/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 2},
                           timeout=120, trust_env=False)
            assert r.status_code == 200
    finally:
        m.close()
    assert where and all(w.startswith("localspec-prepare") for w in where), where
