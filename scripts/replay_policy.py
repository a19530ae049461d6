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
machine), and second (informed only by what the fresh run stored). `--bound` adds
hindsight (informed auto with how long the trace's copies last known ahead: the run-age
counts of an earlier pass over it) and two ceilings: the n-gram oracle (drafts exactly
the prefix the target accepts, cut at the curve's cheap points) and a drafter that is
always right.

`random-edits OUT.json` writes --count random dense edits (bench/random_edits.py: short
changes every few tokens, made inconsistently: no model edits this way, and it is where
auto's bets on a copy's age go wrong most) and prints auto's time over plain decoding's
on --curve, informed and fresh: median, 95th percentile, worst, and the share more than 5%
slower. `rounds OUT.json -v` then shows any of them round by round.

`hazard` prints how often the edit traces' copies break by run age (a copy of the file, of
an instruction's prediction of the output, of the output's own earlier text) beside the
priors core/tuning.py holds for each.

`record --prompts FILE` records other workloads (bench's JSONL format) instead, e.g.
scripts/heldout/tasks.jsonl: five edits of this repository's files that no policy
constant was tuned on, to check a change made for the built-in ones.

`record` also runs the draft model over each output once, so model drafts are replayed
too: its greedy token and top probability at every position.

Sessions (localspec/bench/sessions.py) replay with the memory across their requests:

    python scripts/replay_policy.py record-sessions s.json --model qwen2.5-coder-0.5b \
        [--sessions tests,agent,fresh] [--requests 4] [-n 96]    # plain decode of each request
    python scripts/replay_policy.py sessions s.json --curve cpu.json   # per request: auto, memory

    python scripts/replay_policy.py synth traces.json --prompts edits.jsonl
    python scripts/replay_policy.py rounds traces.json --curve cpu.json [--fresh]

`rounds` prints auto's rounds beside the n-gram oracle's (bench.replay.rounds_against_oracle):
where each round stood, what it drafted, what was accepted and what the oracle's drafter
would have had accepted, and its regret (what it lost against the oracle), summed by
kind: drafts too long (rejected before their end), cut short (all accepted, the copy went
on), plain rounds where the n-gram had a match.

`pieces` adds the tokens' texts to traces recorded without them (the n-gram drafter is
given the target's, as in `localspec edit`: a rename's other spellings), and an edit's
prediction where its instruction foretells changes (renames.py: the file so changed,
which the n-gram drafter copies in place of the file, as in `localspec edit`); `record` and
`synth` store both.

`synth` writes edit traces without decoding: each task of the JSONL names, beside "file"
and "instruction", an "after" file (the edit done right, relative to the JSONL); the
output is that file's body and the closing fence, in the target's tokens. A trace of an
edit a model would make in minutes of plain decoding, made in seconds (no draft-model
tokens: replay it with --no-model, as `localspec edit` runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from rich.console import Console
from rich.table import Table

from localspec.bench.replay import FIXED_K, copy_hazard, replay_session, replay_trace, true_curve
from localspec.bench.random_edits import against_plain, random_traces, summary
from localspec.core.config import ModelConfig, SpecConfig
from localspec.core.tuning import COPY_PRIOR, EDGES, PREDICTED_PRIOR, PRIOR
from localspec.profile import Profile


def record(path: str, target: str, draft: str, prompts: str | None = None,
           fast: bool = False) -> None:
    """One greedy generation per workload (edits first), written after each. `fast`
    decodes with n-gram drafting: the same greedy output (up to near-ties of batched
    kernels, immaterial to a trace) in a fraction of the time on long edits."""
    from localspec import models
    from localspec.bench.runner import NoProgress, Settings, Variant, run_engine
    from localspec.bench.workloads import builtin, load_jsonl, name_workloads, prepare
    from localspec.core.backend import Model, default_threads
    from localspec.runtime import Runtime

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
                    "instruction": w.instruction, "file": w.file, "ids": ids, "d_arg": arg, "d_p": top})
        add_prediction(t, out[-1])
        out[-1]["pieces"] = token_pieces(t, out[-1])
        print(f"{w.name}: {len(ids)} tokens", file=sys.stderr)
        with open(path, "w") as f:
            json.dump(out, f)


def add_prediction(t, tr: dict) -> None:
    """An edit trace's prediction, where its instruction foretells changes (renames,
    replacements, settings, type hints and docstrings): the file so changed, in the
    target's tokens ("predicted"), the old names ("renamed") and the tokens before which
    a change of unknown text goes in ("unsure"), as `localspec edit` gives them to the
    n-gram drafter (runtime.predict_edit)."""
    from localspec.runtime import predict_edit

    renaming = predict_edit(t, tr["extra"], tr.get("instruction", ""), tr.get("file") or None)
    for key in ("predicted", "renamed", "unsure"):
        tr.pop(key, None)
    if renaming is not None:
        tr["predicted"], tr["renamed"], tr["unsure"] = renaming.tokens, list(renaming.old), list(renaming.unsure)


def token_pieces(t, tr: dict) -> dict[str, str]:
    """{id: text} for every token of a trace (its prompt, text to copy, prediction and
    output): what the n-gram drafter is given as the runtime gives it the target's (`text`)."""
    ids = {*tr["prompt"], *tr["extra"], *tr.get("predicted", ()), *tr["ids"]}
    return {str(i): t.token_piece(i).decode("utf-8", errors="replace") for i in sorted(ids)}


def add_pieces(paths: list[str], target: str) -> None:
    """Add each trace's token texts (`token_pieces`) to trace files recorded without them,
    and an edit's prediction (`add_prediction`: its file's name taken as "file", else none)."""
    from localspec import models
    from localspec.core.backend import Model

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=64, n_threads=1))
    for path in paths:
        with open(path) as f:
            traces = json.load(f)
        for tr in traces:
            if "ids" in tr:
                if tr.get("instruction") and "extra" in tr:
                    add_prediction(t, tr)
                tr["pieces"] = token_pieces(t, tr)
        with open(path, "w") as f:
            json.dump(traces, f)


def record_sessions(path: str, target: str, names: list[str], n_requests: int, n_predict: int) -> None:
    """Plain greedy decoding of each session's first n_requests requests, as the session
    benchmark prompts them: {"name", "repeats", "requests": [{"prompt", "ids"}]} per session."""
    from localspec import models
    from localspec.bench import sessions as sb
    from localspec.core.backend import Model, default_threads
    from localspec.core.chat_template import chat_prompt
    from localspec.core.config import GenerationConfig
    from localspec.core.drafters import NoDrafter
    from localspec.core.engine import collect, generate

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=4096, n_threads=default_threads()))
    known, out = {s.name: s for s in sb.builtin_sessions()}, []
    for name in names:
        s, reqs = known[name], []
        for user in s.requests[:n_requests]:
            prompt = chat_prompt(t, user, s.system)
            ids, _, _ = collect(generate(t, prompt, NoDrafter(), sampling=sb.GREEDY, spec=SpecConfig(mode="none"),
                                         gen=GenerationConfig(max_tokens=n_predict)))
            reqs.append({"prompt": list(prompt), "ids": ids})
            print(f"{name} {len(reqs)}: {len(prompt)} + {len(ids)} tokens", file=sys.stderr)
        out.append({"name": name, "repeats": s.repeats, "requests": reqs})
        with open(path, "w") as f:
            json.dump(out, f)


def report_sessions(paths: list[str], v: list[float], c: float, args) -> None:
    """Per session and request: auto's and the memory's speedup over plain, memory tokens
    accepted; per session the geometric means over all requests and from the third."""
    print(f"{'session':8} {'req':>3} {'tokens':>6} {'auto':>6} {'memory':>7}  accepted")
    for path in paths:
        with open(path) as f:
            sessions = json.load(f)
        for s in sessions:
            rows = replay_session(s, v, c, max(args.k_max), args.noise, tuned_v=args.tuned_v)
            for r in rows:
                acc = ", ".join(f"{k} {n}" for k, n in sorted(r["accepted"].items())) or "-"
                print(f"{s['name']:8} {r['request']:>3} {r['tokens']:>6} {r['auto']:5.2f}x {r['memory']:6.2f}x  {acc}")
            later = [r["memory"] for r in rows if r["request"] >= 3]
            print(f"{s['name']:8} all {_gm([r['auto'] for r in rows]):5.2f}x {_gm([r['memory'] for r in rows]):6.2f}x"
                  f"  from 3: {_gm(later) if later else float('nan'):.2f}x")


def report_hazard(paths: list[str], sizes: tuple[int, int]) -> None:
    """How often edit copies break by run age (the priors of core/tuning.py beside it)."""
    traces = []
    for path in paths:
        with open(path) as f:
            traces += json.load(f)
    rows = copy_hazard(traces, sizes)
    table = Table(title=f"copies broken by run age, {len(traces)} traces")
    for col in ("age", *[c for kind in ("copy", "pred.", "own") for c in (f"{kind} n", "broke", "a", "prior")]):
        table.add_column(col, justify="right")
    for i, edge in enumerate(EDGES):
        cells = [f"{edge}+"]
        for kind, prior in (("copy", COPY_PRIOR), ("predicted", PREDICTED_PRIOR), ("own", PRIOR)):
            n, broke = rows.get((kind, edge), (0, 0))
            cells += [str(n), str(broke), f"{1 - broke / n:.4f}" if n else "-", f"{prior[i]:.4f}"]
        table.add_row(*cells)
    Console(width=160).print(table)


def report_rounds(paths: list[str], v: list[float], c: float, args) -> None:
    """Per trace (edits only, n-gram only, the largest --k-max): auto's rounds that lost
    against the oracle, then its regret by kind of round."""
    from localspec.bench.replay import _long_band, rounds_against_oracle, trace_ngram, tuned
    from localspec.core.drafters.auto import AutoDrafter

    k = max(args.k_max)
    for path in paths:
        with open(path) as f:
            traces = [tr for tr in json.load(f) if tr["tag"] == "edit"]
        for tr in traces:
            def ng(tr=tr):
                return trace_ngram(tr, args.edit_ngram)
            profile = None if args.fresh else tuned(args.tuned_v or v, c, long=_long_band(args, v))
            rows = rounds_against_oracle(tr, AutoDrafter(ng(), None, profile, k_max=k), ng(), v, c, k)
            plain = (len(tr["ids"]) - 1) * v[0]
            spent = sum(v[r["drafted"]] for r in rows)
            print(f"{tr['name']}: auto {plain / spent:.2f}x, oracle {plain / (spent - sum(r['regret'] for r in rows)):.2f}x, "
                  f"{len(rows)} rounds")
            kinds: dict[str, list[float]] = {}
            for r in rows:
                kind = ("plain, a match there" if not r["drafted"] and r["oracle"] else "plain, no match"
                        if not r["drafted"] else "too long" if r["accepted"] < r["drafted"]
                        else "cut short" if r["oracle"] > r["drafted"] else "right")
                kinds.setdefault(kind, []).append(r["regret"])
                if r["regret"] > 0.05 and args.verbose:
                    print(f"  pos {r['pos']:5d} age {r['age']:4d} drafted {r['drafted']:4d} accepted {r['accepted']:4d}"
                          f"  oracle's drafter {r['oracle']:4d}  regret {r['regret']:5.2f}")
            for kind, regrets in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
                print(f"  {kind:22} {len(regrets):4d} rounds, regret {sum(regrets):6.1f} one-token times")


def _gm(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def synth(path: str, target: str, prompts: str) -> None:
    """Edit traces from edits done right (each task's "after" file): no decoding."""
    from pathlib import Path

    from localspec import edit, models
    from localspec.bench.workloads import load_jsonl, name_workloads, prepare
    from localspec.core.backend import Model

    t = Model(ModelConfig(str(models.resolve(target)), n_ctx=512, n_threads=1))
    base = Path(prompts).resolve().parent
    afters = [json.loads(line)["after"] for line in Path(prompts).read_text().splitlines() if line.strip()]
    out = []
    for w, after in zip(name_workloads(load_jsonl(prompts)), afters):
        prep = prepare(w, t, 256)
        body = edit.split_region((base / after).read_text()).body
        ids = t.tokenize(f"{body}\n{prep.fence}", add_special=False, parse_special=False)
        out.append({"name": Path(w.file).stem, "tag": w.tag, "prompt": prep.tokens, "extra": prep.extra,
                    "instruction": w.instruction, "file": w.file, "ids": ids, "d_arg": [], "d_p": []})
        add_prediction(t, out[-1])
        out[-1]["pieces"] = token_pieces(t, out[-1])
        print(f"{out[-1]['name']}: {len(prep.tokens)} prompt, {len(ids)} output tokens", file=sys.stderr)
    with open(path, "w") as f:
        json.dump(out, f)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("record", "synth", "pieces", "vcurve", "replay", "rounds",
                                       "record-sessions", "sessions", "hazard", "random-edits"))
    ap.add_argument("traces", nargs="+", help="trace files (vcurve: the output file)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", help="record: a workload JSONL instead of the built-in ones")
    ap.add_argument("--sessions", default="tests,agent,fresh", help="record-sessions: which sessions")
    ap.add_argument("--requests", type=int, default=4, help="record-sessions: requests per session")
    ap.add_argument("-n", "--n-predict", type=int, default=96, help="record-sessions: tokens a request")
    ap.add_argument("--fast", action="store_true", help="record: decode with n-gram drafting "
                    "(the same greedy output, up to near-ties; much faster on edits)")
    ap.add_argument("--n-max", type=int, default=257, help="vcurve: the largest batch timed")
    ap.add_argument("--curve", default="profile", help="the true V(n): profile (this machine's "
                    "`tune` profile), gpu (1 + 0.02 n) or a file from `vcurve`")
    ap.add_argument("--profile", help="a profile JSON from `localspec tune` (default: this "
                    "machine's for the default pair)")
    ap.add_argument("--tuned-curve", help="the curve `tune` measured, which informs auto's "
                    "profile (default: the true curve). The same machine's curve at a "
                    "shorter context (amx_xeon_2core.json against its 600ctx file) replays "
                    "a tuned run against the untuned fresh and second ones")
    ap.add_argument("--tuned-long-curve", help="the curve `tune` measured after a long context "
                    "(its V(n) band to 256, which informs auto on long prompts as edits'; "
                    "default: the true curve), or `none`: a profile of a tune that timed "
                    "the short curve alone")
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
    ap.add_argument("--count", type=int, default=470, help="random-edits: how many")
    ap.add_argument("--fresh", action="store_true", help="rounds: auto with no profile (a first run)")
    ap.add_argument("-v", "--verbose", action="store_true", help="rounds: every round that lost")
    ap.add_argument("--bound", action="store_true", help="also report the n-gram oracle's "
                    "speedup (drafts exactly the prefix the target accepts, cut at the "
                    "curve's cheap points: no policy with this drafter does better), a "
                    "perfect drafter's (the cap of speculation on this curve), and "
                    "hindsight: informed auto given the run-age counts of an earlier pass "
                    "over the same trace (how long its copies last, known ahead)")
    ap.add_argument("--peer", action="store_true", help="replay: also llama-server's n-gram "
                    "settings (ngram-simple at 16 and 48, ngram-mod) on the same traces and "
                    "curve, and auto's speedup over the best of them")
    ap.add_argument("--wall", type=lambda s: tuple(float(x) for x in s.split(",")),
                    metavar="PREFILL_TOK_S,T1_MS,OTHER_S", help="replay: a first edit's whole "
                    "wall time on that machine (prefill + decode + other), plain against auto "
                    "with no profile and llama-server's best, e.g. 133,86,1.7 on the AMX Xeon")
    args = ap.parse_args()
    if args.action == "record":
        record(args.traces[0], args.model, args.draft, args.prompts, args.fast)
        return 0
    if args.action == "record-sessions":
        record_sessions(args.traces[0], args.model, args.sessions.split(","), args.requests, args.n_predict)
        return 0
    if args.action == "synth":
        synth(args.traces[0], args.model, args.prompts)
        return 0
    if args.action == "pieces":
        add_pieces(args.traces, args.model)
        return 0
    if args.action == "vcurve":
        measure_curve(args.traces[0], args.model, args.n_max)
        return 0
    if args.action == "hazard":
        report_hazard(args.traces, tuple(args.edit_ngram))
        return 0
    # the draft model's cost comes from the profile unless given, or unless there is no model
    profile = load(args) if args.curve == "profile" or (args.c is None and args.model) else None
    c = args.c if args.c is not None else (profile.c or 0.5) if profile else 0.0
    v = true_curve(args.curve, max([*args.k_max, *FIXED_K]) + 2, profile)
    args.tuned_v = true_curve(args.tuned_curve, len(v), None) if args.tuned_curve else None
    args.tuned_long_v = (args.tuned_long_curve if args.tuned_long_curve in (None, "none")
                         else true_curve(args.tuned_long_curve, len(v), None))
    if args.action == "rounds":
        report_rounds(args.traces, v, c, args)
        return 0
    if args.action == "random-edits":
        report_random_edits(args.traces[0], v, args)
        return 0
    if args.action == "sessions":
        print("V(n): " + ", ".join(f"{n}:{v[n - 1]:.2f}" for n in (2, 4, 8, 16, 32, 64) if n <= len(v)))
        report_sessions(args.traces, v, c, args)
        return 0
    print("V(n): " + ", ".join(f"{n}:{v[n - 1]:.2f}" for n in (2, 4, 8, 16, 32, 64, 128, 256)
                                if n <= len(v)) + f"; c = {c:.2f}")
    rows, traces = [], []
    for path in args.traces:
        with open(path) as f:
            loaded = json.load(f)
        traces += loaded
        rows += [(tr["name"] if len(args.traces) == 1 else f"{path.split('/')[-1][:4]}:{tr['name']}",
                  replay_trace(tr, v, c, args)) for tr in loaded]
    report(rows, args.k_max)
    if args.peer or args.wall:
        report_peer(traces, rows, v, args.k_max, args.wall)
    return 0


def report_random_edits(path: str, v: list[float], args) -> None:
    """Random dense edits written to `path`, and auto's time over plain's on them."""
    traces = random_traces(args.count)
    with open(path, "w") as f:
        json.dump(traces, f)
    k = max(args.k_max)
    ratios = against_plain(traces, v, k, args.noise or 0.1, tuple(args.edit_ngram))
    table = Table(title=f"auto's decode time over plain's, {len(traces)} random dense edits "
                        f"(--draft-max {k}; V(16) = {v[15]:.2f}, V(64) = {v[63]:.2f})")
    for col in ("auto", "median", "95th percentile", "worst", "> 5% slower"):
        table.add_column(col, justify="right")
    for kind, xs in ratios.items():
        s = summary(xs)
        table.add_row(kind, f"{s['median']:.3f}", f"{s['p95']:.3f}", f"{s['worst']:.3f}", f"{s['slower']:.1%}")
    Console().print(table)


def report_peer(traces: list[dict], rows: list[tuple[str, dict[str, float]]], v: list[float],
                k_max: list[int], wall: tuple[float, float, float] | None = None) -> None:
    """llama-server's n-gram settings replayed on the same traces and curve (its drafters
    as localspec.bench.llamacpp_policies re-implements them): each setting's speedup
    over plain, and auto's (informed, fresh) over the best of them. `wall` (prefill
    tok/s, one-token ms, other s): a first edit's whole wall time, prefill + decode +
    other (loading, writing), plain against auto with no profile (fresh) and against
    the best llama-server setting. With --bound, the n-gram oracle's too: how far any
    n-gram policy could go over llama-server, and in wall time."""
    from localspec.bench.llamacpp_policies import llamacpp_settings
    from localspec.bench.replay import replay
    from localspec.core.drafters.base import NoDrafter

    names = [d.name for d in llamacpp_settings()]
    k = max(k_max)
    print(f"\nllama-server's settings replayed (speedup over plain); auto {k} over the best of them")
    print(f"{'trace':14} " + " ".join(f"{n:>18}" for n in names) + f" {'auto / best':>12} {'fresh / best':>12}"
          + (f" {'hindsight / best':>16}" if "hindsight" in rows[0][1] else "")
          + (f" {'oracle / best':>13}" if "bound" in rows[0][1] else "")
          + (f" {'wall: plain s':>13} {'fresh s':>8} {'speedup':>8} {'llama best':>10}" if wall else "")
          + (f" {'oracle':>7}" if wall and "bound" in rows[0][1] else ""))
    for (name, out), tr in zip(rows, traces):
        plain = replay(tr, NoDrafter(), v, 0.0, 1, False)
        peer = [plain / replay(tr, d, v, 0.0, 256, False) for d in llamacpp_settings()]
        best = max(peer)
        line = (f"{name:14} " + " ".join(f"{x:17.2f}x" for x in peer)
                + f" {out[f'auto {k}'] / best:11.2f}x {out[f'fresh {k}'] / best:11.2f}x"
                + (f" {out['hindsight'] / best:15.2f}x" if "hindsight" in out else "")
                + (f" {out['bound'] / best:12.2f}x" if "bound" in out else ""))
        if wall:
            tok_s, t1_ms, other = wall
            fixed = len(tr["prompt"]) / tok_s + other
            decode = (len(tr["ids"]) - 1) * t1_ms / 1000

            def speedup(x: float) -> float:  # the first edit's wall time, plain over a decode speedup x
                return (fixed + decode) / (fixed + decode / x)

            line += (f" {fixed + decode:13.1f} {fixed + decode / out[f'fresh {k}']:8.1f}"
                     f" {speedup(out[f'fresh {k}']):7.2f}x {speedup(best):9.2f}x"
                     + (f" {speedup(out['bound']):6.2f}x" if "bound" in out else ""))
        print(line)


def load(args) -> Profile:
    if args.profile:
        with open(args.profile) as f:
            return Profile(**json.load(f))
    from localspec import models
    from localspec.core.backend import Model, default_threads
    from localspec.runtime import find_profile

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
    bounds = [b for b in ("hindsight", "bound", "perfect") if b in rows[0][1]]
    print(f"{'trace':14} {'best fixed':>18} " + " ".join(f"{a:>16}" for a in autos)
          + "".join(f"{b:>10}" for b in bounds))
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
              + "".join(f"{out[b]:9.2f}x" for b in bounds))
    print(f"{'worst':14} {'':>18} " + " ".join(f"{w[0]:.2f}x ({w[1]:.3f})".rjust(16) for w in worst.values()))


if __name__ == "__main__":
    sys.exit(main())
