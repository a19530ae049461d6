"""The profile store keeps what `--spec auto` measured during runs (V(n) at real
contexts), merged with `localspec tune`'s curve: a fresh machine's second run starts
informed, and a new `tune` does not erase it."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

from localspec.core.backend import Model
from localspec.core.config import ModelConfig
from localspec.runtime import setup_of
from localspec.models import paths
from localspec.profile import (
    Profile,
    Setup,
    load_profile,
    merge_online,
    save_profile,
    store_online,
    store_online_later,
)
from localspec import profile as profile_module


def _tuned(key: str) -> Profile:
    return Profile(key=key, target="t", draft=None, device="cpu", n_threads=1, n_gpu_layers=0,
                   t_token_s=0.1, vcurve=[1.0, 1.5, 2.0], prefill_tok_s=100.0)


def test_merge_weighs_runs_and_lets_new_ones_move_old_points():
    merged = merge_online({}, {16: (8.0, 3)})
    assert merged == {"16": [8.0, 3]}
    merged = merge_online(merged, {16: (10.0, 1), 4: (2.5, 2)})
    assert merged["16"] == [8.5, 4] and merged["4"] == [2.5, 2]
    for _ in range(40):  # many runs: the weight is capped, so the present state wins
        merged = merge_online(merged, {16: (6.0, 5)})
    assert abs(merged["16"][0] - 6.0) < 0.01 and merged["16"][1] == 30


def test_a_tuned_profile_wins_over_an_untuned_one_of_the_pair():
    # the pair's profile holds only what runs measured; the target's own was tuned: both
    # lookups get the tuned curve, and the on-line lookup the pair's where nothing is tuned
    pair = Setup(target="t", draft="d", device="cpu", n_threads=1, n_gpu_layers=0)
    save_profile(replace(_tuned(pair.key), vcurve=[], online={"8": [5.0, 4]}))
    assert load_profile(pair) is None
    assert load_profile(pair, online=True).online_v() == {8: 5.0}
    save_profile(_tuned(pair.alone().key))
    for online in (False, True):
        assert load_profile(pair, online=online).key == pair.alone().key


def test_store_creates_a_profile_auto_finds_and_tune_keeps(smol_path):
    target = Model(ModelConfig(path=smol_path, n_ctx=128, n_threads=1))
    try:
        assert load_profile(setup_of(target), online=True) is None
        store_online(setup_of(target), target.name, {8: (5.0, 4), 64: (20.0, 1)}, 0.05)
        # a profile with on-line points only: auto gets it, serve's tune lookup does not
        assert load_profile(setup_of(target)) is None
        got = load_profile(setup_of(target), online=True)
        assert got is not None and got.vcurve == [] and got.online_v() == {8: 5.0, 64: 20.0}
        assert got.key == setup_of(target).key and got.t_token_s == 0.05
        # `tune` saves its curve under the same key: the on-line points stay
        save_profile(replace(_tuned(got.key), target=target.name))
        again = load_profile(setup_of(target))
        assert again.vcurve == [1.0, 1.5, 2.0] and again.online_v() == {8: 5.0, 64: 20.0}
        # the next run's measurements merge into it
        store_online(setup_of(target), target.name, {8: (7.0, 4)}, 0.05)
        assert load_profile(setup_of(target)).online["8"] == [6.0, 8]
    finally:
        target.close()


def test_a_corrupt_profile_is_ignored_and_replaced(smol_path):
    target = Model(ModelConfig(path=smol_path, n_ctx=128, n_threads=1))
    try:
        path = paths.ensure(paths.state_dir() / "profiles") / f"{setup_of(target).key}.json"
        path.write_text("{not json")
        assert load_profile(setup_of(target), online=True) is None
        store_online(setup_of(target), target.name, {4: (2.0, 3)}, 0.05)
        assert json.loads(path.read_text())["online"] == {"4": [2.0, 3]}
    finally:
        target.close()


def test_a_store_off_the_thread_lands_where_home_was_when_asked(smol_path, tmp_path, monkeypatch):
    # the server hands stores to a writer thread; a write that runs after the state dir
    # changed (another test, another user) still goes where it was asked for
    target = Model(ModelConfig(path=smol_path, n_ctx=128, n_threads=1))
    try:
        setup = setup_of(target)
        first, second = tmp_path / "first", tmp_path / "second"
        monkeypatch.setenv("LOCALSPEC_HOME", str(first))
        gate = threading.Event()
        profile_module._writer.submit(gate.wait, 10)  # hold the writer until the home moved
        pending = store_online_later(setup, target.name, {8: (5.0, 4)}, 0.05)
        monkeypatch.setenv("LOCALSPEC_HOME", str(second))
        assert not pending.done()
        gate.set()
        pending.result(timeout=10)
        assert not (second / "profiles").exists()
        monkeypatch.setenv("LOCALSPEC_HOME", str(first))
        assert load_profile(setup, online=True).online_v() == {8: 5.0}
    finally:
        target.close()


def _write_raw(key: str, data: dict) -> None:
    folder = paths.ensure(paths.state_dir() / "profiles")
    (folder / f"{key}.json").write_text(json.dumps(data))


def test_on_line_costs_saved_by_the_build_that_timed_shared_steps_are_dropped(smol_path):
    # the build before ONLINE_VERSION 2 timed a serve round at its whole shared step: its
    # file (no online_version) held a one-token time of 34.8 ms against 10-17 ms real
    target = Model(ModelConfig(path=smol_path, n_ctx=128, n_threads=1))
    try:
        setup = setup_of(target)
        tuned = {**_tuned(setup.key).__dict__, "target": target.name, "online": {"8": [2.1, 30]},
                 "memory_accept": {"n": [[3, 2]]}}
        tuned.pop("online_version", None)
        _write_raw(setup.key, tuned)
        got = load_profile(setup)
        assert got.online == {} and got.vcurve == [1.0, 1.5, 2.0] and got.t_token_s == 0.1
        assert got.memory_accept == {"n": [[3, 2]]} and got.online_version == profile_module.ONLINE_VERSION
        # the next run's measurements are stored as the only on-line ones, with the version
        store_online(setup, target.name, {8: (5.0, 4)}, 0.05)
        raw = json.loads((paths.state_dir() / "profiles" / f"{setup.key}.json").read_text())
        assert raw["online"] == {"8": [5.0, 4]} and raw["online_version"] == profile_module.ONLINE_VERSION
        assert load_profile(setup).online_v() == {8: 5.0}  # this build's are kept
        # a profile no tune measured: its one-token time was timed on-line the old way too
        online_only = {**tuned, "vcurve": [], "t_token_s": 0.0348}
        _write_raw(setup.key, online_only)
        got = load_profile(setup, online=True)
        assert got.online == {} and got.t_token_s == 0.0
        store_online(setup, target.name, {8: (5.0, 4)}, 0.014)
        assert load_profile(setup, online=True).t_token_s == 0.014  # the latest run's
    finally:
        target.close()


# ----- V(n) bands after a long context (tune --vcurve-long-max) -----------------------------


def _banded(key: str = "k") -> Profile:
    # the short curve to 4 after 64 tokens; a band to 8 after 1,024 tokens (dearer per size)
    return replace(_tuned(key), vcurve=[1.0, 2.0, 3.0, 4.0], vcurve_context=64,
                   vbands={"1024": [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]})


def test_a_profile_with_bands_round_trips_and_one_without_still_loads(smol_path):
    target = Model(ModelConfig(path=smol_path, n_ctx=128, n_threads=1))
    try:
        setup = setup_of(target)
        saved = _banded(setup.key)
        save_profile(saved)
        got = load_profile(setup)
        assert got.vbands == {"1024": [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]}
        assert got.vcurve_context == 64 and got == saved
        # a file an earlier tune wrote has neither field: it loads, with no band, and
        # every context gets its short curve
        old = {**_tuned(setup.key).__dict__, "online_version": profile_module.ONLINE_VERSION}
        old.pop("vbands"), old.pop("vcurve_context")
        _write_raw(setup.key, old)
        got = load_profile(setup)
        assert got is not None and got.vbands == {} and got.vcurve == [1.0, 1.5, 2.0]
        assert got.curve_for(2000) == got.curve_for(None) == [1.0, 1.5, 2.0]
        # a band that is not {"context": [V(1)..]} is corrupt: the file is not trusted
        _write_raw(setup.key, {**old, "vbands": [[1.0, 2.0]]})
        assert load_profile(setup) is None
        _write_raw(setup.key, {**old, "vbands": {"long": [1.0, 2.0]}})
        assert load_profile(setup) is None
    finally:
        target.close()


def test_curve_for_picks_the_band_measured_nearest_the_context():
    p = _banded()
    band = p.vbands["1024"]
    assert p.curve_for(2000) == band and p.curve_for(1024) == band
    assert p.curve_for(300) == band  # nearer 1,024 than 64 on a log scale (3.4x against 4.7x)
    # the short curve for a short context, continued past its 4 sizes along the band's
    # shape, scaled to meet it at 4 (V(4) = 4 against the band's 6)
    short = [1.0, 2.0, 3.0, 4.0, 8.0 * 4 / 6, 10.0 * 4 / 6, 12.0 * 4 / 6, 14.0 * 4 / 6]
    for n_ctx in (None, 10, 64, 200):
        assert p.curve_for(n_ctx) == pytest.approx(short)
    # two bands: the nearest wins
    two = replace(p, vbands={**p.vbands, "4096": [1.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0]})
    assert two.curve_for(3000) == two.vbands["4096"] and two.curve_for(1500) == band
    assert replace(p, vcurve=[], vbands={}).curve_for(500) == []  # nothing measured
