"""`localspec tune` on a real model: it measures, stores the profile where auto and
serve find it, and `--spec auto` runs with it."""

from __future__ import annotations

import json

from test_cli import cli

from localspec.models import paths


def test_tune_saves_a_profile_that_auto_and_serve_find(smol_path):
    proc = cli("tune", "-m", smol_path, "-md", smol_path, "-t", "1", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    v = out["vcurve"]
    assert len(v) == 32 and v[0] == 1.0 and all(x > 0 for x in v)
    assert out["t_token_s"] > 0 and out["prefill_tok_s"] > 0
    assert out["draft_t_token_s"] > 0 and out["n_threads"] == 1

    stored = [json.loads(p.read_text()) for p in (paths.state_dir() / "profiles").glob("*.json")]
    # the pair's profile, and the target's alone (V(n) does not depend on the draft): serve
    # and runs without a draft model look that one up
    assert sorted(p["draft"] is None for p in stored) == [False, True]
    assert all(p["vcurve"] == v for p in stored)

    proc = cli("run", "--raw", "-m", smol_path, "-md", smol_path, "-t", "1", "--spec", "auto",
               "-n", "24", "--stats", "json", "--no-log", "def fib(n):")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["generated"] == 24 and stats["policy"]


def test_tune_text_report_names_the_policy(smol_path):
    proc = cli("tune", "-m", smol_path, "-md", "none", "-t", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "V(n)" in proc.stdout and "policy that follows" in proc.stdout and "saved" in proc.stdout
