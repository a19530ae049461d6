"""Engine logic against a deterministic fake backend (tests/fakes.py): speculative
output equals plain output, batching, stats, stop conditions, KV bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import (
    FakeModel,
    GarbageDrafter,
    Interrupted,
    OverlongDrafter,
    PerfectDrafter,
    chi2_pvalue,
    mixed_next,
    periodic_next,
    token_text,
    tv_distance,
)

import localspec.core.engine as engine_mod
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters import Draft, NgramDrafter, NoDrafter
from localspec.core.drafters.base import DrafterBase
from localspec.core.drafters.draft_model import ModelDrafter
from localspec.core.engine import Done, Round, StopMatcher, Token, collect, generate
from localspec.core.errors import ContextFull
from localspec.core.sampling import sample

PROMPT = [11, 4, 27, 4, 9]


def run(model, drafter, prompt=PROMPT, **kw):
    """All events, plus collect()'s (ids, text, stats)."""
    events = list(generate(model, prompt, drafter, **kw))
    ids, text, stats = collect(iter(events))
    return events, ids, text, stats


def rounds_of(events):
    return [e for e in events if isinstance(e, Round)]


def tokens_of(events):
    return [e for e in events if isinstance(e, Token)]


def drafters_for(model):
    """Every kind of drafter the engine must be lossless with."""
    def mostly_right(ctx, n_vocab):  # agrees with the target at 3 positions out of 4
        nxt = model.next_fn(ctx, n_vocab)
        return nxt if len(ctx) % 4 else (nxt + 1) % n_vocab

    draft_model = FakeModel(n_vocab=model.n_vocab, n_ctx=model.n_ctx, next_fn=mostly_right)
    return {
        "none": NoDrafter(),
        "ngram": NgramDrafter(),
        "perfect": PerfectDrafter(model),
        "garbage": GarbageDrafter(model),
        "overlong": OverlongDrafter(model),
        "model": ModelDrafter(draft_model, SamplingConfig()),
    }


DRAFTERS = ["none", "ngram", "perfect", "garbage", "overlong", "model"]


def check_cache(model, prompt, ids, exact=True):
    """The KV bookkeeping matches the cells, holds only true tokens, and covers every
    context token but the last (exactly that, when `exact`)."""
    assert model.cells == model.cached
    truth = list(prompt) + model.continuation(prompt, len(ids) + 64)
    assert model.cached == truth[: model.n_past]
    if exact:
        assert model.cached == list(prompt) + ids[:-1]
    else:
        assert model.n_past >= len(prompt) + len(ids) - 1


# ----- losslessness (greedy) ---------------------------------------------------------


@pytest.mark.parametrize("next_fn", [periodic_next, mixed_next], ids=["periodic", "mixed"])
@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_equals_plain(name, next_fn):
    n = 60
    plain_model = FakeModel(next_fn=next_fn)
    _, plain_ids, plain_text, plain_stats = run(plain_model, NoDrafter(), gen=GenerationConfig(max_tokens=n))
    assert plain_ids == plain_model.continuation(PROMPT, n)
    assert plain_text == "".join(token_text(t) for t in plain_ids)
    assert plain_stats.rounds == n - 1 and plain_stats.drafted == 0

    model = FakeModel(next_fn=next_fn)
    _events, ids, text, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=n))
    assert ids == plain_ids
    assert text == plain_text
    assert stats.generated == n and stats.stop_reason == "length"
    check_cache(model, PROMPT, ids)


@pytest.mark.parametrize("name", DRAFTERS)
def test_batching_one_decode_per_round(name):
    model = FakeModel(next_fn=mixed_next)
    events, _ids, _, _stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=50))
    rounds = rounds_of(events)
    # one prefill of the whole prompt, then exactly one target decode per round of
    # [id_last, *draft] with logits for every row
    assert model.calls[0] == ("prefill", len(PROMPT))
    assert [kind for kind, _ in model.calls[1:]] == ["decode"] * len(rounds)
    assert model.decode_sizes == [1 + r.n_draft for r in rounds]
    if name == "none":
        assert set(model.decode_sizes) == {1}


def test_perfect_drafter_full_acceptance_and_fewer_rounds():
    n = 80
    plain = FakeModel()
    _, _, _, plain_stats = run(plain, NoDrafter(), gen=GenerationConfig(max_tokens=n))
    model = FakeModel()
    events, _ids, _, stats = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=n))
    assert stats.drafted > 0
    assert stats.accepted == stats.drafted
    assert stats.acceptance == 1.0
    assert stats.acceptance_by_pos() == [1.0] * len(stats.drafted_by_pos)
    assert stats.rounds < plain_stats.rounds / 4
    assert max(model.decode_sizes) > 8  # it really verified big batches
    assert all(r.n_accept == r.n_draft for r in rounds_of(events))


def test_garbage_drafter_zero_acceptance_still_correct():
    n = 40
    model = FakeModel(next_fn=mixed_next)
    events, ids, _, stats = run(model, GarbageDrafter(model), gen=GenerationConfig(max_tokens=n))
    assert ids == FakeModel(next_fn=mixed_next).continuation(PROMPT, n)
    assert stats.drafted > 0 and stats.accepted == 0 and stats.acceptance == 0.0
    assert stats.rounds == n - 1  # one (correction) token per round, like plain decoding
    assert not any(t.from_draft for t in tokens_of(events))


def test_ngram_drafter_gets_accepts_on_repetitive_target():
    model = FakeModel()  # periodic continuation: prompt lookup should win big
    _, _ids, _, stats = run(model, NgramDrafter(), gen=GenerationConfig(max_tokens=60))
    assert stats.accepted > 30
    assert stats.rounds < 30


def test_spec_mode_none_never_drafts():
    model = FakeModel()
    drafter = PerfectDrafter(model)
    _events, ids, _, stats = run(model, drafter, spec=SpecConfig(mode="none"), gen=GenerationConfig(max_tokens=20))
    assert ids == model.continuation(PROMPT, 20)
    assert stats.drafted == 0 and drafter.calls == 0
    assert set(model.decode_sizes) == {1}


def test_draft_shorter_than_draft_min_is_dropped():
    class Short(DrafterBase):
        name = "short"

        def begin(self, prompt):
            pass

        def draft(self, context, k):
            return Draft(tokens=model.continuation(context, 2), source="short")

    model = FakeModel()
    events, ids, _, stats = run(model, Short(), spec=SpecConfig(draft_min=3), gen=GenerationConfig(max_tokens=20))
    assert ids == model.continuation(PROMPT, 20)
    assert stats.drafted == 0
    assert all(r.n_draft == 0 for r in rounds_of(events))


def test_k_respects_draft_max_and_adapts():
    model = FakeModel()
    spec = SpecConfig(draft_max=12)
    events, _, _, _ = run(model, OverlongDrafter(model), spec=spec, gen=GenerationConfig(max_tokens=200))
    rounds = rounds_of(events)
    assert all(r.n_draft <= r.k <= 12 for r in rounds)
    assert rounds[0].k == 8  # adaptive: starts at min(draft_max, 8) ...
    assert rounds[1].k == 12  # ... and grows after a fully accepted round
    model = FakeModel()
    events, _, _, _ = run(
        model, OverlongDrafter(model), spec=SpecConfig(draft_max=5, adaptive=False), gen=GenerationConfig(max_tokens=50)
    )
    assert {r.k for r in rounds_of(events)[:-1]} == {5}


# ----- stats and event flags -----------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
def test_stats_consistent_with_events(name):
    model = FakeModel(next_fn=mixed_next)
    events, ids, _, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=70))
    rounds = rounds_of(events)
    assert isinstance(events[-1], Done) and sum(isinstance(e, Done) for e in events) == 1
    assert stats.prompt_tokens == len(PROMPT) and stats.prefill_tokens == len(PROMPT)
    assert stats.generated == len(ids) == 70
    assert stats.rounds == len(rounds)
    assert stats.draft_rounds == sum(1 for r in rounds if r.n_draft > 0)
    assert stats.drafted == sum(r.n_draft for r in rounds)
    assert stats.accepted == sum(r.n_accept for r in rounds)
    assert all(0 <= r.n_accept <= r.n_draft for r in rounds)
    # every round yields its accepted tokens plus one; the first token comes from prefill
    assert 1 + sum(r.n_accept + 1 for r in rounds) == len(ids)
    width = max([r.n_draft for r in rounds], default=0)
    assert stats.drafted_by_pos == [sum(1 for r in rounds if r.n_draft > i) for i in range(width)]
    assert stats.accepted_by_pos == [sum(1 for r in rounds if r.n_accept > i) for i in range(width)]
    assert sum(stats.drafted_by_pos) == stats.drafted and sum(stats.accepted_by_pos) == stats.accepted
    assert stats.tokens_per_round == pytest.approx(stats.generated / stats.rounds)
    d = stats.to_dict()
    assert d["acceptance"] == stats.acceptance and d["generated"] == 70
    assert stats.drafter == drafters_for(model)[name].name


@pytest.mark.parametrize("name", DRAFTERS)
def test_from_draft_flags(name):
    model = FakeModel(next_fn=mixed_next)
    events, _ids, _, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=70))
    assert isinstance(events[0], Token) and not events[0].from_draft  # from the prefill
    flags = []
    expect = []
    pending: list[bool] = []
    for ev in events[1:]:
        if isinstance(ev, Round):
            assert not pending, "a round started before the last one's tokens were emitted"
            pending = [True] * ev.n_accept + [False]
        elif isinstance(ev, Token):
            flags.append(ev.from_draft)
            expect.append(pending.pop(0))
    assert flags == expect
    assert sum(flags) == stats.accepted


def varied_logits(ctx) -> np.ndarray:
    """mixed_next's argmax on top of a row that differs with every context (so another
    position's row gives another logprob), margin varying too."""
    rng = np.random.default_rng(ctx[-1] * 1000 + len(ctx))
    row = rng.normal(size=50).astype(np.float32)
    row[mixed_next(ctx)] += 5.0 + 3.0 * rng.random()
    return row


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, seed=3)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["none", "ngram", "perfect", "garbage"])
def test_logprobs_come_from_the_row_that_checked_each_token(name, sampling):
    model = FakeModel(next_fn=mixed_next, logits_fn=varied_logits)
    gen = GenerationConfig(max_tokens=60, logprobs=3)
    events, ids, _, stats = run(model, drafters_for(model)[name], sampling=sampling, gen=gen)
    tokens = tokens_of(events)
    assert len(tokens) == len(ids) == 60
    if name in ("ngram", "perfect"):
        assert any(t.from_draft for t in tokens) and stats.accepted > 0
    ctx = list(PROMPT)
    for t in tokens:
        row = model.logits_fn(ctx).astype(np.float64)
        ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))  # log-softmax, raw
        assert t.logprob.token == t.id and t.logprob.logprob == pytest.approx(ref[t.id], abs=1e-6)
        top = np.argsort(-ref)[:3]
        assert [i for i, _ in t.logprob.top] == list(top)
        assert [lp for _, lp in t.logprob.top] == pytest.approx(ref[top], abs=1e-6)  # float32 sums
        ctx.append(t.id)
    if sampling.greedy:  # the greedy token is the top one
        assert all(t.logprob.top[0] == (t.id, t.logprob.logprob) for t in tokens)
    # not asked: not computed
    plain, plain_ids, _, _ = run(FakeModel(next_fn=mixed_next, logits_fn=varied_logits), NoDrafter(),
                                 sampling=sampling, gen=GenerationConfig(max_tokens=60))
    assert all(t.logprob is None for t in tokens_of(plain)) and len(plain_ids) == 60
    if sampling.greedy or name == "none":  # asking for logprobs changes nothing else
        assert plain_ids == ids


# ----- stopping -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("name", ["none", "perfect", "overlong", "ngram"])
def test_max_tokens_exact(name, n):
    model = FakeModel()
    events, ids, _, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=n))
    assert len(ids) == n == stats.generated
    assert ids == model.continuation(PROMPT, n)
    assert stats.stop_reason == "length"
    # never verified more than needed: the last round could not overshoot -n
    assert all(r.n_draft <= max(0, n - 2) for r in rounds_of(events))
    check_cache(model, PROMPT, ids)


@pytest.mark.parametrize("name", DRAFTERS)
def test_eos_stops_and_is_not_emitted(name):
    truth = FakeModel(next_fn=mixed_next).continuation(PROMPT, 40)
    eos = truth[9]
    cut = truth.index(eos)
    model = FakeModel(next_fn=mixed_next, eos=eos)
    _events, ids, text, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=100))
    assert ids == truth[:cut]
    assert eos not in ids
    assert stats.stop_reason == "eos"
    assert stats.generated == cut
    assert text == "".join(token_text(t) for t in ids)
    check_cache(model, PROMPT, ids, exact=False)


def test_eos_from_plain_round_leaves_exact_cache():
    truth = FakeModel(next_fn=mixed_next).continuation(PROMPT, 40)
    eos = truth[9]
    model = FakeModel(next_fn=mixed_next, eos=eos)
    _, ids, _, _ = run(model, NoDrafter(), gen=GenerationConfig(max_tokens=100))
    # the EOS is the uncached last token: the cache holds prompt + every emitted token
    assert model.cached == PROMPT + ids


def test_eos_inside_an_accepted_draft():
    # the first round drafts 8 tokens, all accepted; the EOS is the 3rd of them
    truth = FakeModel(next_fn=mixed_next).continuation(PROMPT, 12)
    eos = truth[3]
    assert eos not in truth[:3]
    model = FakeModel(next_fn=mixed_next, eos=eos)
    events, ids, _, stats = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=100))
    assert rounds_of(events)[0].n_draft == 8 and rounds_of(events)[0].n_accept == 8
    assert ids == truth[:3]
    assert stats.stop_reason == "eos" and stats.generated == 3
    assert [t.from_draft for t in tokens_of(events)] == [False, True, True]
    assert isinstance(events[-1], Done)
    check_cache(model, PROMPT, ids, exact=False)


def test_stop_string_inside_an_accepted_draft():
    truth = FakeModel().continuation(PROMPT, 12)
    full = "".join(token_text(t) for t in truth)
    stop = token_text(truth[3])  # completed by the 3rd drafted token
    assert full.find(stop) == sum(len(token_text(t)) for t in truth[:3])
    model = FakeModel()
    _events, ids, text, stats = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=100, stop=(stop,)))
    assert ids == truth[:4]
    assert text == full[: full.find(stop)]
    assert stats.stop_reason == "stop" and stats.generated == 4
    check_cache(model, PROMPT, ids, exact=False)


def test_eos_as_first_token():
    first = FakeModel().continuation(PROMPT, 1)[0]
    model = FakeModel(eos=first)
    events, ids, text, stats = run(model, PerfectDrafter(model))
    assert ids == [] and text == ""
    assert stats.stop_reason == "eos" and stats.rounds == 0 and stats.generated == 0
    assert len(events) == 1 and isinstance(events[0], Done)
    assert model.cached == PROMPT


def test_ignore_eos_keeps_going():
    truth = FakeModel().continuation(PROMPT, 30)
    model = FakeModel(eos=truth[3])
    _, ids, _, stats = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=30, ignore_eos=True))
    assert ids == truth
    assert stats.stop_reason == "length"


def test_stop_matcher_spanning_tokens():
    m = StopMatcher(["lo W"])
    assert m.feed("Hel") == ("He", False)  # "l" could start the stop string
    assert m.feed("lo") == ("l", False)  # "lo" held
    assert m.feed(" Wor") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_releases_false_starts():
    m = StopMatcher(["abc"])
    assert m.feed("xa") == ("x", False)
    assert m.feed("b") == ("", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("a") == ("", False)
    assert m.flush() == "a"
    assert m.flush() == ""


def test_stop_matcher_overlapping_prefix():
    m = StopMatcher(["aab"])
    assert m.feed("aa") == ("", False)
    assert m.feed("ab") == ("a", True)  # "aaab": the stop starts at the second a


def test_stop_matcher_earliest_of_several_and_inside_one_piece():
    m = StopMatcher(["END", "", "##"])
    assert m.feed("abc##xEND") == ("abc", True)
    m = StopMatcher(["XYZ", "Y"])
    assert m.feed("aXY") == ("aX", True)


def test_stop_matcher_without_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    m = StopMatcher([""])
    assert m.feed("a") == ("a", False) and m.flush() == ""


@pytest.mark.parametrize("name", DRAFTERS)
def test_stop_string_spanning_tokens_through_generate(name):
    truth = FakeModel(next_fn=mixed_next).continuation(PROMPT, 60)
    full = "".join(token_text(t) for t in truth)
    a, b = truth[11], truth[12]
    stop = token_text(a)[1:] + token_text(b)[:2]  # e.g. "19;t3": spans two tokens
    pos = full.find(stop)
    assert pos >= 0
    # the token that completes the first occurrence of the stop string
    ends = np.cumsum([len(token_text(t)) for t in truth])
    last = int(np.searchsorted(ends, pos + len(stop)))
    model = FakeModel(next_fn=mixed_next)
    events, ids, text, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=60, stop=(stop,)))
    assert stats.stop_reason == "stop"
    assert text == full[:pos]
    assert stop not in text
    assert ids == truth[: last + 1]
    assert events[-1].text == ""
    check_cache(model, PROMPT, ids, exact=False)


def test_held_back_text_is_released_at_the_end():
    # every token text ends with ";", a prefix of the stop string ";Z": the engine
    # must hold each ";" back and release it later (and the last one in Done.text)
    model = FakeModel()
    events, ids, text, stats = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=12, stop=(";Z",)))
    assert stats.stop_reason == "length"
    assert text == "".join(token_text(t) for t in ids)
    assert events[-1].text == ";"
    assert all(not t.text.endswith(";") for t in tokens_of(events))


def test_split_utf8_character_across_tokens():
    truth = FakeModel().continuation(PROMPT, 10)
    a, b = truth[2], truth[3]
    assert a != b and a not in truth[:2] and b not in truth[:3]
    texts = {a: b"x\xc3", b: b"\xa9y"}  # "é" split over two tokens
    model = FakeModel(texts=texts)
    _events, _ids, text, _ = run(model, PerfectDrafter(model), gen=GenerationConfig(max_tokens=10))
    assert "\ufffd" not in text
    assert "xéy" in text
    model = FakeModel(texts=texts)
    _, _, text, stats = run(model, NoDrafter(), gen=GenerationConfig(max_tokens=10, stop=("é",)))
    assert stats.stop_reason == "stop" and text.endswith("x") and "\ufffd" not in text


# ----- context limits -------------------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("max_tokens", [0, 100])
def test_context_full_ends_cleanly(name, max_tokens):
    n_ctx = 30
    model = FakeModel(n_ctx=n_ctx)
    _events, ids, _, stats = run(model, drafters_for(model)[name], gen=GenerationConfig(max_tokens=max_tokens))
    assert stats.stop_reason == "context"
    # the cache is full and the last token (never decoded) is still emitted
    assert len(ids) == n_ctx + 1 - len(PROMPT)
    assert ids == FakeModel().continuation(PROMPT, len(ids))
    assert model.n_past == n_ctx
    check_cache(model, PROMPT, ids)


def test_prompt_one_short_of_context():
    prompt = list(range(1, 10))
    model = FakeModel(n_ctx=10)
    _, ids, _, stats = run(model, NgramDrafter(), prompt=prompt)
    assert stats.stop_reason == "context" and len(ids) == 2


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_prompt_too_long_raises_context_full(extra):
    model = FakeModel(n_ctx=10)
    gen = generate(model, list(range(10 + extra)), NoDrafter())
    with pytest.raises(ContextFull):
        next(gen)
    assert model.cached == [] and model.calls == []


def test_empty_prompt_rejected():
    with pytest.raises(ValueError):
        next(generate(FakeModel(), [], NoDrafter()))


# ----- cancellation, early close, interrupted decode ----------------------------------


@pytest.mark.parametrize("name", ["none", "perfect", "ngram"])
def test_should_stop_cancels(name):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 3

    model = FakeModel()
    events, ids, _, stats = run(model, drafters_for(model)[name], should_stop=should_stop,
                                gen=GenerationConfig(max_tokens=1000))
    assert stats.stop_reason == "cancelled"
    assert stats.rounds == 3
    assert isinstance(events[-1], Done)
    assert ids == model.continuation(PROMPT, len(ids))
    check_cache(model, PROMPT, ids)


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("after", [1, 3, 7])
def test_consumer_closes_generator_early(name, after):
    model = FakeModel(next_fn=mixed_next)
    gen = generate(model, PROMPT, drafters_for(model)[name], gen=GenerationConfig(max_tokens=200))
    ids = []
    for ev in gen:
        if isinstance(ev, Token):
            ids.append(ev.id)
            if len(ids) == after:
                break
    gen.close()
    # only whole rounds are in the cache: everything emitted but the last token, plus
    # any accepted tokens of the current round not yet handed out
    check_cache(model, PROMPT, ids, exact=(name in ("none", "garbage")))
    # the fake can serve another generation that reuses the cached prefix
    prompt2 = PROMPT + ids
    _, ids2, _, stats2 = run(model, NoDrafter(), prompt=prompt2, gen=GenerationConfig(max_tokens=5))
    assert ids2 == FakeModel(next_fn=mixed_next).continuation(prompt2, 5)
    assert stats2.prefill_tokens <= 1


def test_close_right_after_round_event():
    model = FakeModel()
    gen = generate(model, PROMPT, PerfectDrafter(model), gen=GenerationConfig(max_tokens=200))
    assert isinstance(next(gen), Token)
    rnd = next(gen)
    assert isinstance(rnd, Round) and rnd.n_accept == rnd.n_draft > 0
    gen.close()
    assert model.cells == model.cached
    assert model.cached == PROMPT + model.continuation(PROMPT, 1 + rnd.n_accept)


@pytest.mark.parametrize("nth", [0, 1, 4])
def test_interrupted_decode_leaves_consistent_cache(nth):
    model = FakeModel()
    drafter = PerfectDrafter(model)
    model.interrupt_on_decode = nth  # 0: inside the prefill; n: inside round n's verify
    with pytest.raises(Interrupted):
        collect(generate(model, PROMPT, drafter, gen=GenerationConfig(max_tokens=200)))
    assert model.interrupt_on_decode is None  # it did fire
    # the batch was written to the cells but not to the bookkeeping: the engine's
    # finally must drop those cells
    assert model.cells == model.cached
    assert model.cached == (PROMPT + model.continuation(PROMPT, 300))[: model.n_past]


def test_second_generation_reuses_prefix():
    model = FakeModel()
    _, ids, _, _ = run(model, NgramDrafter(), gen=GenerationConfig(max_tokens=20))
    prompt2 = PROMPT + ids + [3, 1]
    _, ids2, _, stats2 = run(model, NgramDrafter(), prompt=prompt2, gen=GenerationConfig(max_tokens=20))
    assert stats2.prefill_tokens == 3  # the last emitted token and the two new ones
    assert ids2 == FakeModel().continuation(prompt2, 20)
    # a shorter, diverging prompt rewinds and re-prefills
    prompt3 = PROMPT[:3] + [0]
    _, ids3, _, stats3 = run(model, NgramDrafter(), prompt=prompt3, gen=GenerationConfig(max_tokens=5))
    assert stats3.prefill_tokens == 1
    assert ids3 == FakeModel().continuation(prompt3, 5)


# ----- sampled mode: same distribution with and without speculation --------------------

SV = 6
# target: next-token distribution depends on the last token (rows differ a lot)
_BASE_P = np.array([0.45, 0.25, 0.12, 0.08, 0.06, 0.04])
TARGET_P = np.array([np.roll(_BASE_P, 2 * t + 1) for t in range(SV)])
# draft model: a different (wrong-ish) distribution, so speculation both hits and misses
_BASE_Q = np.array([0.20, 0.35, 0.15, 0.10, 0.10, 0.10])
DRAFT_Q = np.array([np.roll(_BASE_Q, t) for t in range(SV)])
SCFG = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
S_PROMPT = [0, 3, 2]
N_SEEDS = 1000
N_TOK = 3


def stochastic_target(n_ctx=64):
    return FakeModel(n_vocab=SV, n_ctx=n_ctx, logits_fn=lambda ctx: np.log(TARGET_P[ctx[-1]]))


def stochastic_draft():
    return FakeModel(n_vocab=SV, n_ctx=64, logits_fn=lambda ctx: np.log(DRAFT_Q[ctx[-1]]))


def exact_joint():
    """P(t1, t2, t3) under the target."""
    p1 = TARGET_P[S_PROMPT[-1]]
    return p1[:, None, None] * TARGET_P[:, :, None] * TARGET_P[None, :, :]


def sampled_counts(make_drafter, n_seeds=N_SEEDS):
    counts = np.zeros((SV,) * N_TOK, dtype=np.int64)
    target = stochastic_target()
    n_drafted = 0
    for seed in range(n_seeds):
        sampling = SamplingConfig(seed=seed, **SCFG)
        _, ids, _, stats = run(
            target, make_drafter(target, sampling), prompt=S_PROMPT, sampling=sampling,
            gen=GenerationConfig(max_tokens=N_TOK + 1),  # +1: the first round drafts N_TOK - 1
        )
        assert len(ids) == N_TOK + 1
        counts[tuple(ids[:N_TOK])] += 1
        n_drafted += stats.drafted
        assert target.cells == target.cached
    return counts, n_drafted


class ArgmaxChainDrafter(DrafterBase):
    """Deterministic (q=None) draft: the target's most likely continuation."""

    name = "argmax"

    def begin(self, prompt):
        pass

    def draft(self, context, k):
        out, last = [], context[-1]
        for _ in range(k):
            last = int(np.argmax(TARGET_P[last]))
            out.append(last)
        return Draft(tokens=out, source=self.name)


SAMPLED_DRAFTERS = {
    "none": lambda target, sampling: NoDrafter(),
    "argmax": lambda target, sampling: ArgmaxChainDrafter(),
    "model": lambda target, sampling: ModelDrafter(stochastic_draft(), sampling),
}


@pytest.mark.parametrize("name", list(SAMPLED_DRAFTERS))
def test_sampled_mode_follows_target_distribution(name):
    counts, n_drafted = sampled_counts(SAMPLED_DRAFTERS[name])
    joint = exact_joint()
    if name != "none":
        assert n_drafted > N_SEEDS  # speculation really happened
    assert chi2_pvalue(counts, joint) > 1e-4
    for axis in range(N_TOK):
        others = tuple(a for a in range(N_TOK) if a != axis)
        assert tv_distance(counts.sum(axis=others), joint.sum(axis=others)) < 0.06


def test_sampled_mode_check_catches_a_broken_accept_rule(monkeypatch):
    def always_accept(draft, p, q, rng):
        return len(draft), sample(p[len(draft)], rng)

    monkeypatch.setattr(engine_mod, "accept_stochastic", always_accept)
    counts, _ = sampled_counts(SAMPLED_DRAFTERS["model"], n_seeds=600)
    assert chi2_pvalue(counts, exact_joint()) < 1e-6


def test_sampled_mode_is_reproducible_with_a_seed():
    sampling = SamplingConfig(seed=1234, **SCFG)
    outs = []
    for _ in range(2):
        target = stochastic_target()
        _, ids, _, _ = run(target, ModelDrafter(stochastic_draft(), sampling), prompt=S_PROMPT,
                           sampling=sampling, gen=GenerationConfig(max_tokens=30))
        outs.append(ids)
    assert outs[0] == outs[1]


class _WhimDrafter(ArgmaxChainDrafter):
    """A deterministic draft of a length that varies by whim (as auto's does with timing)."""

    def __init__(self, whim: int) -> None:
        self.lengths = np.random.default_rng(whim)

    def draft(self, context, k):
        return super().draft(context, int(self.lengths.integers(0, k + 1)))


def test_a_seeded_sample_is_the_same_whatever_a_deterministic_drafter_drafted():
    """One draw a position, as plain decoding: the drafting cannot move the output."""
    sampling = SamplingConfig(seed=99, **SCFG)
    gen = GenerationConfig(max_tokens=40)
    _, plain, _, _ = run(stochastic_target(), NoDrafter(), prompt=S_PROMPT, sampling=sampling, gen=gen)
    drafted = 0
    for whim in range(4):
        _, ids, _, stats = run(stochastic_target(), _WhimDrafter(whim), prompt=S_PROMPT, sampling=sampling,
                               gen=gen, spec=SpecConfig(mode="ngram", draft_max=6))
        assert ids == plain, whim
        drafted += stats.drafted
    assert drafted > 40 and len(set(plain)) > 2  # it drafted, and the output is a real sample


@pytest.mark.parametrize("nth", [0, 1, 3])  # 0: the draft model's prefill; then drafting
def test_interrupted_draft_decode_repairs_the_draft_model(nth):
    model = FakeModel(next_fn=mixed_next)
    draft_model = FakeModel(next_fn=mixed_next)
    draft_model.interrupt_on_decode = nth
    with pytest.raises(Interrupted):
        run(model, ModelDrafter(draft_model, SamplingConfig()), spec=SpecConfig(mode="model"),
            gen=GenerationConfig(max_tokens=100), draft_model=draft_model)
    assert draft_model.interrupt_on_decode is None  # it did fire
    assert draft_model.cells == draft_model.cached
    assert model.cells == model.cached
    # the draft model serves the next generation (its decode checks cells == record)
    _, ids, _, stats = run(model, ModelDrafter(draft_model, SamplingConfig()), spec=SpecConfig(mode="model"),
                           gen=GenerationConfig(max_tokens=30), draft_model=draft_model)
    assert ids == model.continuation(PROMPT, 30) and stats.accepted > 0


def test_auto_chooses_k_without_adaptive_cap():
    # auto's policy picks k itself, up to draft_max: AdaptiveK must neither start it at
    # 8 nor shrink it after rejections, whatever SpecConfig.adaptive says
    class Asked(DrafterBase):
        name = "auto"

        def __init__(self):
            self.ks = []

        def begin(self, prompt):
            pass

        def draft(self, context, k):
            self.ks.append(k)
            return Draft(tokens=[(t + 1) % model.n_vocab for t in model.continuation(context, k)],
                         source="ngram")

    for adaptive in (True, False):
        model = FakeModel()
        asked = Asked()
        run(model, asked, spec=SpecConfig(mode="auto", draft_max=16, adaptive=adaptive),
            gen=GenerationConfig(max_tokens=40))
        assert asked.ks[:20] == [16] * 20  # every round rejected, k still draft_max
