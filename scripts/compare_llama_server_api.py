#!/usr/bin/env python3
"""llama-server's own endpoints, localspec against llama-server on the same model and
the same requests: /tokenize, /detokenize, /apply-template, /completion and /infill
(greedy, whole and streamed), /props, /slots, /v1/models. For each it prints whether
both answered 200, the keys llama-server's reply has that localspec's lacks, and whether
the values that must agree do (token ids, text, generated content). A check to run by
hand where llama-server is built (scripts/compare_llama_server.py's docstring says how),
not a test.

    python scripts/compare_llama_server_api.py [--model qwen2.5-coder-0.5b] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_infill import Localspec  # noqa: E402
from compare_llama_server import Server as LlamaServer  # noqa: E402
from compare_llama_server import Setting, find_server  # noqa: E402

from localspec import models  # noqa: E402

PREFIX = "import math\n\n\ndef area(r):\n    return math.pi * r * r\n\n\ndef circumference(r):\n"
SUFFIX = "\n\n\ndef volume(r):\n    return 4 / 3 * math.pi * r ** 3\n"
GREEDY = {"temperature": 0.0, "top_k": 1, "n_predict": 24}
REQUESTS = [
    ("POST", "/tokenize", {"content": "def f(x):\n    return x  # ünïcode"}, ["tokens"]),
    ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}, ["tokens"]),
    ("POST", "/detokenize", {"tokens": [750, 282, 2075, 982]}, ["content"]),
    ("POST", "/apply-template", {"messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hi"}]}, ["prompt"]),
    ("POST", "/completion", {"prompt": "def fibonacci(n):", **GREEDY}, ["content", "tokens_predicted", "tokens_evaluated"]),
    ("POST", "/completion", {"prompt": [750, 282, 2075, 982], **GREEDY}, ["content", "tokens_evaluated"]),
    ("POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    ", **GREEDY,
                         "input_extra": [{"filename": "geo.py", "text": "def diameter(r):\n    return 2 * r\n"}]},
     ["content", "tokens_evaluated"]),
    ("POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    ", **GREEDY,
                         "response_fields": ["content", "timings/prompt_n", "truncated"]}, ["content"]),
    ("GET", "/props", None, []),
    ("GET", "/slots", None, []),
    ("GET", "/v1/models", None, []),
]


def call(port: int, method: str, path: str, body: dict | None, stream: bool = False) -> tuple[int, object]:
    data = json.dumps({**body, "stream": True} if stream else body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:200]
    if stream:
        events = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: ")]
        return status, {"content": "".join(e.get("content", "") for e in events), "events": len(events),
                        "last": sorted(events[-1]) if events else []}
    return status, json.loads(raw)


def keys(obj: object) -> set[str]:
    if isinstance(obj, list):
        return keys(obj[0]) if obj else set()
    return set(obj) if isinstance(obj, dict) else set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = models.resolve(args.model, role="target")
    exe = find_server(args.llama_server)
    log_dir = Path(tempfile.mkdtemp(prefix="compare_api-"))
    args.server_args = "-b 2048 --slots --jinja"
    ok = True
    with contextlib.ExitStack() as stack:
        ls = stack.enter_context(Localspec(str(path), args.ctx, args.threads, "auto", log_dir)).port
        ref = stack.enter_context(LlamaServer(exe, path, Setting("plain"), args, 0, log_dir)).port
        for method, route, body, agree in REQUESTS:
            for stream in ((False, True) if route in ("/completion", "/infill") and "response_fields" not in body
                           else (False,)):
                (s1, mine), (s2, theirs) = call(ls, method, route, body, stream), call(ref, method, route, body, stream)
                missing = sorted(keys(theirs) - keys(mine))
                fields = ["content"] if stream else agree
                differ = [f for f in fields if isinstance(mine, dict) and isinstance(theirs, dict)
                          and mine.get(f) != theirs.get(f)]
                good = s1 == s2 == 200 and not differ
                ok &= good
                name = f"{method} {route}{' (stream)' if stream else ''} {json.dumps(body)[:40] if body else ''}"
                print(f"{'ok  ' if good else 'DIFF'} {name:70} status {s1}/{s2}"
                      + (f"  missing keys: {missing}" if missing else "")
                      + "".join(f"\n       {f}: localspec {str(mine.get(f))[:90]!r}\n       {'':{len(f)}}  "
                                f"llama-server {str(theirs.get(f))[:90]!r}" for f in differ))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
