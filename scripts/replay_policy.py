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
    python scripts/replay_policy.py replay traces.json [--profile P.json] [--noise 0.15]

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
import sys

import numpy as np

from localspec.core.config import ModelConfig, SpecConfig
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.base import Draft, DrafterBase, NoDrafter
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import AdaptiveK
from localspec.models.profile import Profile


def record(path: str, target: str, draft: str, prompts: str | None = None) -> None:
    from localspec import models
    from localspec.bench.runner import NoProgress, Settings, Variant, run_engine
    from localspec.bench.workloads import builtin, load_jsonl, name_workloads, prepare
    from localspec.core.backend import Model, default_threads
    from localspec.core.runtime import Runtime

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=4096, n_threads=default_threads()))
    d = Model(ModelConfig(str(models.resolve(draft, role="draft")), n_ctx=4096, n_threads=default_threads()))
    rt, settings = Runtime(t), Settings(log=False)
    out = []
    for w in name_workloads(load_jsonl(prompts)) if prompts else builtin():
        prep = prepare(w, t, 256)
        # the bench's plain run: stops at an edit's closing fence as `localspec edit` does
        ids = run_engine(rt, prep, Variant("none"), w, settings, NoProgress()).ids
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
    """Modelled decode time (in one-token times) of the trace's output with `drafter`."""
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
        verify = v[min(n + 1, len(v)) - 1]
        draft_cost = n * c if d.source == "model" else 0.0
        total += verify + draft_cost
        seen = verify * (math.exp(rng.gauss(0, noise)) if noise else 1.0)
        policy.update(n, a)
        drafter.observe(n, a, seen, draft_cost)
        tokens += ids[done : done + a + 1]
        done += a + 1
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("record", "replay"))
    ap.add_argument("traces")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", help="record: a workload JSONL instead of the built-in ones")
    ap.add_argument("--profile", help="a profile JSON from `localspec tune` (default: this "
                    "machine's for the default pair)")
    ap.add_argument("--noise", type=float, default=0.0, help="lognormal sigma on the round "
                    "times auto sees (the modelled cost stays exact)")
    args = ap.parse_args()
    if args.action == "record":
        record(args.traces, args.model, args.draft, args.prompts)
        return 0
    if args.profile:
        with open(args.profile) as f:
            profile = Profile(**json.load(f))
    else:
        from localspec import models
        from localspec.core.backend import Model, default_threads
        from localspec.core.runtime import find_profile

        threads = default_threads()  # as `localspec tune` measures by default
        t = Model(ModelConfig(str(models.resolve(args.model)), n_ctx=64, n_threads=threads))
        d = Model(ModelConfig(str(models.resolve(args.draft, role="draft")), n_ctx=64, n_threads=threads))
        profile = find_profile(t, d)
        if profile is None:
            print("no profile for the default pair: run `localspec tune` or pass --profile", file=sys.stderr)
            return 2
    v, c = profile.vcurve, profile.c or 0.5
    with open(args.traces) as f:
        traces = json.load(f)
    for tr in traces:
        sizes, extra = ((3, 12) if tr["tag"] == "edit" else (1, 4)), tr["extra"]

        def ng(sizes=sizes, extra=extra) -> NgramDrafter:
            return NgramDrafter(*sizes, extra=extra)

        plain = replay(tr, NoDrafter(), v, c, 1, False)
        fixed = {}
        for k in (4, 8, 16):
            fixed[f"ngram k={k}"] = replay(tr, ng(), v, c, k, True)
            fixed[f"model k={k}"] = replay(tr, ReplayModelDrafter(tr), v, c, k, True)
        best = min(fixed, key=fixed.get)
        autos = {k: replay(tr, AutoDrafter(ng(), ReplayModelDrafter(tr), profile, k_max=k), v, c, k,
                           False, args.noise) for k in (4, 16, 32)}
        print(f"{tr['name']:8} best fixed {best:11} {plain / fixed[best]:.2f}x | auto "
              + " ".join(f"k<={k}: {plain / t:.2f}x" for k, t in autos.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
