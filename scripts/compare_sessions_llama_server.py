#!/usr/bin/env python3
"""The session benchmark (localspec/bench/sessions.py) side by side with llama-server:
the same sessions' prompt tokens through llama-server plain and with `--spec-type
ngram-cache` (its dynamic cache lives for the server's lifetime, so later requests of a
session can draft from earlier ones) and the other n-gram kinds, against localspec plain,
auto, and auto with its memory. A benchmark, not a test; greedy; decode speed only.

Each llama-server setting gets a fresh server per session (its caches start empty, as
localspec's memory does); each tool's speedup is over its OWN plain run of the same
request, and "vs best" is localspec's memory run over the best llama-server setting.

    python scripts/compare_sessions_llama_server.py [--model NAME] [--sessions tests,agent]
        [--requests 5] [-n 128] [--settings plain,ngram-cache:16,ngram-map-k:16] [--json out.json]

llama-server comes from --llama-server PATH, $LLAMA_SERVER or the build
scripts/compare_llama_server.py --build makes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_llama_server import Server, Setting, find_server, server_commit  # noqa: E402

from localspec.bench import sessions as sb  # noqa: E402
from localspec.commands.doctor import system_report  # noqa: E402
from localspec.core.config import LoadOptions  # noqa: E402
from localspec.core.chat_template import chat_prompt
from localspec.runtime import open_runtime  # noqa: E402


def complete(server: Server, tokens: list[int], n_predict: int) -> dict:
    body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
            "cache_prompt": True, "stream": False}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    t = out["timings"]
    return {"tok_s": t["predicted_per_second"], "tokens": t["predicted_n"], "drafted": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0), "text": out.get("content", "")}


def parse_settings(text: str) -> list[Setting]:
    out = []
    for item in text.split(","):
        kind, _, n = item.strip().partition(":")
        out.append(Setting(kind, int(n or 0)))
    return out


def gm(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--sessions", default="tests,hints,agent,fresh")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--settings", default="plain,ngram-cache:16,ngram-map-k:16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    exe = find_server(args.llama_server)
    settings = parse_settings(args.settings)
    known = {s.name: s for s in sb.builtin_sessions()}
    chosen = [known[n] for n in args.sessions.split(",")]
    cpu = system_report(args.threads)["cpu"]["description"]
    opts = LoadOptions(model=args.model, draft="none", n_ctx=args.ctx, n_threads=args.threads,
                       n_gpu_layers=0, n_gpu_layers_draft=0)
    with open_runtime(opts, want_draft=False) as rt, tempfile.TemporaryDirectory() as logs:
        print(f"{rt.target.name} on {cpu}, {args.threads} threads; llama-server {server_commit(exe)}",
              file=sys.stderr)
        ours = sb.speedups(sb.run_sessions(rt, chosen, args.requests, args.n_predict,
                                           progress=lambda s: print(s, file=sys.stderr)))
        theirs: dict[tuple[str, int], dict[str, dict]] = {}
        for s in chosen:
            prompts = [chat_prompt(rt.target, u, s.system) for u in s.requests[:args.requests]]
            for setting in settings:
                with contextlib.ExitStack() as stack:
                    server = stack.enter_context(Server(exe, rt.target.path, setting, args, 0, Path(logs)))
                    for i, p in enumerate(prompts):
                        g = complete(server, p, args.n_predict)
                        theirs.setdefault((s.name, i + 1), {})[setting.label] = g
                        print(f"{s.name} {i + 1} llama-server {setting.label}: {g['tok_s']:.1f} tok/s "
                              f"accepted {g['accepted']}/{g['drafted']}", file=sys.stderr)
    rows = []
    for line in ours:
        runs = theirs[(line["session"], line["request"])]
        plain = runs["plain"]
        server_up = {k: g["tok_s"] / plain["tok_s"] for k, g in runs.items() if k != "plain"}
        best = max(server_up.items(), key=lambda kv: kv[1]) if server_up else ("-", None)
        same = {k: g["text"] == plain["text"] for k, g in runs.items() if k != "plain"}
        rows.append({**line, "server": server_up, "server_same": same, "server_best": best[0],
                     "vs_best": line["memory"] / best[1] if best[1] else None})
    print(f"{'session':8} {'req':>3} {'auto':>6} {'memory':>7} " + " ".join(f"{s.label:>16}" for s in settings[1:])
          + f" {'vs best':>8}  memory accepted")
    for r in rows:
        print(f"{r['session']:8} {r['request']:>3} {r['auto']:5.2f}x {r['memory']:6.2f}x "
              + " ".join(f"{r['server'].get(s.label, 0):15.2f}x" for s in settings[1:])
              + f" {r['vs_best'] or 0:7.2f}x  {r['memory_accepted']}")
    print()
    for name in dict.fromkeys(r["session"] for r in rows):
        mine = [r for r in rows if r["session"] == name]
        later = [r for r in mine if r["request"] >= 3]
        cols = [f"memory {gm([r['memory'] for r in mine]) or 0:.2f}x (3+: {gm([r['memory'] for r in later]) or 0:.2f}x)"]
        cols += [f"{s.label} {gm([r['server'].get(s.label) for r in mine]) or 0:.2f}x" for s in settings[1:]]
        cols += [f"memory vs best {gm([r['vs_best'] for r in mine]) or 0:.2f}x"]
        print(f"{name:8} " + ", ".join(cols))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
