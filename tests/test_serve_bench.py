"""`bench --serve` (localspec/bench/serve_bench.py): serve's default drafting (auto) timed
with speculation off, on and under the rule, per context band and concurrency; the
crossover it prints and why (pure code on made-up runs), and the limits it keeps in the
profile, where `localspec serve` reads them and /health shows them (SmolLM2)."""

from __future__ import annotations

import json

import pytest
from test_serve import http, start_server, stop_server

from localspec.bench.serve_bench import Run, band_crossover, format_report, run_serve_bench
from localspec.core.config import LoadOptions


def _run(c: int, mode: str, tok_s: float, step_ms: float, tokens: float) -> Run:
    return Run(c, mode, "short", context=100.0, requests=c, tokens=64, tok_s=tok_s, decode_tok_s=tok_s,
               decode_steps=10, decode_step_ms=step_ms, decode_step_tokens=tokens)


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
    assert {(r["band"], r["concurrency"], r["mode"]) for r in out["runs"]} == {
        (b, c, m) for b in ("short", "long") for c in (1, 2) for m in ("off", "on", "rule")}
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in out["runs"])
    short, long = out["crossover"]["short"], out["crossover"]["long"]
    assert short["context"] < 200 < long["context"]  # an edit holds its file
    assert set(out["limits"]) == {str(short["context"]), str(long["context"])}
    assert all(0 <= v <= 2 for v in out["limits"].values())
    assert json.loads(json.dumps(out)) == out  # JSON-ready for `bench --json`
    text = format_report(out)
    assert text.count("crossover at") == 2 and len(lines) == 1 + 2 * 6
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
