"""llama-server's n-gram drafters as the replay re-implements them: what they propose on
small contexts, worked out by hand from llama.cpp's rules."""

from localspec.bench.llamacpp_policies import NgramMod, NgramSimple
from localspec.bench.replay import oracle, replay


def _simple(context, size_n=3, size_m=4):
    d = NgramSimple(size_n, size_m)
    d.begin(context)
    return d.draft(context, 64).tokens


def test_ngram_simple_copies_after_the_most_recent_earlier_match():
    # the last 3 tokens (7 8 9) occur at 2 and at 12; the later one wins
    context = [1, 2, 7, 8, 9, 10, 11, 12, 13, 14, 3, 4, 7, 8, 9, 20, 21, 22, 23, 24, 25, 7, 8, 9]
    assert _simple(context) == [20, 21, 22, 23]


def test_ngram_simple_caps_at_size_m_and_needs_size_n_tokens_after_the_match():
    context = [5, 6, 1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47, 1, 2, 3]
    assert _simple(context, size_m=6) == [40, 41, 42, 43, 44, 45]
    assert _simple(context, size_m=2) == []  # a draft shorter than size_n is not made
    # no earlier occurrence of the last n-gram: nothing
    assert _simple([*range(30), 99, 98, 97]) == []


def test_ngram_mod_drafts_only_a_chain_of_at_least_n_min():
    source = list(range(100, 140))
    context = [*source, 1, 2, *source[:4]]  # 6 tokens past the prompt: not in the table yet
    capped = NgramMod(n_match=4, n_min=8, n_max=16)
    capped.begin(source)
    assert capped.draft(context, 64).tokens == source[4:20]
    whole = NgramMod(n_match=4, n_min=8, n_max=48)  # the chain ends with the prompt's n-grams
    whole.begin(source)
    assert whole.draft(context, 64).tokens == source[4:]
    short = NgramMod(n_match=4, n_min=40, n_max=48)  # 36 tokens chained: below n_min
    short.begin(source)
    assert short.draft(context, 64).tokens == []


def test_ngram_mod_resets_after_five_rounds_that_accept_under_a_quarter():
    source = list(range(100, 140))
    context = [*source, 1, *source[:4]]
    d = NgramMod(n_match=4, n_min=8, n_max=16)
    d.begin(context)
    for _ in range(4):
        assert d.draft(context, 64).tokens
        d.observe(16, 1, 1.0, 0.0)
    assert d.draft(context, 64).tokens
    d.observe(16, 1, 1.0, 0.0)  # the fifth: the table is emptied ...
    assert d._table == {}
    assert d.draft(context, 64).tokens == source[4:20]  # ... and refilled from the context


def test_the_replayed_llama_server_policies_never_beat_the_perfect_drafter():
    # a copy-heavy output: the prompt's 200 tokens repeated with one change every 50
    prompt = [1000 + (i * 7) % 50 + 50 * (i // 50) for i in range(200)]
    ids = [t if i % 50 else 7 for i, t in enumerate(prompt)]
    trace = {"prompt": prompt, "ids": ids}
    v = [1.0 + 0.1 * n for n in range(400)]
    from localspec.core.drafters.base import NoDrafter

    plain = replay(trace, NoDrafter(), v, 0.0, 1, False)
    best = plain / oracle(trace, None, v, 256, perfect=True)
    for d in (NgramSimple(12, 48), NgramMod(n_match=8, n_min=16, n_max=64)):
        speedup = plain / replay(trace, d, v, 0.0, 256, False)
        assert 1.5 < speedup <= best
