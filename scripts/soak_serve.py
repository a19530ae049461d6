#!/usr/bin/env python3
"""Soak `localspec serve`: many clients at once, a third of them walking away, and then
proof that nothing was lost. The CI test (tests/test_serve_soak.py) runs the same code
for a bounded number of requests; run this for longer:

    python scripts/soak_serve.py --clients 32 --duration 600        # starts a server
    python scripts/soak_serve.py --url http://127.0.0.1:8080 --clients 16 --requests 8

Every client sends greedy requests drawn (seeded) from a fixed set: chat and
completions, streaming and not, repetitive prompts the n-gram drafter copies from, and
chat requests carrying a `prediction`. About a third disconnect on purpose, at a random
moment: cut off at a random time (before, during or after the body; mid-stream), closed
after k streamed chunks, a body sent half-way, or a request sent and never read.

Afterwards: the server answered every request that stayed (no 5xx), each completed
reply is exactly the text the same request gets alone (computed once, one request at a
time, on the same server, before the load; a slot's cells for a prompt's start may come
from another batch, so a reply can part from it at a near-tie of a small model: the
test checks the margin there), every slot is free and llama.cpp's KV cache holds no
cells for any slot (/health kv_tokens: each slot's last user left), and /metrics balances
(requests started = finished + cancelled + failed, none failed). When it started the
server, it also checks that SIGTERM exits 0 and that the acceptance log holds one row
per finished request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import httpx

from localspec.bench.soak import Load, metrics, run


# ----- a server of its own ------------------------------------------------------------


def start_server(model: str, parallel: int, queue: int, threads: int, home: str,
                 spec_disable: int = -1) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "localspec", "serve", "-m", model, "--port", str(port), "--parallel",
           str(parallel), "--queue-size", str(queue), "-c", str(parallel * 1024), "-t", str(threads),
           "--spec-disable-by-batch-size", str(spec_disable)]
    proc = subprocess.Popen(cmd, env={**os.environ, "LOCALSPEC_HOME": home}, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2, trust_env=False, verify=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not start: {proc.stderr.read()[-2000:]}")


def stop_server(proc: subprocess.Popen, home: str, finished: float) -> list[str]:
    """SIGTERM: exit 0, and the acceptance log holds one row per finished request."""
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    problems = [] if rc == 0 else [f"server exited {rc} on SIGTERM: {proc.stderr.read()[-2000:]}"]
    with sqlite3.connect(os.path.join(home, "logs.db")) as db:
        rows = db.execute("SELECT count(*) FROM generations WHERE command = 'serve'").fetchone()[0]
    if rows != finished:
        problems.append(f"acceptance log: {rows} rows for {finished:g} finished requests")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--api-key")
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--spec-disable-by-batch-size", dest="spec_disable", type=int, default=-1,
                    help="the started server's rule (-1: speculate at any load, the harder case)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="per client, without --duration")
    ap.add_argument("--duration", type=float, help="seconds of load (clients loop until then)")
    ap.add_argument("-n", "--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as home:
        proc, base = (None, a.url) if a.url else start_server(a.model, a.parallel, a.clients, a.threads, home,
                                                              a.spec_disable)
        load = Load(base, a.api_key, a.clients, a.requests, a.duration, a.max_tokens, a.seed)
        try:
            report, problems = run(load)
            if proc is not None:
                after = metrics(base, a.api_key)
                finished = sum(v for (name, labels), v in after.items()
                               if name == "localspec_requests_ended_total" and ("outcome", "finished") in labels)
                problems += stop_server(proc, home, finished)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    print(json.dumps(report) if a.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
