"""The replay's oracle bound (bench/replay.py, run by scripts/replay_policy.py): the least modelled decode time any policy
could reach with a drafter (it drafts exactly the prefix the target accepts, cut where
the curve is cheapest). Pure Python: a synthetic edit (a file copied with changes)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from localspec.bench import replay as rp
from localspec.core.drafters import NgramDrafter, NoDrafter
from localspec.core.drafters.auto import AutoDrafter


def edit_trace(seed: int) -> dict:
    """A 'file' of random tokens and an output that copies it, changing a token every
    15-60 positions (and inserting a few new ones there)."""
    rng = random.Random(seed)
    src = [rng.randrange(1000, 5000) for _ in range(400)]
    out, i = [], 0
    while i < len(src):
        run = rng.randint(15, 60)
        out += src[i : i + run]
        out += [rng.randrange(5000, 6000) for _ in range(rng.randint(1, 3))]
        i += run + 1
    return {"prompt": [1, 2, *src, 3], "ids": out, "extra": src, "tag": "edit"}


CURVES = {
    "jagged": [1.0, 1.5, 2.1, 2.7, 3.0, 4.1, 4.5, 7.9, 5.8, 8.1] + [8.0 + 0.45 * n for n in range(300)],
    "flat": [1.0 + 0.02 * n for n in range(1, 320)],
}


@pytest.mark.parametrize("curve", CURVES)
@pytest.mark.parametrize("seed", [0, 1])
def test_oracle_is_a_lower_bound_on_every_policy(curve, seed):
    """No fixed k (adaptive or not) and no auto run takes less modelled time than the
    oracle with the same drafter; the perfect drafter takes less still, and plain
    decoding more."""
    tr, v = edit_trace(seed), CURVES[curve]
    bound = rp.oracle(tr, NgramDrafter(3, 12, extra=tr["extra"]), v, 64)
    perfect = rp.oracle(tr, None, v, 64, perfect=True)
    plain = rp.replay(tr, NoDrafter(), v, 0.0, 1, False)
    assert plain == pytest.approx((len(tr["ids"]) - 1) * v[0])
    times = [rp.replay(tr, NgramDrafter(3, 12, extra=tr["extra"]), v, 0.0, k, adaptive)
             for k in (4, 8, 16, 32, 64) for adaptive in (False, True)]
    auto = AutoDrafter(NgramDrafter(3, 12, extra=tr["extra"]), None, rp.tuned(v, 0.0), k_max=64)
    times.append(rp.replay(tr, auto, v, 0.0, 64, False))
    assert perfect <= bound < plain
    assert bound <= min(times) + 1e-9
    # the bound is attained by some plan, not just below everything: it is within the
    # best fixed choice's reach on a copy this regular
    assert bound > 0.5 * min(times)


def test_perfect_drafter_on_a_linear_curve():
    """With every token drafted right and V(n) = n (no batching gain) nothing beats
    plain decoding; with V(n) = 1 the whole output takes one verify per 64 + 1 tokens."""
    tr = edit_trace(3)
    n = len(tr["ids"]) - 1  # decoded after the first token
    assert rp.oracle(tr, None, [float(m) for m in range(1, 100)], 64, perfect=True) == pytest.approx(n)
    assert rp.oracle(tr, None, [1.0] * 100, 64, perfect=True) == pytest.approx(-(-n // 65))


CURVE_DIR = Path(__file__).resolve().parents[1] / "scripts" / "curves"
# a jagged curve whose last point lies below its middle one: the extension may fall
SYNTHETIC = {"sizes": [1, 2, 4, 8, 9, 16, 24], "v": [1.0, 1.4, 2.1, 5.0, 3.1, 4.0, 3.8]}


@pytest.mark.parametrize("name", [*sorted(p.name for p in CURVE_DIR.glob("*.json")), "synthetic"])
def test_a_curve_file_replays_as_measured(name, tmp_path):
    """The replay's V(n) from any measured curve file (the shipped ones and a jagged one):
    the file's value at every size it measured, linear between them, and past its last
    size linear with the slope over its upper half (the sizes from the middle one on)."""
    path = CURVE_DIR / name
    if name == "synthetic":
        path = tmp_path / "synthetic.json"
        path.write_text(json.dumps(SYNTHETIC))
    data = json.loads(path.read_text())
    sizes, values = data["sizes"], data["v"]
    n_max = 2 * sizes[-1] + 3
    v = rp.true_curve(str(path), n_max, None)  # v[n - 1] = V(n)
    assert len(v) == n_max
    for n, x in zip(sizes, values):
        assert v[n - 1] == pytest.approx(x)
    for (a, va), (b, vb) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        for n in range(a + 1, b):
            assert v[n - 1] == pytest.approx(va + (vb - va) * (n - a) / (b - a))
    mid = len(sizes) // 2
    slope = (values[-1] - values[mid]) / (sizes[-1] - sizes[mid])
    for n in range(sizes[-1] + 1, n_max + 1):
        assert v[n - 1] == pytest.approx(values[-1] + slope * (n - sizes[-1]))


def test_a_session_replays_with_its_memory_across_requests():
    """replay_session: a second request whose reply repeats the first's drafts it from
    the memory; the first has nothing to recall."""
    rng = random.Random(0)
    reply = [rng.randrange(1000, 5000) for _ in range(120)]
    session = {"name": "toy", "requests": [{"prompt": [1, 2, 3], "ids": reply},
                                           {"prompt": [1, 2, 4], "ids": reply}]}
    first, second = rp.replay_session(session, CURVES["flat"], 0.5, k_max=64)
    assert "memory" not in first["accepted"]
    assert second["accepted"]["memory"] > 100 and second["memory"] > 2 * second["auto"], second


def rename_trace(seed: int) -> dict:
    """A 'file' of random tokens renamed densely: four names, each a token of its own,
    every 5-15 positions, each replaced by another token throughout (as `lo` -> `low`)."""
    rng = random.Random(seed)
    names = {7: 17, 8: 18, 9: 19, 10: 20}
    src, i = [], 0
    while len(src) < 600:
        src += [rng.randrange(1000, 5000) for _ in range(rng.randint(5, 15))]
        src.append(rng.choice(list(names)))
    out = [names.get(t, t) for t in src]
    return {"prompt": [1, 2, *src, 3], "ids": out, "extra": src, "tag": "edit"}


@pytest.mark.parametrize("curve", CURVES)
def test_auto_drafts_a_dense_rename_in_long_runs(curve):
    """A rename that breaks the copy every 5-15 tokens: the n-gram drafter follows the
    copy across the renamed tokens and, once it has seen each renamed SURE times,
    drafts through them, so auto drafts it in long runs; a drafter that loses the copy
    at every change (follow=False) is held to the short stretches between them."""
    tr, v = rename_trace(0), CURVES[curve]
    plain = rp.replay(tr, NoDrafter(), v, 0.0, 1, False)

    def auto(follow):
        ng = NgramDrafter(3, 12, extra=tr["extra"], follow=follow)
        return plain / rp.replay(tr, AutoDrafter(ng, None, rp.tuned(v, 0.0), k_max=256), v, 0.0, 256, False)

    assert auto(True) > 1.3 * auto(False)


@pytest.mark.parametrize("curve", CURVES)
def test_rounds_against_the_oracle_add_up_to_the_gap(curve):
    """rounds_against_oracle replays auto as `replay` does (same rounds, same time) and
    its per-round regrets add up to auto's time less the oracle's."""
    tr, v = edit_trace(1), CURVES[curve]

    def ng():
        return NgramDrafter(3, 12, extra=tr["extra"])

    def auto():
        return AutoDrafter(ng(), None, rp.tuned(v, 0.0), k_max=64)

    rows = rp.rounds_against_oracle(tr, auto(), ng(), v, 0.0, 64)
    spent = sum(v[r["drafted"]] for r in rows)
    assert spent == pytest.approx(rp.replay(tr, auto(), v, 0.0, 64, False))
    assert sum(r["regret"] for r in rows) == pytest.approx(spent - rp.oracle(tr, ng(), v, 64))
    assert sum(r["accepted"] + 1 for r in rows) == len(tr["ids"]) - 1


def spelled_trace(seed: int = 0) -> dict:
    """A rename reaching every spelling of a word: " lo" (7) every 40 tokens, and "(lo",
    "'lo", ".lo" (9, 11, 13) each twice in the second half, all renamed ("low"); the
    trace's "pieces" give the tokens' texts, as `replay_policy.py pieces` adds them."""
    rng = random.Random(seed)
    src = [rng.randrange(1000, 5000) for _ in range(1200)]
    for i in range(39, len(src), 40):
        src[i] = 7
    for j, t in enumerate((9, 11, 13, 9, 11, 13)):
        src[620 + 90 * j] = t
    texts = {7: " lo", 8: " low", 9: "(lo", 10: "(low", 11: "'lo", 12: "'low", 13: ".lo", 14: ".low"}
    out = [t + 1 if t in texts and t % 2 else t for t in src]
    pieces = {str(t): texts.get(t, f" w{t}") for t in {*src, *out, 1, 2, 3}}
    return {"prompt": [1, 2, *src, 3], "ids": out, "extra": src, "tag": "edit", "pieces": pieces}


@pytest.mark.parametrize("curve", CURVES)
def test_a_trace_with_token_texts_stops_before_other_spellings(curve):
    """With the trace's token texts (as the runtime gives the target's), auto's drafts
    stop before each new spelling of the renamed word instead of breaking on it (a
    broken long draft costs every token drafted past the break), and the edit replays
    faster for it; without them drafts break there."""
    tr, v = spelled_trace(), CURVES[curve]
    plain = rp.replay(tr, NoDrafter(), v, 0.0, 1, False)
    spellings = {620 + 90 * j for j in range(6)}

    def run(trace):
        def auto():
            return AutoDrafter(rp.trace_ngram(trace, (3, 12)), None, rp.tuned(v, 0.0), k_max=256)

        rows = rp.rounds_against_oracle(trace, auto(), rp.trace_ngram(trace, (3, 12)), v, 0.0, 256)
        broken = {r["pos"] + r["accepted"] for r in rows if r["accepted"] < r["drafted"]}
        return plain / rp.replay(trace, auto(), v, 0.0, 256, False), len(broken & spellings)

    (blind, blind_broken), (seen, seen_broken) = run({**tr, "pieces": None}), run(tr)
    assert seen_broken == 0 < blind_broken
    assert seen > blind


@pytest.mark.parametrize("curve", CURVES)
def test_hindsight_knows_the_run_ages_of_an_earlier_pass(curve, monkeypatch):
    """`hindsight` replays informed auto twice over one trace: the second pass starts from
    the run-age counts the first left (how long this trace's copies last, known ahead),
    with a cost model of its own; no policy with the drafter beats the oracle."""
    tr, v = edit_trace(0), CURVES[curve]

    def ng():
        return NgramDrafter(3, 12, extra=tr["extra"])

    passes, replay = [], rp.replay

    def spy(trace, drafter, *args):
        passes.append((drafter, float(drafter.runs.reached.sum())))
        return replay(trace, drafter, *args)

    monkeypatch.setattr(rp, "replay", spy)
    t = rp.hindsight(tr, ng, lambda: None, rp.tuned(v, 0.0), v, 0.0, 64)
    (first, seen_first), (second, seen_second) = passes
    assert seen_first == 0 and seen_second > 0
    assert second.runs.reached is first.runs.reached and second.cost is not first.cost
    assert rp.oracle(tr, ng(), v, 64) <= t + 1e-9


def test_copy_hazard_counts_each_change_as_one_break_of_a_copy():
    """`replay_policy.py hazard`'s counts: every position the drafter drafts at, by the age
    of its run; a change the output makes breaks the copy once (the first token of the
    change; the tokens inserted after it have no draft, and the copy resumed after them
    is young again). A copy of the file, not of a prediction of the output."""
    rng = random.Random(4)
    src = [rng.randrange(1000, 5000) for _ in range(300)]
    out = src[:100] + [7000] + src[101:200] + [7001] + src[201:]  # two tokens replaced
    tr = {"prompt": [1, 2, *src, 3], "ids": out, "extra": src, "tag": "edit"}
    rows = rp.copy_hazard([tr, {**tr, "tag": "code"}], (3, 12))  # a trace not of an edit: skipped
    assert {kind for kind, _ in rows} == {"copy"}
    assert sum(broke for _, broke in rows.values()) == 2
    drafted = sum(n for n, _ in rows.values())
    assert len(out) - 10 <= drafted <= len(out)  # nearly every position drafts
    old = [edge for (_, edge), (n, broke) in rows.items() if broke]
    assert min(old) >= 65  # each break ends a run of ~100 tokens
