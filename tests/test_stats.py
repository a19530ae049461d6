"""`localspec stats` and the drift rule, on synthetic records (no models needed)."""

from __future__ import annotations

import json
import random
import sys
import time

import pytest
from click.testing import CliRunner

from localspec.acceptance import drift, logdb
from localspec.cli import cli
from localspec.commands import stats as stats_cmd
from localspec.core.config import SamplingConfig, SpecConfig
from localspec.core.engine import GenerationStats

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
NOW = time.time()


def record(acceptance: float | None, *, age_s: float = 0.0, target: str = TARGET,
           draft: str | None = None, drafter: str = "ngram", tag: str = "code",
           drafted: int = 200, generated: int = 100, decode_s: float = 4.0) -> dict:  # fmt: skip
    """One synthetic generation, `age_s` seconds ago, with the given acceptance."""
    if acceptance is None:
        drafted, drafter = 0, "none"
    accepted = round((acceptance or 0.0) * drafted)
    stats = GenerationStats(prompt_tokens=50, generated=generated, rounds=40,
                            draft_rounds=20 if drafted else 0, drafted=drafted, accepted=accepted,
                            decode_s=decode_s, drafter=drafter)  # fmt: skip
    return logdb.build_record("run", stats, target=target, draft=draft, spec=SpecConfig(),
                              sampling=SamplingConfig(), tag=tag, now=NOW - age_s)  # fmt: skip


def add(acceptance: float | None, **kw) -> None:
    logdb.insert(record(acceptance, **kw))


def series(values, **kw) -> None:
    """Values in time order, one minute apart, the last one now."""
    n = len(values)
    logdb.insert_many([record(v, age_s=60.0 * (n - 1 - i), **kw) for i, v in enumerate(values)])


def invoke(*args: str):
    return CliRunner().invoke(cli, ["stats", *args], env={"COLUMNS": "200"})


def noisy(mean: float, n: int, sd: float = 0.04, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [min(1.0, max(0.0, rng.gauss(mean, sd))) for _ in range(n)]


# ----- the command ------------------------------------------------------------------


def test_empty_log_is_a_friendly_message():
    result = invoke()
    assert result.exit_code == 0, result.output
    assert "No generations logged yet" in result.stdout
    assert not logdb.db_path().exists()  # reading does not create the log
    result = invoke("--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["groups"] == []


def test_table_per_pair_drafter_and_tag():
    series([0.7, 0.8, 0.9])
    series([0.2, 0.3], tag="prose")
    series([0.5], draft=DRAFT, drafter="hybrid")
    add(None)  # plain decoding: counted, no acceptance
    result = invoke()
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"{TARGET} + ngram" in out and f"{TARGET} + {DRAFT} (hybrid)" in out
    assert f"{TARGET} + none" in out
    assert "prose" in out and "80%" in out and "7 runs" in out
    assert stats_cmd.sparkline([0.7, 0.8, 0.9]) in out
    assert result.stderr == ""  # no drift with so few runs


def test_json_numbers():
    series([0.5, 0.6, 0.7, 0.8, 0.9], generated=100, decode_s=4.0)
    add(None, tag="code")
    doc = json.loads(invoke("--json").stdout)
    assert doc["runs"] == 6 and doc["drift"] == []
    by_drafter = {g["drafter"]: g for g in doc["groups"]}
    g = by_drafter["ngram"]
    assert (g["target"], g["draft"], g["tag"], g["runs"], g["tokens"]) == (TARGET, None, "code", 5, 500)
    assert g["acceptance_mean"] == pytest.approx(0.7)
    assert g["acceptance_p10"] == pytest.approx(0.54)  # numpy's linear percentile
    assert g["acceptance_p90"] == pytest.approx(0.86)
    assert g["mean_accepted"] == pytest.approx(200 * 0.7 / 20)
    assert g["tokens_per_s"] == pytest.approx(25.0)
    assert g["trend"] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert g["pair"] == f"{TARGET} + ngram" and g["first"] < g["last"]
    none = by_drafter["none"]
    assert none["acceptance_mean"] is None and none["acceptance_runs"] == 0 and none["runs"] == 1


@pytest.mark.parametrize("since, runs", [("24h", 2), ("90m", 1), ("2w", 3), ("30D", 3)])
def test_since_relative(since, runs):
    add(0.5, age_s=3 * 86400)
    add(0.6, age_s=2 * 3600)
    add(0.7, age_s=60)
    doc = json.loads(invoke("--since", since, "--json").stdout)
    assert doc["runs"] == runs


def test_since_iso_date_and_time():
    add(0.5, age_s=10 * 86400)
    add(0.7, age_s=60)
    day = time.strftime("%Y-%m-%d", time.localtime(NOW - 2 * 86400))
    assert json.loads(invoke("--since", day, "--json").stdout)["runs"] == 1
    assert stats_cmd.parse_since("2025-06-01T12:00:00+00:00") == 1748779200.0
    assert stats_cmd.parse_since("7d", now=1000000.0) == 1000000.0 - 7 * 86400


def test_since_nothing_recent_and_bad_value():
    add(0.5, age_s=10 * 86400)
    result = invoke("--since", "1h")
    assert result.exit_code == 0 and "No generations logged since 1h" in result.stdout
    result = invoke("--since", "last tuesday")
    assert result.exit_code == 2
    assert "--since" in result.stderr and "7d" in result.stderr


def test_plot_without_matplotlib_is_one_clear_line(monkeypatch):
    add(0.5)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    result = invoke("--plot", "out.png")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install matplotlib" in lines[0]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    series(noisy(0.7, 6))
    series([0.3, 0.4], draft=DRAFT, drafter="model", tag="prose")
    add(None)
    out = tmp_path / "acc.png"
    result = invoke("--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupt_log_is_one_line_error():
    logdb.db_path().parent.mkdir(parents=True)
    logdb.db_path().write_bytes(b"garbage" * 500)
    result = invoke()
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot read the acceptance log" in lines[0]


def test_drift_warning_from_the_command():
    series([0.72] * 20 + [0.41] * 5)
    series(noisy(0.6, 25), tag="prose")  # a steady group next to it: no warning
    result = invoke()
    assert result.exit_code == 0
    expected = (f"warning: acceptance for {TARGET} + ngram on code fell from 72% to 41% "
                "over the last 5 runs (previous 20 runs; drop > 10% needed)")
    assert result.stderr.strip().splitlines() == [expected]
    doc = json.loads(invoke("--json").stdout)
    (alert,) = doc["drift"]
    assert (alert["tag"], alert["before"], alert["after"]) == ("code", pytest.approx(0.72), pytest.approx(0.41))


# ----- helpers ----------------------------------------------------------------------


def test_sparkline_and_buckets():
    assert stats_cmd.sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert stats_cmd.sparkline([]) == ""
    assert stats_cmd.buckets([1, 2, 3], 12) == [1, 2, 3]
    assert stats_cmd.buckets([0.0] * 10 + [1.0] * 10, 2) == [0.0, 1.0]
    assert len(stats_cmd.buckets(list(range(100)), 12)) == 12


def test_percentile_interpolates_between_ranks():
    xs = [0.9, 0.1, 0.5, 0.3]  # sorted: 0.1 0.3 0.5 0.9; rank (n - 1) * q / 100
    assert stats_cmd.percentile(xs, 0) == pytest.approx(0.1)
    assert stats_cmd.percentile(xs, 10) == pytest.approx(0.1 + 0.3 * 0.2)
    assert stats_cmd.percentile(xs, 50) == pytest.approx(0.4)
    assert stats_cmd.percentile(xs, 90) == pytest.approx(0.5 + 0.7 * 0.4)
    assert stats_cmd.percentile(xs, 100) == pytest.approx(0.9)
    assert stats_cmd.percentile([], 10) is None


# ----- the drift rule ---------------------------------------------------------------


def test_stable_series_raises_no_alert():
    for seed in range(20):
        assert drift.check(noisy(0.7, 25, sd=0.08, seed=seed)) is None


def test_clear_drop_raises_an_alert():
    hit = drift.check(noisy(0.72, 20, seed=3) + noisy(0.41, 5, seed=4))
    assert hit is not None
    before, after, n_history, threshold = hit
    assert before == pytest.approx(0.72, abs=0.03) and after == pytest.approx(0.41, abs=0.04)
    assert n_history == 20 and threshold >= drift.FLOOR


def test_too_few_runs_raise_no_alert():
    assert drift.check([0.9] * 9 + [0.1] * 5) is None  # history below MIN_HISTORY
    assert drift.check([0.9] * 20 + [0.1] * 4) is not None  # the recent window reaches back


def test_small_or_noisy_drops_raise_no_alert():
    assert drift.check([0.72] * 20 + [0.65] * 5) is None  # below the 10-point floor
    assert drift.check(noisy(0.72, 20, sd=0.02) + [0.72, 0.72, 0.72, 0.72, 0.0]) is None  # one odd run
    wild = [0.1, 0.95] * 10  # a history too spread out to call a drop of 0.2 clear
    assert drift.check(wild + [0.33] * 5) is None


def test_history_window_is_bounded():
    old_high = [0.95] * 40  # long ago: outside the 20-run history window
    assert drift.check(old_high + [0.5] * 20 + [0.45] * 5) is None
    assert drift.check(old_high + [0.5] * 20 + [0.45] * 5, history=60) is not None


def test_detect_groups_and_ignores_tiny_drafts():
    series([0.8] * 20 + [0.3] * 5, tag="json")
    series([0.8] * 20 + [0.3] * 5, tag="prose", drafted=drift.MIN_DRAFTED - 1)
    series([0.8] * 25, draft=DRAFT, drafter="model", tag="json")
    alerts = drift.detect(logdb.read_records())
    assert [(a.draft, a.drafter, a.tag) for a in alerts] == [(None, "ngram", "json")]
    assert alerts[0].pair == f"{TARGET} + ngram"
    assert "fell from 80% to 30% over the last 5 runs" in alerts[0].message()


# ----- --plot: one row per pair, the legend outside the axes --------------------------

# a fortnight of runs as this project's machines log them: (target, draft, drafter, tag,
# runs, acceptance mean and sd or None for no drafting, tok/s mean and sd)
REALISTIC = [
    (TARGET, DRAFT, "auto", "code", 90, (0.62, 0.14), (12.0, 2.5)),
    (TARGET, DRAFT, "auto", "prose", 50, (0.44, 0.15), (9.0, 2.0)),
    (TARGET, DRAFT, "auto", "json", 25, (0.72, 0.10), (13.5, 2.5)),
    (TARGET, None, "ngram", "edit", 60, (0.86, 0.08), (21.0, 6.0)),
    (TARGET, None, "ngram", "code", 35, (0.33, 0.18), (8.0, 1.5)),
    (TARGET, DRAFT, "model", "code", 40, (0.58, 0.13), (8.5, 1.8)),
    (TARGET, None, "none", "prose", 30, None, (7.1, 0.4)),
    ("smollm2-135m", None, "ngram", "prose", 45, (0.28, 0.15), (78.0, 14.0)),
    ("smollm2-135m", None, "ngram", "code", 20, (0.41, 0.15), (85.0, 14.0)),
    (DRAFT, None, "auto", "code", 30, (0.5, 0.2), (24.0, 4.0)),
]


def realistic_log(groups=REALISTIC, seed: int = 7) -> None:
    rng = random.Random(seed)
    rows = []
    for target, draft, drafter, tag, n, acc, tps in groups:
        for _ in range(n):
            a = None if acc is None else min(1.0, max(0.0, rng.gauss(*acc)))
            speed = max(1.0, rng.gauss(*tps))
            generated = rng.randint(40, 600)
            rows.append(record(a, age_s=rng.uniform(0, 14 * 86400), target=target, draft=draft,
                               drafter=drafter, tag=tag, drafted=rng.randint(80, 400),
                               generated=generated, decode_s=generated / speed))
    logdb.insert_many(sorted(rows, key=lambda r: r["ts"]))


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_has_a_row_per_pair_and_the_legend_outside_every_axes():
    plt = stats_cmd._pyplot()
    from localspec.acceptance import plot

    realistic_log()
    fig = plot.figure(plt, logdb.read_records())
    try:
        pairs = {(t, d, dr) for t, d, dr, *_ in REALISTIC}
        rows = [fig.axes[i: i + 2] for i in range(0, len(fig.axes), 2)]
        assert len(rows) == len(pairs) == 6
        titles = {acc.get_title(loc="left").split("  ·  ")[0] for acc, _ in rows}
        assert titles == {drift.pair_label(*p) for p in pairs}
        for acc, tps in rows:
            pair = acc.get_title(loc="left")
            drafted = "+ none" not in pair
            for ax in (acc, tps) if drafted else (tps,):  # points and a rolling median per tag
                gids = {a.get_gid() for a in [*ax.collections, *ax.lines]}
                assert any(g.startswith("points:") for g in gids) and any(g.startswith("median:") for g in gids)
            assert tps.get_ylabel().endswith(pair.split(" + ")[0])  # tok/s of this target
        by_target: dict = {}
        for _, tps in rows:
            by_target.setdefault(tps.get_ylabel(), set()).add(tps.get_ylim())
        assert all(len(limits) == 1 for limits in by_target.values())  # one scale per target
        assert len({next(iter(v)) for v in by_target.values()}) == len(by_target)  # not shared across
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        labels = [t.get_text() for t in legend.get_texts()]
        assert {"code", "edit", "json", "prose"} <= set(labels)
        assert all(not _overlaps(box, ax.get_tightbbox(renderer)) for ax in fig.axes)
        whole = fig.bbox
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1
    finally:
        plt.close(fig)


def test_plot_draws_the_busiest_pairs_and_names_the_rest():
    plt = stats_cmd._pyplot()
    from localspec.acceptance import plot

    groups = [(f"model-{i}", None, "ngram", "code", 3 + i, (0.5, 0.1), (10.0, 1.0)) for i in range(10)]
    realistic_log(groups)
    fig = plot.figure(plt, logdb.read_records())
    try:
        assert len(fig.axes) == 2 * plot.MAX_ROWS
        drawn = {ax.get_title(loc="left").split(" + ")[0] for ax in fig.axes[::2]}
        assert drawn == {f"model-{i}" for i in range(2, 10)}  # the two with fewest runs left out
        footnote = " ".join(t.get_text() for t in fig.texts)
        assert "model-0 + ngram" in footnote and "model-1 + ngram" in footnote
    finally:
        plt.close(fig)


def test_rolling_median_follows_a_step():
    from localspec.acceptance.plot import rolling_median

    assert list(rolling_median([0.2, 0.2, 0.2, 0.9, 0.9, 0.9], 3)) == [0.2, 0.2, 0.2, 0.2, 0.9, 0.9]
