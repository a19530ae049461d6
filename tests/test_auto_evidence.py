"""What the auto policy learns from: a draft model's early stops, a copy source's prior,
and the one-token time where every round drafts (pure logic, no models)."""

from __future__ import annotations

from dataclasses import replace

from fakes import FakeModel
from test_auto import _NoMatch

from localspec.core.drafters.auto import AcceptModel, AutoDrafter, Plan, SpentShare, expected_tokens
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.drafters.costs import CostModel
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.drafters.copy_age import COPY_PRIOR, PREDICTED_PRIOR, PRIOR, CopyAge
from localspec.profile import Profile


def _profile(v: list[float]) -> Profile:
    return Profile(key="k", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                   t_token_s=0.1, vcurve=v, prefill_tok_s=100.0)


def test_a_draft_that_stops_early_promises_no_more_than_it_gave():
    # a draft model that is always right but stops after 2 tokens (unsure of the third)
    # when 8 were planned: a round yields 3 tokens, whatever the plan
    acc = AcceptModel(prior=0.6, n_max=16)
    for _ in range(60):
        acc.observe(2, 2, planned=8)
    assert expected_tokens(acc.rates(8)) < 3.5
    # without the plan (or with a plan it met) the evidence says nothing about position 3
    blind = AcceptModel(prior=0.6, n_max=16)
    for _ in range(60):
        blind.observe(2, 2)
    assert expected_tokens(blind.rates(8)) > 5


def test_a_draft_that_stops_where_planned_is_not_counted_as_stopped():
    acc = AcceptModel(prior=0.6, n_max=16)
    for _ in range(60):
        acc.observe(4, 4, planned=4)
    assert min(acc.rates(5)) > 0.9  # a plan met: position 4 was never reached, not refused


def test_a_copy_source_starts_from_the_copy_prior():
    runs = CopyAge()
    runs.reset(10)
    plain = runs.rates(3, 30)
    runs.reset(10, copying=True)
    copy = runs.rates(3, 30)
    assert list(COPY_PRIOR) != list(PRIOR)
    assert (copy >= plain).all() and expected_tokens(copy) > 1.5 * expected_tokens(plain)
    runs.reset(10)  # the next generation without a source: back to the plain prior
    assert (runs.rates(3, 30) == plain).all()


def test_an_edit_drafts_longer_from_its_first_match_than_a_prompt():
    flat = _profile([1.0 + 0.02 * (n - 1) for n in range(1, 66)])
    text = list(range(100, 160))
    prompt = [*text, 1, 2]
    context = [*prompt, *text[:3]]  # the reply has begun copying the text

    def first_k(extra: list[int]) -> int:
        auto = AutoDrafter(NgramDrafter(3, 12, extra=extra), None, flat, k_max=64, learn_costs=False)
        auto.begin(prompt)
        return len(auto.draft(context, 64).tokens)

    assert first_k(text) > first_k([])  # the source makes it a copy: a longer first draft


def test_a_prediction_of_the_output_is_drafted_longer_from_its_first_match():
    """A copy of an edit's file with its renames made (a prediction) breaks only where
    the model departs from the instruction: its prior is bolder than a copy of the file."""
    flat = _profile([1.0 + 0.02 * (n - 1) for n in range(1, 66)])
    text = list(range(100, 160))
    predicted = [*text[:40], 999, *text[41:]]
    prompt = [*text, 1, 2]
    context = [*prompt, *text[:3]]

    def first_k(prediction) -> int:
        auto = AutoDrafter(NgramDrafter(3, 12, extra=text, prediction=prediction), None, flat, k_max=64,
                           learn_costs=False)
        auto.begin(prompt)
        return len(auto.draft(context, 64).tokens)

    assert all(p > c for p, c in zip(PREDICTED_PRIOR, COPY_PRIOR))
    assert first_k(predicted) > first_k(None)


def test_one_token_time_is_inferred_from_an_earlier_runs_points():
    """A run whose every round drafts, with no tune profile but the points an earlier
    run timed once (stored on-line), infers its one-token time from them: without one it
    could never account a loss nor try a size it has not measured (a second run stuck at
    the sizes the first happened to time)."""
    stored = Profile(key="k", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                     t_token_s=0.1, vcurve=[], prefill_tok_s=0.0, online={"32": [5.0, 1], "224": [25.0, 1]})
    cost = CostModel(stored, 256)
    for _ in range(3):
        cost.observe_verify(32, 0.5)  # V(32) = 5.0 by the earlier run: 0.1 s a token here
    assert cost.seconds(1, 3) is None and abs(cost.t1() - 0.1) < 1e-9


def test_one_token_time_is_inferred_when_every_round_drafts():
    v = [1.0 + 0.5 * (n - 1) for n in range(1, 33)]
    cost = CostModel(_profile(v), 32)
    for _ in range(3):
        cost.observe_verify(9, 0.5)  # V(9) = 5.0 by the profile: 0.1 s a token here
    assert cost.seconds(1, 3) is None and abs(cost.t1() - 0.1) < 1e-9
    fresh = CostModel(None, 32)  # no profile: nothing to infer it from
    for _ in range(3):
        fresh.observe_verify(9, 0.5)
    assert fresh.t1() is None


def test_report_only_reports_and_end_stores():
    stored: list[dict] = []
    auto = AutoDrafter(NgramDrafter(1, 4), None, None, k_max=8, store=lambda m, t1: stored.append(m))
    auto.begin([1, 2, 3])
    for n in (1, 1, 1, 3, 3, 3):
        auto.observe(n - 1, 0, 0.1 * n, 0.0)
    assert auto.report() and stored == []
    auto.end()
    assert len(stored) == 1 and list(stored[0]) == [3]
    v3, rounds = stored[0][3]
    assert abs(v3 - 3.0) < 1e-9 and rounds == 3


class _RightModel(DrafterBase):
    """A draft 'model' that drafts the fake target's own continuation: always right."""

    name = "model"

    def __init__(self, model: FakeModel) -> None:
        self.model, self.asked = model, []

    def begin(self, prompt):
        pass

    def draft(self, context, k):
        self.asked.append(k)
        return Draft(tokens=self.model.continuation(context, k), source="model")


def test_draft_model_plans_grow_by_doubling_from_what_was_accepted():
    # a flat (GPU-like) curve and a cheap draft: the estimates alone would plan 32 tokens
    # at once, the positions past the longest accepted run extrapolated from the last
    # one seen; a plan reaches at most twice the longest run accepted so far
    model = FakeModel()
    flat = replace(_profile([1.0 + 0.02 * (n - 1) for n in range(1, 34)]), draft_t_token_s=0.005)
    drafter = _RightModel(model)
    auto = AutoDrafter(_NoMatch(), drafter, flat, k_max=32, learn_costs=False)
    prompt = list(range(1, 9))
    auto.begin(prompt)
    context, longest = prompt + model.continuation(prompt, 1), 0
    for _ in range(8):
        d = auto.draft(context, 32)
        assert d.source == "model" and len(d.tokens) <= max(4, 2 * longest)
        auto.observe(len(d.tokens), len(d.tokens), 0.1, 0.0005 * len(d.tokens))
        longest = max(longest, len(d.tokens))
        context = context + model.continuation(context, len(d.tokens) + 1)
    assert drafter.asked[0] <= 4 and drafter.asked[-1] == 32  # it does get there


class _SometimesSure(_RightModel):
    """Always right, but every other round unsure after its first token (it stops there,
    as `--draft-p-min` stops the draft model): half the plans cost a fraction."""

    def draft(self, context, k):
        d = super().draft(context, k)
        if len(self.asked) % 2:
            d.tokens = d.tokens[:1]
        return d


class _InFull(SpentShare):
    """Every plan costs as if drafted in full (what auto charged before)."""

    def __call__(self, k: int) -> float:
        return 1.0


def _plans(spent_share: bool) -> list[int]:
    model = FakeModel()
    flat = replace(_profile([1.0 + 0.02 * (n - 1) for n in range(1, 34)]), draft_t_token_s=0.03)
    drafter = _SometimesSure(model)
    auto = AutoDrafter(_NoMatch(), drafter, flat, k_max=32, learn_costs=False)
    if not spent_share:
        auto.model_spent = _InFull()
    prompt = list(range(1, 9))
    auto.begin(prompt)
    context = prompt + model.continuation(prompt, 1)
    for _ in range(60):
        d = auto.draft(context, 32)
        auto.observe(len(d.tokens), len(d.tokens), 0.1, 0.03 * len(d.tokens))
        context = context + model.continuation(context, len(d.tokens) + 1)
    return drafter.asked[-10:]


def test_a_draft_models_plans_cost_what_its_early_stops_spend():
    # a plan of k costs V(k + 1) + k c only when drafted in full; this draft stops after
    # one token in every other round, so long plans cost about half: auto plans longer
    # than it would charging every plan in full
    full, measured = _plans(False), _plans(True)
    assert max(full) <= 4 and min(measured) >= 16


def test_spent_share_starts_in_full_and_borrows_from_shorter_plans():
    share = SpentShare()
    assert share(8) == 1.0
    for _ in range(30):
        share.observe(8, 0.4)
    assert share(4) == 1.0  # never planned that short: no evidence, full cost
    assert 0.4 < share(8) < 0.5
    assert share(16) == share(8)  # a longer plan not seen yet: the shorter one's share


def test_a_failed_trial_does_not_lock_auto_out_of_sizes_it_has_timed():
    # a fresh edit: plain rounds time one token (0.1 s); a 5-token draft verified at
    # 0.21 s (V(6) = 2.1, timed once) came back whole; then a 27-token trial failed at
    # 1.75 s (V(28) = 17.5 for 3 tokens): drafting has lost more than its budget. Sizes
    # it has timed are still drafted at their worst case (no trying budget needed), or
    # one failed trial keeps an edit at plain decoding to its end
    text = list(range(100, 400))
    prompt = [*text, 1, 2]
    auto = AutoDrafter(NgramDrafter(3, 12, extra=text), None, None, k_max=64)
    auto.begin(prompt)
    for _ in range(3):
        auto.observe(0, 0, 0.1, 0.0)
    auto._last = Plan("ngram", 5, 5.0)
    auto.observe(5, 5, 0.21, 0.0)
    auto._last = Plan("ngram", 27, 15.8)
    auto.observe(27, 2, 1.75, 0.0)
    assert auto.deficit() > 0 and not auto._affordable(6, 5.0, 0.0, 1.0)
    context = [*prompt, *text[:120]]  # the reply has copied 120 tokens of the text
    d = auto.draft(context, 64)
    assert d.source == "ngram" and len(d.tokens) == 5


def test_an_edit_weighs_a_copy_of_its_own_output_as_any_match_not_as_a_copy_of_the_file():
    """In an edit, a match in what the output itself wrote (a docstring like the one the
    model wrote above) is flagged `own` and drafted at the plain prior: such matches broke
    at 36% a token at ages 3-8 in the model's edits, copies of the file at 6%. The same
    match in the file (the prompt's copy of it) is drafted longer."""
    flat = _profile([1.0 + 0.02 * (n - 1) for n in range(1, 66)])
    text = list(range(100, 160))
    written = [500, 501, 502, *range(600, 640)]  # text not in the file...

    def first(file, output):
        prompt = [*file, 1, 2]
        context = [*prompt, *output, 7, 500, 501, 502]  # ... and its start written again
        d = NgramDrafter(3, 12, extra=file)
        auto = AutoDrafter(d, None, flat, k_max=64, learn_costs=False)
        auto.begin(prompt)
        return d.draft(context, 64), len(auto.draft(context, 64).tokens)

    (own, k_own), (in_file, k_file) = first(text, written), first([*text, *written], [])
    assert own.own and own.tokens[:5] == written[3:8]
    assert not in_file.own and in_file.tokens[:5] == written[3:8]  # the same tokens, in the file
    assert 0 < k_own < k_file
    # with nothing to copy, no draft is anyone's own: the plain prior holds for all
    assert not NgramDrafter(3, 12).draft([1, 2, *written, 7, 500, 501, 502], 8).own
