"""The auto policy: cost model, k choice, learning from feedback (pure logic, no models)."""

from __future__ import annotations

from fakes import FakeModel

from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.auto import AcceptModel, AutoDrafter, CostModel, best_k
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import collect, generate
from localspec.models.profile import Profile, vcurve_sizes


def _profile(v_per_token: float, c: float | None = None) -> Profile:
    curve = [1.0 + v_per_token * (n - 1) for n in range(1, 33)]
    return Profile(key="k", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                   t_token_s=0.1, vcurve=curve, prefill_tok_s=100.0,
                   draft_t_token_s=0.1 * c if c is not None else None)


def test_best_k_is_zero_when_nothing_pays():
    cost = CostModel(_profile(0.5), 32)
    k, expected, rate = best_k([0.3] * 16, cost, 0.0)
    assert k == 0 and expected == 1.0 and rate == 1.0


def test_best_k_drafts_long_when_verify_is_flat():
    gpu_like = CostModel(_profile(0.01), 32)
    k, _, rate = best_k([0.95] * 32, gpu_like, 0.0)
    assert k >= 16 and rate > 5


def test_best_k_accounts_for_draft_model_cost():
    cost = CostModel(_profile(0.05), 32)
    k_cheap, _, r_cheap = best_k([0.8] * 16, cost, 0.05)
    k_dear, _, r_dear = best_k([0.8] * 16, cost, 0.9)
    assert r_cheap > r_dear and k_cheap >= k_dear


def test_online_measurements_replace_the_prior():
    cost = CostModel(None, 32)
    for _ in range(20):
        cost.observe_verify(1, 0.10)
        cost.observe_verify(9, 0.11)  # a GPU-like machine: 9 tokens cost about one
    assert abs(cost.v(9) - 1.1) < 0.02
    assert cost.v(5) < 1.5  # unmeasured sizes scale from the nearest measured one


def test_online_costs_keep_the_profiles_shape_between_measured_sizes():
    p = _profile(0.5)
    p.vcurve[4] = 2.0  # the profile knows V(5) is cheap (a kernel sweet spot)
    cost = CostModel(p, 32)
    for _ in range(5):
        cost.observe_verify(1, 0.10)
        cost.observe_verify(9, 0.25)  # this context: V(9) measured at half the profile's 5.0
    assert abs(cost.v(9) - 2.5) < 1e-9
    # V(5) scaled by the ratio halfway from 1 (at n = 1) to 0.5 (at n = 9): 2.0 x 0.75;
    # a straight line from V(1) to V(9) would say 1.75 and hide the sweet spot
    assert abs(cost.v(5) - 1.5) < 1e-9 and cost.v(5) < cost.v(4)


def test_online_costs_shrug_off_a_stalled_round():
    cost = CostModel(None, 32)
    for _ in range(10):
        cost.observe_verify(1, 0.10)
        cost.observe_verify(5, 0.20)
    cost.observe_verify(1, 5.0)  # one round stalled by another process
    assert abs(cost.v(5) - 2.0) < 1e-9  # medians, not means


def test_vcurve_sizes_cover_the_range():
    sizes = vcurve_sizes(32)
    assert sizes[:9] == list(range(1, 10)) and sizes[-1] == 32 and len(sizes) < 20
    assert vcurve_sizes(13)[-1] == 13 and vcurve_sizes(3) == [1, 2, 3]


def test_accept_model_learns_and_decays():
    acc = AcceptModel(prior=0.5, n_max=8)
    for _ in range(50):
        acc.observe(4, 4)
    assert acc.rates(4)[0] > 0.9
    for _ in range(100):
        acc.observe(4, 0)
    assert acc.rates(1)[0] < 0.2


class _Fixed(DrafterBase):
    """Proposes the fake target's true continuation with the first `wrong` tokens wrong."""

    name = "fixed"

    def __init__(self, model: FakeModel, good: bool, match_len: int = 4) -> None:
        self.model, self.good, self.match_len = model, good, match_len

    def begin(self, prompt):
        pass

    def draft(self, context, k):
        toks = self.model.continuation(context, k)
        if not self.good:
            toks = [(t + 1) % self.model.n_vocab for t in toks]
        return Draft(tokens=toks, source="ngram", match_len=self.match_len)


def _run(model, drafter, n=120):
    spec = SpecConfig(mode="auto", draft_max=16, adaptive=False)
    prompt = list(range(1, 9))
    ids, _, stats = collect(generate(model, prompt, drafter, sampling=SamplingConfig(), spec=spec,
                                     gen=GenerationConfig(max_tokens=n)))
    assert ids == model.continuation(prompt, n)  # lossless, whatever auto chose
    return stats


def test_auto_drafts_long_when_drafts_are_right():
    model = FakeModel()
    auto = AutoDrafter(_Fixed(model, good=True), None, _profile(0.1), k_max=16)
    stats = _run(model, auto)
    assert stats.acceptance == 1.0 and stats.tokens_per_round > 6
    assert any(key.startswith("ngram:") for key in stats.policy)


def test_auto_falls_back_to_plain_when_drafts_are_wrong():
    model = FakeModel()
    # the fake decodes every batch size equally fast; judge with CPU-like profile costs
    auto = AutoDrafter(_Fixed(model, good=False), None, _profile(0.3), k_max=16, learn_costs=False)
    stats = _run(model, auto, n=200)
    plain_rounds = stats.policy.get("none:0", {}).get("rounds", 0)
    assert plain_rounds > 0.8 * stats.rounds  # it stopped paying for wrong drafts
    assert stats.drafted < 40  # a few probes, not a draft every round


def test_auto_learns_ngram_acceptance_without_drafting():
    # a 1-token match (prior 0.2) does not pay on this CPU's curve (V(2) = 1.6), so auto
    # starts plain; its candidates are scored against the tokens the target produces
    # anyway, so it finds out they are right and drafts long without waiting for a probe
    model = FakeModel()
    auto = AutoDrafter(_Fixed(model, good=True, match_len=1), None, _profile(0.6), k_max=16,
                       learn_costs=False)
    stats = _run(model, auto, n=200)
    assert stats.policy.get("none:0", {}).get("rounds", 0) < 10
    assert stats.tokens_per_round > 4


def test_auto_does_not_bet_on_unproven_short_matches():
    # on this CPU's curve a 4-token match at the old prior (0.75) drafted on sight; on
    # ~100-token code replies those failed verifies left auto 4-5% behind plain decoding
    # (replay of the built-in prompts). Now evidence comes first: candidates are scored
    # in hindsight, and wrong ones are never verified.
    model = FakeModel()
    auto = AutoDrafter(_Fixed(model, good=False, match_len=4), None, _profile(0.6), k_max=16,
                       learn_costs=False)
    stats = _run(model, auto, n=96)
    assert stats.drafted == 0


def test_auto_scores_deep_positions_it_never_drafted():
    model = FakeModel()
    auto = AutoDrafter(_Fixed(model, good=True, match_len=2), None, _profile(0.3), k_max=16)
    prompt = list(range(1, 9))
    auto.begin(prompt)
    context = prompt + model.continuation(prompt, 1)
    for _ in range(30):  # decode plainly: one token a round, auto's draft not used
        auto.draft(context, 16)
        auto.observe(0, 0, 0.1, 0.0)
        context = context + model.continuation(context, 1)
    rates = auto.ngram_acc[2].rates(16)
    assert min(rates) > 0.9  # 16 positions deep, learned from 16-token candidates


def test_auto_uses_real_ngram_drafter():
    # the fake's continuation repeats every 4 tokens, so once it has, every n-gram match
    # is right: auto (no profile: prior costs) must learn that and draft the matches
    model = FakeModel()
    auto = AutoDrafter(NgramDrafter(1, 4), None, None, k_max=16, learn_costs=False)
    stats = _run(model, auto)
    policy = stats.policy
    assert sum(row["rounds"] for row in policy.values()) == stats.rounds
    assert {key.split(":")[0] for key in policy} == {"ngram", "none"}
    assert policy["none:0"]["rounds"] < 0.25 * stats.rounds  # plain only until it learned
    assert stats.acceptance > 0.9 and stats.tokens_per_round > 3
    # and it knew what it would get: expected tokens per round close to the realised ones
    main = max(policy.values(), key=lambda row: row["rounds"])
    assert main["rounds"] > stats.rounds / 2 and abs(main["expected"] / main["realised"] - 1) < 0.2


class _CountingModelDrafter(DrafterBase):
    """A draft 'model' that records when it is asked (each ask re-syncs its KV cache)."""

    name = "model"

    def __init__(self, model: FakeModel) -> None:
        self.model, self.calls = model, 0

    def begin(self, prompt):
        pass

    def draft(self, context, k):
        self.calls += 1
        return Draft(tokens=self.model.continuation(context, k), source="model")


class _NoMatch(DrafterBase):
    name = "ngram"

    def begin(self, prompt):
        pass

    def draft(self, context, k):
        return Draft(source="ngram")


def test_auto_never_probes_a_draft_model_that_cannot_pay():
    # this CPU (tune: V(2) = 1.6, c = 0.38): even at 90% acceptance plain decoding
    # wins, so probing would only pay the draft's KV re-sync
    model = FakeModel()
    dear = _CountingModelDrafter(model)
    auto = AutoDrafter(_NoMatch(), dear, _profile(0.6, c=0.38), k_max=16, learn_costs=False)
    _run(model, auto, n=300)
    assert dear.calls == 0
    # lucky round times (2 and 17 tokens verified as fast as one) do not reopen the
    # question where the profile measured the draft; without that measurement they do
    for profile, verdict in ((_profile(0.6, c=0.38), False), (_profile(0.6), True)):
        auto = AutoDrafter(_NoMatch(), _CountingModelDrafter(model), profile, k_max=16)
        for _ in range(5):
            auto.cost.observe_verify(1, 0.100)
            auto.cost.observe_verify(2, 0.100)
            auto.cost.observe_verify(17, 0.101)
        assert auto._model_could_pay(16) is verdict
    # GPU-like: the same draft model is probed, and kept once it proves right
    cheap = _CountingModelDrafter(model)
    auto = AutoDrafter(_NoMatch(), cheap, _profile(0.01, c=0.05), k_max=16, learn_costs=False)
    stats = _run(model, auto, n=300)
    assert cheap.calls > 0 and stats.accepted > 100
