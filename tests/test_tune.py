"""`localspec tune` on a real model: it measures, stores the profile where auto and
serve find it, and `--spec auto` runs with it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from test_cli import cli

from localspec.commands.tune import _policy_lines, ceiling
from localspec.models import paths
from localspec.profile import Profile, Setup, load_profile, save_profile


def test_tune_saves_a_profile_that_auto_and_serve_find(smol_path):
    proc = cli("tune", "-m", smol_path, "-md", smol_path, "-t", "1", "--json", "--vcurve-max", "24",
               timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    v = out["vcurve"]
    assert len(v) == 24 and v[0] == 1.0 and all(x > 0 for x in v)
    assert out["t_token_s"] > 0 and out["prefill_tok_s"] > 0
    assert out["draft_t_token_s"] > 0 and out["n_threads"] == 1
    assert out["flash_attn"] in ("on", "off", None)  # timed both ways at a long context

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
    # -fa forced: no attention timing (the test above covers it), and the report says so
    proc = cli("tune", "-m", smol_path, "-md", "none", "-t", "1", "--vcurve-max", "16", "-fa", "off",
               timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "V(n)" in proc.stdout and "policy that follows" in proc.stdout and "saved" in proc.stdout
    assert "flash attention: off (set by -fa)" in proc.stdout
    assert "ceiling: " in proc.stdout
    assert ", 16:" in proc.stdout and ", 24:" not in proc.stdout  # timed up to --vcurve-max
    # by default up to 64 tokens: edits draft long copies, and a size tune knows is one
    # auto need not try
    assert "[default: 64;" in " ".join(cli("tune", "--help").stdout.split())


# ----- profiles without a model ---------------------------------------------------------


def _profile(setup: Setup, draft: str | None = None) -> Profile:
    return Profile(key=setup.key, target="t.gguf", draft=draft, device=setup.device,
                   n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers, t_token_s=0.1,
                   vcurve=[1.0, 1.5], prefill_tok_s=100.0, draft_t_token_s=0.05 if draft else None)


def test_profile_keys_are_those_earlier_versions_stored():
    # sha256("target id|draft id or -|device|threads|gpu layers")[:16]: a profile saved by
    # an earlier `localspec tune` keeps being found
    assert Setup("m.gguf:10", None, "cpu", 2, 0).key == "8c316150411a1c6a"
    with_draft = Setup("m.gguf:10", "d.gguf:5", "cpu", 2, 0)
    assert with_draft.key != with_draft.alone().key == "8c316150411a1c6a"


def test_a_pair_falls_back_to_the_targets_own_profile():
    pair = Setup("t.gguf:10", "d.gguf:5", "cpu", 2, 0)
    assert load_profile(pair) is None
    save_profile(_profile(pair.alone()))
    assert load_profile(pair).draft is None  # V(n) is the target's: usable for the pair
    path = save_profile(_profile(pair, draft="d.gguf"))
    assert load_profile(pair).draft == "d.gguf" and load_profile(pair.alone()).draft is None
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [f"{pair.key}.json", f"{pair.alone().key}.json"])  # written whole, no temp files left
    assert load_profile(Setup("t.gguf:10", None, "cpu", 4, 0)) is None  # other threads: not ours


def test_the_auto_drafter_loads_no_model_code():
    code = ("import sys, localspec.core.drafters.auto, localspec.profile; "
            "print([m for m in ('llama_cpp', 'localspec.core.backend') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_the_ceiling_is_the_best_tokens_per_verify_cost_measured():
    p = _profile(Setup("t.gguf:10", None, "cpu", 2, 0))
    p = replace(p, vcurve=[1.0, 1.5, 2.0, 4.0, 4.9])  # n / V(n): 1, 1.33, 1.5, 1.0, 1.02
    assert ceiling(p) == (3, 1.5)
    assert any(line.strip().startswith("ceiling: 1.50x") and "verifying 3 tokens" in line
               for line in _policy_lines(p))
    assert ceiling(replace(p, vcurve=[1.0, 1.9, 2.4])) == (3, 1.25)  # the last size can win
