"""Where a request goes (serve/slots.py) and the scheduler's use of it, on SmolLM2:

- the busy slots' ids stay in as few runs of consecutive ids as the free slots allow
  (llama.cpp decodes each run in a ubatch of its own);
- a prompt's start that another slot holds, busy or free, is copied into the chosen slot
  instead of prefilled again, and the reply is the one a fresh prefill gives;
- a slot holding another request's cells is left alone while an empty one will do.
- a reply sent whole wakes the event loop once, not once per token.
"""

from __future__ import annotations

import threading


from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.tuning import SLOT_COPY_MIN
from localspec.serve.jobs import Failed, Finished, Job, Text, loop_sink
from localspec.serve.scheduler import Scheduler, SchedulerConfig
from localspec.serve.slots import Placement, place, runs

SLOTS = 4


def test_runs_counts_runs_of_consecutive_ids():
    assert runs([]) == 0
    assert runs([3]) == 1
    assert runs([0, 1, 2, 3]) == 1
    assert runs([0, 2, 4, 6]) == 4
    assert runs([5, 4, 0]) == 2


def _place(free, busy, have, sizes=None, min_copy=8):
    sizes = sizes or have
    return place(free, busy, lambda s: have.get(s, 0), lambda s: sizes.get(s, 0), 8, min_copy)


def test_a_free_slot_beside_the_busy_ones_wins_over_one_holding_the_prompt():
    # busy 0, 1; slot 5 holds 100 tokens of the prompt: the request goes to 2 and the
    # 100 tokens are copied from 5 (the old rule took 5 itself: runs {0, 1} and {5})
    got = _place(free=[2, 3, 4, 5, 6, 7], busy=[0, 1], have={5: 100})
    assert got == Placement(slot=2, held=100, source=5)


def test_a_busy_slot_holding_the_prompt_is_copied_from():
    got = _place(free=[1, 2, 3], busy=[0], have={0: 50})
    assert got == Placement(slot=1, held=50, source=0)


def test_among_equal_runs_the_slot_holding_the_prompt_is_taken_without_a_copy():
    got = _place(free=list(range(8)), busy=[], have={6: 40}, sizes={6: 60})
    assert got == Placement(slot=6, held=40)


def test_a_short_gain_is_not_copied_and_other_requests_cells_are_kept():
    # slot 0 holds 20 tokens of an earlier request (3 of them this prompt's start): an
    # empty slot is taken, so those cells stay for whoever sends that prompt again
    got = _place(free=[0, 1, 2], busy=[], have={0: 3}, sizes={0: 20}, min_copy=8)
    assert got == Placement(slot=1, held=0)
    # a gain under the minimum is prefilled, not copied
    got = _place(free=[1, 2], busy=[0], have={0: 5, 1: 0}, min_copy=8)
    assert got == Placement(slot=1, held=0)


def test_min_copy_zero_never_copies():
    assert _place(free=[1, 2], busy=[0], have={0: 500}, min_copy=0).source is None


# ----- the scheduler, on the real model --------------------------------------------------


class Run:
    """A job on a scheduler: its Finished (or Failed), and an event set at its first text."""

    def __init__(self, prompt: list[int], n: int) -> None:
        self.done = threading.Event()
        self.started = threading.Event()
        self.result: Finished | Failed | None = None
        self.text: list[str] = []
        self.job = Job(prompt, SamplingConfig(temperature=0.0), GenerationConfig(max_tokens=n, ignore_eos=True),
                       self.sink)

    def sink(self, ev: object) -> None:
        if isinstance(ev, Text):
            self.text.append(ev.text)
            self.started.set()
        elif isinstance(ev, (Finished, Failed)):
            self.result = ev
            self.text.append(getattr(ev, "text", ""))
            self.done.set()

    def wait(self) -> Finished:
        assert self.done.wait(120), "request did not finish"
        assert isinstance(self.result, Finished), self.result
        return self.result


def _scheduler(model: Model, **cfg) -> Scheduler:
    for s in range(SLOTS):
        model.rewind(0, force=True, seq=s)
    sched = Scheduler(model, SchedulerConfig(**{"n_slots": SLOTS, "spec": SpecConfig(mode="none"), **cfg}))
    sched.start()
    return sched


def _prompts(model: Model) -> tuple[list[int], list[int], list[int]]:
    base = model.tokenize("Here is a list of fruit: apple, banana, cherry, date, elderberry, fig, grape, "
                          "honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry. ")
    assert len(base) > SLOT_COPY_MIN + 8
    return (base + model.tokenize("Which is red?", add_special=False),
            model.tokenize("Count from one to twenty in words, one per line."),
            base + model.tokenize("Which is yellow?", add_special=False))


def _beside_busy(model: Model, first: list[int], second: list[int], n: tuple[int, int] = (48, 12),
                 held: tuple[list[int], int] | None = None, **cfg) -> tuple[Run, Run, Finished, int]:
    """`second` submitted while `first` decodes: (first's run, second's, its result, copies).
    `held`: (tokens, slot) prefilled into that free slot before either comes."""
    sched = _scheduler(model, **cfg)
    try:
        if held is not None:
            model.decode(held[0], seq=held[1])
        r1 = Run(first, n[0])
        sched.submit(r1.job)
        assert r1.started.wait(60)
        r2 = Run(second, n[1])
        sched.submit(r2.job)
        got = r2.wait()
        r1.wait()
        return r1, r2, got, sched.metrics.slot_copies
    finally:
        sched.stop()


def test_a_prompt_start_held_by_a_busy_slot_is_copied_not_prefilled(model):
    first, _, second = _prompts(model)
    # the same two requests prefilled without copies, for comparison
    _, fresh, want, copies = _beside_busy(model, first, second, slot_copy=False)
    assert want.stats.restored_tokens == 0 and copies == 0
    r1, r2, got, copies = _beside_busy(model, first, second)
    assert (r1.job.slot, r2.job.slot) == (0, 1)
    shared = len(_common(first, second))
    assert copies == 1
    assert got.stats.restored_tokens == shared
    assert got.stats.prefill_tokens == len(second) - shared
    assert "".join(r2.text) == "".join(fresh.text)


def test_a_gap_between_busy_slots_is_filled_by_a_copy(model):
    first, other, second = _prompts(model)
    # slot 0 is kept busy, slot 2 holds `first` (slot 1 empty): `second` goes to 1,
    # beside 0, with first's start copied from 2
    busy, r2, got, copies = _beside_busy(model, other, second, n=(64, 4), held=(first, 2))
    assert busy.job.slot == 0 and r2.job.slot == 1, (busy.job.slot, r2.job.slot)
    assert got.stats.restored_tokens == len(_common(first, second))
    assert copies == 1


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# ----- what the event loop is woken for ---------------------------------------------------


class _Loop:
    """Counts call_soon_threadsafe calls and runs them at once."""

    def __init__(self) -> None:
        self.calls = 0
        self.got: list[object] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls += 1
        fn(*args)


def _feed(whole: bool) -> _Loop:
    from localspec.core.events import GenerationStats

    loop = _Loop()
    sink = loop_sink(loop.call_soon_threadsafe, loop.got.append, whole)
    events = [Text(f"t{i}", 1) for i in range(5)] + [Finished(GenerationStats(), "")]
    for ev in events:
        sink(ev)
    assert loop.got == events  # every event, in order
    return loop


def test_a_whole_reply_wakes_the_event_loop_once_a_stream_per_event():
    assert _feed(whole=True).calls == 1
    assert _feed(whole=False).calls == 6


# ----- the prompt cache (--cache-ram) ------------------------------------------------------


def _one_slot_runs(model: Model, prompts: list[list[int]], **cfg) -> tuple[list[Run], Scheduler]:
    """Each prompt in turn on a one-slot scheduler: every request takes the slot the last one had."""
    sched = _scheduler(model, n_slots=1, **cfg)
    runs_ = []
    try:
        for p in prompts:
            r = Run(p, 12)
            sched.submit(r.job)
            r.wait()
            runs_.append(r)
    finally:
        sched.stop()
    return runs_, sched


def test_a_prompt_whose_slot_was_taken_is_restored_from_the_prompt_cache(model):
    first, other, _ = _prompts(model)
    runs_, sched = _one_slot_runs(model, [first, other, first])
    again = runs_[2].result.stats
    # `other` shares nothing with `first`: the slot's cells were saved before it took them
    assert again.restored_tokens == len(first) - 1  # the last token is decoded again
    assert again.prefill_tokens == 1
    assert sched.metrics.prompt_restores == 1
    assert sched.prompt_cache.snapshot()["saves"] >= 1
    assert "".join(runs_[2].text) == "".join(runs_[0].text)  # the reply a fresh prefill gives
    # without the cache the prompt is prefilled again
    off, sched = _one_slot_runs(model, [first, other, first], prompt_cache_bytes=0)
    assert off[2].result.stats.restored_tokens == 0 and sched.prompt_cache is None
    assert "".join(off[2].text) == "".join(runs_[2].text)


def test_the_prompt_cache_keeps_what_fits_newest_first_and_a_slot_held_elsewhere_once(model):
    from localspec.serve.prompt_cache import PromptCache

    first, other, second = _prompts(model)
    for s in range(2):
        model.rewind(0, force=True, seq=s)
    model.decode(first, seq=0)
    model.decode(other, seq=1)
    cache = PromptCache(len(model.state_bytes(0)) + len(model.state_bytes(1)) - 1)
    model.rewind(0, force=True, seq=1)
    assert not cache.keep(model, 0, len(first) // 2 + 1)  # the request keeps most of it: not saved
    assert cache.keep(model, 0, 0)
    assert not cache.keep(model, 0, 0)  # held already
    model.rewind(0, force=True, seq=0)
    model.decode(other, seq=0)
    assert cache.keep(model, 0, 0)
    assert len(cache.entries) == 1  # both do not fit: the older went
    assert cache.find(second, 0) is None  # `first` (which shares second's start) is gone
    entry = cache.find(other + [13], 0)
    assert cache.restore(model, 1, entry, other + [13]) == len(other)
    assert model.seq_tokens(1) == other and model.kv_len(1) == len(other)
