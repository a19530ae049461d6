"""`localspec stats`: acceptance per (target, draft, drafter, tag) from the acceptance log,
its trend over time, and a warning when it drifts down (see drift.py)."""

from __future__ import annotations

import itertools
import json
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import click
import numpy as np

from localspec.acceptance import drift, logdb
from localspec.acceptance import plot as acceptance_plot
from localspec.acceptance.logdb import Record

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 12  # runs are averaged into at most this many buckets
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)


@dataclass
class GroupSummary:
    target: str
    draft: str | None
    drafter: str
    tag: str
    runs: int
    tokens: int
    acceptance_runs: int  # runs that drafted anything (acceptance is defined)
    acceptance_mean: float | None
    acceptance_p10: float | None
    acceptance_p90: float | None
    mean_accepted: float | None
    tokens_per_s: float | None
    first: str
    last: str
    trend: list[float]  # bucketed acceptance, oldest first (the sparkline's data)

    @property
    def pair(self) -> str:
        return drift.pair_label(self.target, self.draft, self.drafter)


@click.command()
@click.option("--since", "since", metavar="WHEN", default=None,
              help="only runs since WHEN: 30m, 24h, 7d, 2w or an ISO date/time (2025-06-01)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE.png",
              help="also draw acceptance and tok/s over time, one row per pair (needs matplotlib)")
def stats(since: str | None, as_json: bool, plot_file: str | None) -> None:
    """Acceptance and speed per target, draft, drafter and workload tag.

    \b
      localspec stats                 everything logged
      localspec stats --since 7d      the last week
      localspec stats --json          for scripts
      localspec stats --plot acc.png  acceptance over time (matplotlib)

    Warns when a group's recent acceptance fell clearly below its own history.
    """
    plt = _pyplot() if plot_file else None  # fail before any work without matplotlib
    cutoff = parse_since(since) if since else None
    path = logdb.db_path()
    try:
        records = logdb.read_records(cutoff, path)
        sources = logdb.tokens_by_source(cutoff, path)
    except (sqlite3.Error, OSError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise click.ClickException(f"cannot read the acceptance log {path}: {reason}") from None
    groups = summarise(records)
    alerts = drift.detect(records)
    if as_json:
        doc = _json_doc(path, cutoff, groups, alerts) | {
            "by_source": {s: {"drafted": d, "accepted": a} for s, (d, a) in sources.items()}}
        click.echo(json.dumps(doc, indent=2))
    elif not records:
        click.echo(_empty_message(path, since))
    else:
        _print_table(groups, path, since)
        if sources:
            click.echo("draft tokens accepted by source: " + ", ".join(
                f"{s} {a:,} of {d:,} ({a / d:.0%})" if d else f"{s} 0" for s, (d, a) in sources.items()))
    for alert in alerts:
        click.echo(f"warning: {alert.message()}", err=True)
    if plt is not None and records:
        plot(plt, records, plot_file)
        click.echo(f"wrote {plot_file}", err=True)


def parse_since(value: str, now: float | None = None) -> float:
    """'7d', '24h', '30m', '90s', '2w', or an ISO date/time (local time unless it
    carries an offset) -> unix time."""
    now = time.time() if now is None else now
    m = _RELATIVE.match(value)
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2).lower()]
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected an age like 7d, 24h, 30m or an ISO date like 2025-06-01",
            param_hint="'--since'",
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()  # naive: the user's local time
    return when.timestamp()


def summarise(records: Sequence[Record]) -> list[GroupSummary]:
    """One summary per (target, draft, drafter, tag), sorted by those names."""
    by_key: dict[tuple, list[Record]] = {}
    for r in records:
        by_key.setdefault(r.key, []).append(r)
    out = []
    for key in sorted(by_key, key=lambda k: tuple(x or "" for x in k)):
        rs = by_key[key]
        acc = [r.acceptance for r in rs if r.acceptance is not None]
        lens = [r.mean_accepted for r in rs if r.mean_accepted is not None]
        timed = [r for r in rs if r.decode_s > 0]
        decode_s = sum(r.decode_s for r in timed)
        out.append(GroupSummary(
            *key, runs=len(rs), tokens=sum(r.generated for r in rs),
            acceptance_runs=len(acc),
            acceptance_mean=sum(acc) / len(acc) if acc else None,
            acceptance_p10=percentile(acc, 10), acceptance_p90=percentile(acc, 90),
            mean_accepted=sum(lens) / len(lens) if lens else None,
            tokens_per_s=sum(r.generated for r in timed) / decode_s if decode_s > 0 else None,
            first=_iso(rs[0].ts), last=_iso(rs[-1].ts), trend=buckets(acc, SPARK_WIDTH),
        ))  # fmt: skip
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None when empty."""
    return float(np.percentile(values, q)) if len(values) else None


def buckets(values: Sequence[float], width: int) -> list[float]:
    """Means of `width` consecutive, near-equal slices (the values themselves if fewer)."""
    n = len(values)
    if n <= width:
        return list(values)
    edges = [round(i * n / width) for i in range(width + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(edges)]


def sparkline(values: Sequence[float]) -> str:
    """Block characters on an absolute 0..1 scale, so rows compare with each other."""
    top = len(SPARK) - 1
    return "".join(SPARK[min(top, max(0, round(v * top)))] for v in values)


def plot(plt, records: Sequence[Record], file: str) -> None:
    """Write the acceptance/speed figure (acceptance/plot.py) to `file`."""
    fig = acceptance_plot.figure(plt, records)
    try:
        fig.savefig(file, dpi=110)
    finally:
        plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def _print_table(groups: Sequence[GroupSummary], path: Path, since: str | None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    runs = sum(g.runs for g in groups)
    scope = f"since {since}" if since else "all time"
    table = Table(title="acceptance by pair and workload", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption_justify="left",
                  caption=f"{runs} runs, {scope} · log: {path}\nlen: draft tokens "
                          "accepted per drafting round · trend: acceptance over time")  # fmt: skip
    table.add_column("pair (drafter)", overflow="fold", min_width=14)
    table.add_column("tag", no_wrap=True)
    for name in ("runs", "tokens", "accept", "p10-p90", "len", "tok/s"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("trend", no_wrap=True, min_width=5)
    for g in groups:
        table.add_row(
            g.pair, g.tag, str(g.runs), f"{g.tokens:,}", _pct(g.acceptance_mean),
            _pct_range(g.acceptance_p10, g.acceptance_p90),
            "-" if g.mean_accepted is None else f"{g.mean_accepted:.2f}",
            "-" if g.tokens_per_s is None else f"{g.tokens_per_s:.1f}",
            sparkline(g.trend) or "-",
        )
    Console().print(table)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _pct_range(lo: float | None, hi: float | None) -> str:
    return "-" if lo is None or hi is None else f"{lo:.0%}-{hi:.0%}"


def _empty_message(path: Path, since: str | None) -> str:
    if since:
        return f"No generations logged since {since} (log: {path})."
    msg = (f"No generations logged yet. Each `localspec run`, `edit` and `chat` adds one; "
           f"the log is {path}.")  # fmt: skip
    if logdb.logging_disabled():
        msg += f" Logging is off: {logdb.NO_LOG_ENV} is set."
    return msg


def _json_doc(path: Path, cutoff: float | None, groups, alerts) -> dict:
    return {
        "db": str(path),
        "since": _iso(cutoff) if cutoff is not None else None,
        "runs": sum(g.runs for g in groups),
        "groups": [asdict(g) | {"pair": g.pair} for g in groups],
        "drift": [a.to_dict() for a in alerts],
    }


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")
