"""Above serve's load limit the scheduler still verifies the auto drafts a step pays for
(Scheduler._keep_paying), on the real SmolLM2: two copying requests decoding together
under a limit of 0, auto's costs given as a flat curve (a GPU's shape) or a steep one, so the
decision does not hang on this machine's load. Greedy replies are the same either way."""

from __future__ import annotations

from fakes import fixed_costs
from test_serve_slots import Run

from localspec.core.config import SpecConfig
from localspec.serve.defaults import BatchLimits
from localspec.serve.scheduler import Scheduler, SchedulerConfig

SLOTS = 2
TEXT = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n")


def _together(model, sure_bets: bool, limits: BatchLimits, slope: float = 0.02) -> list[Run]:
    for s in range(SLOTS):
        model.rewind(0, force=True, seq=s)
    cfg = SchedulerConfig(n_slots=SLOTS, spec=SpecConfig(mode="auto", draft_max=16), spec_limits=limits,
                          auto_costs=fixed_costs(slope), sure_bets=sure_bets, prompt_cache_bytes=0)
    sched = Scheduler(model, cfg)
    prompts = [model.tokenize(f"Copy this code exactly, {i} times:\n\n{TEXT}{TEXT}{TEXT}") for i in (2, 3)]
    runs = [Run(p, 64) for p in prompts]
    sched.start()
    try:
        for r in runs:  # under a limit of 0 the rule never speculates: what drafts is _keep_paying
            sched.submit(r.job)
        for r in runs:
            r.wait()
    finally:
        sched.stop()
    return runs


def test_above_the_limit_sure_copies_are_still_verified_and_replies_unchanged(model):
    limit0 = BatchLimits(((0, 0),), "measured by bench --serve")
    sure = _together(model, True, limit0)
    off = _together(model, False, limit0)
    drafted = [r.result.stats.drafted for r in sure]
    assert sum(drafted) > 0, drafted  # speculation off by the rule, yet the copies drafted
    assert [r.result.stats.drafted for r in off] == [0, 0]
    assert sum(r.result.stats.accepted for r in sure) > 0
    assert ["".join(r.text) for r in sure] == ["".join(r.text) for r in off]  # lossless
    # on a steep curve (V(n) = 1 + 0.8 (n - 1)) auto alone would still draft these copies
    # (22-23 tokens each with the step's pricing removed), but beside a second sequence the
    # step does not pay for them: none is kept
    assert [r.result.stats.drafted for r in _together(model, True, limit0, slope=0.8)] == [0, 0]
    # a limit set by the user is obeyed as given: off above it
    assert [r.result.stats.drafted for r in _together(model, True, BatchLimits(((0, 0),), "set"))] == [0, 0]
