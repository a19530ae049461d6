#!/usr/bin/env python3
"""Replay recorded greedy generations through the drafting policies under a measured cost
curve: a deterministic, noise-free comparison of `auto` with every fixed (drafter, k).

Timing on a shared 2-core machine varies ~10-15% between identical runs, which hides
the 3-5% differences the auto policy is judged on. Greedy output does not depend on the
drafter (lossless), so one plain generation per workload fixes every policy's rounds:
what each drafter would propose, what the target accepts. Only the cost is modelled:
V(n) from a `localspec tune` profile for each verify of n tokens, c per draft-model
token. `auto` runs as it does in the engine (its own drafter object, fed the modelled
round times, optionally with noise).

    python scripts/replay_policy.py record traces.json     # plain decode of every
                                                           # built-in workload (~6 min)
    python scripts/replay_policy.py vcurve cpu.json        # V(n) up to 257 (~2 min)
    python scripts/replay_policy.py replay traces.json [--curve gpu|cpu.json] [--noise 0.1]

`replay` compares auto three ways with the best fixed (drafter, k): informed by a tune
profile of the true curve (V(1..64), c), fresh (no profile at all: the first run on a
machine), and second (informed only by what the fresh run stored). `--bound` adds two
ceilings: the n-gram oracle (drafts exactly the prefix the target accepts, cut at the
curve's cheap points) and a drafter that is always right.

`record --prompts FILE` records other workloads (bench's JSONL format) instead, e.g.
scripts/heldout/tasks.jsonl: five edits of this repository's files that no policy
constant was tuned on, to check a change made for the built-in ones.

`record` also runs the draft model over each output once, so model drafts are replayed
too: its greedy token and top probability at every position.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys

import numpy as np

from localspec.core.config import ModelConfig, SpecConfig
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.base import Draft, DrafterBase, NoDrafter
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import AdaptiveK
from localspec.models.profile import Profile, merge_online

# the fixed k auto is judged against, adaptive and fixed (15 fixed: edit's old default)
FIXED_K = (4, 8, 15, 16, 32, 64, 128, 256)


def record(path: str, target: str, draft: str, prompts: str | None = None,
           fast: bool = False) -> None:
    """One greedy generation per workload (edits first), written after each. `fast`
    decodes with n-gram drafting: the same greedy output (up to near-ties of batched
    kernels, immaterial to a trace) in a fraction of the time on long edits."""
    from localspec import models
    from localspec.bench.runner import NoProgress, Settings, Variant, run_engine
    from localspec.bench.workloads import builtin, load_jsonl, name_workloads, prepare
    from localspec.core.backend import Model, default_threads
    from localspec.core.runtime import Runtime

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=4096, n_threads=default_threads()))
    d = Model(ModelConfig(str(models.resolve(draft, role="draft")), n_ctx=4096, n_threads=default_threads()))
    rt, settings = Runtime(t), Settings(log=False)
    variant = Variant("ngram", 64, SpecConfig(mode="ngram", draft_max=64)) if fast else Variant("none")
    out = []
    workloads = name_workloads(load_jsonl(prompts)) if prompts else builtin()
    for w in sorted(workloads, key=lambda w: not w.is_edit):
        prep = prepare(w, t, 256)
        # the bench's run: stops at an edit's closing fence as `localspec edit` does
        ids = run_engine(rt, prep, variant, w, settings, NoProgress()).ids
        d.rewind(0)
        d.prefill(prep.tokens[:-1])
        rest = [prep.tokens[-1], *ids]
        arg, top = [], []
        for i in range(0, len(rest), 256):
            r = np.asarray(d.decode(rest[i : i + 256], "all"), dtype=np.float64)
            p = np.exp(r - r.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            arg += [int(x) for x in p.argmax(axis=1)]
            top += [float(x) for x in p.max(axis=1)]
        out.append({"name": w.name, "tag": w.tag, "prompt": prep.tokens, "extra": prep.extra,
                    "ids": ids, "d_arg": arg, "d_p": top})
        print(f"{w.name}: {len(ids)} tokens", file=sys.stderr)
        with open(path, "w") as f:
            json.dump(out, f)


class ReplayModelDrafter(DrafterBase):
    """The draft model's recorded greedy tokens (stops below p_min like ModelDrafter)."""

    name = "model"

    def __init__(self, trace: dict, p_min: float = 0.75) -> None:
        self.trace, self.p_min, self.n0 = trace, p_min, 0

    def begin(self, prompt):
        self.n0 = len(prompt)

    def draft(self, context, k):
        j = len(context) - self.n0  # the draft predicts ids[j] next
        ids, arg, top = self.trace["ids"], self.trace["d_arg"], self.trace["d_p"]
        toks: list[int] = []
        for i in range(j, min(j + k, len(arg))):
            if toks and top[i] < self.p_min:
                break
            toks.append(arg[i])
            if i < len(ids) and arg[i] != ids[i]:
                toks += [-1] * (k - len(toks))  # off the target's path: wrong from here on
                break
        return Draft(tokens=toks, source="model")


def replay(trace: dict, drafter, v: list[float], c: float, k_max: int, adaptive: bool,
           noise: float = 0.0, seed: int = 0) -> float:
    """Modelled decode time (in one-token times) of the trace's output with `drafter`;
    v[n - 1] is the true V(n) (len(v) > k_max)."""
    ids, rng = trace["ids"], random.Random(seed)
    policy = AdaptiveK(SpecConfig(mode="replay", draft_max=k_max, adaptive=adaptive))
    drafter.begin(trace["prompt"])
    tokens, done, total = [*trace["prompt"], ids[0]], 1, 0.0
    while done < len(ids):
        k = min(policy.k, len(ids) - done - 1)
        d = drafter.draft(tokens, k) if k > 0 else Draft()
        n = len(d.tokens[:k])
        a = 0
        while a < n and d.tokens[a] == ids[done + a]:
            a += 1
        verify = v[n]
        draft_cost = n * c if d.source == "model" else 0.0
        total += verify + draft_cost
        seen = verify * (math.exp(rng.gauss(0, noise)) if noise else 1.0)
        policy.update(n, a)
        drafter.observe(n, a, seen, draft_cost)
        tokens += ids[done : done + a + 1]
        done += a + 1
    drafter.end()  # the end of a generation: auto hands what it measured to `store`
    return total


def oracle(trace: dict, drafter, v: list[float], k_max: int, perfect: bool = False) -> float:
    """The least modelled decode time any drafting policy could reach with `drafter`: an
    oracle that knows how much of each draft the target accepts drafts exactly that
    prefix, cut where the curve is cheapest (dynamic programming over the output).
    `perfect`: a drafter that always proposes the target's own continuation (the cap of
    speculative decoding itself on this curve)."""
    ids = trace["ids"]
    n = len(ids)
    accept = [n - 1 - i for i in range(n)] if perfect else [0] * n
    if not perfect:
        drafter.begin(trace["prompt"])
        tokens = [*trace["prompt"], ids[0]]
        for done in range(1, n):
            d = drafter.draft(tokens, min(k_max, n - done - 1)).tokens
            a = 0
            while a < len(d) and d[a] == ids[done + a]:
                a += 1
            accept[done] = a
            tokens.append(ids[done])
    cost = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        cost[i] = min(v[m] + cost[i + m + 1] for m in range(min(accept[i], k_max) + 1))
    return cost[1]


def measure_curve(path: str, target: str, n_max: int) -> None:
    """V(n) of the target up to n_max (every n to 32, then costs.GRID's sizes; best of 3
    tries at each, as bench's V(n)), saved as {"sizes": [...], "v": [...]}."""
    from localspec import models
    from localspec.bench.vcurve import _context_tokens, decode_ms
    from localspec.core.backend import Model, default_threads
    from localspec.core.drafters.costs import grid_sizes

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=4096, n_threads=default_threads()))
    base = _context_tokens(t, 512)
    batch = _context_tokens(t, 512 + n_max)[512:]
    sizes = sorted({*range(1, 33), *grid_sizes(n_max)})
    decode_ms(t, base, batch[:1], 1)
    ms = []
    for n in sizes:
        ms.append(decode_ms(t, base, batch[:n], 3))
        print(f"V({n}) = {ms[-1] / ms[0]:.2f}", file=sys.stderr)
    with open(path, "w") as f:
        json.dump({"sizes": sizes, "v": [m / ms[0] for m in ms], "t_token_s": ms[0] / 1000}, f)


def true_curve(spec: str, n_max: int, profile: Profile | None) -> list[float]:
    """V(1..n_max) for the replay's cost: "gpu" (1 + 0.02 n), "profile" (the tune profile,
    extended linearly), or a file from `vcurve` (linear between its sizes)."""
    n = np.arange(1, n_max + 1)
    if spec == "gpu":
        return [float(x) for x in 1 + 0.02 * n]
    if spec == "profile":
        sizes, v = np.arange(1, len(profile.vcurve) + 1), np.asarray(profile.vcurve)
    else:
        with open(spec) as f:
            data = json.load(f)
        sizes, v = np.asarray(data["sizes"]), np.asarray(data["v"])
    slope = (v[-1] - v[len(v) // 2]) / (sizes[-1] - sizes[len(v) // 2])
    out = np.interp(n, sizes, v)
    out[n > sizes[-1]] = v[-1] + slope * (n[n > sizes[-1]] - sizes[-1])
    return [float(x) for x in out]


def tuned(v: list[float], c: float, n: int = 64) -> Profile:
    """The profile `localspec tune` would measure on that curve (V(1..64), c)."""
    return Profile(key="replay", target="t", draft="d", device="cpu", n_threads=2, n_gpu_layers=0,
                   t_token_s=1.0, vcurve=v[:n], prefill_tok_s=0.0, draft_t_token_s=c)


def fresh_then_stored(tr: dict, ng, model, v: list[float], c: float, k: int, noise: float,
                      seed: int) -> tuple[float, float]:
    """(first run with no profile, a second run informed by what the first stored)."""
    stored: dict = {}

    def keep(measured, t1):
        stored.update(merge_online({}, measured))

    t_first = replay(tr, AutoDrafter(ng(), model(), None, k_max=k, store=keep), v, c, k, False,
                     noise, seed)
    second = Profile(key="replay", target="t", draft=None, device="cpu", n_threads=2,
                     n_gpu_layers=0, t_token_s=1.0, vcurve=[], prefill_tok_s=0.0, online=stored)
    t_second = replay(tr, AutoDrafter(ng(), model(), second, k_max=k), v, c, k, False, noise, seed + 1)
    return t_first, t_second


def replay_trace(tr: dict, v: list[float], c: float, args) -> dict[str, float]:
    """Speedups over plain decoding of every fixed choice and of auto (informed by a tune
    profile, fresh, and second run), mean over the noise seeds."""
    sizes, extra = (args.edit_ngram if tr["tag"] == "edit" else (1, 4)), tr["extra"]

    def ng(sizes=sizes, extra=extra) -> NgramDrafter:
        return NgramDrafter(*sizes, extra=extra)

    def model(tr=tr) -> ReplayModelDrafter | None:
        return ReplayModelDrafter(tr) if args.model else None

    plain = replay(tr, NoDrafter(), v, c, 1, False)
    out = {}
    for k in FIXED_K:
        out[f"ngram {k}"] = plain / replay(tr, ng(), v, c, k, True)
        out[f"ngram ={k}"] = plain / replay(tr, ng(), v, c, k, False)
        if args.model and k <= 16:
            out[f"model {k}"] = plain / replay(tr, ReplayModelDrafter(tr), v, c, k, True)
    seeds = range(args.seeds if args.noise else 1)
    if args.bound:
        out["bound"] = plain / oracle(tr, ng(), v, max(args.k_max))
        out["perfect"] = plain / oracle(tr, None, v, max(args.k_max), perfect=True)
    for k in args.k_max:
        informed = [replay(tr, AutoDrafter(ng(), model(), tuned(v, c), k_max=k), v, c, k, False,
                           args.noise, s) for s in seeds]
        runs = [fresh_then_stored(tr, ng, model, v, c, k, args.noise, s) for s in seeds]
        out[f"auto {k}"] = plain / statistics.mean(informed)
        out[f"fresh {k}"] = plain / statistics.mean(r[0] for r in runs)
        out[f"second {k}"] = plain / statistics.mean(r[1] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("record", "vcurve", "replay"))
    ap.add_argument("traces", nargs="+", help="trace files (vcurve: the output file)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", help="record: a workload JSONL instead of the built-in ones")
    ap.add_argument("--fast", action="store_true", help="record: decode with n-gram drafting "
                    "(the same greedy output, up to near-ties; much faster on edits)")
    ap.add_argument("--n-max", type=int, default=257, help="vcurve: the largest batch timed")
    ap.add_argument("--curve", default="profile", help="the true V(n): profile (this machine's "
                    "`tune` profile), gpu (1 + 0.02 n) or a file from `vcurve`")
    ap.add_argument("--profile", help="a profile JSON from `localspec tune` (default: this "
                    "machine's for the default pair)")
    ap.add_argument("--c", type=float, default=None, help="draft model cost ratio (default: the profile's)")
    ap.add_argument("--no-model", dest="model", action="store_false",
                    help="replay without the draft model (as `localspec edit` runs by default)")
    ap.add_argument("--k-max", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 256],
                    help="auto's --draft-max values, comma-separated")
    ap.add_argument("--noise", type=float, default=0.0, help="lognormal sigma on the round "
                    "times auto sees (the modelled cost stays exact)")
    ap.add_argument("--seeds", type=int, default=5, help="noise seeds averaged (with --noise)")
    ap.add_argument("--edit-ngram", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=(3, 12), help="n-gram sizes for edits (min,max), as `localspec edit`")
    ap.add_argument("--bound", action="store_true", help="also report the n-gram oracle's "
                    "speedup (drafts exactly the prefix the target accepts, cut at the "
                    "curve's cheap points: no policy with this drafter does better) and a "
                    "perfect drafter's (the cap of speculation on this curve)")
    args = ap.parse_args()
    if args.action == "record":
        record(args.traces[0], args.model, args.draft, args.prompts, args.fast)
        return 0
    if args.action == "vcurve":
        measure_curve(args.traces[0], args.model, args.n_max)
        return 0
    profile = load(args) if args.curve == "profile" or args.c is None else None
    c = args.c if args.c is not None else (profile.c or 0.5)
    v = true_curve(args.curve, max([*args.k_max, *FIXED_K]) + 2, profile)
    print("V(n): " + ", ".join(f"{n}:{v[n - 1]:.2f}" for n in (2, 4, 8, 16, 32, 64, 128, 256)
                                if n <= len(v)) + f"; c = {c:.2f}")
    rows = []
    for path in args.traces:
        with open(path) as f:
            rows += [(tr["name"] if len(args.traces) == 1 else f"{path.split('/')[-1][:4]}:{tr['name']}",
                      replay_trace(tr, v, c, args)) for tr in json.load(f)]
    report(rows, args.k_max)
    return 0


def load(args) -> Profile:
    if args.profile:
        with open(args.profile) as f:
            return Profile(**json.load(f))
    from localspec import models
    from localspec.core.backend import Model, default_threads
    from localspec.core.runtime import find_profile

    threads = default_threads()  # as `localspec tune` measures by default
    t = Model(ModelConfig(str(models.resolve(args.model)), n_ctx=64, n_threads=threads))
    d = Model(ModelConfig(str(models.resolve(args.draft, role="draft")), n_ctx=64, n_threads=threads))
    profile = find_profile(t, d)
    if profile is None:
        sys.exit("no profile for the default pair: run `localspec tune` or pass --profile")
    return profile


def report(rows: list[tuple[str, dict[str, float]]], k_max: list[int]) -> None:
    """One line per trace: the best fixed choice, then auto (tune profile), fresh (no
    profile) and second (the profile the fresh run stored) per --draft-max, as speedups
    over plain and, in brackets, over the best fixed; then the oracle bounds (--bound);
    then the worst of each column."""
    autos = [f"{kind} {k}" for k in k_max for kind in ("auto", "fresh", "second")]
    bounds = [b for b in ("bound", "perfect") if b in rows[0][1]]
    print(f"{'trace':14} {'best fixed':>18} " + " ".join(f"{a:>16}" for a in autos)
          + "".join(f"{b:>9}" for b in bounds))
    worst = {a: [math.inf, math.inf] for a in autos}
    for name, out in rows:
        best = max((key for key in out if key.split()[0] not in ("auto", "fresh", "second",
                                                                 *bounds)), key=out.get)
        cells = []
        for a in autos:
            rel = out[a] / out[best]
            worst[a] = [min(worst[a][0], out[a]), min(worst[a][1], rel)]
            cells.append(f"{out[a]:.2f}x ({rel:.3f})")
        print(f"{name:14} {best:>10} {out[best]:.2f}x " + " ".join(f"{c:>16}" for c in cells)
              + "".join(f"{out[b]:8.2f}x" for b in bounds))
    print(f"{'worst':14} {'':>18} " + " ".join(f"{w[0]:.2f}x ({w[1]:.3f})".rjust(16) for w in worst.values()))


if __name__ == "__main__":
    sys.exit(main())
