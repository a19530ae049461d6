"""`bench --serve` (localspec/bench/serve_bench.py): serve's default drafting (auto) timed
with speculation off, on and under the rule, per context band and concurrency; the
crossover it prints and why (pure code on made-up runs), and the limits it keeps in the
profile, where `localspec serve` reads them and /health shows them (SmolLM2)."""

from __future__ import annotations

import json

import pytest
from test_serve import http, start_server, stop_server

from localspec.bench.serve_bench import (
    Run,
    _crossover_line,
    _step_noise,
    band_crossover,
    format_report,
    ratio_noise,
    run_serve_bench,
)
from localspec.core.config import LoadOptions


def _run(c: int, mode: str, tok_s: float, step_ms: float = 20.0, tokens: float = 1.0, repeat: int = 0,
         noise: float | None = None, drafted: int | None = None) -> Run:
    if drafted is None:
        drafted = 10 if mode == "on" else 0
    return Run(c, mode, "short", context=100.0, requests=c, tokens=64, tok_s=tok_s, decode_tok_s=tok_s,
               decode_steps=10, decode_step_ms=step_ms, decode_step_tokens=tokens, repeat=repeat,
               step_noise=noise, drafted=drafted, accepted=drafted // 2)


def _pairs(c: int, ratios: list[float], noise: float | None = None) -> list[Run]:
    """Repeats of on and off at C whose on/off ratios are `ratios` (off at 100 tok/s)."""
    return [r for i, x in enumerate(ratios)
            for r in (_run(c, "off", 100.0, repeat=i, noise=noise), _run(c, "on", 100.0 * x, repeat=i, noise=noise))]


def test_the_crossover_is_the_last_concurrency_of_the_first_run_where_speculating_paid():
    runs = [_run(1, "off", 50.0, 20.0, 1.0), _run(1, "on", 65.0, 30.0, 1.95),
            _run(2, "off", 80.0, 25.0, 2.0), _run(2, "on", 88.0, 40.0, 3.5),
            _run(4, "off", 120.0, 33.0, 4.0), _run(4, "on", 96.0, 60.0, 5.8),
            _run(8, "off", 150.0, 53.0, 8.0), _run(8, "on", 160.0, 70.0, 11.0)]  # noise past the loss
    x = band_crossover(runs)
    assert x["limit"] == 2 and x["context"] == 100
    row4 = x["by_concurrency"][2]
    assert row4["on_over_off"] == pytest.approx(0.8) and row4["on_per_slot"] == pytest.approx(24.0)
    # why: the speculative step at batch 4 cost 60/33 plain steps for 5.8/4 the tokens
    assert row4["step_cost"] == pytest.approx(60 / 33) and row4["step_tokens"] == pytest.approx(1.45)
    assert band_crossover([_run(1, "off", 50.0, 20.0, 1.0), _run(1, "on", 40.0, 30.0, 1.2)])["limit"] == 0


def test_a_gain_within_the_repeats_spread_is_a_tie_and_keeps_speculation_off():
    # last session's SmolLM2 edits at C=1: 1.06x in one run, 0.94x in the next
    x = band_crossover(_pairs(1, [1.06, 0.94, 1.04]) + _pairs(2, [0.85, 0.90, 0.88]))
    row = x["by_concurrency"][0]
    assert row["on_over_off"] == pytest.approx(1.04) and row["repeats"] == 3
    # 2 standard errors of the median: the three ratios' spread / sqrt(3)
    assert row["noise"] == pytest.approx(2 * 0.0643 / 3 ** 0.5, rel=0.01)
    assert not row["pays"] and x["limit"] == 0  # 1.04 - 1 < 0.074: a tie goes to off
    assert "within the noise: a tie, kept off" in _crossover_line(x)
    # the same median with repeats that agree clears the noise
    x = band_crossover(_pairs(1, [1.04, 1.05, 1.04]) + _pairs(2, [0.85, 0.90, 0.88]))
    assert x["by_concurrency"][0]["pays"] and x["limit"] == 1
    assert "beats off by more than the noise" in _crossover_line(x)


def test_the_runs_step_spread_is_the_noise_when_the_repeats_agree_by_chance():
    # two repeats at exactly 1.06x: no spread between them, but each run's steps spread 4%
    x = band_crossover(_pairs(1, [1.06, 1.06], noise=0.04))
    row = x["by_concurrency"][0]
    assert row["noise"] == pytest.approx(2 * 1.06 * (2 * 0.04 ** 2 / 2) ** 0.5)  # 0.085
    assert x["limit"] == 0
    assert band_crossover(_pairs(1, [1.06, 1.06], noise=0.01))["limit"] == 1


def test_a_gain_with_nothing_drafted_is_drift_not_speculation():
    # on drafted nothing at C=2 (auto declined): its 5% over off, with repeats that agree,
    # is the machine between runs; with drafts the same figures would pay
    runs = _pairs(1, [1.3, 1.3]) + [_run(2, m, 100.0 * x, repeat=i, noise=0.005, drafted=0)
                                    for i in (0, 1) for m, x in (("off", 1.0), ("on", 1.05))]
    x = band_crossover(runs)
    assert x["limit"] == 1 and "nothing drafted" in _crossover_line(x)
    for r in runs:
        r.drafted = 10 if r.mode == "on" else 0
    assert band_crossover(runs)["limit"] == 2


def test_an_exact_tie_keeps_speculation_off():
    assert band_crossover(_pairs(1, [1.0]))["limit"] == 0
    assert band_crossover(_pairs(1, [1.001]))["limit"] == 1  # no noise measured: any gain


def test_the_noise_of_a_ratio_and_of_a_run_s_steps():
    assert ratio_noise([1.1]) == 0.0
    assert ratio_noise([1.0, 1.2], z=1.0) == pytest.approx(0.1)  # stdev 0.141 / sqrt(2)
    assert ratio_noise([1.0, 1.0], [0.05, None], z=1.0) == pytest.approx(0.05 / 2 ** 0.5)
    assert _step_noise([(0.1, 2)]) is None
    assert _step_noise([(0.1, 2), (0.2, 4), (0.05, 1)]) == pytest.approx(0.0)  # one rate throughout
    # speculative steps: the same time, 1 or 9 tokens: half the steps' tokens are noise
    noisy = _step_noise([(0.1, 1), (0.1, 9)] * 5)
    assert noisy == pytest.approx((10 / 9 * 10 * 16) ** 0.5 / 50)


def test_the_report_says_where_it_stops_paying_and_why():
    runs = [_run(1, "off", 50.0, 20.0, 1.0), _run(1, "on", 65.0, 30.0, 1.95),
            _run(2, "off", 80.0, 25.0, 2.0), _run(2, "on", 72.0, 40.0, 2.88)]
    result = {"target": "t", "threads": 2, "n_predict": 64, "drafter": "auto", "draft_max": 32,
              "rule": "off above 1 active (default)", "runs": [{**r.__dict__, "acceptance": 0.5} for r in runs],
              "crossover": {"short": band_crossover(runs)}, "rule_check": [], "rule_within_5pct": None,
              "limits": {"100": 1}, "stored": "bench --serve"}
    text = format_report(result)
    assert "drafter auto" in text and "~100 tokens" in text
    line = next(s for s in text.splitlines() if "crossover" in s)
    assert "off above 1 active" in line
    assert "C=2: a speculative step cost 1.60 plain steps" in line and "1.44x the tokens: 0.90x" in line
    assert "off above 1 active at 100 tokens" in text.splitlines()[-1]


def test_serve_bench_measures_auto_by_band_and_serve_reads_the_limits(smol_path, tmp_path):
    opts = LoadOptions(model=smol_path, draft=None, n_ctx=0, n_threads=1, n_gpu_layers=0,
                       n_gpu_layers_draft=0)
    lines: list[str] = []
    out = run_serve_bench(opts=opts, n_predict=6, concurrency=(1, 2), tags=("code", "edit"),
                          progress=lines.append)
    assert out["drafter"] == "auto" and out["draft_max"] == 32  # serve's default, not a fixed n-gram
    assert sorted((r["band"], r["concurrency"], r["mode"], r["repeat"]) for r in out["runs"]) == sorted(
        (b, c, m, i) for b in ("short", "long") for c in (1, 2) for m in ("off", "on", "rule") for i in (0, 1))
    rows = [y for x in out["crossover"].values() for y in x["by_concurrency"]]
    assert all(y["repeats"] == 2 and y["noise"] >= 0 and y["pays"] == (y["drafted"] > 0 and y["on_over_off"] - 1 > y["noise"])
               for y in rows)
    assert any(r["step_noise"] for r in out["runs"])  # steps at batch C measured their spread
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in out["runs"])
    short, long = out["crossover"]["short"], out["crossover"]["long"]
    assert short["context"] < 200 < long["context"]  # an edit holds its file
    assert set(out["limits"]) == {str(short["context"]), str(long["context"])}
    assert all(0 <= v <= 2 for v in out["limits"].values())
    assert json.loads(json.dumps(out)) == out  # JSON-ready for `bench --json`
    text = format_report(out)
    assert text.count("crossover at") == 2 and len(lines) == 1 + 2 * 2 * 6 and "+-" in text
    assert out["stored"].startswith("bench --serve")
    # `localspec serve` with no tune profile takes them, by band, and /health says whence
    proc, base = start_server(smol_path, tmp_path / "home", "--parallel", "2", "-c", "2048")
    try:
        health = http(base, None).get("/health").json()
    finally:
        assert stop_server(proc) == 0
    limits = health["spec_limits"]
    assert limits["source"] == f"measured by {out['stored']}"
    assert {str(b["context"]): b["limit"] for b in limits["bands"]} == out["limits"]
    pytest.importorskip("matplotlib")
    from localspec.bench.serve_bench import plot

    png = tmp_path / "serve.png"
    plot(out, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
