"""`bench --serve`: where does speculation stop paying once requests share a batch?

For each context band and concurrency C, the serve scheduler (the same code `localspec
serve` runs, minus HTTP) is driven by C closed-loop clients over the band's workloads,
with serve's default drafting (`--spec auto`: each round n-grams, or plain decoding where
the verify times say drafting does not pay) three ways, interleaved so drift in machine
load hits all alike:

    off   speculation never (--spec-disable-by-batch-size 0)
    on    speculation always (-1)
    rule  serve's rule as it stands: off while more than N sequences are active

The bands: `short`, chat-sized prompts (code, json, prose: ~60 tokens), and `long`, the
edit tasks (a whole file in the prompt: 450-700 tokens); a long KV cache moves the
crossover. Reported per run: end-to-end throughput (generated tokens / wall time, prefill
included), decode throughput over the steps that decoded all C sequences together and no
prompt (batched decode at batch size C), the mean such step's time and tokens, latency and
time to first token. Every (C, mode) runs `repeats` times (2 by default), the modes
interleaved anew each time.

Per band the crossover is the largest C up to which `on` beat `off` by more than the noise
at every C measured, and why: a speculative step at batch C costs so many plain steps (V at
that load) for so many times the tokens. The noise is measured, not assumed: two standard
errors of the on/off ratio, from the spread of the repeats' ratios or, where that is
smaller (two repeats that agree by chance), from the spread of the runs' own steps
(`_step_noise`). A ratio within the noise is a tie, and a tie keeps speculation off: off
is speculation-off itself, so a limit set on a tie can never make serve slower than
`--spec none` at that load, while on might. The limits are kept in
the target's profile (`batch_limits`, by the band's mean context), where `localspec serve`
reads its --spec-disable-by-batch-size from, and /health shows them with this reason.
No memory (serve's earlier replies as drafts): the bench repeats its prompts.

    python -m localspec.bench.serve_bench --concurrency 1,2,4 -n 48 --repeats 3
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import click

from localspec.core.config import (
    GenerationConfig,
    LoadOptions,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.tuning import AUTO_DRAFT_MAX
from localspec.serve.defaults import BatchLimits

MODES = ("off", "on", "rule")
BANDS = ("short", "long")  # chat-sized prompts; edit tasks (a file in the prompt)
GREEDY = SamplingConfig(temperature=0.0)
SERVE_SPEC = SpecConfig(mode="auto", draft_max=AUTO_DRAFT_MAX)  # serve's default without --draft
REPEATS = 2  # runs of every (C, mode): the spread of their on/off ratios is the noise
NOISE_Z = 2.0  # speculation must beat off by this many standard errors of the ratio


@dataclass
class Run:
    """One (band, concurrency, mode) measurement."""

    concurrency: int
    mode: str
    band: str = "short"
    context: float = 0.0  # mean tokens a sequence held: its prompt and half its reply
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tok_s: float = 0.0  # end to end, prefill included
    decode_tok_s: float | None = None  # steps decoding all C sequences (no prefill)
    decode_steps: int = 0
    decode_step_ms: float | None = None  # the mean such step's time ...
    decode_step_tokens: float | None = None  # ... and the tokens it made (C plain)
    latency_mean_s: float = 0.0
    latency_max_s: float = 0.0
    ttft_mean_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    spec_steps: float = 0.0  # share of steps with speculation on
    repeat: int = 0  # which of the (C, mode)'s repeats
    # relative standard error of decode_tok_s from its steps' spread (None: < 2 such steps)
    step_noise: float | None = None

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _Client:
    pending: list[list[int]]
    t_submit: float = 0.0
    t_first: float | None = None


def band_of(w: Any) -> str:
    return "long" if w.is_edit else "short"


def _step_log():
    """serve's metrics, plus every decode-only step's (sequences, seconds, tokens): the
    spread a run's throughput has within itself. (Made here: serve's metrics import the
    engine, which `localspec bench --help` must not need.)"""
    from localspec.serve.metrics import Metrics

    class StepLog(Metrics):
        def __init__(self) -> None:
            super().__init__()
            self.decode_steps: list[tuple[int, float, int]] = []

        def decode_step(self, n_seqs: int, speculating: bool, seconds: float, n_new: int) -> None:
            super().decode_step(n_seqs, speculating, seconds, n_new)
            self.decode_steps.append((n_seqs, seconds, n_new))

    return StepLog()


def _step_noise(steps: Sequence[tuple[float, int]]) -> float | None:
    """Relative standard error of a throughput sum(tokens) / sum(seconds) from its steps'
    spread (the ratio estimator's: residuals n_i - T t_i), treating steps as independent:
    a speculative step's tokens vary with what it accepted, a plain one's time with the
    machine. None with fewer than two steps."""
    if len(steps) < 2:
        return None
    seconds = sum(t for t, _ in steps)
    tokens = sum(n for _, n in steps)
    if not seconds or not tokens:
        return None
    rate = tokens / seconds
    n = len(steps)
    return (n / (n - 1) * sum((k - rate * t) ** 2 for t, k in steps)) ** 0.5 / tokens


def run_serve_bench(
    *,
    opts: LoadOptions | None = None,
    n_predict: int = 64,
    concurrency: Sequence[int] = (1, 2, 4, 8),
    modes: Sequence[str] = MODES,
    threshold: int | None = None,
    spec: SpecConfig | None = None,
    tags: Sequence[str] = ("code", "json", "prose", "edit"),
    per_tag: int = 1,
    names: Sequence[str] = (),
    bands: Sequence[str] = BANDS,
    repeats: int = REPEATS,
    store: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure serving throughput per context band and concurrency with speculation off,
    on and under the rule (serve's default drafting unless `spec`, greedy), `repeats` times
    each. Loads its own copy of the target with max(concurrency) sequences. `store`: keep
    each band's limit in the target's profile (with both off and on measured at two
    concurrencies or more). Returns a JSON-ready dict: runs, the crossover by band, the
    limits, rule check."""
    from localspec.bench import workloads as wl
    from localspec.core.drafters.auto import Learned
    from localspec.runtime import find_profile, open_runtime
    from localspec.serve.defaults import default_n_ctx, spec_threshold

    say = progress or (lambda line: None)
    spec = spec or SERVE_SPEC
    max_c = max(concurrency)
    opts = opts or LoadOptions(model=None, draft=None, n_ctx=0, n_threads=None, n_gpu_layers=-1,
                               n_gpu_layers_draft=0)
    # the context `localspec serve --parallel max_c` allocates by default
    opts = replace(opts, draft=None, n_ctx=default_n_ctx(max_c))
    with open_runtime(opts, want_draft=False, n_seq_max=max_c) as rt:
        target = rt.target
        profile = None if threshold is not None else find_profile(target, online=True)
        limits = spec_threshold(threshold, profile)
        items = wl.select(wl.builtin(), [t for t in tags], 0 if names else per_tag)
        if names:
            items = [w for w in items if w.name in names]
        room = target.n_ctx_seq - n_predict - spec.draft_max - 1
        prepared = [(w, wl.prepare(w, target, n_predict, n_predict).tokens) for w in items]
        by_band = {b: [(w.name, p) for w, p in prepared if band_of(w) == b and len(p) < room] for b in bands}
        by_band = {b: kept for b, kept in by_band.items() if kept}
        if not by_band:
            raise ValueError("no workload fits the per-slot context")
        say(f"serve bench: {target.name}, {target.info.n_threads} threads, drafter {spec.mode} "
            f"(k<={spec.draft_max}), -n {n_predict}, "
            + "; ".join(f"{b}: {', '.join(n for n, _ in kept)}" for b, kept in by_band.items())
            + f"; {repeats} repeat{'s' if repeats != 1 else ''}; rule now: {limits.describe()}")
        learned = Learned()  # one server's: what auto learns carries across the runs
        runs: list[Run] = []
        for band, kept in by_band.items():
            prompts = [p for _, p in kept]
            # warm-up: every prompt prefilled once (the slots keep them, as for the runs
            # after the first), and auto's first rounds timed
            _measure(target, prompts, min(len(prompts), max_c), "on", spec, limits, min(8, n_predict),
                     learned, band)
            for i, c in enumerate(concurrency):
                for rep in range(repeats):
                    order = list(modes) if (i + rep) % 2 == 0 else list(reversed(modes))
                    for mode in order:
                        run = _measure(target, prompts, c, mode, spec, limits, n_predict, learned, band)
                        run.repeat = rep
                        runs.append(run)
                        say(_run_line(run))
        names = [n for kept in by_band.values() for n, _ in kept]
        out = _summary(runs, target, limits, n_predict, names, spec)
        out["stored"] = _store(target, out, concurrency) if store else None
        return out


def _measure(target: Any, prompts: list[list[int]], c: int, mode: str, spec: SpecConfig,
             limits: BatchLimits, n_predict: int, learned: Any = None, band: str = "short") -> Run:
    """C closed-loop clients; max(C, len(prompts)) requests round-robin over prompts.
    `learned`: auto's costs carried from earlier runs (one server's)."""
    from localspec.serve.jobs import Failed, Finished, Job, Text
    from localspec.serve.scheduler import Scheduler, SchedulerConfig

    n_req = max(c, len(prompts))
    work = [prompts[i % len(prompts)] for i in range(n_req)]
    clients = [_Client(pending=work[i::c]) for i in range(c)]
    cfg = SchedulerConfig(n_slots=c, queue_size=n_req, spec=spec,
                          spec_disable_by_batch_size={"off": 0, "on": -1}.get(mode),
                          spec_limits=limits if mode == "rule" else None)
    sched = Scheduler(target, cfg, metrics=_step_log())
    if learned is not None:
        sched.learned = learned
    events: queue.Queue = queue.Queue()
    gen = GenerationConfig(max_tokens=n_predict)
    latencies, ttfts, contexts = [], [], []
    run = Run(c, mode, band, requests=n_req)

    def submit(i: int) -> None:
        cl = clients[i]
        cl.t_submit, cl.t_first = time.perf_counter(), None
        sched.submit(Job(cl.pending.pop(0), GREEDY, gen, sink=lambda ev, i=i: events.put((i, ev))))

    sched.start()
    t0 = time.perf_counter()
    try:
        for i in range(c):
            submit(i)
        done = 0
        while done < n_req:
            i, ev = events.get(timeout=600)
            now, cl = time.perf_counter(), clients[i]
            if isinstance(ev, Text):
                cl.t_first = cl.t_first or now
            elif isinstance(ev, Failed):
                raise RuntimeError(f"serve bench request failed: {ev.message}")
            elif isinstance(ev, Finished):
                done += 1
                st = ev.stats
                cl.t_first = cl.t_first or now
                latencies.append(now - cl.t_submit)
                ttfts.append(cl.t_first - cl.t_submit)
                contexts.append(st.prompt_tokens + st.generated / 2)
                run.tokens += st.generated
                run.drafted += st.drafted
                run.accepted += st.accepted
                if cl.pending:
                    submit(i)
        run.wall_s = time.perf_counter() - t0
    finally:
        sched.stop()
    run.context = statistics.fmean(contexts)
    _rates(run, sched.metrics, latencies, ttfts)
    return run


def _rates(run: Run, m: Any, latencies: list[float], ttfts: list[float]) -> None:
    """Fill in the run's rates from its counts, the scheduler's metrics and the times."""
    run.spec_steps = m.spec_steps / m.steps if m.steps else 0.0
    run.tok_s = run.tokens / run.wall_s if run.wall_s else 0.0
    run.latency_mean_s = statistics.fmean(latencies)
    run.latency_max_s = max(latencies)
    run.ttft_mean_s = statistics.fmean(ttfts)
    steps, seconds, tokens = m.batch_throughput(run.concurrency)
    run.decode_tok_s = tokens / seconds if steps and seconds else None
    run.decode_steps = steps
    if steps:
        run.decode_step_ms, run.decode_step_tokens = 1e3 * seconds / steps, tokens / steps
    if hasattr(m, "decode_steps"):
        run.step_noise = _step_noise([(t, n) for b, t, n in m.decode_steps if b == run.concurrency])


def _mean(runs: Sequence[Any], key: str) -> float | None:
    """The mean of a field over runs (Run or its dict), None where no run has it."""
    vals = [v for r in runs if (v := (r.get(key) if isinstance(r, dict) else getattr(r, key))) is not None]
    return statistics.fmean(vals) if vals else None


def ratio_noise(ratios: Sequence[float], step_noise: Sequence[float | None] = (), z: float = NOISE_Z) -> float:
    """The margin on/off must clear: z standard errors of the median ratio, the larger of
    what the repeats' ratios say (their spread / sqrt(R)) and what the runs' own steps say
    (`step_noise`: each pair's relative standard error of on/off, pooled over the R pairs).
    Two repeats that agree by chance do not make the margin vanish; one run with no steps
    at batch C has none (0)."""
    r = len(ratios)
    between = statistics.stdev(ratios) / r ** 0.5 if r >= 2 else 0.0
    known = [x for x in step_noise if x is not None]
    within = (statistics.fmean(x * x for x in known) / r) ** 0.5 * statistics.median(ratios) if known else 0.0
    return z * max(between, within)


def band_crossover(runs: list[Run], z: float = NOISE_Z) -> dict[str, Any]:
    """One band's crossover: per C, on against off (decode throughput at batch C where
    both have such steps, else end to end; the median of the repeats' ratios, each
    repeat's on against its off) with its noise (`ratio_noise`), and why (a speculative
    step's time and tokens against a plain one's). Speculation pays at C where on/off - 1
    exceeds the noise; a tie (within it) counts as not paying, since off is never below
    speculation-off. `limit`: the largest C up to which it paid at every C (0: not even
    alone), as the serve rule's --spec-disable-by-batch-size."""
    rows = []
    for c in sorted({r.concurrency for r in runs}):
        ons = {r.repeat: r for r in runs if r.concurrency == c and r.mode == "on"}
        offs = {r.repeat: r for r in runs if r.concurrency == c and r.mode == "off"}
        pairs = [(ons[i], offs[i]) for i in sorted(ons) if i in offs]
        if not pairs:
            continue
        key = "decode_tok_s" if all(on.decode_tok_s and off.decode_tok_s for on, off in pairs) else "tok_s"
        pairs = [(on, off) for on, off in pairs if getattr(off, key)]
        if not pairs:
            continue
        ratios = [getattr(on, key) / getattr(off, key) for on, off in pairs]
        steps = [(on.step_noise ** 2 + off.step_noise ** 2) ** 0.5
                 if key == "decode_tok_s" and on.step_noise is not None and off.step_noise is not None else None
                 for on, off in pairs]
        ratio, noise = statistics.median(ratios), ratio_noise(ratios, steps, z)
        on_runs, off_runs = [on for on, _ in pairs], [off for _, off in pairs]
        on_ms, off_ms = _mean(on_runs, "decode_step_ms"), _mean(off_runs, "decode_step_ms")
        on_tk, off_tk = _mean(on_runs, "decode_step_tokens"), _mean(off_runs, "decode_step_tokens")
        decode = key == "decode_tok_s"
        drafted = sum(r.drafted for r in on_runs)
        rows.append({"concurrency": c, "metric": key, "off_per_slot": _mean(off_runs, key) / c,
                     "on_per_slot": _mean(on_runs, key) / c, "on_over_off": ratio, "ratios": ratios,
                     # with nothing drafted, on decoded plainly as off did: a gain is drift
                     "noise": noise, "repeats": len(pairs), "pays": drafted > 0 and ratio - 1.0 > noise,
                     "step_cost": on_ms / off_ms if decode and on_ms and off_ms else None,
                     "step_tokens": on_tk / off_tk if decode and on_tk and off_tk else None,
                     "acceptance": sum(r.accepted for r in on_runs) / drafted if drafted else 0.0,
                     "drafted": drafted})
    limit = 0
    for x in rows:  # the end of the first run of concurrencies where it paid
        if not x["pays"]:
            break
        limit = x["concurrency"]
    context = round(statistics.fmean(r.context for r in runs)) if runs else 0
    return {"context": context, "limit": limit if rows else None, "noise_z": z, "by_concurrency": rows}


def _summary(runs: list[Run], target: Any, limits: BatchLimits, n_predict: int,
             names: list[str], spec: SpecConfig) -> dict[str, Any]:
    bands = list(dict.fromkeys(r.band for r in runs))
    crossover = {b: band_crossover([r for r in runs if r.band == b]) for b in bands}
    rule_check = []
    for b in bands:
        mine = [r for r in runs if r.band == b]
        for c in sorted({r.concurrency for r in mine}):
            on, off, rule = (_mean([r for r in mine if r.concurrency == c and r.mode == m], "tok_s")
                             for m in MODES)
            if on and off and rule:
                best = max(on, off)
                rule_check.append({"band": b, "concurrency": c, "rule_over_best": rule / best})
    return {
        "target": target.name, "threads": target.info.n_threads, "n_predict": n_predict,
        "workloads": names, "drafter": str(spec.mode), "draft_max": spec.draft_max,
        "rule_limit": limits.limit(), "rule_source": limits.source, "rule_limits": limits.to_dict(),
        "rule": limits.describe(),
        "runs": [{**asdict(r), "acceptance": r.acceptance} for r in runs],
        "crossover": crossover,
        "limits": {str(x["context"]): x["limit"] for x in crossover.values() if x["limit"] is not None},
        "rule_check": rule_check,
        "rule_within_5pct": all(x["rule_over_best"] is not None and x["rule_over_best"] >= 0.95
                                for x in rule_check) if rule_check else None,
    }


def limits_line(result: dict[str, Any], when: str | None = None) -> str:
    """How the limits were measured and why, in one line (the profile's batch_limits_by,
    shown by serve's log line and /health)."""
    when = when or time.strftime("%Y-%m-%d", time.gmtime())
    parts = []
    for x in result["crossover"].values():
        ratios = ", ".join(f"{r['on_over_off']:.2f}x+-{r['noise']:.2f} at C={r['concurrency']}"
                           for r in x["by_concurrency"] if r["on_over_off"] is not None)
        parts.append(f"{x['context']} tokens: on/off {ratios}")
    reps = max((r["repeats"] for x in result["crossover"].values() for r in x["by_concurrency"]), default=0)
    return (f"bench --serve {when} ({result['drafter']}, k<={result['draft_max']}, {reps} repeats, "
            f"on kept only beyond the noise; {'; '.join(parts)})")


def _store(target: Any, result: dict[str, Any], concurrency: Sequence[int]) -> str | None:
    """Keep the limits in the target's profile, where serve reads them; None when this run
    cannot say (on or off not measured, or one concurrency only)."""
    from localspec.profile import store_batch_limits
    from localspec.runtime import setup_of

    if len(set(concurrency)) < 2 or not result["limits"]:
        return None
    ones = [r for r in result["runs"] if r["concurrency"] == 1 and r["mode"] == "off" and r["decode_tok_s"]]
    t1 = 1.0 / statistics.fmean(r["decode_tok_s"] for r in ones) if ones else 0.0
    by = limits_line(result)
    store_batch_limits(setup_of(target), target.name, result["limits"], by, t1).result()
    return by


# ----- text and plot ----------------------------------------------------------------


def _run_line(r: Run) -> str:
    dec = f"{r.decode_tok_s:6.2f}" if r.decode_tok_s else "     -"
    return (f"  {r.band:<5} C={r.concurrency:<3} {r.mode:<4}  {r.tok_s:6.2f} tok/s  decode {dec} tok/s  "
            f"latency {r.latency_mean_s:6.2f}s (max {r.latency_max_s:.2f})  ttft {r.ttft_mean_s:5.2f}s  "
            f"acc {r.acceptance:4.0%} ({r.accepted}/{r.drafted})  spec steps {r.spec_steps:4.0%}")


def _f(x: float | None, w: int = 7, p: int = 2) -> str:
    return f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"


def format_report(result: dict[str, Any]) -> str:
    """Plain-text tables of a run_serve_bench result: per band, throughput by mode (the
    mean of the repeats), then the crossover and why."""
    lines = [(f"serve bench: {result['target']}, {result['threads']} threads, -n {result['n_predict']}, "
              f"drafter {result['drafter']} (k<={result['draft_max']}), rule now: {result['rule']}")]
    for band, x in result["crossover"].items():
        runs = [r for r in result["runs"] if r["band"] == band]
        lines += [f"{band} prompts, ~{x['context']} tokens of context a sequence:",
                  f"    | {'end-to-end tok/s':<20} | {'decode tok/s a slot':<20} | {'step ms':<13}"
                  f" | {'tokens/step':<13} |",
                  f"  C | {'off':>6} {'on':>6} {'rule':>6} | {'off':>8} {'on':>8}    | {'off':>6} {'on':>6}"
                  f" | {'off':>5} {'on':>5}   | on/off  noise  acc"]
        for c in sorted({r["concurrency"] for r in runs}):
            row = [[r for r in runs if r["concurrency"] == c and r["mode"] == m] for m in MODES]
            e2e = " ".join(_f(_mean(rs, "tok_s"), 6) for rs in row)
            dec = " ".join(_f((v := _mean(rs, "decode_tok_s")) and v / c, 8) for rs in row[:2])
            step = " ".join(_f(_mean(rs, "decode_step_ms"), 6, 1) for rs in row[:2])
            toks = " ".join(_f(_mean(rs, "decode_step_tokens"), 5) for rs in row[:2])
            y = next((y for y in x["by_concurrency"] if y["concurrency"] == c), None)
            ratio = f"{_f(y['on_over_off'], 5)}x  +-{y['noise']:4.2f}" if y else f"{_f(None, 5)}         "
            acc = y["acceptance"] if y else None
            lines.append(f"{c:3d} | {e2e} | {dec}    | {step} | {toks}   | {ratio}"
                         + (f" {acc:4.0%}" if acc is not None else ""))
        lines.append(_crossover_line(x))
    checks = ", ".join(f"{x['band']} C={x['concurrency']}: {x['rule_over_best']:.2f}" for x in result["rule_check"]
                       if x["rule_over_best"] is not None)
    if result["rule_within_5pct"] is not None:
        verdict = "within 5%" if result["rule_within_5pct"] else "NOT within 5% everywhere"
        lines.append(f"rule now / best of on,off (end-to-end): {checks}  [{verdict}]")
    if result.get("stored"):
        lines.append("kept in the profile (serve's --spec-disable-by-batch-size by context band): "
                     + ", ".join(f"off above {v} active at {k} tokens" for k, v in result["limits"].items()))
    return "\n".join(lines)


def _crossover_line(x: dict[str, Any]) -> str:
    """A band's crossover and why: at the first C where speculating did not beat off by
    more than the noise (and the last where it did), what a speculative step cost against
    a plain one for what tokens, the ratio and its noise, and a tie's verdict."""
    rows = x["by_concurrency"]
    if not rows:
        return "  crossover: not measured (needs both on and off)"
    lim = x["limit"]
    z = x.get("noise_z", NOISE_Z)

    def why(r: dict) -> str:
        n = r.get("repeats", 1)
        ratio = (f"{r['on_over_off']:.2f}x +-{r['noise']:.2f} ({z:g} standard errors, {n} repeat"
                 f"{'s' if n != 1 else ''})")
        if not r["drafted"]:
            verdict = "nothing drafted (on decoded plainly): a tie, kept off"
        elif r["on_over_off"] - 1.0 > r["noise"]:
            verdict = "beats off by more than the noise"
        elif r["on_over_off"] > 1.0 - r["noise"]:
            verdict = "within the noise: a tie, kept off (off is never below speculation-off; on may be)"
        else:
            verdict = "loses to off"
        if r["step_cost"] is None or r["step_tokens"] is None:
            return f"C={r['concurrency']}: on/off {ratio} (end to end): {verdict}"
        return (f"C={r['concurrency']}: a speculative step cost {r['step_cost']:.2f} plain steps "
                f"(V at that load) for {r['step_tokens']:.2f}x the tokens: {ratio}: {verdict}")

    lost = next((r for r in rows if r["concurrency"] > lim), None)
    paid = [r for r in rows if r["concurrency"] <= lim]
    if lost is None:
        head = f"speculation beat off beyond the noise at every C measured (up to {lim}): off above {lim} active"
    elif lim == 0:
        head = "speculation did not beat off beyond the noise even alone: off above 0 active"
    else:
        head = f"off above {lim} active"
    reasons = [why(r) for r in ([paid[-1]] if paid else []) + ([lost] if lost else [])]
    return f"  crossover at ~{x['context']} tokens: {head}; " + "; ".join(reasons)


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput and latency against concurrency (the mean of the repeats), one line per
    band and mode (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for band in dict.fromkeys(r["band"] for r in result["runs"]):
        for mode in MODES:
            rs = [r for r in result["runs"] if r["mode"] == mode and r["band"] == band]
            if not rs:
                continue
            cs = sorted({r["concurrency"] for r in rs})
            at = [[r for r in rs if r["concurrency"] == c] for c in cs]
            ax1.plot(cs, [_mean(x, "tok_s") for x in at], marker="o", label=f"{band} {mode}")
            ax2.plot(cs, [_mean(x, "latency_mean_s") for x in at], marker="o", label=f"{band} {mode}")
    for ax, label in ((ax1, "total tok/s"), (ax2, "mean latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"localspec serve: {result['target']}, speculation off / on / rule")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----- script entry -----------------------------------------------------------------


@click.command()
@click.option("-m", "--model", default=None, help="target model [default: the manifest's default]")
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None)
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, default=-1)
@click.option("--concurrency", default="1,2,4,8", show_default=True)
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--threshold", type=int, default=None,
              help="the rule's --spec-disable-by-batch-size [default: serve's default]")
@click.option("--spec", "mode", type=click.Choice(["auto", "ngram"]), default="auto", show_default=True,
              help="the slots' drafting: serve's default (auto), or the fixed n-gram drafter")
@click.option("--draft-max", type=click.IntRange(1, 64), default=None,
              help=f"[default: {AUTO_DRAFT_MAX} for auto, 16 for ngram: serve's]")
@click.option("--tags", default="code,json,prose,edit", show_default=True)
@click.option("--per-tag", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--workloads", "names", default="", help="only these workloads, e.g. edit-3,code-1")
@click.option("--bands", default="short,long", show_default=True,
              help="context bands: short (code, json, prose prompts), long (edit tasks)")
@click.option("--modes", default="off,on,rule", show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=REPEATS, show_default=True,
              help="runs of every (C, mode); their spread is the noise on/off must clear")
@click.option("--no-store", is_flag=True, help="do not keep the limits in the profile")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON on stdout")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png")
def main(model: str | None, n_threads: int | None, n_gpu_layers: int, concurrency: str, n_predict: int,
         threshold: int | None, mode: str, draft_max: int | None, tags: str, per_tag: int, names: str,
         bands: str, modes: str, repeats: int, no_store: bool, as_json: bool, plot_path: str | None) -> None:
    """Serving throughput by context band and concurrency: speculation off, on, and the rule;
    the crossover kept in the profile for `localspec serve`."""
    if plot_path:
        from localspec.bench.report import check_plot
        from localspec.core.errors import LocalspecError

        try:
            check_plot()  # before the model loads and the long run starts
        except LocalspecError as exc:
            raise click.ClickException(str(exc)) from None
    opts = LoadOptions(model=model, draft=None, n_ctx=0, n_threads=n_threads,
                       n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=0)
    cs = [int(x) for x in concurrency.split(",") if x.strip()]
    k = draft_max or (AUTO_DRAFT_MAX if mode == "auto" else 16)
    result = run_serve_bench(opts=opts, n_predict=n_predict, concurrency=cs, threshold=threshold,
                             spec=SpecConfig(mode=mode, draft_max=k),
                             tags=[t.strip() for t in tags.split(",") if t.strip()], per_tag=per_tag,
                             names=[n.strip() for n in names.split(",") if n.strip()],
                             bands=[b.strip() for b in bands.split(",") if b.strip() in BANDS],
                             modes=[m.strip() for m in modes.split(",") if m.strip() in MODES],
                             repeats=repeats, store=not no_store, progress=lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(format_report(result))
    if plot_path:
        plot(result, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)


if __name__ == "__main__":
    main(sys.argv[1:])
