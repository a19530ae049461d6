"""The serve rule's load threshold (--spec-disable-by-batch-size) as a measurement: by
context band, from the profile `tune` wrote, shown in /health's snapshot; and the
measurement itself on the real SmolLM2 (timings are never asserted, only their shape)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from localspec.core.backend import ubatches
from localspec.core.config import SpecConfig
from localspec.profile import Profile
from localspec.serve.defaults import (
    DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE,
    BatchLimits,
    crossover_limit,
    spec_threshold,
    threshold_from_vcurve,
)
from localspec.serve.scheduler import Scheduler, SchedulerConfig

PROFILE = Profile(key="k", target="t.gguf", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                  t_token_s=0.1, vcurve=[1.0 + 0.3 * i for i in range(64)], prefill_tok_s=100.0)


def test_limits_pick_the_band_measured_nearest_the_context():
    limits = BatchLimits(((256, 4), (2048, 1)), "measured by tune")
    assert limits.limit(0) == limits.limit(100) == limits.limit(600) == 4  # log scale: 600 is nearer 256
    assert limits.limit(900) == limits.limit(2048) == limits.limit(30000) == 1
    assert "off above 4 active at 256 tokens" in limits.describe()
    assert limits.to_dict() == {"source": "measured by tune",
                                "bands": [{"context": 256, "limit": 4}, {"context": 2048, "limit": 1}]}
    assert BatchLimits(((0, None),), "set").to_dict()["bands"] == [{"context": 0, "limit": -1}]


def test_an_explicit_limit_wins_then_tune_s_measurement_then_the_curve_then_the_default():
    measured = replace(PROFILE, batch_limits={"2048": 1, "256": 3})
    assert spec_threshold(2, measured) == BatchLimits(((0, 2),), "set")
    assert spec_threshold(-1, measured).limit() is None
    got = spec_threshold(None, measured)
    assert got.bands == ((256, 3), (2048, 1)) and got.source == "measured by tune"
    # a draft model's decodes were not part of tune's batches: the curve and c decide
    with_draft = spec_threshold(None, measured, c=0.3)
    assert threshold_from_vcurve(PROFILE.vcurve, c=0.3) == 0 and with_draft.limit() == 1  # alone: auto decides
    assert spec_threshold(None, PROFILE).limit() == threshold_from_vcurve(PROFILE.vcurve)
    assert spec_threshold(None, None).limit() == DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    assert "tune" in spec_threshold(None, None).source


def test_tune_s_synthetic_figures_never_turn_off_a_sequence_decoding_alone():
    # tune judges 4-token drafts at 60%: on a steep curve every band comes out 0, which
    # would keep `serve` from drafting even for one request (an edit accepting 95%)
    zero = replace(PROFILE, batch_limits={"256": 0, "2048": 0})
    assert spec_threshold(None, zero).bands == ((256, 1), (2048, 1))
    assert spec_threshold(None, replace(zero, batch_limits={"256": 3, "2048": -1})).bands == ((256, 3), (2048, -1))
    # bench --serve timed serve's own drafting: a loss alone is a measurement, kept
    timed = replace(zero, batch_limits_by="bench --serve (auto, 2 repeats)")
    assert spec_threshold(None, timed).bands == ((256, 0), (2048, 0))
    # the limit V(n) implies: a linear curve pays at no batch size, yet alone is auto's call
    linear = replace(PROFILE, vcurve=[float(n) for n in range(1, 65)])
    assert threshold_from_vcurve(linear.vcurve) == 0 and spec_threshold(None, linear).limit() == 1
    sched = _scheduler(SchedulerConfig(n_slots=2, spec=SpecConfig(mode="auto"), spec_limits=spec_threshold(None, zero)))
    sched.active = [_active(1500)]
    assert sched._speculate() is True
    sched.active = [_active(1500), _active(1500)]
    assert sched._speculate() is False
    # ... yet above the limit auto's paying drafts are verified, and /health says so
    assert sched.snapshot()["spec_above_limit"] == "drafts the step pays for"
    sched = _scheduler(SchedulerConfig(n_slots=2, spec=SpecConfig(mode="auto"), spec_limits=spec_threshold(0, zero)))
    assert sched.snapshot()["spec_above_limit"] == "off"  # a limit set is kept as given


def test_crossover_is_the_end_of_the_first_run_where_speculating_pays():
    e = 2.0  # tokens a speculative round yields per sequence
    pays = [(1, 1.0, 1.5), (2, 1.1, 2.0), (3, 1.2, 2.6), (4, 1.3, 2.5)]  # 2.6 > 2.4 at B=3
    assert crossover_limit(pays, e) == 2
    assert crossover_limit([(1, 1.0, 2.5)], e) == 0
    assert crossover_limit([(1, 1.0, 1.0), (8, 2.0, 3.0)], e) == 8


def _scheduler(cfg: SchedulerConfig) -> Scheduler:
    target = SimpleNamespace(cfg=SimpleNamespace(n_seq_max=8), n_batch=512,
                             ubatches=lambda lengths: ubatches(lengths, 512))  # a KV cache per sequence
    return Scheduler(target, cfg)


def _active(context: int, prefilling: bool = False) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(tokens=[1] * context, prefilling=prefilling))


def test_a_prompt_still_prefilling_is_not_load_for_the_rule():
    # one slot decodes while another's prompt prefills: the step carries a chunk of it
    # anyway, so the decoding slot's draft costs little; the limit counts decoding ones
    sched = _scheduler(SchedulerConfig(n_slots=4, spec=SpecConfig(mode="ngram"), spec_disable_by_batch_size=1))
    sched.active = [_active(600), _active(600, prefilling=True)]
    assert sched._speculate() is True
    sched.active = [_active(600), _active(600)]
    assert sched._speculate() is False
    # by band: the decoding sequences' context picks it, not a long prompt being prefilled
    limits = BatchLimits(((256, 2), (2048, 1)), "measured by tune")
    sched = _scheduler(SchedulerConfig(n_slots=4, spec=SpecConfig(mode="ngram"), spec_limits=limits))
    sched.active = [_active(200), _active(200), _active(3000, prefilling=True)]
    assert sched._limit() == 2 and sched._speculate() is True


def test_the_rule_follows_the_active_sequences_context():
    limits = BatchLimits(((256, 3), (2048, 1)), "measured by tune")
    sched = _scheduler(SchedulerConfig(n_slots=8, spec=SpecConfig(mode="ngram"), spec_limits=limits))
    sched.active = [_active(200), _active(300)]
    assert sched._speculate() is True  # 2 short sequences: the short band allows 3
    assert sched.snapshot()["spec_disable_by_batch_size"] == 3
    sched.active = [_active(1800), _active(2400)]
    assert sched._speculate() is False  # the same load at a long context: off above 1
    snap = sched.snapshot()
    assert snap["spec_disable_by_batch_size"] == 1 and snap["spec_limits"] == limits.to_dict()
    sched.active = [_active(2400)]
    assert sched._speculate() is True


def test_a_plain_limit_still_applies_without_bands():
    sched = _scheduler(SchedulerConfig(n_slots=4, spec=SpecConfig(mode="ngram"), spec_disable_by_batch_size=1))
    sched.active = [_active(10), _active(10)]
    assert sched._speculate() is False
    assert sched.snapshot()["spec_limits"] == {"source": "set", "bands": [{"context": 0, "limit": 1}]}


def test_tune_measures_the_limit_on_batches_of_real_sequences(smol_path):
    from localspec.bench.calibrate import measure_batch_limits
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    target = Model(ModelConfig(path=smol_path, n_ctx=1024, n_threads=1))
    try:
        limits, detail = measure_batch_limits(target, contexts=(32, 128), sizes=(1, 2), reps=1)
    finally:
        target.close()
    assert set(limits) == {"32", "128"} and all(0 <= v <= 2 for v in limits.values())
    assert [(d["context"], d["batch"]) for d in detail] == [(32, 1), (32, 2), (128, 1), (128, 2)]
    assert all(d["plain_ms"] > 0 and d["spec_ms"] > 0 for d in detail)


class _Offer:
    """A decoding sequence (KV sequence `seq`) that proposed `k` tokens its drafter
    expects `promise` of."""

    def __init__(self, k: int, promise: float | None, seq: int = 0) -> None:
        self.seq = seq
        self.draft = SimpleNamespace(tokens=[7] * k)
        self._promise, self.withdrawn = promise, False

    def promise(self) -> float | None:
        return self._promise if self.draft.tokens else None

    def withdraw(self) -> None:
        self.draft, self.withdrawn = SimpleNamespace(tokens=[]), True


def _offered(vcurve: list[float], k_max: int, offers: list[tuple[int, float | None]]) -> tuple[Scheduler, list]:
    """A scheduler whose auto priced verifies by `vcurve`, and sequences that proposed `offers`."""
    from localspec.core.drafters.costs import CostModel

    sched = _scheduler(SchedulerConfig(n_slots=8, spec=SpecConfig(mode="auto")))
    sched.learned.cost = CostModel(replace(PROFILE, vcurve=vcurve), k_max, learn=False)
    active = [SimpleNamespace(state=_Offer(k, p, seq), promised=0.0) for seq, (k, p) in enumerate(offers)]
    for a in active:
        a.state.k = len(a.state.draft.tokens)
    return sched, active


def _keeps(vcurve: list[float], offers: list[tuple[int, float | None]], n_plain: int) -> list[bool]:
    """Which drafts the step keeps: `offers` on sequences 0.., beside plain rows up to
    `n_plain` sequences."""
    sched, active = _offered(vcurve, 64, offers)
    sched._keep_paying(active, {seq: 1 for seq in range(n_plain)})
    return [not a.state.withdrawn for a in active]


def test_above_the_limit_a_draft_is_verified_only_where_the_step_pays_for_it():
    flat = [1.0 + 0.02 * i for i in range(65)]  # a GPU's or an AMX Xeon's curve
    steep = [float(n) for n in range(1, 66)]  # V(n) = n: a verify costs its tokens
    # two sequences, one with a long sure copy, one with a doubtful 8-token guess
    assert _keeps(flat, [(16, 15.0), (8, 1.05)], 2) == [True, False]
    assert _keeps(steep, [(16, 15.0), (8, 1.05)], 2) == [False, False]
    # on the flat curve the step pays for every sure copy; no promise: decoded plainly
    assert _keeps(flat, [(12, 11.0), (12, 10.0), (4, None)], 3) == [True, True, False]
    # a pass past the curve the cost model knows is priced as linear from its end
    assert _keeps(flat, [(128, 120.0)], 4) == [True]
    assert _keeps(steep, [(128, 120.0)], 4) == [False]


def test_a_draft_beside_plain_rows_is_priced_as_the_pass_of_its_own_it_makes():
    """With a KV cache per sequence llama.cpp splits a step into ubatches of equal tokens
    per sequence: 8 plain rows and an 8-token draft are two passes, V(8) + V(8), not one
    of 16. On this CPU's tuned curve (2-core AMD EPYC, AVX-512, the 1.5B: V(8) 4.90, V(16)
    5.62) one pass of 16 would make the draft look nearly free."""
    tuned = [1.0, 1.63, 2.37, 2.94, 3.68, 4.16, 4.87, 4.9, 5.28, 5.76, 5.91, 6.07, 6.38, 6.68, 6.15, 5.62,
             *(5.62 + 0.46 * i for i in range(1, 50))]
    assert _keeps(tuned, [(8, 7.0)], 8) == [False]  # (8 + 6) / 9.8 < 8 / 4.9
    # a long sure copy pays for its own pass: (8 + 15) / (4.9 + V(16) 5.62) = 2.19 > 1.63
    assert _keeps(tuned, [(15, 16.0)], 8) == [True]


def test_a_loaded_server_times_the_passes_its_steps_make_and_tries_an_untimed_size_twice():
    """Without a profile, sizes are learned from the server's own steps: a step of one
    pass times V of its tokens; a draft's pass is timed as what its step took beyond the
    plain pass. A size never timed is priced at its worst case (no better per token than
    the largest timed size below it), which would never let a draft at it be tried, so a
    sure draft is tried there TRIALS times beside a plain pass."""
    from localspec.core.drafters.costs import CostModel
    from localspec.core.tuning import TRIALS

    t1 = 0.03
    sched = _scheduler(SchedulerConfig(n_slots=8, spec=SpecConfig(mode="auto")))
    sched.learned.cost = cost = CostModel(None, 64)
    sched._learn_step([(0, 1), (1, 1)], 1.6 * t1)  # no one-token time yet: nothing to scale by
    assert not cost.known(2)
    for _ in range(3):
        cost.observe_verify(1, t1)  # a sequence's plain rounds alone
    for _ in range(3):
        sched._learn_step([(0, 1), (1, 1)], 1.6 * t1)  # plain steps of two sequences: V(2)
    assert cost.settled(2) and abs(cost.v(2) - 1.6) < 1e-9
    assert not cost.known(16)

    def offer() -> bool:
        a = SimpleNamespace(state=_Offer(16, 15.0, seq=0), promised=0.0)
        sched._keep_paying([a], {0: 1, 1: 1})
        return not a.state.withdrawn

    assert [offer() for _ in range(TRIALS + 1)] == [True] * TRIALS + [False]
    # the trial's step: the plain pass of 2 and the draft's own pass of 16
    sched._learn_step([(0, 17), (1, 1)], (1.6 + 5.6) * t1)
    assert cost.known(16) and abs(cost.v(16) - 5.6) < 1e-6
    assert offer()  # now priced as timed: (2 + 14) / (1.6 + 1.3 x 5.6) > 1.1 x 2 / 1.6
    # a stalled step is taken as at most its tokens' one-token decodes
    sched._learn_step([(0, 1), (1, 1), (2, 1)], 50 * t1)
    assert cost.v(3) <= 3.0


def test_promises_are_trusted_as_far_as_the_drafts_kept_above_the_limit_gave_them():
    """auto promises for a sequence alone; where the drafts kept beside others give less
    (a review quoting its prompt), the step scales later promises by what they gave."""
    flat = [1.0 + 0.02 * i for i in range(65)]
    sched, _ = _offered(flat, 64, [])

    def kept(promise: float) -> tuple[bool, float]:
        a = SimpleNamespace(state=_Offer(16, promise, seq=0), promised=0.0)
        a.state.k = 16
        sched._keep_paying([a], {0: 1, 1: 1})
        return not a.state.withdrawn, a.promised

    assert kept(9.0) == (True, 9.0)  # full trust before any evidence; auto's own promise kept
    for _ in range(20):  # kept drafts gave nothing of the 8 tokens each promised
        sched._kept(0, 8.0)
    assert sched._trust() < 0.15
    assert kept(9.0) == (False, 0.0)  # 1 + 0.12 x 8 tokens no longer pay for the pass
    for _ in range(200):  # ... and then gave all of it
        sched._kept(8, 8.0)
    assert sched._trust() > 0.95 and kept(9.0)[0]


def test_ubatches_follow_llama_cpp_s_split_of_a_multi_sequence_batch():
    # split_equal(sequential): a run of consecutive ids, the same tokens from each
    assert ubatches([(s, 1) for s in range(8)], 512) == [8]
    assert ubatches([(0, 9), *((s, 1) for s in range(1, 8))], 512) == [8, 8]
    assert ubatches([(s, 5) for s in range(8)], 512) == [40]
    assert ubatches([(0, 5), (1, 9)], 512) == [10, 4]
    assert ubatches([(2, 9), (1, 1), (0, 5)], 512) == [3, 4, 8]  # taken in id order
    assert ubatches([(0, 1), (3, 1), (4, 300)], 256) == [1, 2, 256, 43]  # a gap ends a run
    assert ubatches([(0, 700)], 512, one_stream=True) == [512, 188]  # split_simple


def _spared(vcurve: list[float], offers: list[tuple[int, float | None]], chunk: int) -> list[int]:
    """What is left of `offers` (sequences 0..) beside a prompt prefilling `chunk` tokens
    on the next sequence."""
    sched, active = _offered(vcurve, 32, offers)
    sched._spare_first_tokens(active, {**{seq: 1 for seq in range(len(offers))}, len(offers): chunk})
    return [0 if a.state.withdrawn else a.state.k for a in active]


def test_drafts_beside_a_prompt_s_last_chunk_leave_its_first_token_little_later():
    steep = [float(n) for n in range(1, 66)]  # V(n) = n: 6 tokens in the step, +50% = 3 more
    assert _spared(steep, [(16, 15.0)], 5) == [3]
    assert _spared(steep, [(16, 15.0), (8, 1.5)], 4) == [3, 0]  # the surest draft keeps the room
    # a GPU: a pass costs about one token's time whatever its size, so a draft that rides
    # in the pass the chunk makes anyway costs it ~nothing; the other one is a pass more
    flat = [1.0 + 0.01 * i for i in range(65)]
    assert _spared(flat, [(8, 1.5), (16, 15.0)], 40) == [8, 16]
    # a 256-token chunk is past the sizes auto timed: linear from the curve's end
    assert _spared(steep, [(32, 30.0)], 256) == [32]


def test_a_sequence_whose_drafts_are_not_kept_is_asked_less_often():
    sched = _scheduler(SchedulerConfig(n_slots=2, spec=SpecConfig(mode="auto")))
    a = SimpleNamespace(state=_Offer(0, None), quiet=0, quiet_until=0)
    gaps = []
    for _ in range(7):  # withdrawn (or nothing drafted) every time it is asked
        sched._steps = a.quiet_until
        sched._quieten([a])
        gaps.append(a.quiet_until - sched._steps)
    assert gaps == [1, 2, 4, 8, 16, 16, 16]
    a.state = _Offer(8, 7.0)  # a kept draft: asked again at the next step
    sched._quieten([a])
    assert a.quiet_until == sched._steps
