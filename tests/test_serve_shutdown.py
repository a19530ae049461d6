"""`serve` shutting down: the drain in-process (new requests get a 503 with Retry-After,
running ones finish; past the grace period what is left ends with a 503), and the real
`localspec serve` in a subprocess: SIGTERM lets admitted requests finish, flushes the
acceptance log and exits 0; SIGKILL then a restart leaves a usable log; by default the
server is reachable on loopback only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
from test_serve import start_server
from test_serve_concurrency import Server
from test_serve_faults import CHAT, _Held, _refused

from localspec.serve.admission import Drain


SLOTS = 1  # the sequences of the `model` fixture (conftest)


@pytest.fixture()
def one_slot(model):
    with Server(model, n_slots=1, queue_size=1, spec_disable_by_batch_size=-1) as server:
        yield server


def test_drain_refuses_new_requests_and_finishes_running_ones(one_slot, model):
    held = _Held(one_slot, max_tokens=24)
    one_slot.scheduler.drain()
    r = httpx.post(f"{one_slot.base}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=60,
                   trust_env=False, verify=False)
    assert _refused(r, (503,))["code"] == "server_shutting_down" and int(r.headers["retry-after"]) >= 1
    health = httpx.get(f"{one_slot.base}/health", trust_env=False, verify=False)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert held.events()[-1]["choices"][0]["finish_reason"] == "length"  # the running one finished
    held.close()


def test_drain_grace_period_ends_what_is_left_with_a_503(one_slot, model):
    held = _Held(one_slot, max_tokens=400)
    Drain(one_slot.scheduler, grace_s=0.5).begin()
    events = held.events()
    assert "shutting down" in events[-1]["error"]["message"]
    assert len(events) < 400
    held.close()
    assert one_slot.health()["status"] == "unavailable" and model.kv_len(0) == 0


# ----- the real command: SIGTERM and SIGKILL --------------------------------------------


def _stream_in_thread(base: str, body: dict, out: list) -> threading.Thread:
    """A streaming chat request in a thread: its events go to `out` (then the error, if
    the connection broke)."""
    def run() -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120,
                              trust_env=False, verify=False) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        out.append(json.loads(line[6:]))
        except httpx.HTTPError as exc:
            out.append(exc)
    t = threading.Thread(target=run)
    t.start()
    return t


def _rows(home) -> int:
    with sqlite3.connect(home / "logs.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT count(*) FROM generations WHERE command = 'serve'").fetchone()[0]


def _wait_busy(base: str, active: int, queued: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        h = httpx.get(f"{base}/health", trust_env=False, verify=False).json()
        if h["active"] == active and h["queued"] == queued:
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_sigterm_drains_flushes_the_log_and_exits_0(smol_path, tmp_path):
    home = tmp_path / "home"
    proc, base = start_server(smol_path, home, "--parallel", "1", "-c", "1024", "--queue-size", "2",
                              "--shutdown-timeout", "120")
    try:
        body = {"model": "m", "messages": CHAT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        first, second = [], []
        # the first is long enough to still run when the second has queued behind it
        threads = [_stream_in_thread(base, {**body, "max_tokens": 96}, first)]
        _wait_busy(base, 1, 0)
        threads.append(_stream_in_thread(base, body, second))
        _wait_busy(base, 1, 1)  # one running, one waiting for the slot
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # stopped accepting: the listener is closed (or, mid-handshake, a 503)
            r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10,
                           trust_env=False, verify=False)
            _refused(r, (503,))
        except httpx.ConnectError:
            pass
        for t in threads:
            t.join(120)
        for events in (first, second):  # both admitted requests ran to the end
            assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]
        assert proc.wait(60) == 0
        assert _rows(home) == 2  # the log pool was flushed before exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _other_address() -> str | None:
    """This machine's non-loopback address, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_sigkill_then_restart_keeps_a_usable_log(smol_path, tmp_path):
    home = tmp_path / "home"
    proc, base = start_server(smol_path, home, "--parallel", "2", "-c", "1024")
    try:
        addr = _other_address()
        if addr:  # bound to loopback by default: not reachable on the machine's own address
            with pytest.raises(OSError):
                socket.create_connection((addr, int(base.rsplit(":", 1)[1])), timeout=2).close()
        for _ in range(2):
            httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4},
                       timeout=120, trust_env=False, verify=False).raise_for_status()
        deadline = time.monotonic() + 30
        while (home / "logs.db").exists() is False or _rows(home) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        events: list = []
        body = {"model": "m", "messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        t = _stream_in_thread(base, body, events)
        _wait_busy(base, 1, 0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t.join(30)
        assert isinstance(events[-1], httpx.HTTPError)  # killed mid-stream
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the restarted server logs on; its SIGTERM grace is 1 s: a long reply is cut with a 503
    proc, base = start_server(smol_path, home, "--parallel", "1", "-c", "1024", "--shutdown-timeout", "1")
    try:
        httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 4},
                   timeout=120, trust_env=False, verify=False).raise_for_status()
        events = []
        t = _stream_in_thread(base, {**body, "max_tokens": 900}, events)
        _wait_busy(base, 1, 0)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert "shutting down" in events[-1]["error"]["message"] and len(events) < 900
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _rows(home) == 3
    stats = subprocess.run([sys.executable, "-m", "localspec", "stats", "--json"], check=False, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "LOCALSPEC_HOME": str(home)})
    assert stats.returncode == 0 and json.loads(stats.stdout)["runs"] == 3, stats.stderr
