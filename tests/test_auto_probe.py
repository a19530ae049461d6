"""The auto policy's probes of a draft model it has written off: they are taken although
they score no better than plain decoding, and what they report must be what the
acceptance model expected of them (not a made-up 1.0 token a round)."""

from __future__ import annotations

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
