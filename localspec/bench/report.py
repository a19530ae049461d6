"""What `localspec bench` shows: a rich table per workload, a summary per tag (never
one blended number only), the V(n) curve, `--json`, `--plot`, and the progress bar."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from localspec.bench.results import Result
from localspec.bench.vcurve import VCurve
from localspec.bench.workloads import tag_rank
from localspec.core.errors import LocalspecError

LEGEND = (
    "tok/s: decode speed (first token to last). speedup: tok/s over `none` on the same "
    "workload in the same run. wall: the same ratio end to end (prefill included). ttft: "
    "time to first token, per run; prefill: prompt tokens decoded for it (+N cached: "
    "restored from the prefix cache, --prefix-cache). cpu: the decode ratio in this "
    "process's CPU seconds, steadier "
    "when other processes compete for the cores (unless llama.cpp's threads spin: -t 1 "
    "avoids that). accept: accepted / drafted tokens. tok/rnd: tokens per "
    "drafting round (accepted + the target's own). E(a,k): theory for that acceptance "
    "and the mean draft length k, assuming independent acceptances. c: drafting time per "
    "drafted token over plain time per token. pred: speedup predicted from k, c and "
    "V(k+1). output: token ids against `none`; near-tie = diverged where plain decoding's "
    "top-2 logits were < 0.5 apart (batched kernels differ slightly)."
)
PEER_LEGEND = (
    "peer: llama-cpp-python's own speculative path, Llama(draft_model="
    "LlamaPromptLookupDecoding(num_pred_tokens=k)), same prompt tokens, same process; its "
    "acceptance is inferred from tokens per batched decode."
)


def _f(x: float | None, fmt: str, none: str = "-") -> str:
    return none if x is None or not math.isfinite(x) else format(x, fmt)


def _console(stderr: bool = False) -> Console:
    # a pipe gets 80 columns by default: too narrow for the table
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=160)


def _x(ratio: float | None) -> str:
    return _f(ratio, ".2f") + ("x" if ratio else "")


def _secs(x: float | None) -> str:
    return _f(x, ".2f") + ("s" if x is not None else "")


def _prefill(r: Result) -> str:
    """Prompt tokens decoded before the first token, and those the prefix cache restored."""
    tokens, restored = r.mean("prefill_tokens"), r.mean("restored")
    text = _f(tokens, ".0f")
    return text + f" +{restored:.0f} cached" if restored else text


# ----- per tag --------------------------------------------------------------------------


def by_tag(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Per (tag, variant): workloads, tokens, tok/s, geometric-mean speedup, acceptance,
    and how many outputs were identical to `none`."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.tag, r.variant.label), []).append(r)
    out = []
    for (tag, label), rs in groups.items():
        tokens = sum(r.tokens for r in rs)
        secs = sum(r.decode_s for r in rs)
        ups = [r.speedup for r in rs if r.speedup]
        cpu_ups = [r.cpu_speedup for r in rs if r.cpu_speedup]
        wall_ups = [r.wall_speedup for r in rs if r.wall_speedup]
        ttfts = [x.ttft_s for r in rs for x in r.runs]
        drafted = sum(x.drafted for r in rs for x in r.runs)
        accepted = sum(x.accepted for r in rs for x in r.runs)
        statuses = [r.verdict.status for r in rs]
        out.append({
            "tag": tag, "mode": rs[0].variant.mode, "k": rs[0].variant.k, "label": label,
            "workloads": len(rs), "tokens": tokens,
            "tokens_per_s": round(tokens / secs, 3) if secs else None,
            "speedup": _geomean(ups), "cpu_speedup": _geomean(cpu_ups),
            "wall_speedup": _geomean(wall_ups),
            "ttft_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "identical": statuses.count("identical"), "near_tie": statuses.count("near-tie"),
            "mismatch": statuses.count("MISMATCH"),
        })
    return sorted(out, key=lambda d: tag_rank(d["tag"]))


def _geomean(xs: Sequence[float]) -> float | None:
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 3) if xs else None


# ----- terminal ---------------------------------------------------------------------------


def print_report(results: Sequence[Result], vcurve: VCurve | None, title: str) -> None:
    console = _console()
    console.print(workload_table(results, title, with_pred=vcurve is not None))
    console.print(tag_table(by_tag(results)))
    if vcurve is not None:
        console.print(vcurve_table(vcurve))
    console.print(f"[dim]{LEGEND}[/dim]")
    if any(r.variant.mode == "peer" for r in results):
        console.print(f"[dim]{PEER_LEGEND}[/dim]")


def workload_table(results: Sequence[Result], title: str, with_pred: bool = False) -> Table:
    t = Table(title=title, title_justify="left")
    cols = ["workload", "mode", "k", "tokens", "tok/s", "speedup", "cpu", "wall", "ttft", "prefill",
            "accept", "tok/rnd", "E(a,k)", "k mean", "c", *(["pred"] if with_pred else []), "output"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("workload", "mode", "output") else "right")
    last = None
    for r in results:
        if last is not None and r.workload != last:
            t.add_section()
        last = r.workload
        out = str(r.verdict) if not r.error else f"error: {r.error}"
        style = "bold red" if r.verdict.status == "MISMATCH" or r.error else None
        t.add_row(
            f"{r.workload} ({r.tag})" if r.variant.mode == "none" else "", r.variant.mode,
            str(r.variant.k or "-"), str(r.tokens), _f(r.tokens_per_s, ".2f"),
            _x(r.speedup), _x(r.cpu_speedup), _x(r.wall_speedup),
            _secs(r.mean("ttft_s")), _prefill(r), _f(r.acceptance, ".0%"),
            _f(r.tokens_per_draft_round, ".2f"), _f(r.expected, ".2f"), _f(r.k_mean, ".1f"),
            _f(r.c, ".3f"), *([_f(r.predicted_speedup, ".2f")] if with_pred else []), out,
            style=style,
        )
    return t


def tag_table(rows: Sequence[dict[str, Any]]) -> Table:
    t = Table(title="per tag (speedup: geometric mean over the tag's workloads)", title_justify="left")
    for col in ("tag", "mode", "k", "workloads", "tokens", "tok/s", "speedup", "cpu", "wall", "ttft",
                "accept", "outputs"):
        t.add_column(col, justify="left" if col in ("tag", "mode", "outputs") else "right")
    last = None
    for d in rows:
        if last is not None and d["tag"] != last:
            t.add_section()
        last = d["tag"]
        outputs = "baseline" if d["mode"] == "none" else ", ".join(
            f"{d[key]} {name}" for key, name in (("identical", "identical"), ("near_tie", "near-tie"),
                                                  ("mismatch", "MISMATCH")) if d[key])
        t.add_row(d["tag"], d["mode"], str(d["k"] or "-"), str(d["workloads"]), str(d["tokens"]),
                  _f(d["tokens_per_s"], ".2f"), _x(d["speedup"]), _x(d["cpu_speedup"]),
                  _x(d["wall_speedup"]), _secs(d["ttft_s"]), _f(d["acceptance"], ".0%"),
                  outputs or "-")
    return t


def vcurve_table(vc: VCurve, per_row: int = 8) -> Table:
    """V(n) in rows of `per_row` batch sizes; ms per token shows where batches pay."""
    title = f"verify cost V(n) = t(n) / t(1), t(1) = {vc.ms[0]:.1f} ms, context {vc.context}"
    if vc.c is not None:
        title += f"; draft model one token {vc.draft_ms:.1f} ms, c = {vc.c:.3f}"
    t = Table(title=title, title_justify="left")
    t.add_column("n", justify="right")
    for i in range(per_row):
        t.add_column(f"+{i}", justify="right")
    v = vc.v
    for start in range(0, len(v), per_row):
        chunk = v[start : start + per_row]
        t.add_row(f"{start + 1}..", *[f"{x:.2f}" for x in chunk])
    return t


# ----- json and plot ------------------------------------------------------------------


def to_json(results: Sequence[Result], vcurve: VCurve | None, meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "vcurve": vcurve.to_dict() if vcurve else None,
            "results": [r.to_dict() for r in results], "by_tag": by_tag(results)}


def check_plot() -> None:
    """Fail before any model loads when --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalspecError("--plot needs matplotlib (pip install matplotlib)") from None


def plot(path: str | Path, results: Sequence[Result], vcurve: VCurve | None, title: str) -> None:
    """Speedup by mode and tag (left), V(n) and tokens per verify cost (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [d for d in by_tag(results) if d["mode"] != "none" and d["speedup"]]
    tags = list(dict.fromkeys(d["tag"] for d in rows))
    labels = list(dict.fromkeys(d["label"] for d in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        ys = [next((d["speedup"] for d in rows if d["tag"] == t and d["label"] == label), 0) for t in tags]
        ax1.bar([i + j * width for i in range(len(tags))], ys, width, label=label)
    ax1.axhline(1.0, color="grey", lw=1, ls="--")
    ax1.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(tags))], tags)
    ax1.set_ylabel("speedup vs none")
    ax1.set_title("speedup by mode and tag")
    ax1.legend(fontsize=8)
    if vcurve is not None:
        n = list(range(1, len(vcurve.ms) + 1))
        ax2.plot(n, vcurve.v, marker="o", ms=3, label="V(n) = t(n) / t(1)")
        ax2.plot(n, [k / v for k, v in zip(n, vcurve.v)], marker=".", ms=3, label="n / V(n)")
        ax2.set_xlabel("tokens in the verify batch (n)")
        ax2.set_title("verify cost on this machine")
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "V(n) not measured (--vcurve)", ha="center", va="center")
        ax2.set_axis_off()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- progress -------------------------------------------------------------------------


class BenchProgress:
    """Two bars on stderr: generations done, and tokens of the current one."""

    def __init__(self, steps: int, enabled: bool = True) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=Console(stderr=True), transient=True,
            disable=not enabled or not sys.stderr.isatty(),
        )
        self.steps = self.progress.add_task("bench", total=steps)
        self.tokens = self.progress.add_task("", total=1, visible=False)
        self._started = False

    def __enter__(self) -> BenchProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def step(self, label: str, budget: int) -> None:
        if self._started:
            self.progress.advance(self.steps)
        self._started = True
        self.progress.update(self.tokens, description=f"  {label}", total=max(1, budget),
                             completed=0, visible=True)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.tokens, n)

    def add_steps(self, n: int) -> None:
        self.progress.update(self.steps, total=(self.progress.tasks[self.steps].total or 0) + n)
