"""What the server's speculation learns of verify costs, on SmolLM2 (the rounds) and in
pure code (auto's bookkeeping):

- a round decoded in a step shared with other sequences' rows is not timed: its
  drafter is told no verify time (auto learned a one-token decode as dear as a whole
  batch's, halved every V(n) after a phase at two clients, and then drafted at a loss);
- auto given no time keeps its cost model as it was and still counts the round;
- with a draft model, each slot is charged its share of the drafting phase the slots'
  drafts were made in together, not the whole phase (auto learned a draft N times as
  dear as it was at N slots).
"""

from __future__ import annotations

import threading

import pytest

from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, ModelConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.draft_model import DraftBatch, ModelDrafter
from localspec.core.drafters.auto import AutoDrafter, Learned
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.drafters.ngram import NgramDrafter
from localspec.serve.jobs import Failed, Finished, Job
from localspec.serve.scheduler import Scheduler, SchedulerConfig

SLOTS = 2


class _Spy(DrafterBase):
    """Drafts nothing; records, for each round, the verify time it was told and how many
    sequences the decode it came from held."""

    name = "spy"

    def __init__(self, seen: list[tuple[float | None, int]], entries: list[int]) -> None:
        self.seen, self.entries = seen, entries

    def begin(self, prompt) -> None:
        pass

    def draft(self, context, k) -> Draft:
        return Draft()

    def observe(self, n_draft, n_accept, verify_s, draft_s) -> None:
        self.seen.append((verify_s, self.entries[-1]))


def _finish_both(sched: Scheduler, *gens: GenerationConfig) -> list[Finished]:
    """Start `sched`, run two greedy jobs on it at once (gens[i] for the i-th prompt) to
    their ends, stop it; their Finished events."""
    model = sched.target
    prompts = [model.tokenize("Count from one to forty in words."),
               model.tokenize("List the planets of the solar system, one per line.")]
    done = [threading.Event() for _ in gens]
    results: list[object] = [None] * len(gens)

    def sink(i: int):
        def put(ev: object) -> None:
            if isinstance(ev, (Finished, Failed)):
                results[i] = ev
                done[i].set()
        return put

    sched.start()
    try:
        for i, gen in enumerate(gens):
            sched.submit(Job(prompts[i], SamplingConfig(temperature=0.0), gen, sink=sink(i)))
        for d in done:
            assert d.wait(120)
    finally:
        sched.stop()
    assert all(isinstance(r, Finished) for r in results)
    return results


def test_a_round_decoded_beside_other_sequences_is_not_timed(model, monkeypatch):
    entries: list[int] = []
    decode_multi = model.decode_multi

    def counting(batch, *a, **kw):
        entries.append(len(batch))
        return decode_multi(batch, *a, **kw)

    monkeypatch.setattr(model, "decode_multi", counting)
    seen: list[tuple[float | None, int]] = []
    for s in range(SLOTS):
        model.rewind(0, force=True, seq=s)
    sched = Scheduler(model, SchedulerConfig(n_slots=SLOTS, spec=SpecConfig(mode="none")),
                      drafter_factory=lambda spec, sampling, extra: _Spy(seen, entries))
    # the second ends first: the first decodes alone after it
    _finish_both(sched, GenerationConfig(max_tokens=48), GenerationConfig(max_tokens=24))
    shared = [v for v, e in seen if e > 1]
    alone = [v for v, e in seen if e == 1]
    assert shared and alone, "the run must have rounds of both kinds"
    assert all(v is None for v in shared)
    assert all(v is not None and v > 0 for v in alone)




def test_auto_told_no_time_keeps_its_costs_and_counts_the_round():
    learned = Learned()
    auto = AutoDrafter(NgramDrafter(1, 4), None, None, k_max=8, learned=learned)
    auto.begin([1, 2, 3])
    for _ in range(5):  # plain rounds timed alone: the one-token time
        auto.observe(0, 0, 0.01, 0.0)
    cost = learned.cost
    before = {n: list(t) for n, t in cost.times.items()}
    t1 = cost.t1()
    assert t1 is not None
    auto.observe(0, 0, None, 0.0)  # a plain round of a shared step
    auto.observe(3, 1, None, 0.0)  # a drafted one
    assert {n: list(t) for n, t in cost.times.items()} == before
    assert cost.t1() == t1
    assert auto.produced == 5 + 1 + 2
    # the drafted round is priced at the estimate: it lost what V(4) costs beyond 2 tokens
    assert auto.lost == pytest.approx(cost.v(4) - 2)


@pytest.fixture(scope="module")
def draft(smol_path):
    m = Model(ModelConfig(path=smol_path, n_ctx=SLOTS * 1024, n_seq_max=SLOTS, n_threads=1))
    yield m
    m.close()


def test_a_shared_drafting_phase_is_split_between_the_slots_it_drafted_for(model, draft):
    for m in (model, draft):
        for s in range(SLOTS):
            m.rewind(0, force=True, seq=s)
    # every slot drafts k = 4 in every step (no p_min stop, no adaptive k): the phases are shared
    spec = SpecConfig(mode="model", draft_max=4, draft_p_min=0.0, adaptive=False)
    sched = Scheduler(model, SchedulerConfig(n_slots=SLOTS, spec=spec, spec_disable_by_batch_size=-1),
                      draft=draft)
    gen = GenerationConfig(max_tokens=32, ignore_eos=True)
    results = _finish_both(sched, gen, gen)
    m = sched.metrics
    assert m.draft_model_rows > 1.5 * m.draft_model_decodes  # most draft decodes held both slots
    charged = sum(r.stats.draft_s for r in results)
    # the slots' drafting times add up to the phases' (plus their own few microseconds of
    # proposing), not to the phases' times once per slot
    assert charged == pytest.approx(m.draft_model_seconds, rel=0.15)


def test_a_phase_s_shares_follow_the_tokens_decoded_for_each_sequence(draft):
    for s in range(SLOTS):
        draft.rewind(0, force=True, seq=s)
    greedy = SamplingConfig(temperature=0.0)
    ctx = draft.tokenize("Write a haiku about the sea.")
    batch = DraftBatch(draft)
    for s, k in enumerate((2, 8)):
        ModelDrafter(draft, greedy, seq=s, batch=batch).draft(ctx, k)
    phase = batch.run()
    # the same context to catch up; then 1 more decode for k = 2 and 7 for k = 8
    n = len(ctx)
    assert phase.shares == pytest.approx({0: (n + 1) / (2 * n + 8), 1: (n + 7) / (2 * n + 8)})
    assert phase.seconds_of(0) + phase.seconds_of(1) == pytest.approx(phase.seconds)
    assert phase.seconds_of(5) == 0.0
    for s in range(SLOTS):
        draft.rewind(0, force=True, seq=s)
