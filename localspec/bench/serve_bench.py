"""`bench --serve`: where does speculation stop paying once requests share a batch?

For each concurrency C, the serve scheduler (the same code `localspec serve` runs, minus
HTTP) is driven by C closed-loop clients over the workloads, three ways, interleaved so
drift in machine load hits all alike:

    off   speculation never (--spec-disable-by-batch-size 0)
    on    speculation always (-1)
    rule  the threshold rule: off while more than N sequences are active (serve's default N)

Reported per run: end-to-end throughput (generated tokens / wall time, prefill
included), decode throughput (tokens per second over the steps that decoded all C
sequences together and no prompt: batched decode at batch size C), latency and time to
first token. The crossover is the smallest C at which `on` decodes slower than
`off`; the rule should track the better of the two at every C.

    python -m localspec.bench.serve_bench --concurrency 1,2,4,8 -n 48
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

from localspec.serve.defaults import BatchLimits
from localspec.core.config import (
    GenerationConfig,
    LoadOptions,
    SamplingConfig,
    SpecConfig,
)

MODES = ("off", "on", "rule")
GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class Run:
    """One (concurrency, mode) measurement."""

    concurrency: int
    mode: str
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tok_s: float = 0.0  # end to end, prefill included
    decode_tok_s: float | None = None  # steps decoding all C sequences (no prefill)
    decode_steps: int = 0
    latency_mean_s: float = 0.0
    latency_max_s: float = 0.0
    ttft_mean_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    spec_steps: float = 0.0  # share of steps with speculation on

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class _Client:
    pending: list[list[int]]
    t_submit: float = 0.0
    t_first: float | None = None


def run_serve_bench(
    *,
    opts: LoadOptions | None = None,
    n_predict: int = 64,
    concurrency: Sequence[int] = (1, 2, 4, 8, 16),
    modes: Sequence[str] = MODES,
    threshold: int | None = None,
    spec: SpecConfig | None = None,
    tags: Sequence[str] = ("code", "json", "prose", "edit"),
    per_tag: int = 1,
    names: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure serving throughput at each concurrency with speculation off, on and under
    the threshold rule (n-gram drafting, greedy). Loads its own copy of the target with
    max(concurrency) sequences. Returns a JSON-ready dict: runs, crossover, rule check."""
    from localspec.bench import workloads as wl
    from localspec.runtime import find_profile, open_runtime
    from localspec.serve.defaults import default_n_ctx, spec_threshold

    say = progress or (lambda line: None)
    spec = spec or SpecConfig(mode="ngram", draft_max=16)
    max_c = max(concurrency)
    opts = opts or LoadOptions(model=None, draft=None, n_ctx=0, n_threads=None, n_gpu_layers=-1,
                               n_gpu_layers_draft=0)
    # the context `localspec serve --parallel max_c` allocates by default
    opts = replace(opts, draft=None, n_ctx=default_n_ctx(max_c))
    with open_runtime(opts, want_draft=False, n_seq_max=max_c) as rt:
        target = rt.target
        limits = spec_threshold(threshold, find_profile(target) if threshold is None else None)
        items = wl.select(wl.builtin(), [t for t in tags], 0 if names else per_tag)
        if names:
            items = [w for w in items if w.name in names]
        prompts = [wl.prepare(w, target, n_predict, n_predict).tokens for w in items]
        room = target.n_ctx_seq - n_predict - spec.draft_max - 1
        kept = [(w.name, p) for w, p in zip(items, prompts) if len(p) < room]
        if not kept:
            raise ValueError("no workload fits the per-slot context")
        names = [n for n, _ in kept]
        prompts = [p for _, p in kept]
        say(f"serve bench: {target.name}, {target.info.n_threads} threads, workloads {', '.join(names)}, "
            f"-n {n_predict}, rule: {limits.describe()}")
        _measure(target, [prompts[0]], 1, "on", spec, limits, min(8, n_predict))  # warm-up
        runs: list[Run] = []
        for i, c in enumerate(concurrency):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for mode in order:
                run = _measure(target, prompts, c, mode, spec, limits, n_predict)
                runs.append(run)
                say(_run_line(run))
        return _summary(runs, target, limits, n_predict, names, spec)


def _measure(target: Any, prompts: list[list[int]], c: int, mode: str, spec: SpecConfig,
             limits: BatchLimits, n_predict: int) -> Run:
    """C closed-loop clients; max(C, len(prompts)) requests round-robin over prompts."""
    from localspec.serve.jobs import Failed, Finished, Job, Text
    from localspec.serve.scheduler import Scheduler, SchedulerConfig

    n_req = max(c, len(prompts))
    work = [prompts[i % len(prompts)] for i in range(n_req)]
    clients = [_Client(pending=work[i::c]) for i in range(c)]
    cfg = SchedulerConfig(n_slots=c, queue_size=n_req, spec=spec,
                          spec_disable_by_batch_size={"off": 0, "on": -1}.get(mode),
                          spec_limits=limits if mode == "rule" else None)
    sched = Scheduler(target, cfg)
    events: queue.Queue = queue.Queue()
    gen = GenerationConfig(max_tokens=n_predict)
    latencies, ttfts = [], []
    run = Run(c, mode, requests=n_req)

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
                run.tokens += st.generated
                run.drafted += st.drafted
                run.accepted += st.accepted
                if cl.pending:
                    submit(i)
        run.wall_s = time.perf_counter() - t0
    finally:
        sched.stop()
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


def _summary(runs: list[Run], target: Any, limits: BatchLimits, n_predict: int,
             names: list[str], spec: SpecConfig) -> dict[str, Any]:
    by = {(r.concurrency, r.mode): r for r in runs}
    cs = sorted({r.concurrency for r in runs})

    def speed(r: Run | None, key: str) -> float | None:
        return None if r is None else getattr(r, key)

    def crossover(key: str) -> int | None:
        for c in cs:
            on, off = speed(by.get((c, "on")), key), speed(by.get((c, "off")), key)
            if on is not None and off is not None and on < off:
                return c
        return None

    rule_check = []
    for c in cs:
        on, off, rule = (by.get((c, m)) for m in MODES)
        if on and off and rule:
            best = max(on.tok_s, off.tok_s)
            rule_check.append({"concurrency": c, "rule_over_best": rule.tok_s / best if best else None})
    return {
        "target": target.name, "threads": target.info.n_threads, "n_predict": n_predict,
        "workloads": names, "drafter": spec.mode, "draft_max": spec.draft_max,
        "rule_limit": limits.limit(), "rule_source": limits.source, "rule_limits": limits.to_dict(),
        "rule": limits.describe(),
        "runs": [{**asdict(r), "acceptance": r.acceptance} for r in runs],
        "crossover": {"decode": crossover("decode_tok_s"), "end_to_end": crossover("tok_s")},
        "rule_check": rule_check,
        "rule_within_5pct": all(x["rule_over_best"] is not None and x["rule_over_best"] >= 0.95
                                for x in rule_check) if rule_check else None,
    }


# ----- text and plot ----------------------------------------------------------------


def _run_line(r: Run) -> str:
    dec = f"{r.decode_tok_s:6.2f}" if r.decode_tok_s else "     -"
    return (f"  C={r.concurrency:<3} {r.mode:<4}  {r.tok_s:6.2f} tok/s  decode {dec} tok/s  "
            f"latency {r.latency_mean_s:6.2f}s (max {r.latency_max_s:.2f})  ttft {r.ttft_mean_s:5.2f}s  "
            f"acc {r.acceptance:4.0%} ({r.accepted}/{r.drafted})  spec steps {r.spec_steps:4.0%}")


def format_report(result: dict[str, Any]) -> str:
    """A plain-text table of a run_serve_bench result."""
    runs = result["runs"]
    cs = sorted({r["concurrency"] for r in runs})
    by = {(r["concurrency"], r["mode"]): r for r in runs}
    lines = [(f"serve bench: {result['target']}, {result['threads']} threads, -n {result['n_predict']}, "
              f"drafter {result['drafter']} (k<={result['draft_max']}), rule: {result['rule']}"),
             "      end-to-end tok/s (prefill incl.)   | decode tok/s at batch C    | mean latency s",
             "  C     off      on    rule  on/off |   off     on   rule on/off |   off     on   rule"]

    def f(x: float | None, w: int = 7, p: int = 2) -> str:
        return f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"

    for c in cs:
        row = [by.get((c, m), {}) for m in MODES]
        e2e = [r.get("tok_s") for r in row]
        dec = [r.get("decode_tok_s") for r in row]
        lat = [r.get("latency_mean_s") for r in row]
        ratio = lambda v: v[1] / v[0] if v[0] and v[1] else None
        lines.append(f"{c:3d} {f(e2e[0])} {f(e2e[1])} {f(e2e[2])} {f(ratio(e2e), 6)}x |"
                     f"{f(dec[0], 6)} {f(dec[1], 6)} {f(dec[2], 6)} {f(ratio(dec), 5)}x |"
                     f"{f(lat[0], 6)} {f(lat[1], 6)} {f(lat[2], 6)}")
    lines.append(_crossover_line(result, by, cs))
    checks = ", ".join(f"C={x['concurrency']}: {x['rule_over_best']:.2f}" for x in result["rule_check"]
                       if x["rule_over_best"] is not None)
    if result["rule_within_5pct"] is not None:
        verdict = "within 5%" if result["rule_within_5pct"] else "NOT within 5% everywhere"
        lines.append(f"rule / best of on,off (end-to-end): {checks}  [{verdict}]")
    return "\n".join(lines)


def _crossover_line(result: dict[str, Any], by: dict, cs: list[int]) -> str:
    """The crossover this run measured, and why: the on/off throughput ratio either side."""
    cross = result["crossover"]
    c = cross["end_to_end"]

    def ratio(n: int) -> str:
        on, off = by.get((n, "on"), {}).get("tok_s"), by.get((n, "off"), {}).get("tok_s")
        return f"{on / off:.2f}x" if on and off else "-"

    if c is None:
        why = f"speculation paid at every C measured (on/off {', '.join(f'C={n}: {ratio(n)}' for n in cs)})"
    else:
        below = [n for n in cs if n < c]
        why = (f"on/off {ratio(c)} at C={c}" + (f", {ratio(below[-1])} at C={below[-1]}" if below else "")
               + ": past it a rejected draft row costs more compute than the accepted ones save")
    return (f"crossover (speculation stops paying): end-to-end at C={c or 'none measured'}, decode at "
            f"C={cross['decode'] or 'none measured'}; {why}. The rule: {result['rule']}")


def plot(result: dict[str, Any], path: str) -> None:
    """Throughput and latency against concurrency, one line per mode (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        rs = sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in rs]
        ax1.plot(cs, [r["tok_s"] for r in rs], marker="o", label=mode)
        ax2.plot(cs, [r["latency_mean_s"] for r in rs], marker="o", label=mode)
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
@click.option("--concurrency", default="1,2,4,8,16", show_default=True)
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--threshold", type=int, default=None,
              help="the rule's --spec-disable-by-batch-size [default: serve's default]")
@click.option("--draft-max", type=click.IntRange(1, 64), default=16, show_default=True)
@click.option("--tags", default="code,json,prose,edit", show_default=True)
@click.option("--per-tag", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--workloads", "names", default="", help="only these workloads, e.g. edit-3,code-1")
@click.option("--modes", default="off,on,rule", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON on stdout")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png")
def main(model: str | None, n_threads: int | None, n_gpu_layers: int, concurrency: str, n_predict: int,
         threshold: int | None, draft_max: int, tags: str, per_tag: int, names: str, modes: str,
         as_json: bool, plot_path: str | None) -> None:
    """Serving throughput at several concurrencies: speculation off, on, and the rule."""
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
    result = run_serve_bench(opts=opts, n_predict=n_predict, concurrency=cs, threshold=threshold,
                             spec=SpecConfig(mode="ngram", draft_max=draft_max),
                             tags=[t.strip() for t in tags.split(",") if t.strip()], per_tag=per_tag,
                             names=[n.strip() for n in names.split(",") if n.strip()],
                             modes=[m.strip() for m in modes.split(",") if m.strip() in MODES],
                             progress=lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(format_report(result))
    if plot_path:
        plot(result, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)


if __name__ == "__main__":
    main(sys.argv[1:])
