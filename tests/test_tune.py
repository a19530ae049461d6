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
from localspec.profile import Profile, Setup, load_profile, save_profile, vcurve_sizes


def test_tune_saves_a_profile_that_auto_and_serve_find(smol_path):
    proc = cli("tune", "-m", smol_path, "-md", smol_path, "-t", "1", "--json", "--vcurve-max", "24",
               "--vcurve-long-max", "40", timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    v = out["vcurve"]
    assert len(v) == 24 and v[0] == 1.0 and all(x > 0 for x in v)
    assert out["t_token_s"] > 0 and out["prefill_tok_s"] > 0
    assert out["draft_t_token_s"] > 0 and out["n_threads"] == 1
    assert out["flash_attn"] in ("on", "off", None)  # timed both ways at a long context
    # and V(n) again after 1,024 tokens (the default context, 4,096, holds it), to 40
    assert list(out["vbands"]) == ["1024"] and out["vcurve_context"] > 0
    band = out["vbands"]["1024"]
    assert len(band) == 40 and band[0] == 1.0 and all(x > 0 for x in band)

    stored = [json.loads(p.read_text()) for p in (paths.state_dir() / "profiles").glob("*.json")]
    # the pair's profile, and the target's alone (V(n) does not depend on the draft): serve
    # and runs without a draft model look that one up
    assert sorted(p["draft"] is None for p in stored) == [False, True]
    assert all(p["vcurve"] == v and p["vbands"] == out["vbands"] for p in stored)

    proc = cli("run", "--raw", "-m", smol_path, "-md", smol_path, "-t", "1", "--spec", "auto",
               "-n", "24", "--stats", "json", "--no-log", "def fib(n):")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["generated"] == 24 and stats["policy"]


def test_tune_text_report_names_the_policy(smol_path):
    # -fa forced: no attention timing (the test above covers it), and the report says so
    proc = cli("tune", "-m", smol_path, "-md", "none", "-t", "1", "--vcurve-max", "16", "-fa", "off",
               "--vcurve-long-max", "0", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "V(n)" in proc.stdout and "policy that follows" in proc.stdout and "saved" in proc.stdout
    assert "flash attention: off (set by -fa)" in proc.stdout
    assert "ceiling: " in proc.stdout
    assert ", 16:" in proc.stdout and ", 24:" not in proc.stdout  # timed up to --vcurve-max
    # by default up to 64 tokens: edits draft long copies, and a size tune knows is one
    # auto need not try
    assert "V(n) after" not in proc.stdout and "tokens of context (verifying" not in proc.stdout  # no band
    help_text = " ".join(cli("tune", "--help").stdout.split())
    assert "[default: 64;" in help_text
    # and after a long context up to 256 by default: edits verify up to 257 tokens there
    assert "--vcurve-long-max INTEGER RANGE largest verify batch timed after 1,024 tokens" in help_text
    assert "[default: 256; 0<=x<=512]" in help_text
    proc = cli("tune", "-m", smol_path, "--vcurve-long-max", "-1")
    assert proc.returncode == 2 and "--vcurve-long-max" in proc.stderr


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


def test_the_report_gives_each_bands_ceiling():
    p = _profile(Setup("t.gguf:10", None, "cpu", 2, 0))
    p = replace(p, vcurve=[1.0, 1.5, 2.0, 4.0], vbands={"1024": [1.0, 1.8, 2.9, 3.2, 4.0]})
    lines = _policy_lines(p)
    assert any("1.50x" in line and "verifying 3 tokens" in line for line in lines)  # the short curve's
    band_line = [line for line in lines if "after 1,024 tokens of context" in line]
    assert len(band_line) == 1 and "1.25x" in band_line[0] and "verifying 4 at a time" in band_line[0]


# ----- the band's measurement on a real model ------------------------------------------------


def test_measure_band_times_every_size_after_the_long_context(smol_path, monkeypatch):
    from localspec.bench import calibrate
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    timed = []
    real = calibrate._time_decode

    def recording(model, base, n, reps):
        timed.append((len(base), n, list(model.cached) == list(base)))
        return real(model, base, n, reps)

    monkeypatch.setattr(calibrate, "_time_decode", recording)
    target = Model(ModelConfig(path=smol_path, n_ctx=512, n_threads=1))
    try:
        ticks = []
        at, band = calibrate.measure_band(target, context=300, n_max=24, reps=1,
                                          tick=lambda: ticks.append(1))
        assert at == 300 and len(band) == 24 and band[0] == 1.0 and all(x > 0 for x in band)
        sizes = calibrate.band_sizes(24)
        assert sizes == [*range(1, 10), 10, 12, 14, 16, 20, 24] and len(ticks) == len(sizes)
        # one-token time first (and again as V(1)'s), then every size, each after the 300
        # tokens of real text the cache holds
        assert [n for _, n, _ in timed] == [1, *sizes[1:]]
        assert all(ctx == 300 and held for ctx, _, held in timed)
        assert target.cached == []  # left empty, as tune's other measurements expect
        # a context that cannot hold context + n_max tokens: as long as it can
        at, band = calibrate.measure_band(target, context=1024, n_max=24, reps=1)
        assert at == 512 - 24 - 1 and len(band) == 24
    finally:
        target.close()


def test_band_sizes_reach_past_the_short_curve_on_the_policys_grid():
    from localspec.bench.calibrate import band_sizes

    sizes = band_sizes(256)
    assert sizes[:25] == vcurve_sizes(64) and sizes[25:] == [80, 96, 112, 128, 160, 192, 224, 256]
    assert band_sizes(100)[-2:] == [96, 100]  # the largest asked for is timed
