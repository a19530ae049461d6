#!/usr/bin/env python3
"""`localspec serve` next to `llama-server` under concurrent load, over HTTP, greedy.
A benchmark, not a test.

Both servers load the same GGUF with the same slots (-np), context, threads and batch
sizes, and stay up for the whole run. For each (prompt length, clients, streaming) cell,
C client threads each send R chat requests one after another (max_tokens N, temperature
0) to one server, then the same to the other (the order alternates cell by cell, so a
drift in the machine's speed lands on both). Reported per cell and server: aggregate
tok/s (completion tokens of every request / the cell's wall time) and the mean time to
first token (streaming: the first content chunk; not streaming: the whole reply).

    python scripts/serve_vs_llama_server.py --clients 1,2,4,8 --requests 2 -n 128 \
        --prompts 50,1500,edit --stream both [--localspec-args "--spec none"]

--localspec-args may be given more than once: one localspec server per value, all in the
same run (`--localspec-args "" --localspec-args "--spec none"`: the default settings
beside speculation off). Prompts: 50 (a short code request), a token count (a code
review of about that many tokens: the reply copies little of it), or `edit` (the
built-in edit tasks, the whole file asked back: the reply copies most of the prompt).

Where llama-server comes from: --llama-server PATH, $LLAMA_SERVER, or the build
scripts/compare_llama_server.py --build makes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llama_server import find_server  # noqa: E402

from localspec import models  # noqa: E402
from localspec.bench.soak import metrics  # noqa: E402
from localspec.bench.workers import free_port  # noqa: E402
from localspec.core import backend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHORT = ("Write a Python function that parses a CSV file of orders (id, customer, amount, date) "
         "and returns the total amount per customer, with a docstring and type hints.")


def edit_prompts() -> list[str]:
    """The built-in edit tasks as chat requests that ask for the whole file back."""
    base = ROOT / "localspec" / "workloads"
    tasks = [json.loads(line) for line in (base / "edit" / "tasks.jsonl").read_text().splitlines() if line.strip()]
    return [f"{t['instruction']} Reply with the complete updated file in one code block.\n\n"
            f"```\n{(base / t['file']).read_text()}```" for t in tasks]


def long_prompt(n_tokens: int) -> str:
    """A code-review request of about n_tokens tokens (this project's own source)."""
    src = (ROOT / "localspec" / "serve" / "scheduler.py").read_text()
    code = (src * 4)[: int(n_tokens * 3.2)]
    return f"Review this code and list its three biggest problems:\n\n```python\n{code}\n```"


class Server:
    """A server process on a free port, up for the duration of a `with` block."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path, env: dict | None = None) -> None:
        self.name, self.cmd, self.port, self.env = name, cmd, port, env
        self.log = log_dir / f"{name}.log"
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def one_request(client: httpx.Client, url: str, prompt: str, n: int, stream: bool) -> tuple[int, float, str]:
    """(completion tokens, seconds to the first token, text) of one chat request."""
    body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0.0, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url + "/v1/chat/completions", json=body, timeout=3600)
        r.raise_for_status()
        out = r.json()
        return out["usage"]["completion_tokens"], time.perf_counter() - t0, out["choices"][0]["message"]["content"]
    body["stream_options"] = {"include_usage": True}
    first, parts, tokens = None, [], 0
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter() - t0
                    parts.append(text)
    return tokens, first or time.perf_counter() - t0, "".join(parts)


COUNTERS = ("steps_total", "speculative_steps_total", "draft_tokens_total", "accepted_tokens_total")


def counters(srv: Server) -> dict[str, float] | None:
    """localspec's drafting counters from /metrics (None for llama-server)."""
    if not srv.name.startswith("localspec"):
        return None
    got = metrics(srv.url, None)
    return {name.removesuffix("_total"): got[("localspec_" + name, ())] for name in COUNTERS}


def run_cell(srv: Server, prompts: list[str], clients: int, requests: int, n: int, stream: bool) -> dict:
    """One cell on one server, with what localspec drafted in it (steps, speculative steps,
    draft tokens verified and accepted: the /metrics counters' change)."""
    before = counters(srv)
    out = cell(srv.url, prompts, clients, requests, n, stream)
    if before is not None:
        after = counters(srv)
        out["drafting"] = {k: int(after[k] - before.get(k, 0.0)) for k in after}
    return out


def cell(url: str, prompts: list[str], clients: int, requests: int, n: int, stream: bool) -> dict:
    """C clients x R requests; aggregate tok/s and mean TTFT."""
    results: list[tuple[int, float, str]] = []
    lock = threading.Lock()
    failed: list[str] = []

    def client_loop(i: int) -> None:
        with httpx.Client() as c:
            for r in range(requests):
                prompt = prompts[(i * requests + r) % len(prompts)]
                for attempt in range(2):  # a kept-alive connection the server closed: once more
                    try:
                        out = one_request(c, url, prompt, n, stream)
                    except httpx.HTTPError as e:
                        if attempt == 0 and isinstance(e, httpx.RemoteProtocolError):
                            continue
                        with lock:
                            failed.append(f"{type(e).__name__}: {e}")
                    else:
                        with lock:
                            results.append(out)
                    break

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_s": statistics.fmean(r[1] for r in results) if results else float("nan"),
            "texts": [r[2] for r in results], "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("-m", "--model", default=None, help="[default: the manifest's default]")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompts", default="50", help="prompt sizes: 50 (a short request) or a token count")
    ap.add_argument("--stream", default="no", choices=("no", "yes", "both"))
    ap.add_argument("-np", "--parallel", type=int, default=0, help="slots [default: the most clients]")
    ap.add_argument("-t", "--threads", type=int, default=backend.default_threads())
    ap.add_argument("--localspec-args", action="append", default=None,
                    help='localspec serve flags [default: "--spec none"]; repeat for several servers')
    ap.add_argument("--server-args", default="", help="extra llama-server flags")
    ap.add_argument("--only", default="both", choices=("both", "localspec", "llama-server"))
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each cell this many times (the servers' order alternating); a summary "
                         "line gives medians and each localspec variant over the first, run by run")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    cs = [int(x) for x in args.clients.split(",")]
    slots = args.parallel or max(cs)
    model = Path(models.resolve(args.model, role="target"))
    n_ctx = 4096 * slots
    log_dir = Path(tempfile.mkdtemp(prefix="serve-vs-"))
    servers = []
    if args.only in ("both", "llama-server"):
        exe = find_server(args.llama_server)
        servers.append(Server("llama-server", [
            str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(p := free_port()),
            "-c", str(n_ctx), "-np", str(slots), "-t", str(args.threads), "-tb", str(args.threads),
            "-b", "512", "-ub", "512", "--no-webui", "--jinja", *shlex.split(args.server_args)], p, log_dir))
    if args.only in ("both", "localspec"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        variants = args.localspec_args or ["--spec none"]
        for i, extra in enumerate(variants):
            name = "localspec" if i == 0 else f"localspec[{extra or 'default'}]"
            servers.append(Server(name, [
                sys.executable, "-m", "localspec", "serve", "-m", str(model), "--port", str(p := free_port()),
                "-c", str(n_ctx), "-np", str(slots), "-t", str(args.threads), "--no-log",
                *shlex.split(extra)], p, log_dir, env))
    sizes = args.prompts.split(",")
    streams = {"no": [False], "yes": [True], "both": [False, True]}[args.stream]
    rows = []
    with contextlib.ExitStack() as up:  # each server started once (--only: there is one)
        for srv in servers:
            up.enter_context(srv)
        for srv in servers:  # warm-up: first decodes allocate buffers
            cell(srv.url, [SHORT], 1, 1, 8, False)
        k = 0
        for size in sizes:
            if size == "edit":
                prompts = edit_prompts()
            elif int(size) <= 64:
                prompts = [SHORT + f" Call it variant {i}." for i in range(8)]
            else:
                prompts = [long_prompt(int(size)) + f"\n(review {i})" for i in range(8)]
            for stream in streams:
                for c in cs:
                    runs = []
                    for _ in range(args.repeat):
                        order = servers if k % 2 == 0 else servers[::-1]
                        k += 1
                        ran = {s.name: run_cell(s, prompts, c, args.requests, args.n, stream) for s in order}
                        got = {s.name: ran[s.name] for s in servers}  # reported in a fixed order
                        rows.append({"prompt": size, "stream": stream, "clients": c, **{
                            name: {key: v for key, v in r.items() if key != "texts"} for name, r in got.items()},
                            "same_texts": _same(got)})
                        runs.append(rows[-1])
                        print(_line(rows[-1]), flush=True)
                    if args.repeat > 1:
                        print(_summary(runs, [s.name for s in servers]), flush=True)
    print(f"\n(logs in {log_dir})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def _summary(runs: list[dict], names: list[str]) -> str:
    """A cell's repeats: each server's median tok/s; each localspec server over
    llama-server (tok/s and TTFT) and each localspec variant after the first over the
    first, paired run by run (median [min-max])."""
    parts = [f"  median of {len(runs)}:"]
    for name in names:
        parts.append(f"{name} {statistics.median(r[name]['tok_s'] for r in runs):6.2f} tok/s")
    ls = [n for n in names if n.startswith("localspec")]
    if "llama-server" in names:
        for name in ls:
            tok = sorted(r[name]["tok_s"] / r["llama-server"]["tok_s"] for r in runs)
            ttft = sorted(r[name]["ttft_s"] / r["llama-server"]["ttft_s"] for r in runs)
            parts.append(f"{name} / llama-server {statistics.median(tok):.2f}x [{tok[0]:.2f}-{tok[-1]:.2f}], "
                         f"ttft {statistics.median(ttft):.2f}x [{ttft[0]:.2f}-{ttft[-1]:.2f}]")
    for name in ls[1:]:
        ratios = sorted(r[ls[0]]["tok_s"] / r[name]["tok_s"] for r in runs)
        parts.append(f"{ls[0]} / {name} {statistics.median(ratios):.3f}x [{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    return "  ".join(parts)


def _same(got: dict) -> str | None:
    """How many of the first two servers' texts are the same."""
    if len(got) < 2:
        return None
    a, b = (sorted(r["texts"]) for r in list(got.values())[:2])
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def _line(row: dict) -> str:
    lp = row.get("llama-server")
    head = f"prompt {row['prompt']:>5}  stream {'yes' if row['stream'] else 'no ':3}  C={row['clients']:<2}"
    parts = [head]
    for name, r in row.items():
        if isinstance(r, dict):
            parts.append(f"{name} {r['tok_s']:6.2f} tok/s ttft {r['ttft_s']:6.2f}s"
                         + (f" ({len(r['failed'])} failed: {r['failed'][0]})" if r.get("failed") else ""))
            d = r.get("drafting")
            if d and d.get("draft_tokens"):
                parts.append(f"[{d['speculative_steps']}/{d['steps']} steps spec, "
                             f"{d['accepted_tokens']}/{d['draft_tokens']} accepted]")
            if lp and r is not lp:
                parts.append(f"({r['tok_s'] / lp['tok_s']:.2f}x, ttft {r['ttft_s'] / lp['ttft_s']:.2f}x)")
    if row.get("same_texts"):
        parts.append(f"same {row['same_texts']}")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
