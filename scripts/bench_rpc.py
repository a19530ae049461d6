#!/usr/bin/env python3
"""RPC benchmark: the target on two loopback `localspec worker`s, plain vs n-gram vs auto
on an edit task and a code prompt, greedy, side by side in one process. Prints decode
tok/s, the speedup of each mode as a ratio to plain, and whether its output equals plain's.

    python scripts/bench_rpc.py [--model NAME] [-n 64] [--delay-ms 0,1] [--repeats 1]

Every layer goes to the workers (-ngl -1 with --rpc), shared evenly; the drafter runs
here. --delay-ms adds latency with a user-space relay in front of each worker (each
chunk held D ms per direction, so a round trip costs 2*D ms more): a loopback network
has almost none, a LAN ~0.2-1 ms per direction. `tc netem` would be the kernel's way,
but needs the sch_netem module, which containers often lack.
"""

from __future__ import annotations

import argparse
import sys
import time

from localspec import models
from localspec.bench import workloads as wl
from localspec.bench.workers import DelayRelay, LoopbackWorkers
from localspec.core.backend import Model
from localspec.core.config import (
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.engine import collect, generate
from localspec.runtime import make_drafter

MODES = ("none", "ngram", "auto")
GREEDY = SamplingConfig(temperature=0.0)


def pick_workloads(names: str) -> list[wl.Workload]:
    by_name = {w.name: w for w in wl.builtin()}
    missing = [n for n in names.split(",") if n not in by_name]
    if missing:
        sys.exit(f"unknown workload {', '.join(missing)}; have {', '.join(by_name)}")
    return [by_name[n] for n in names.split(",")]


def run_mode(target: Model, prep: wl.Prepared, mode: str, n: int) -> tuple[list[int], object]:
    spec = SpecConfig(mode=mode, draft_max=32 if mode == "auto" else 16, adaptive=mode != "auto")
    drafter = make_drafter(spec, GREEDY, None, prep.extra, target=target)
    ids, _, stats = collect(generate(target, prep.tokens, drafter, sampling=GREEDY, spec=spec,
                                     gen=GenerationConfig(max_tokens=n)))
    return ids, stats


def bench(endpoints: list[str], args: argparse.Namespace, label: str) -> None:
    path = models.resolve(args.model, role="target")
    t0 = time.perf_counter()
    target = Model(ModelConfig(path=str(path), n_ctx=4096, n_threads=args.threads,
                               rpc=tuple(endpoints), n_gpu_layers=-1))
    print(f"\n== {label}: {target.name} on {', '.join(target.info.offload)} via "
          f"{', '.join(endpoints)} (load {time.perf_counter() - t0:.1f} s)")
    try:
        for w in pick_workloads(args.workloads):
            prep = wl.prepare(w, target, args.n, args.n)
            run_mode(target, prep, "none", 4)  # warm-up: prefill, first graphs on the workers
            rows: dict[str, list] = {m: [] for m in MODES}
            for _ in range(args.repeats):  # interleaved: machine noise hits every mode alike
                for mode in MODES:
                    rows[mode].append(run_mode(target, prep, mode, args.n))
            report(w.name, rows)
    finally:
        target.close()


def report(name: str, rows: dict[str, list]) -> None:
    """Decode speed (first token to last: the prompt's prefill, cached after the first
    mode, is left out) and its ratio to plain."""
    def rate(runs: list) -> float:
        return sum(st.generated for _, st in runs) / sum(st.decode_s for _, st in runs)

    plain_ids, plain_rate = rows["none"][0][0], rate(rows["none"])
    for mode, runs in rows.items():
        stats = runs[-1][1]
        same = all(ids == plain_ids for ids, _ in runs)
        print(f"  {name:<8} {mode:<6} {rate(runs):6.1f} tok/s  {rate(runs) / plain_rate:5.2f}x plain  "
              f"{stats.tokens_per_round:5.2f} tok/round  acceptance {stats.acceptance:4.0%}  "
              f"{'same output' if same else 'OUTPUT DIFFERS from plain'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target [default: qwen2.5-coder-1.5b]")
    ap.add_argument("-n", type=int, default=64, help="tokens per generation")
    ap.add_argument("--workloads", default="edit-1,code-1", help="built-in workload names")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="threads of each worker and of this process")
    ap.add_argument("--delay-ms", default="0", help="added one-way latency, comma-separated runs")
    args = ap.parse_args()
    with LoopbackWorkers(2, threads=args.threads) as workers:
        for delay in (float(d) for d in args.delay_ms.split(",")):
            if delay <= 0:
                bench(workers.endpoints, args, "loopback")
                continue
            relays = [DelayRelay(ep, delay / 1000) for ep in workers.endpoints]
            bench([r.endpoint for r in relays], args, f"loopback + {delay:g} ms each way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
