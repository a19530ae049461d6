"""`localspec stats --plot`: the acceptance log drawn one row per target/draft/drafter
pair, acceptance on the left and tok/s on the right, over time.

Each workload tag is one colour: its runs as points and their rolling median as a line
(single runs scatter too much to read a trend from, and a line joining them draws a
tangle). tok/s axes are shared between rows of the same target only: speeds of different
targets do not compare. The tag legend sits outside the axes, in a band of its own under
the title, so it never covers data. matplotlib is passed in (imported by the command, only for --plot)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import numpy as np

from localspec.acceptance.drift import pair_label
from localspec.acceptance.logdb import Record

MAX_ROWS = 8  # pairs drawn; the rest (fewest runs) are named in a footnote
ROW_HEIGHT = 2.3  # inches per pair
HEADER = 0.8  # inches above the grid: the title, then the legend
FOOTER = 0.25  # inches below it for the footnote naming pairs not drawn


def rolling_median(values: Sequence[float], window: int) -> np.ndarray:
    """Median of each value with the window before it (shorter at the start)."""
    data = np.asarray(values, dtype=float)
    return np.array([np.median(data[max(0, i - window + 1): i + 1]) for i in range(len(data))])


def window_for(n: int) -> int:
    """A fifth of the runs, between 3 and 25: smooth enough to read, short enough to
    follow a change."""
    return max(3, min(25, n // 5))


def figure(plt, records: Sequence[Record]):
    """The figure for these records (time order); the caller saves and closes it."""
    pairs = _pairs(records)
    shown, hidden = pairs[:MAX_ROWS], pairs[MAX_ROWS:]
    tags = sorted({r.tag for _, rs in shown for r in rs})
    colours = {tag: f"C{i % 10}" for i, tag in enumerate(tags)}
    rows = len(shown)
    fig, axes = plt.subplots(rows, 2, squeeze=False, sharex=True,
                             figsize=(13, HEADER + 0.6 + ROW_HEIGHT * rows))
    tps_axes: dict[str, object] = {}  # the first tok/s axes of each target
    for row, ((target, draft, drafter), rs) in enumerate(shown):
        ax_acc, ax_tps = axes[row]
        ax_acc.set_title(f"{pair_label(target, draft, drafter)}  ·  {len(rs)} runs", loc="left",
                         fontsize="medium")
        _draw(ax_acc, rs, colours, lambda r: r.acceptance)
        ax_acc.set_ylim(-0.02, 1.02)
        ax_acc.set_ylabel("acceptance")
        if all(r.acceptance is None for r in rs):
            ax_acc.text(0.5, 0.5, "no drafting (acceptance undefined)", transform=ax_acc.transAxes,
                        ha="center", va="center", color="0.45")
        _draw(ax_tps, rs, colours, lambda r: r.tokens_per_s if r.decode_s > 0 else None)
        ax_tps.set_ylabel(f"tok/s · {target}", fontsize="small")
        first = tps_axes.setdefault(target, ax_tps)
        if first is not ax_tps:
            ax_tps.sharey(first)
        for ax in (ax_acc, ax_tps):
            ax.grid(alpha=0.3)
    for ax in tps_axes.values():
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # from zero: speeds read as proportions
    for ax in axes[-1]:
        _date_axis(ax)
    height = fig.get_size_inches()[1]
    fig.suptitle("localspec: acceptance (left) and decode speed (right) per run, by pair", x=0.01,
                 y=1 - 0.12 / height, ha="left", va="top")
    fig.tight_layout(rect=(0, FOOTER / height if hidden else 0, 1, 1 - HEADER / height))
    _legend(fig, colours, y=1 - 0.42 / height)
    if hidden:
        names = ", ".join(pair_label(*key) for key, _ in hidden)
        fig.text(0.01, 0.005, f"not drawn (fewer runs): {names}", fontsize="x-small", color="0.4")
    return fig


def _pairs(records: Sequence[Record]) -> list[tuple[tuple, list[Record]]]:
    """(target, draft, drafter) -> its records, most runs first."""
    by_pair: dict[tuple, list[Record]] = {}
    for r in records:
        by_pair.setdefault((r.target, r.draft, r.drafter), []).append(r)
    return sorted(by_pair.items(), key=lambda kv: (-len(kv[1]), str(kv[0])))


def _draw(ax, records: Sequence[Record], colours: dict[str, str], value) -> None:
    """One tag at a time: its points, and its rolling median once it has 3 of them."""
    by_tag: dict[str, list[Record]] = {}
    for r in records:
        by_tag.setdefault(r.tag, []).append(r)
    for tag, rs in sorted(by_tag.items()):
        points = [(datetime.fromtimestamp(r.ts), v) for r in rs if (v := value(r)) is not None]
        if not points:
            continue
        when, ys = zip(*points)
        ax.scatter(when, ys, s=12, alpha=0.45, color=colours[tag], linewidths=0, gid=f"points:{tag}")
        if len(ys) >= 3:
            ax.plot(when, rolling_median(ys, window_for(len(ys))), color=colours[tag], linewidth=2,
                    gid=f"median:{tag}")


def _legend(fig, colours: dict[str, str], y: float):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", markersize=5, linewidth=2, label=tag)
               for tag, c in colours.items()]
    handles.append(Line2D([], [], color="0.3", marker="o", markersize=4, linewidth=0, alpha=0.5,
                          label="points: runs"))
    handles.append(Line2D([], [], color="0.3", linewidth=2, label="line: rolling median"))
    return fig.legend(handles=handles, title="workload:", loc="upper left", frameon=False,
                      bbox_to_anchor=(0.01, y), ncol=len(handles), alignment="left",
                      title_fontproperties={"size": "medium"}, fontsize="medium")


def _date_axis(ax) -> None:
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    formatter = mdates.AutoDateFormatter(locator)
    # by tick spacing in days: dates, with the time of day once ticks are hours apart
    formatter.scaled = {365.0: "%Y", 30.0: "%b %Y", 1.0: "%b %d", 1 / 24: "%b %d %H:%M",
                        1 / 1440: "%H:%M", 1 / 86400: "%H:%M:%S"}
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(formatter)
