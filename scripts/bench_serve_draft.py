#!/usr/bin/env python3
"""Serving throughput with the draft model: aggregate tokens/s for C closed-loop
clients with --spec none / ngram / model / auto, side by side in one process (the serve
scheduler, minus HTTP; speculation never turned off by load, so each mode is measured
at each C), greedy. Prints ratios to `none` at each C, acceptance per drafter, draft
slots per batched draft decode, and whether every text equals the `none` text.

    python scripts/bench_serve_draft.py -m smollm2-135m --draft smollm2-135m -n 48
    python scripts/bench_serve_draft.py -n 32            # the default Qwen pair
"""

from __future__ import annotations

import argparse
import queue
import time

from localspec.bench import workloads as wl
from localspec.core.config import (
    GenerationConfig,
    LoadOptions,
    SamplingConfig,
    SpecConfig,
)
from localspec.runtime import open_runtime
from localspec.serve.jobs import Failed, Finished, Job
from localspec.serve.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingConfig(temperature=0.0)
SPECS = {
    "none": SpecConfig(mode="none"),
    "ngram": SpecConfig(mode="ngram", draft_max=16),
    "model": SpecConfig(mode="model", draft_max=16),
    "auto": SpecConfig(mode="auto", draft_max=32, adaptive=False),
}


def measure(target, draft, prompts: list[list[int]], c: int, spec: SpecConfig, n: int) -> dict:
    """C clients, each sending its share of `prompts` (at least C) one after another."""
    prompts = [prompts[i % len(prompts)] for i in range(max(c, len(prompts)))]
    cfg = SchedulerConfig(n_slots=c, queue_size=len(prompts), spec=spec, spec_disable_by_batch_size=-1)
    sched = Scheduler(target, cfg, draft=draft if spec.mode in ("model", "auto") else None)
    events: queue.Queue = queue.Queue()
    pending = [list(range(i, len(prompts), c)) for i in range(c)]
    texts: dict[int, str] = {}
    parts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    tokens = 0

    def submit(client: int) -> None:
        i = pending[client].pop(0)
        sched.submit(Job(prompts[i], GREEDY, GenerationConfig(max_tokens=n),
                         sink=lambda ev, i=i, client=client: events.put((i, client, ev))))

    sched.start()
    t0 = time.perf_counter()
    try:
        for client in range(c):
            submit(client)
        while len(texts) < len(prompts):
            i, client, ev = events.get(timeout=1200)
            if isinstance(ev, Failed):
                raise RuntimeError(ev.message)
            if isinstance(ev, Finished):
                texts[i] = "".join(parts[i]) + ev.text
                tokens += ev.stats.generated
                if pending[client]:
                    submit(client)
            else:
                parts[i].append(ev.text)
        wall = time.perf_counter() - t0
    finally:
        sched.stop()
    m = sched.metrics
    return {"tok_s": tokens / wall, "texts": [texts[i] for i in range(len(prompts))],
            "by_drafter": {k: tuple(v) for k, v in m.by_drafter.items()},
            "rows_per_draft_decode": m.draft_model_rows / m.draft_model_decodes if m.draft_model_decodes else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--modes", default="none,ngram,model,auto")
    ap.add_argument("--tags", default="code,json,prose,edit", help="one built-in workload of each")
    args = ap.parse_args()
    cs = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    opts = LoadOptions(model=args.model, draft=args.draft, n_ctx=max(cs) * 1024, n_threads=args.threads,
                       n_gpu_layers=-1, n_gpu_layers_draft=-1)
    with open_runtime(opts, want_draft=True, n_seq_max=max(cs)) as rt:
        target, draft = rt.target, rt.draft
        items = wl.select(wl.builtin(), args.tags.split(","), 1)
        prompts = [wl.prepare(w, target, args.n, args.n).tokens for w in items]
        prompts = [p for p in prompts if len(p) + args.n + 40 < target.n_ctx_seq]
        print(f"target {target.name}, draft {draft.name if draft else None}, {len(prompts)} prompts, "
              f"-n {args.n}, {target.info.n_threads} threads")
        measure(target, draft, prompts[:1], 1, SPECS["model" if draft else "ngram"], 4)  # warm-up
        for j, c in enumerate(cs):
            runs = {}
            for mode in modes if j % 2 == 0 else modes[::-1]:  # interleaved: drift hits all alike
                runs[mode] = measure(target, draft, prompts, c, SPECS[mode], args.n)
            base = runs["none"]
            for mode in modes:
                r = runs[mode]
                same = sum(a == b for a, b in zip(r["texts"], base["texts"]))
                total = len(base["texts"])
                acc = ", ".join(f"{k} {a}/{d}" for k, (_, d, a) in sorted(r["by_drafter"].items()))
                rows = r["rows_per_draft_decode"]
                print(f"C={c} {mode:6s} {r['tok_s']:7.2f} tok/s  x{r['tok_s'] / base['tok_s']:.2f} vs none"
                      f"  same text {same}/{total}  accepted/drafted: {acc or '-'}"
                      + (f"  slots per draft decode {rows:.2f}" if rows else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
