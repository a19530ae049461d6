"""The auto policy's probes of a draft model it has written off: they are taken although
they score no better than plain decoding, and what they report must be what the
acceptance model expected of them (not a made-up 1.0 token a round)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import FakeModel
from test_auto import _CountingModelDrafter, _NoMatch, _profile

from localspec.core.drafters.auto import EXPLORE_EVERY, AutoDrafter


def test_probe_reports_its_real_expected_tokens():
    model = FakeModel()
    # V(n) = 1 + 0.3 (n - 1), c = 0.3: the draft model pays at 90% acceptance (so it may
    # be probed) but not at its prior of 60% (so auto decodes plainly until the probe)
    drafter = _CountingModelDrafter(model)
    auto = AutoDrafter(_NoMatch(), drafter, _profile(0.3, c=0.3), k_max=16, learn_costs=False)
    assert auto._model_could_pay(16)
    prompt = list(range(1, 9))
    auto.begin(prompt)
    context = prompt + model.continuation(prompt, 1)
    a1, a2 = auto.model_acc.rates(2)
    for _ in range(EXPLORE_EVERY // 2):  # the probe is the last of these rounds
        d = auto.draft(context, 16)
        auto.observe(len(d.tokens), len(d.tokens), 0.1, 0.01)
        context = context + model.continuation(context, len(d.tokens) + 1)
    assert drafter.calls == 1
    report = auto.report()
    probes = {key: row for key, row in report.items() if "probe" in key}
    assert list(probes) == ["model:2 probe"]
    assert probes["model:2 probe"]["expected"] == pytest.approx(1 + a1 + a1 * a2)
    assert probes["model:2 probe"]["realised"] == 3  # both drafted tokens accepted
    assert report["none:0"] == {"rounds": EXPLORE_EVERY // 2 - 1, "expected": 1.0, "realised": 1.0}


# this machine's measured V(1..12) (2-core AVX2 EPYC): a draft model at c = 0.3 pays
# here only at high acceptance, so one good probe is not proof enough
STEEP = [1.0, 1.46, 2.12, 2.68, 2.95, 4.1, 4.46, 7.9, 5.83, 8.13, 8.75, 8.92]


def _probe_rounds(right: bool, rounds: int = 160) -> list[int]:
    """The rounds at which auto asked the draft model, for a draft model whose tokens
    are always right (or always wrong), on costs where it pays only once proven."""
    model = FakeModel()
    drafter = _CountingModelDrafter(model)
    steep = replace(_profile(0.3, c=0.3), vcurve=STEEP)
    auto = AutoDrafter(_NoMatch(), drafter, steep, k_max=8, learn_costs=False)
    prompt = list(range(1, 9))
    auto.begin(prompt)
    context, asked = prompt + model.continuation(prompt, 1), []
    for r in range(rounds):
        calls = drafter.calls
        d = auto.draft(context, 16)
        good = d.tokens if right else []
        if drafter.calls > calls:
            asked.append(r)
        auto.observe(len(d.tokens), len(good), 0.1 * STEEP[len(d.tokens)], 0.03 * len(d.tokens))
        context = context + model.continuation(context, len(good) + 1)
    return asked


def test_probes_that_come_back_whole_come_sooner():
    right, wrong = _probe_rounds(True), _probe_rounds(False)
    # a written-off draft model that keeps proving right is looked at again within tens
    # of rounds and then drafted with, not probed every EXPLORE_EVERY rounds for good (160
    # rounds at that fixed interval hold 3 probes)
    assert len(right) > 5 and right[0] == wrong[0] == EXPLORE_EVERY // 2 - 1
    # one that is always wrong is probed no more often than the fixed interval
    assert len(wrong) <= 3 and all(b - a >= EXPLORE_EVERY for a, b in zip(wrong, wrong[1:]))
