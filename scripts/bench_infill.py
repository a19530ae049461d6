#!/usr/bin/env python3
"""Code completion side by side: llama.vim-shaped `/infill` requests on real code nobody
here wrote (files of the Python standard library, cut at many points), to `localspec
serve` and to `llama-server` on the same model, with and without llama.cpp's n-gram
speculation, and to localspec without speculation. A benchmark, not a timed test.

Each cut puts the cursor after a line's indentation: `input_prefix` is up to --n-prefix
lines above, `prompt` the indentation typed, `input_suffix` the rest of the line and up to
--n-suffix lines below, `input_extra` --chunks chunks of 32 lines from the neighbouring
files (llama.vim's ring buffer: {text, time, filename}). Every request is llama.vim's
(the same fields), greedy on both servers (temperature 0, top_k 1: llama.vim's own
sampling is random), with t_max_predict_ms at each --budgets value (0: unlimited).

Per request: the tokens produced (timings.predicted_n), the wall time to the first
streamed piece and to the end, and the text. The table gives, per server and budget,
the mean tokens per request, the ratio of tokens to llama-server's plain and best
setting (per cut, then the geometric mean), the cuts where it produced fewer tokens than
plain decoding, the latencies, and how many texts equal plain llama-server's (unlimited
budget; a near-tie in the logits may part greedy texts). Every server is up at once and
each cut goes to all of them back to back, so a drift in the machine's speed does not
land on one. llama-server is found as scripts/compare_llama_server.py finds it (that
script's docstring says how to build it); without one only localspec runs.

    python scripts/bench_infill.py [--model qwen2.5-coder-0.5b] [--cuts 8] [--budgets 500,0]
        [--llama-server PATH] [--types ngram-simple,ngram-map-k] [--json out.json]
        [--also before=/path/to/an/older/checkout]
    python scripts/bench_infill.py --report out.json   # the table of a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_llama_server import Server as LlamaServer  # noqa: E402
from compare_llama_server import Setting, find_server  # noqa: E402

from localspec import models  # noqa: E402
from localspec.bench.workers import free_port  # noqa: E402

FILES = ["textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "difflib.py", "calendar.py"]
CHUNK = 32


def cuts(n: int, n_prefix: int, n_suffix: int, n_chunks: int, seed: int) -> list[dict]:
    """llama.vim-shaped request bodies (without the budget) at n cut points."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = {f: (root / f).read_text().splitlines(keepends=True) for f in FILES if (root / f).is_file()}
    rng = random.Random(seed)
    names = list(texts)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        lines = texts[name]
        body_lines = [j for j, ln in enumerate(lines) if j > 20 and ln.startswith("    ") and ln.strip()]
        y = rng.choice(body_lines)
        line = lines[y]
        indent = line[: len(line) - len(line.lstrip())]
        extra = []
        for other in [x for x in names if x != name][:n_chunks]:
            o = texts[other]
            s = rng.randrange(0, max(1, len(o) - CHUNK))
            extra.append({"text": "".join(o[s : s + CHUNK]), "time": [1733000000 + i, 0], "filename": other})
        out.append({"name": f"{name}:{y + 1}", "input_prefix": "".join(lines[max(0, y - n_prefix) : y]),
                    "prompt": indent, "input_suffix": line[len(indent):] + "".join(lines[y + 1 : y + 1 + n_suffix]),
                    "input_extra": extra})
    return out


def llama_vim(cut: dict, budget: int, n_predict: int) -> dict:
    """llama.vim's request (autoload/llama.vim, llama#fim), greedy."""
    return {"input_prefix": cut["input_prefix"], "input_suffix": cut["input_suffix"],
            "input_extra": cut["input_extra"], "prompt": cut["prompt"], "n_predict": n_predict,
            "stop": [], "n_indent": len(cut["prompt"]), "top_k": 1, "top_p": 0.90, "temperature": 0.0,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": budget, "stream": True}


def infill(port: int, body: dict) -> dict:
    """One streamed /infill: tokens, text, seconds to the first piece and to the end."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/infill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, parts, final = None, [], {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content") and first is None:
                first = time.perf_counter() - t0
            parts.append(ev.get("content", ""))
            if ev.get("stop"):
                final = ev
    end = time.perf_counter() - t0
    t = final.get("timings", {})
    return {"tokens": t.get("predicted_n", 0), "first_s": first if first is not None else end, "end_s": end,
            "text": "".join(parts), "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0)}


class Localspec:
    """`localspec serve` on a free port, for a `with` block."""

    def __init__(self, model: str, ctx: int, threads: int, spec: str, log_dir: Path, name: str = "",
                 code: str | None = None) -> None:
        """`code`: the checkout to run (PYTHONPATH), else this one. Each server keeps its
        state (the profile auto stores what it measured in) in a fresh folder: every run
        starts from no profile."""
        self.port = free_port()
        self.log = log_dir / f"localspec-{name or spec}.log"
        self.env = {**os.environ, "LOCALSPEC_HOME": str(log_dir / f"home-{name or spec}")}
        self.cwd = code  # `python -m` puts the working directory first on sys.path
        if code is not None:
            self.env["PYTHONPATH"] = code
        self.cmd = [sys.executable, "-m", "localspec", "serve", "-m", model, "--port", str(self.port),
                    "-np", "1", "-c", str(ctx), "-t", str(threads), "--spec", spec, "--draft", "none", "--no-log",
                    "--max-tokens-limit", "4096"]

    def __enter__(self) -> Localspec:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd)
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"localspec serve exited; see {self.log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.5)
        raise RuntimeError("localspec serve did not come up")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--cuts", type=int, default=8)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP cuts (a run in parts)")
    ap.add_argument("--budgets", default="500,0", help="t_max_predict_ms values (0: unlimited)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--n-prefix", type=int, default=64, help="lines above the cursor (llama.vim: 256)")
    ap.add_argument("--n-suffix", type=int, default=32, help="lines below (llama.vim: 64)")
    ap.add_argument("--chunks", type=int, default=2, help="extra chunks from other files")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--types", default="ngram-simple,ngram-map-k", help="llama-server --spec-type values")
    ap.add_argument("--draft-n", type=int, default=16)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=CHECKOUT",
                    help="one more `localspec serve --spec auto`, run from another checkout (e.g. "
                         "before a change), side by side with the others")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the table of a saved run")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report({k: {int(b): rows for b, rows in v.items()} for k, v in saved.items()}, budgets)
        return
    path = models.resolve(args.model, role="target")
    work = cuts(args.skip + args.cuts, args.n_prefix, args.n_suffix, args.chunks, args.seed)[args.skip:]
    exe = None if args.no_llama_server else find_server_or_none(args.llama_server)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_infill-"))
    results: dict[str, dict[int, list[dict]]] = {}
    with contextlib.ExitStack() as stack:
        servers: dict[str, int] = {}
        for spec in ("none", "auto"):
            servers[f"localspec {spec}"] = stack.enter_context(
                Localspec(str(path), args.ctx, args.threads, spec, log_dir)).port
        for also in args.also:
            name, _, code = also.partition("=")
            servers[f"localspec auto {name}"] = stack.enter_context(
                Localspec(str(path), args.ctx, args.threads, "auto", log_dir, name, code)).port
        if exe is not None:
            args.ctx, args.threads = args.ctx, args.threads  # compare_llama_server's Server reads these
            args.server_args = f"-b 2048 {args.server_args}"
            for s in [Setting("plain"), *(Setting(t, args.draft_n) for t in args.types.split(","))]:
                try:
                    servers[f"llama-server {s.label}"] = stack.enter_context(
                        LlamaServer(exe, path, s, args, 0, log_dir)).port
                except RuntimeError as exc:
                    print(f"{s.label}: {exc}", file=sys.stderr)
        for port in servers.values():  # warm-up: the first request pays for page faults
            infill(port, llama_vim(work[0], 0, 4))
        for i, cut in enumerate(work):
            for budget in budgets:
                for label, port in servers.items():
                    r = infill(port, llama_vim(cut, budget, args.n_predict))
                    results.setdefault(label, {}).setdefault(budget, []).append({"cut": cut["name"], **r})
            print(f"cut {i + 1}/{len(work)} {cut['name']}", file=sys.stderr)
            if args.json:  # after every cut: a run cut short still leaves what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, budgets)


def find_server_or_none(given: str | None) -> Path | None:
    try:
        return find_server(given)
    except SystemExit as exc:
        print(f"(llama-server: {exc}; localspec only)", file=sys.stderr)
        return None


def report(results: dict, budgets: list[int]) -> None:
    """Per server and budget: tokens per request; their ratio (per cut, geometric mean) to
    plain llama-server's, to its best speculative setting's, and to the same tool's own
    plain decoding ("own": localspec none, llama-server plain); the cuts where it gave
    fewer tokens than its own plain run; latencies; texts equal to plain llama-server's
    and to its own plain run's (last budget); draft acceptance."""
    labels = list(results)
    plain = "llama-server plain" if "llama-server plain" in results else "localspec none"
    own_of = lambda label: "localspec none" if label.startswith("localspec") else "llama-server plain"
    ref_text = {lab: {r["cut"]: r["text"] for r in results[lab][budgets[-1]]} for lab in {plain, *map(own_of, labels)}
                if lab in results}
    print(f"{'server':30} {'budget':>6} {'tok/req':>8} {'vs plain':>9} {'vs best ls':>10} {'vs own':>7} "
          f"{'worse own':>9} {'first s':>8} {'end s':>7} {'same':>5} {'same own':>8} {'accept':>7}")
    ratio = lambda rows, base: geomean([r["tokens"] / b["tokens"] for r, b in zip(rows, base) if b["tokens"]])
    for budget in budgets:
        spec_ls = [k for k in labels if k.startswith("llama-server") and k != "llama-server plain"]
        for label in labels:
            rows = results[label][budget]
            own = results[own_of(label)][budget] if own_of(label) in results else rows
            best = None
            if spec_ls:
                best_label = max(spec_ls, key=lambda k: sum(r["tokens"] for r in results[k][budget]))
                best = ratio(rows, results[best_label][budget])
            worse = sum(1 for r, b in zip(rows, own) if r["tokens"] < b["tokens"])
            last = budget == budgets[-1]
            same = sum(1 for r in rows if r["text"] == ref_text[plain].get(r["cut"])) if last else None
            same_own = (sum(1 for r in rows if r["text"] == ref_text[own_of(label)].get(r["cut"]))
                        if last and own_of(label) in ref_text else None)
            drafted = sum(r["drafted"] for r in rows)
            acc = sum(r["accepted"] for r in rows) / drafted if drafted else 0.0
            n = len(rows)
            fmt = lambda x: f"{x}/{n}" if x is not None else "-"
            print(f"{label:30} {budget or 'none':>6} {sum(r['tokens'] for r in rows) / n:8.1f} "
                  f"{(ratio(rows, results[plain][budget]) or 0):8.2f}x {(f'{best:.2f}x' if best else '-'):>10} "
                  f"{(ratio(rows, own) or 0):6.2f}x {worse:>9} "
                  f"{sum(r['first_s'] for r in rows) / n:8.2f} {sum(r['end_s'] for r in rows) / n:7.2f} "
                  f"{fmt(same):>5} {fmt(same_own):>8} {acc:7.2f}")


if __name__ == "__main__":
    main()
