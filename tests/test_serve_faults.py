"""`serve` against bad input and faults, in the manner of llama.cpp's server tests.

In-process (uvicorn in a thread, the real SmolLM2 GGUF):
- known-bad bodies (5,000 nested brackets, a 5,000-digit integer, NaN, invalid UTF-8,
  lone surrogates, bodies over the size limit...) and hypothesis-fuzzed ones (wrong
  types, huge numbers and strings, deep nesting, mutated bytes) always get a
  400/413/422 with an OpenAI error object, never a 500; afterwards every slot is free;
- admission: per-request limits (max_tokens past the context, messages, body size,
  prompt length), the API key, and a full queue (429 + Retry-After) that clients who
  left while waiting do not keep full.
Shutdown (drain, SIGTERM, SIGKILL) is in test_serve_shutdown.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_concurrency import Server

from localspec.core.backend import Model
from localspec.serve.app import ServeSettings

KEY = "fault-key"
SLOT_CTX = 256
BODY_LIMIT = 64 * 1024
MAX_MESSAGES = 16
CHAT = [{"role": "user", "content": "Say hi."}]
PATHS = ("/v1/chat/completions", "/v1/completions")
VALID = {"/v1/chat/completions": {"model": "m", "messages": CHAT},
         "/v1/completions": {"model": "m", "prompt": "Once upon a time"}}


@pytest.fixture(scope="module")
def strict(model):
    """Small limits: replies of at most 8 tokens (4 by default), 64 KiB bodies."""
    cfg = ServeSettings(model_id="smol", api_key=KEY, max_body_bytes=BODY_LIMIT, max_tokens_limit=8,
                        default_max_tokens=4, max_messages=MAX_MESSAGES, log_generations=False)
    with Server(model, settings=cfg, n_slots=2, queue_size=4, spec_disable_by_batch_size=-1) as server:
        yield server


def _post(server: Server, path: str, raw: bytes | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.base + path, content=raw, headers=headers, timeout=120, trust_env=False, verify=False,
                      **kw)


def _refused(r: httpx.Response, statuses: tuple[int, ...] = (400, 413, 422)) -> dict:
    """The response is an OpenAI error object with one of `statuses`."""
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _idle(server: Server, model: Model, n_slots: int = 2) -> None:
    """Every slot idle, and its KV cells exactly what its record says it holds (a
    finished reply stays for the next request; a refused or failed one leaves nothing)."""
    h = server.wait_idle()
    held = [len(model.seq_tokens(seq)) for seq in range(n_slots)]
    assert h["status"] == "ok" and h["kv_tokens"] == held, (h, held)
    assert all(model.kv_len(seq) == held[seq] for seq in range(n_slots))


# ----- bad bodies -------------------------------------------------------------------

DEEP = b"[" * 5000
BAD_BODIES = {
    "5000 nested arrays": DEEP,
    "5000 nested objects": b'{"a":' * 5000,
    "nesting inside a field": b'{"model":"m","user":' + b"[" * 300 + b"]" * 300 + b',"prompt":"x"}',
    "5000-digit integer": b'{"model":"m","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
    "1e400": b'{"model":"m","prompt":"x","temperature":1e400}',
    "NaN": b'{"model":"m","prompt":"x","top_p":NaN}',
    "-Infinity": b'{"model":"m","prompt":"x","min_p":-Infinity}',
    "invalid UTF-8": b'{"model":"m","prompt":"\xff\xfe\xfd"}',
    "overlong UTF-8": b'{"model":"m","prompt":"\xc0\xaf"}',
    "UTF-8 surrogate bytes": b'{"model":"m","prompt":"\xed\xa0\x80"}',
    "lone high surrogate": b'{"model":"m","prompt":"\\ud800"}',
    "lone low surrogate": b'{"model":"m","messages":[{"role":"user","content":"\\udc00"}]}',
    "truncated": b'{"model":"m","prompt":"x"',
    "trailing garbage": b'{"model":"m","prompt":"x"} {}',
    "empty": b"",
    "NUL bytes": b"\x00" * 64,
    "not an object": b"[1, 2, 3]",
    "huge max_tokens": b'{"model":"m","prompt":"x","max_tokens":1e300}',
    "huge seed": b'{"model":"m","prompt":"x","seed":' + b"9" * 40 + b"}",
    "negative token id": b'{"model":"m","prompt":[1,-5]}',
    "token id past vocab": b'{"model":"m","prompt":[1,' + b"9" * 30 + b"]}",
    "huge string over the body limit": b'{"model":"m","prompt":"' + b"x" * BODY_LIMIT + b'"}',
    "huge prompt under the limit": json.dumps({"model": "m", "prompt": "word " * 12000}).encode(),
    "huge role": json.dumps({"model": "m", "messages": [{"role": "x" * 60000, "content": "hi"}]}).encode(),
    "too many messages": json.dumps({"model": "m", "messages": CHAT * (MAX_MESSAGES + 1)}).encode(),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_bodies_get_an_error_object_never_a_500(strict, name):
    for path in PATHS:
        _refused(_post(strict, path, BAD_BODIES[name]))


def test_deep_nesting_is_a_400_naming_the_json(strict, model):
    err = _refused(_post(strict, "/v1/chat/completions", DEEP), (400,))
    assert err["code"] == "invalid_json" and "recursion" in err["message"]
    err = _refused(_post(strict, "/v1/completions", b'{"model":"m","prompt":"' + b"x" * BODY_LIMIT + b'"}'), (413,))
    assert err["code"] == "request_too_large"
    _idle(strict, model)


# ----- fuzzing ------------------------------------------------------------------------

FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed", "ignore_eos", "prediction",
          "logit_bias", "user", "response_format", "echo", "bogus")
_surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
_hostile = st.one_of(  # strings that are valid JSON but hard on what reads them
    _surrogates, st.text(max_size=40), st.sampled_from(["x" * 70000, "word " * 3000, "\x00", "\u202e", "<|im_start|>",
                                                        "</s>" * 50, "\U0001f600" * 10, "\r\n" * 100]),
    st.builds(lambda a, b: a + b, st.text(max_size=10), _surrogates))
_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**18, max_value=10**400),
    st.floats(), _hostile,
)
_value = st.recursive(_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                        kids, max_size=4),
                      max_leaves=16)
_depth = st.one_of(st.integers(1, 40), st.integers(150, 6000))


def _set_string(body: dict, where: str, text: str) -> None:
    """Put `text` where a string is valid, so the body stays valid and reaches the tokenizer."""
    if where == "content" and "messages" in body:
        body["messages"] = [{"role": "user", "content": text}]
    elif where == "content":
        body["prompt"] = text
    elif where == "prediction" and "messages" in body:
        body["prediction"] = {"type": "content", "content": text}
    else:
        body[where] = text


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """A valid body, then one kind of damage: fields replaced, dropped or added; a
    hostile string where a string is valid; a deep nest; or mangled bytes. Serialised
    with NaN and Infinity allowed and lone surrogates escaped or raw."""
    path = draw(st.sampled_from(PATHS))
    body = {**VALID[path], "max_tokens": draw(st.integers(1, 8)), "stream": draw(st.booleans())}
    mode = draw(st.sampled_from(["fields", "string", "deep", "bytes"]))
    if mode == "fields":
        for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            if draw(st.booleans()):
                body[field] = draw(_value)
            else:
                body.pop(field, None)
    elif mode == "string":
        _set_string(body, draw(st.sampled_from(["content", "stop", "prediction", "model", "user"])), draw(_hostile))
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    if mode == "deep":
        n, closed = draw(_depth), draw(st.booleans())
        field = draw(st.sampled_from(["user", "messages", "prompt", "stop", "metadata"]))
        text = text[:-1] + f', "{field}": ' + "[" * n + "]" * (n if closed else 0) + "}"
    raw = text.encode("utf-8", "surrogatepass")
    if mode == "bytes":  # cut, replaced or inserted bytes
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(max_size=3)) + raw[i + draw(st.integers(0, 3)):]
    return path, raw


def _check_answer(r: httpx.Response) -> None:
    """200 with a reply (a stream ends with [DONE] and carries no error), or a 4xx error."""
    if r.status_code != 200:
        _refused(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzzed_bodies_never_crash_or_hang_a_slot(strict, model):
    seen: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies())
    def one(case: tuple[str, bytes]) -> None:
        path, raw = case
        r = _post(strict, path, raw)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        _check_answer(r)

    one()
    print("fuzz statuses:", seen)
    assert seen.get(400, 0) > 30 and seen.get(200, 0) >= 1  # both kinds of outcome were exercised
    _idle(strict, model)


# ----- admission --------------------------------------------------------------------


def test_per_request_limits(strict, model):
    ids = [model.tokenize("hello", add_special=False)[0]] * (SLOT_CTX - 8)
    ok = _post(strict, "/v1/completions", json.dumps({"model": "m", "prompt": ids, "max_tokens": 8}).encode())
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    over = json.dumps({"model": "m", "prompt": [*ids, ids[0]], "max_tokens": 8}).encode()
    err = _refused(_post(strict, "/v1/completions", over), (400,))
    assert err["code"] == "context_length_exceeded" and f"{SLOT_CTX} tokens" in err["message"]
    err = _refused(_post(strict, "/v1/chat/completions", json.dumps(
        {"model": "m", "messages": CHAT, "max_tokens": 9}).encode()), (400,))
    assert err["param"] == "max_tokens"
    many = json.dumps({"model": "m", "messages": CHAT * (MAX_MESSAGES + 1), "max_tokens": 1}).encode()
    assert _refused(_post(strict, "/v1/chat/completions", many), (400,))["code"] == "array_above_max_length"
    enough = json.dumps({"model": "m", "messages": CHAT * MAX_MESSAGES, "max_tokens": 1}).encode()
    assert _post(strict, "/v1/chat/completions", enough).status_code == 200
    # a body over the limit is refused whether it declares its length or streams it chunked
    big = b'{"model":"m","prompt":"' + b"x" * BODY_LIMIT + b'"}'
    assert _refused(_post(strict, "/v1/completions", big), (413,))["code"] == "request_too_large"
    chunks = (big[i:i + 4096] for i in range(0, len(big), 4096))
    assert _refused(_post(strict, "/v1/completions", chunks), (413,))["code"] == "request_too_large"
    _idle(strict, model)


def test_api_key(strict):
    body = json.dumps(VALID["/v1/completions"]).encode()
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = _post(strict, "/v1/completions", body, headers=headers)
        assert _refused(r, (401,)) and r.headers["www-authenticate"] == "Bearer"
    health = httpx.get(f"{strict.base}/health", trust_env=False, verify=False)
    assert health.status_code == 200  # public, like llama.cpp's


class _Held:
    """A long stream, read up to its first text piece: it holds a slot until closed.
    The line iterator is kept: dropping a half-read one closes the connection."""

    def __init__(self, server: Server, max_tokens: int = 200) -> None:
        self.client = httpx.Client(base_url=server.base, timeout=120, trust_env=False, verify=False)
        body = {"model": "m", "messages": CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.response = self.client.send(self.client.build_request("POST", "/v1/chat/completions", json=body),
                                         stream=True)
        self.lines = self.response.iter_lines()
        for line in self.lines:
            if line.startswith("data: {") and '"content": ""' not in line:
                return
        raise AssertionError("the stream ended before its first piece")

    def events(self) -> list[dict]:
        """The rest of the stream's events."""
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]

    def close(self) -> None:
        self.response.close()
        self.client.close()


def _wait_started(server: Server, n: int) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{server.base}/metrics", trust_env=False, verify=False).text
        started = sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples
                      if x.name == "localspec_requests_started_total")
        if started == n:
            return
        assert time.monotonic() < deadline, started
        time.sleep(0.05)


def _wait_for(server: Server, key: str, value: int) -> None:
    deadline = time.monotonic() + 30
    while server.health()[key] != value:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.05)


@pytest.fixture()
def one_slot(model):
    with Server(model, n_slots=1, queue_size=1, spec_disable_by_batch_size=-1) as server:
        yield server


def test_full_queue_is_429_with_retry_after_and_leavers_free_their_place(one_slot, model):
    held = _Held(one_slot)
    # a client queues and leaves: its place must not keep the next one out
    gone = httpx.Client(base_url=one_slot.base, timeout=120, trust_env=False, verify=False)
    body = {"model": "m", "messages": CHAT, "max_tokens": 4, "stream": True}
    r = gone.send(gone.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    _wait_for(one_slot, "queued", 1)
    r.close()
    gone.close()
    waiting: list[httpx.Response] = []
    t = threading.Thread(target=lambda: waiting.append(httpx.post(
        f"{one_slot.base}/v1/chat/completions", json={**body, "stream": False}, timeout=120, trust_env=False,
        verify=False)))
    t.start()
    _wait_started(one_slot, 3)  # held, gone, waiting
    busy = httpx.post(f"{one_slot.base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                      timeout=60, trust_env=False, verify=False)
    assert _refused(busy, (429,))["code"] == "queue_full" and int(busy.headers["retry-after"]) >= 1
    held.close()
    t.join(120)
    assert waiting and waiting[0].status_code == 200
    _idle(one_slot, model, 1)
