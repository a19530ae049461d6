"""The session benchmark's workloads and figures (bench/sessions.py); the runs
themselves are a benchmark (`localspec bench --sessions`), not a test."""

from __future__ import annotations

from click.testing import CliRunner

from localspec.bench import sessions as sb
from localspec.cli import cli


def test_sessions_are_built_from_standard_library_code():
    built = {s.name: s for s in sb.builtin_sessions()}
    assert list(built) == ["tests", "hints", "agent", "fresh"]
    assert all(len(built[n].requests) == 10 for n in ("tests", "hints", "agent"))
    assert "def splitext(" in built["tests"].requests[3] and "def quote(" in built["hints"].requests[1]
    assert '"read_file"' in built["agent"].requests[0] and built["agent"].system
    assert not built["fresh"].repeats and len(set(built["fresh"].requests)) == len(built["fresh"].requests)


def _r(session, i, variant, tok_s, same="identical", src=None):
    return sb.Result(session, i, variant, 64, tok_s, same, src or {})


def test_speedups_are_over_plain_per_request_and_per_session():
    results = [_r("s", 1, "plain", 10), _r("s", 1, "auto", 10), _r("s", 1, "memory", 10),
               _r("s", 2, "plain", 10), _r("s", 2, "auto", 12), _r("s", 2, "memory", 20),
               _r("s", 3, "plain", 10), _r("s", 3, "auto", 12), _r("s", 3, "memory", 40, src={"memory": [60, 50]})]
    lines = sb.speedups(results)
    assert [l["memory"] for l in lines] == [1.0, 2.0, 4.0] and lines[2]["memory_accepted"] == {"memory": 50}
    summary = sb.session_summary(lines)["s"]
    assert abs(summary["memory"] - 2.0) < 1e-9 and summary["memory_from_3"] == 4.0 and summary["all_same"]
    results[-1] = _r("s", 3, "memory", 40, same="MISMATCH @5 (margin 3.00)")
    assert not sb.session_summary(sb.speedups(results))["s"]["all_same"]
    assert "MISMATCH @5" in sb.format_report(sb.speedups(results), sb.session_summary(sb.speedups(results)))


def test_an_unknown_session_is_a_usage_error():
    r = CliRunner().invoke(cli, ["bench", "--sessions", "tests,nope"])
    assert r.exit_code == 2 and "unknown nope" in r.output
