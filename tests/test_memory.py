"""The suffix memory: index, most frequent continuation, bound, acceptance learned in
hindsight, and auto drafting from it (fake target: pure engine logic)."""

from __future__ import annotations

import random

import numpy as np
from fakes import FakeModel

from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters import suffix
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.memory import Memory, MemoryDrafter, MemoryModel
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.drafters.suffix import SuffixIndex, longest_match, most_frequent
from localspec.core.engine import collect, generate
from localspec.profile import Profile


def _draft(memory: Memory | None, context, k=16) -> list[int]:
    d = MemoryDrafter(memory)
    d.begin(context)
    return d.draft(context, k).tokens


def test_most_frequent_continuation_of_the_longest_match():
    mem = Memory()
    for tail in ([10, 11, 12], [10, 11, 12], [10, 11, 12], [20, 21]):
        mem.add([1, 2, 3, *tail])
    assert _draft(mem, [9, 1, 2, 3]) == [10, 11, 12]  # 3 of 4 occurrences continue so
    mem.add([7, 7, 1, 2, 3, 20, 21, 22])  # a longer match wins over a frequent short one
    assert _draft(mem, [7, 7, 1, 2, 3]) == [20, 21, 22]
    assert _draft(mem, [5, 6]) == []  # no match: an empty draft
    assert _draft(None, [1, 2, 3, 4, 1, 2]) == [3, 4, 1, 2]  # the context alone


def test_a_draft_stops_at_a_texts_end_and_where_continuations_split():
    mem = Memory()
    mem.add([1, 2, 3, 4])
    mem.add([5, 6, 3, 4])
    assert _draft(mem, [1, 2]) == [3, 4]  # not into the next text
    tokens, support = most_frequent(np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6]]), 3, 0.3)
    assert tokens == [1, 2, 4] and support == [3, 2, 1]  # ties: the most recent row
    assert most_frequent(np.array([[1, 2], [1, 3], [1, 4], [1, 5]]), 2, 0.3)[0] == [1]


def test_index_finds_the_same_occurrences_however_it_was_built(monkeypatch):
    monkeypatch.setattr(suffix, "TAIL_MAX", 64)  # fold into sorted levels often
    rng = random.Random(3)
    texts = [[rng.randrange(12) for _ in range(rng.randrange(1, 90))] for _ in range(80)]
    grown, whole = SuffixIndex(), SuffixIndex()
    flat: list[int] = []
    for t in texts:
        grown.add_text(t)
        flat += [*t, suffix.SEP]
    whole.extend(flat)
    assert len(grown.levels) >= 1
    for _ in range(300):
        ctx = [rng.randrange(12) for _ in range(rng.randrange(2, 40))]
        for n, key in suffix.query_keys(ctx).items():
            want = [i for i in range(n, len(flat)) if flat[i - n:i] == ctx[-n:]][-suffix.OCC_CAP:]
            assert grown.find(n, key).tolist() == want
            assert whole.find(n, key).tolist() == want


def test_memory_stays_within_its_bound_dropping_the_oldest_first():
    mem = Memory(max_tokens=1000)
    for i in range(100):
        mem.add([5000 + i, *range(i * 100, i * 100 + 30)])
        assert len(mem.texts) <= 1000
    assert _draft(mem, [5099, 9900]) == list(range(9901, 9917))  # the newest text is there
    assert _draft(mem, [5000, 0]) == []  # the oldest is gone
    assert len(mem.texts) > 600  # dropped down to MEMORY_KEEP of the bound, not to nothing


def _finish(memory: Memory, prompt: list[int], output: list[int]) -> None:
    d = MemoryDrafter(memory)
    d.begin(prompt)
    d.finished(prompt + output)


HEAD = list(range(1, 41))  # a system prompt and template every request starts with
MODULE = list(range(100, 160))  # code given in the first prompt


def test_a_later_output_drafts_from_an_earlier_prompt():
    mem = Memory()
    _finish(mem, HEAD + [7] + MODULE, [50, 51, 52])
    later = HEAD + [8, 9]  # another request, whose output goes on to copy the module
    d = MemoryDrafter(mem)
    d.begin(later)
    assert d.draft(later + MODULE[:3], 8).tokens == MODULE[3:11]
    assert _draft(mem, HEAD + [7] + MODULE) == [50, 51, 52]  # the same request: from its first token
    _finish(mem, later, [60, 61])
    assert mem.texts.tokens.tolist().count(HEAD[0]) == 1  # the shared start is not stored again
    outputs_only = Memory(prompts=False)
    _finish(outputs_only, HEAD + [7] + MODULE, [50, 51, 52])
    assert outputs_only.texts.tokens.tolist() == [50, 51, 52, suffix.SEP]
    assert _draft(outputs_only, later + MODULE[:3]) == []


def test_a_remembered_prompt_is_bounded_by_its_end(monkeypatch):
    from localspec.core.drafters import memory as memory_mod

    monkeypatch.setattr(memory_mod, "MEMORY_PROMPT_MAX", 50)
    mem = Memory()
    _finish(mem, list(range(1000, 1200)), [5, 6])
    assert mem.texts.tokens.tolist() == [*range(1150, 1200), 5, 6, suffix.SEP]


def test_memory_model_learns_in_hindsight_by_match_and_support():
    model = MemoryModel()
    good = MemoryModel.bins(8, [5] * 8)
    before = model.rates(good).copy()
    context = list(range(100))
    model.reset(10)
    for pos in range(10, 90, 8):  # right candidates, none of them drafted
        model.offer(pos, context[pos:pos + 8], [5] * 8, 8)
        model.settle(context[:pos + 8])
    assert (model.rates(good) > before).all() and model.rates(good)[0] > 0.9
    bad = MemoryModel.bins(2, [1] * 4)
    model.reset(10)
    for pos in range(10, 90, 4):
        model.offer(pos, [c + 1 for c in context[pos:pos + 4]], [1] * 4, 2)
        model.settle(context[:pos + 4])
    assert model.rates(bad)[0] < 0.15
    again = MemoryModel(model.to_dict())  # what the profile keeps comes back
    assert np.allclose(again.rates(good), model.rates(good), atol=1e-3)


def _scrambled(context, n_vocab):
    """Next token from the last three: no repeats within a reply, nothing for n-grams."""
    a, b, c = context[-3:]
    return (a * 131 + b * 31 + c * 7 + 11) % n_vocab


def _profile(v_per_token: float) -> Profile:
    curve = [1.0 + v_per_token * (n - 1) for n in range(1, 65)]
    return Profile(key="k", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                   t_token_s=0.1, vcurve=curve, prefill_tok_s=100.0)


def _run(model, memory, prompt, n=150, learn=True):
    drafter = MemoryDrafter(memory, learn=learn)
    auto = AutoDrafter(NgramDrafter(1, 4), None, _profile(0.3), k_max=32, learn_costs=False,
                       memory=drafter)
    ids, _, stats = collect(generate(model, prompt, auto, sampling=SamplingConfig(),
                                     spec=SpecConfig(mode="auto", draft_max=32),
                                     gen=GenerationConfig(max_tokens=n)))
    assert ids == model.continuation(prompt, n)  # lossless, whatever auto drafted
    return stats


def test_auto_drafts_from_memory_when_a_request_repeats_an_earlier_one():
    model = FakeModel(n_vocab=4000, n_ctx=1024, next_fn=_scrambled)
    memory = Memory()
    first = _run(model, memory, [1, 2, 3])
    assert first.drafted == 0 or "memory:" not in str(first.policy)  # nothing to recall yet
    assert len(memory.texts) == 154  # the prompt, the output and a separator joined the memory
    again = _run(model, memory, [1, 2, 3])
    used = {k: v for k, v in again.policy.items() if k.startswith("memory:")}
    assert used and again.acceptance > 0.9 and again.tokens_per_round > 4, again.policy


def test_a_misleading_memory_is_not_drafted_for_long():
    model = FakeModel(n_vocab=4000, n_ctx=1024, next_fn=_scrambled)
    memory = Memory()
    out = model.continuation([1, 2, 3], 150)
    for _ in range(3):  # remembered three times, but each token off by one from the 5th on
        memory.add(out[:4] + [(t + 1) % 4000 for t in out[4:]])
    stats = _run(model, memory, [1, 2, 3], learn=False)
    assert stats.drafted < 20, stats.policy  # evidence first: its candidates failed in hindsight
    assert len(memory.texts) == 3 * 151  # learn=False: nothing added


def test_drafting_from_a_memory_of_millions_of_tokens_is_cheap():
    """Printed, not asserted: the cost of a draft next to a memory of 2M tokens."""
    import time

    rng = np.random.default_rng(0)
    mem = Memory(max_tokens=1 << 22)
    words = rng.integers(0, 30000, size=4000)
    t0 = time.perf_counter()
    for _ in range(500):  # 2M tokens of texts drawn from a small phrase book: many matches
        start = int(rng.integers(0, 3900))
        mem.add(np.concatenate([words[start:start + 100], rng.integers(0, 30000, size=3900)]).tolist())
    build = time.perf_counter() - t0
    drafter = MemoryDrafter(mem, learn=False)
    context = rng.integers(0, 30000, size=2000).tolist() + words[1000:1010].tolist()
    drafter.begin(context)
    t0 = time.perf_counter()
    for i in range(200):
        d = drafter.draft(context + words[1010:1010 + i % 50].tolist(), 32)
    per = (time.perf_counter() - t0) / 200
    assert len(d.tokens) > 0
    print(f"memory {len(mem.texts)} tokens, {mem.texts.nbytes / 2**20:.0f} MiB, built in {build:.1f} s; "
          f"draft {per * 1e6:.0f} us")


def _follow(memory: Memory, context: list[int], start: int, k: int = 16) -> list:
    """Drafts for every prefix of `context` from `start` on (none verified: what the
    memory drafter offers round by round while the target writes `context`)."""
    d = MemoryDrafter(memory, learn=False)
    d.begin(context[:start])
    return [d.draft(context[:n], k) for n in range(start, len(context))]


def test_a_copy_followed_past_the_lookups_lengths_is_judged_by_its_true_length():
    mem = Memory()
    mem.add(list(range(100, 200)))
    context = [1, 2, *range(100, 130)]
    drafts = _follow(mem, context, 5)  # from 3 copied tokens on
    lengths = [d.match_len for d in drafts]
    # the lookup finds 3, 4, 4, 4, 4, 8, ...: suffix.ORDERS' lengths; the copy is longer
    assert lengths[:12] == list(range(3, 15)), lengths
    assert all(d.tokens[:3] == list(range(100 + m, 103 + m)) for d, m in zip(drafts, lengths))


def test_a_match_that_takes_up_a_copy_after_its_slot_is_a_reentry():
    mem = Memory()
    template = list(range(100, 160))
    mem.add(template)
    # the copy breaks at a slot (two other tokens for 110, 111) and takes the text up again
    slot = [*template[:10], 7, 8, *template[12:30]]
    drafts = _follow(mem, [1, 2, *slot], 4)  # from 2 copied tokens on
    at = {len(d.tokens) and d.tokens[0]: d for d in drafts}
    assert not at[102].reentry and not at[110].reentry  # the first copy, and its wrong guess
    assert at[114].reentry and at[114].match_len == 2  # 112, 113 match again: 114 follows
    assert at[120].reentry  # ... and stays one while it holds
    # elsewhere: a 2-token match of the same text far from where a copy broke is not
    jump = [*template[:10], 7, 8, 9, *template[40:50]]
    far = {len(d.tokens) and d.tokens[0]: d for d in _follow(mem, [1, 2, *jump], 4)}
    assert 142 in far and not far[142].reentry


def test_reentries_are_weighed_apart_from_other_young_matches():
    """Numpy toy: the target writes 0, 1, 2, ...; every 40 tokens a copy of source text A
    holds 8 tokens and breaks, a re-entry into A 3 tokens on holds 12, and a 2-token
    match from elsewhere (text B) is wrong from its first token."""
    model = MemoryModel()
    context = list(range(2000))
    model.reset(0)
    for seg in range(40):
        p = 40 * seg
        wrong = [-5] * 8
        model.offer(p, context[p:p + 8] + wrong, [1] * 16, 16, (1, 1000 + p))
        model.settle(context[:p + 9])  # it broke at p + 8
        model.offer(p + 11, context[p + 11:p + 23], [1] * 12, 2, (1, 1000 + p + 11))
        model.settle(context[:p + 23])
        model.offer(p + 25, wrong, [1] * 8, 2, (2, 50 * seg))
        model.settle(context[:p + 26])
    young = MemoryModel.bins(2, [1] * 4)
    assert model.rates(MemoryModel.bins(2, [1] * 4, reentry=True))[0] > 0.9
    assert model.rates(young)[0] < 0.1
