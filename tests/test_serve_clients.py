"""Slow and hostile clients against the real server (uvicorn in a thread, SmolLM2):

- slowloris: a client trickling its headers or its body is cut off within the bound
  while normal requests are served; idle sockets past --max-connections make room for
  new ones (/health answers); with every connection serving, a new one gets a 503; a
  client that stops reading its reply is dropped after the timeout;
- SSE keep-alive comments while a streamed request waits for a slot, and the official
  client reads such a stream as before;
- web pages: a POST that is not application/json gets a 415, a foreign Host a 403,
  CORS headers only for --cors-origin origins;
- the flags, through `localspec serve` itself.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from localspec.serve.app import ServeSettings  # noqa: E402
from localspec.serve.connections import ConnectionLimits  # noqa: E402
from test_serve import start_server, stop_server  # noqa: E402
from test_serve_concurrency import SYSTEM, Server, _hold_slot  # noqa: E402

LIMITS = ConnectionLimits(header_timeout=1.0, timeout=2.0, max_connections=12)
SETTINGS = ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=512)


SLOT_CTX = 512  # cells per sequence of the `model` fixture (conftest)


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed_after(sock: socket.socket, payload: bytes, every: float, limit: float) -> float | None:
    """Send `payload` a byte every `every` seconds; the seconds until the server closed
    the connection, or None if it was still open after `limit` seconds."""
    t0 = time.monotonic()
    sock.settimeout(every)
    for i in range(len(payload)):
        if time.monotonic() - t0 > limit:
            return None
        try:
            sock.sendall(payload[i:i + 1])
            if sock.recv(4096) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:  # reset by the server's abort
            return time.monotonic() - t0
    return None


def _health_ok(server: Server) -> bool:
    r = httpx.get(f"{server.base}/health", timeout=5, trust_env=False, verify=False)
    return r.status_code == 200 and r.json()["status"] == "ok"


def _post(server: Server, content: bytes, headers: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.base + path, content=content, headers=headers, timeout=60,
                      trust_env=False, verify=False)


CHAT = json.dumps({"model": "smol", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


# ----- slowloris ---------------------------------------------------------------------


def test_trickled_headers_and_body_are_cut_off_while_others_are_served(model):
    with Server(model, limits=LIMITS, n_slots=1) as server:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n" + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n")
        results: dict[str, float | None] = {}

        def trickle(name: str, payload: bytes, prefix: bytes = b"") -> None:
            with _connect(server) as s:
                s.sendall(prefix)
                results[name] = _closed_after(s, payload, 0.1, 10)

        body = b'{"model": "smol", "messages": []}' * 10
        headers_for_body = head.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        threads = [threading.Thread(target=trickle, args=("head", head)),
                   threading.Thread(target=trickle, args=("body", body, headers_for_body))]
        for t in threads:
            t.start()
        time.sleep(0.3)
        # meanwhile a normal request is served at once
        t0 = time.monotonic()
        r = _post(server, CHAT, {"Content-Type": "application/json"})
        assert r.status_code == 200 and time.monotonic() - t0 < 10, r.text
        assert _health_ok(server)
        for t in threads:
            t.join(30)
        # cut within its bound (1 s for the head, 2 s for the body), not left to trickle
        assert results["head"] is not None and 0.8 <= results["head"] < 2.5, results
        assert results["body"] is not None and 1.8 <= results["body"] < 3.5, results
        server.wait_idle()


def test_idle_sockets_past_the_cap_make_room_and_health_answers(model):
    with Server(model, limits=LIMITS, n_slots=1) as server:
        idle = [_connect(server) for _ in range(3 * LIMITS.max_connections)]
        try:
            time.sleep(0.3)
            assert _health_ok(server)  # at once, not after the header timeout
            # the oldest idle sockets were closed to make room; the newest still open
            closed = 0
            for s in idle:
                s.settimeout(0.05)
                try:
                    closed += s.recv(1) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed += 1
            assert closed >= 2 * LIMITS.max_connections, closed
        finally:
            for s in idle:
                s.close()


def test_a_new_connection_gets_a_503_when_every_connection_is_serving(model):
    limits = ConnectionLimits(header_timeout=5, timeout=5, max_connections=2)
    with Server(model, limits=limits, n_slots=1, queue_size=4) as server:
        held = [_hold_slot(server, max_tokens=300)]
        try:
            h = httpx.Client(base_url=server.base, timeout=60, trust_env=False, verify=False)
            body = {"model": "smol", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
                    "max_tokens": 8, "stream": True}
            queued = h.send(h.build_request("POST", "/v1/chat/completions", json=body), stream=True)
            held.append((h, queued, queued.iter_lines()))
            r = httpx.get(f"{server.base}/health", timeout=5, trust_env=False, verify=False)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert r.headers["retry-after"] == "1"
        finally:
            for h, resp, _ in held:
                resp.close()
                h.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the two connections closed: room again
            try:
                if _health_ok(server):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert _health_ok(server)
        server.wait_idle()


# ----- SSE keep-alive ----------------------------------------------------------------


def test_a_queued_stream_gets_keep_alive_comments_before_its_first_token(model):
    settings = ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=512, sse_keepalive_s=0.2)
    with Server(model, settings=settings, n_slots=1, queue_size=4) as server:
        want = server.client().completions.create(model="smol", prompt="The sea is", max_tokens=12,
                                                  temperature=0).choices[0].text
        body = {"model": "smol", "prompt": "The sea is", "max_tokens": 12, "temperature": 0, "stream": True}
        h, r, lines = _hold_slot(server, max_tokens=200)  # the one slot, for a second or more
        try:
            seen: list[str] = []
            with httpx.Client(base_url=server.base, timeout=60, trust_env=False, verify=False) as c:
                with c.stream("POST", "/v1/completions", json=body) as second:
                    seen = [line for line in second.iter_lines() if line]
        finally:
            r.close()
            h.close()
        first_data = next(i for i, line in enumerate(seen) if line.startswith("data: {"))
        assert ": keep-alive" in seen[:first_data], seen[:5]
        assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in seen
                       if line.startswith("data: {")) == want
        # the official client reads a stream with comments in it as before
        h, r, lines = _hold_slot(server, max_tokens=200)
        try:
            stream = server.client().completions.create(model="smol", prompt="The sea is", max_tokens=12,
                                                        temperature=0, stream=True)
            assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want
        finally:
            r.close()
            h.close()
        server.wait_idle()


# ----- web pages ---------------------------------------------------------------------


def test_posts_must_be_json_and_the_host_must_name_this_server(model):
    with Server(model, limits=LIMITS, n_slots=1) as server:
        for headers in ({"Content-Type": "text/plain"},  # a no-cors fetch() from any page
                        {"Content-Type": "application/x-www-form-urlencoded"},  # a <form>
                        {"Content-Type": "multipart/form-data; boundary=x"},
                        {}):  # none at all
            r = _post(server, CHAT, headers)
            assert r.status_code == 415, (headers, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"
            assert "application/json" in err["message"]
        assert _post(server, CHAT, {"Content-Type": "application/json; charset=utf-8"}).status_code == 200
        assert _post(server, CHAT, {"Content-Type": "Application/JSON"}).status_code == 200
        port = server.port
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            r = _post(server, CHAT, {"Content-Type": "application/json", "Host": host})
            assert r.status_code == 200, (host, r.text)
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"10.1.2.3:{port}"):
            for r in (_post(server, CHAT, {"Content-Type": "application/json", "Host": host}),
                      httpx.get(f"{server.base}/v1/models", headers={"Host": host}, trust_env=False)):
                assert r.status_code == 403, (host, r.text)
                err = r.json()["error"]
                assert err["type"] == "permission_error" and "--allowed-host" in err["message"]
        # no CORS by default: a page of another origin cannot read replies
        r = httpx.get(f"{server.base}/v1/models", headers={"Origin": "http://evil.example"}, trust_env=False)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        server.wait_idle()


def test_allowed_hosts_and_cors_origins_when_asked_for(model):
    settings = ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=512,
                             allowed_hosts=("box.lan", "*.corp.example"),
                             cors_origins=("http://localhost:3000",))
    with Server(model, settings=settings, n_slots=1) as server:
        for host, status in (("box.lan:8080", 200), ("a.corp.example", 200), ("corp.example.evil", 403),
                             ("evil.example", 403)):
            r = httpx.get(f"{server.base}/v1/models", headers={"Host": host}, trust_env=False)
            assert r.status_code == status, (host, r.text)
        page = {"Origin": "http://localhost:3000"}
        r = httpx.options(f"{server.base}/v1/chat/completions", trust_env=False, headers={
            **page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = _post(server, CHAT, {"Content-Type": "application/json", **page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = _post(server, CHAT, {"Content-Type": "text/plain", **page})  # a page may read the 415
        assert r.status_code == 415 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.get(f"{server.base}/v1/models", headers={"Origin": "http://evil.example"}, trust_env=False)
        assert "access-control-allow-origin" not in r.headers
        server.wait_idle()


# ----- the command ------------------------------------------------------------------


def test_serve_flags_reach_the_server(smol_path, tmp_path):
    proc, base = start_server(smol_path, tmp_path / "home", "-c", "512", "--parallel", "1",
                              "--header-timeout", "1", "--allowed-host", "box.lan")
    try:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            cut = _closed_after(s, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X: y\r\n" * 50, 0.1, 10)
        assert cut is not None and cut < 2.5
        assert httpx.get(f"{base}/health", headers={"Host": "box.lan"}, trust_env=False).status_code == 200
        assert httpx.get(f"{base}/health", headers={"Host": "evil.example"}, trust_env=False).status_code == 403
    finally:
        stop_server(proc)


def test_serve_help_names_the_limits():
    out = subprocess.run([sys.executable, "-m", "localspec", "serve", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    for flag in ("--header-timeout", "--timeout", "--max-connections", "--allowed-host", "--cors-origin"):
        assert flag in out, flag


def test_a_client_that_stops_reading_is_dropped_after_the_timeout():
    """The transport pauses the protocol when its write buffer stays full (a client that
    reads nothing of a large reply; on loopback the kernel absorbs megabytes first, so
    the pause is signalled here as the transport would): the connection is closed once
    `timeout` passes without a resume, and kept while resumes come."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from localspec.serve.connections import protocol_class

    async def app(scope, receive, send):  # never reached: no request is sent
        raise AssertionError

    async def main() -> tuple[bool, bool]:
        config = uvicorn.Config(app, log_level="warning")
        config.load()
        cls = protocol_class(ConnectionLimits(header_timeout=30, timeout=0.5, max_connections=8))
        state = ServerState()
        loop = asyncio.get_running_loop()
        out = []
        for resume in (False, True):
            ours, theirs = socket.socketpair()
            _, proto = await loop.connect_accepted_socket(lambda: cls(config=config, server_state=state,
                                                                      app_state={}), ours)
            proto.pause_writing()
            for _ in range(4):
                await asyncio.sleep(0.3)
                if resume:  # a slow reader: the buffer drains now and then
                    proto.resume_writing()
                    proto.pause_writing()
            out.append(proto.transport.is_closing())
            theirs.close()
            proto.transport.abort()
        return out[0], out[1]

    stalled_closed, slow_closed = asyncio.run(main())
    assert stalled_closed and not slow_closed
