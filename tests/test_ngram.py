"""NgramDrafter (prompt lookup): matching rules, the `extra` source, incremental index
sync and re-indexing. Pure Python."""

from __future__ import annotations

import random

import pytest

from localspec.bench import random_edits
from localspec.core.drafters import Draft, HybridDrafter, NgramDrafter, NoDrafter


def fresh(prompt, **kw) -> NgramDrafter:
    d = NgramDrafter(**kw)
    d.begin(prompt)
    return d


def brute_force(context, k, ngram_min, ngram_max, extra=()):
    """Reference: for n from ngram_max down to ngram_min, the most recent earlier
    occurrence of the context's n-suffix that has at least one token after it, searched
    in the context first and then in `extra`; the draft is what follows (up to k). A
    copy of the context that reaches its end where the context ends in three periods of
    a loop (the last period's tokens repeat the two before them) goes on repeating it."""
    context, extra = list(context), list(extra)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n > len(context):
            continue
        suffix = context[-n:]
        for src, limit in ((context, len(context) - 1), (extra, len(extra) - 1)):
            # occurrence ending at e (exclusive) with src[e] existing: e <= limit
            for e in range(limit, n - 1, -1):
                if src[e - n : e] == suffix:
                    period = len(context) - e
                    looped = (src is context and k > period and len(context) >= 3 * period
                              and context[-3 * period:] == context[-period:] * 3)
                    if looped:
                        return (context[e:] * k)[:k], n
                    return src[e : e + k], n
    return [], 0


def test_no_match_gives_empty_draft():
    d = fresh([1, 2, 3, 4])
    out = d.draft([1, 2, 3, 4], 5)
    assert out.tokens == [] and out.match_len == 0 and out.source == "ngram"
    assert isinstance(out, Draft)


def test_single_token_match_copies_what_followed():
    ctx = [5, 6, 7, 8, 5]
    out = fresh(ctx).draft(ctx, 3)
    assert out.tokens == [6, 7, 8] and out.match_len == 1


def test_longest_match_preferred_over_shorter_and_more_recent():
    # suffix [1, 2, 3]: "3" alone occurs most recently at index 6 (followed by 50),
    # but the 3-gram [1, 2, 3] occurs at 0..2 (followed by 10, 11)
    ctx = [1, 2, 3, 10, 11, 9, 3, 50, 51, 1, 2, 3]
    out = fresh(ctx).draft(ctx, 2)
    assert out.tokens == [10, 11]
    assert out.match_len == 3
    # with ngram_max=1 only the 1-gram is considered: most recent "3" -> 50, 51
    assert fresh(ctx, ngram_max=1).draft(ctx, 2).tokens == [50, 51]


def test_most_recent_occurrence_wins():
    ctx = [7, 8, 1, 7, 8, 2, 7, 8, 3, 0, 7, 8]
    out = fresh(ctx).draft(ctx, 2)
    assert out.tokens == [3, 0] and out.match_len == 2


def test_draft_limited_to_k():
    ctx = list(range(20)) + [0]
    d = fresh(ctx)
    for k in (1, 2, 5, 19):
        assert d.draft(ctx, k).tokens == list(range(1, k + 1))
    # more than what follows the match: stops at the end of the context
    assert d.draft(ctx, 100).tokens == list(range(1, 20)) + [0]


@pytest.mark.parametrize("k", [0, -3])
def test_non_positive_k_gives_empty_draft(k):
    ctx = [1, 2, 1]
    assert fresh(ctx).draft(ctx, k).tokens == []


def test_ngram_min_respected():
    ctx = [4, 9, 9, 5, 9]  # only a 1-gram match ("9", most recently at index 2)
    assert fresh(ctx, ngram_min=1).draft(ctx, 3).tokens == [5, 9]
    assert fresh(ctx, ngram_min=2, ngram_max=4).draft(ctx, 3).tokens == []
    ctx2 = [4, 9, 1, 2, 4, 9]  # a 2-gram match
    out = fresh(ctx2, ngram_min=2, ngram_max=4).draft(ctx2, 3)
    assert out.tokens == [1, 2, 4] and out.match_len == 2


def test_ngram_max_bounds_match_len():
    ctx = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    out = fresh(ctx, ngram_max=2).draft(ctx, 1)
    assert out.tokens == [6] and out.match_len == 2
    out = fresh(ctx, ngram_max=5).draft(ctx, 1)
    assert out.match_len == 5


@pytest.mark.parametrize("lo, hi", [(0, 3), (3, 2), (-1, 1)])
def test_bad_sizes_rejected(lo, hi):
    with pytest.raises(ValueError):
        NgramDrafter(ngram_min=lo, ngram_max=hi)


def test_context_shorter_than_ngram_sizes():
    assert fresh([3]).draft([3], 4).tokens == []
    assert fresh([3, 3]).draft([3, 3], 4).tokens == [3]


def test_a_copy_of_a_loop_goes_on_repeating_it():
    # the context ends in three periods of [5, 6, 7]: the copy of the last one reaches
    # the context's end and goes on with the loop, up to k
    ctx = [1, 2, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    out = fresh(ctx).draft(ctx, 8)
    assert out.tokens == [5, 6, 7, 5, 6, 7, 5, 6] and out.match_len == 4
    assert fresh([3, 3, 3]).draft([3, 3, 3], 4).tokens == [3, 3, 3, 3]
    # two periods are not a loop yet, nor is a copy that stops short of the context's end
    two = [1, 2, 5, 6, 7, 5, 6, 7]
    assert fresh(two).draft(two, 8).tokens == [5, 6, 7]
    assert fresh(ctx).draft(ctx, 2).tokens == [5, 6]
    # a copy of `extra` (a file) is not a loop of the context
    assert NgramDrafter(extra=[5, 6, 7], follow=False).draft([9, 5], 8).tokens == [6, 7]


def test_extra_used_when_context_has_no_match():
    extra = [100, 101, 102, 103, 104]
    ctx = [1, 2, 102]
    out = fresh(ctx, extra=extra).draft(ctx, 2)
    assert out.tokens == [103, 104] and out.match_len == 1


def test_context_preferred_over_extra_at_same_size():
    extra = [7, 60, 61]
    ctx = [7, 50, 51, 7]
    assert fresh(ctx, extra=extra).draft(ctx, 2).tokens == [50, 51]


def test_longer_match_in_extra_beats_shorter_in_context():
    extra = [1, 2, 3, 90, 91]
    ctx = [3, 40, 41, 1, 2, 3]
    out = fresh(ctx, extra=extra).draft(ctx, 2)
    assert out.tokens == [90, 91] and out.match_len == 3


def test_extra_last_ngram_has_no_continuation():
    extra = [5, 6]
    ctx = [9, 6]  # "6" occurs in extra only at its very end: nothing to copy
    assert fresh(ctx, extra=extra).draft(ctx, 3).tokens == []


def test_extra_survives_begin():
    extra = [8, 80, 81]
    d = fresh([8], extra=extra)
    assert d.draft([8], 2).tokens == [80, 81]
    d.begin([1, 8])
    assert d.draft([1, 8], 2).tokens == [80, 81]


def test_incremental_sync_after_appending_tokens():
    d = fresh([1, 2, 3])
    ctx = [1, 2, 3]
    assert d.draft(ctx, 4).tokens == []
    ctx += [1, 2]  # appended by the engine (accepted tokens / correction)
    assert d.draft(ctx, 4).tokens == [3, 1, 2]
    ctx += [3, 7]
    assert d.draft(ctx, 4).tokens == []
    ctx += [1, 2, 3]
    out = d.draft(ctx, 4)
    assert out.tokens == [7, 1, 2, 3] and out.match_len == 3
    assert d.ctx.tokens == ctx  # the index follows the context exactly


def test_draft_without_begin_syncs_from_scratch():
    d = NgramDrafter()
    assert d.draft([4, 5, 4], 2).tokens == [5, 4]


def test_reindex_after_rewind_to_shorter_context():
    ctx = [1, 2, 3, 1, 9, 9, 9, 1]
    d = fresh(ctx)
    assert d.draft(ctx, 2).tokens == [9, 9]
    # rewound: the 9s are gone, the latest "1" is followed by 2, 3 again
    short = [1, 2, 3, 1]
    assert d.draft(short, 2).tokens == [2, 3]
    assert d.ctx.tokens == short


def test_reindex_when_last_token_differs():
    ctx = [1, 2, 3, 4, 1]
    d = fresh(ctx)
    assert d.draft(ctx, 2).tokens == [2, 3]
    # same length, different last token: must not keep the old index
    other = [5, 6, 7, 8, 5]
    assert d.draft(other, 2).tokens == [6, 7]
    assert d.ctx.tokens == other
    # longer, but its token at the old end differs: re-indexed, not extended
    longer = [9, 9, 9, 9, 2, 9]
    out = d.draft(longer, 2)
    assert d.ctx.tokens == longer
    assert out.tokens == [2, 9] and out.match_len == 1
    assert (out.tokens, out.match_len) == brute_force(longer, 2, 1, 4)


def test_matches_brute_force_on_random_growing_contexts():
    rnd = random.Random(1234)
    for trial in range(150):
        vocab = rnd.choice([2, 3, 5, 12])
        lo = rnd.randint(1, 3)
        hi = rnd.randint(lo, 5)
        extra = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 15))]
        ctx = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 8))]
        d = NgramDrafter(ngram_min=lo, ngram_max=hi, extra=extra, follow=False)
        d.begin(ctx)
        for _ in range(12):
            k = rnd.randint(0, 6)
            out = d.draft(ctx, k)
            want, n = brute_force(ctx, k, lo, hi, extra) if k > 0 else ([], 0)
            assert out.tokens == want, (trial, ctx, extra, lo, hi, k)
            if want:
                assert out.match_len == n
            ctx = ctx + [rnd.randrange(vocab) for _ in range(rnd.randint(1, 3))]


def test_hybrid_prefers_ngram_then_model():
    class Fixed:
        name = "model"

        def begin(self, prompt):
            self.begun = list(prompt)

        def draft(self, context, k):
            return Draft(tokens=[42] * k, source="model")

    model = Fixed()
    h = HybridDrafter(NgramDrafter(), model)
    h.begin([1, 2, 1])
    assert model.begun == [1, 2, 1]
    found = h.draft([1, 2, 1], 3)
    assert found.tokens == [2, 1] and found.source == "ngram"
    fallback = h.draft([1, 2, 1, 7], 3)
    assert fallback.tokens == [42, 42, 42] and fallback.source == "model"


def test_no_drafter_never_drafts():
    d = NoDrafter()
    d.begin([1, 1, 1])
    assert d.draft([1, 1, 1], 8).tokens == []


def test_run_len_measures_how_long_the_copy_has_held():
    # the suffix [5, 6, 7] matches at most 4 tokens (ngram_max), but the context has
    # agreed with the source for 6 tokens: [3, 4, 5, 6, 7] after a different token
    source = [9, 1, 3, 4, 5, 6, 7, 8, 9, 10]
    ctx = [2, 2, 1, 3, 4, 5, 6, 7]
    out = fresh(ctx, extra=source, ngram_min=2).draft(ctx, 3)
    assert out.tokens == [8, 9, 10] and out.match_len == 4 and out.run_len == 6
    # a match that starts the source: nothing before it to agree with
    assert fresh([5, 1, 2], extra=[1, 2, 3]).draft([5, 1, 2], 1).run_len == 2


# --- following the copy of a given text across the output's changes ------------------

def rename_file(seed: int = 0, n: int = 300, every: int = 9):
    """A 'file' of distinct tokens with the token 7 every `every` positions, and the
    output of renaming it: each 7 becomes 8 (a one-token rename, as `lo` -> `low`)."""
    rng = random.Random(seed)
    src = [rng.randrange(1000, 100000) for _ in range(n)]
    for i in range(0, n, every):
        src[i] = 7
    return src, [8 if t == 7 else t for t in src]


def copy_rounds(d: NgramDrafter, prompt, out, k: int = 64):
    """Decode `out` greedily as a verifier would with `d` drafting k (every accepted
    prefix plus the target's own next token); the accepted length of each round."""
    ctx, accepted = [*prompt, out[0]], []
    while len(ctx) - len(prompt) < len(out):
        done = len(ctx) - len(prompt)
        draft = d.draft(ctx, min(k, len(out) - done))
        a = 0
        while a < len(draft.tokens) and done + a < len(out) and draft.tokens[a] == out[done + a]:
            a += 1
        accepted.append(a)
        ctx += out[done : done + a + 1]
    return accepted


def test_a_learned_rename_is_drafted_through():
    """Once the output has replaced a source token by another SURE (2) times, drafts copy
    the source with it replaced: a dense rename is drafted in long runs, as an unchanged
    copy is. Without following (follow=False) every renamed token breaks the copy."""
    src, out = rename_file()
    prompt = [1, 2, 3]
    follow = copy_rounds(NgramDrafter(3, 12, extra=src), prompt, out)
    plain = copy_rounds(NgramDrafter(3, 12, extra=src, follow=False), prompt, out)
    assert max(plain) < 9  # never past a renamed token
    assert len(follow) < len(plain) / 3
    assert max(follow) >= 60  # a whole k's draft, across 6 renamed tokens


def test_a_copy_resumes_right_after_a_substitution():
    """After the output puts one token in place of a source token and goes on with the
    source, the next draft copies on from there (no waiting for ngram_min new tokens),
    and the copy keeps its age: auto weighs it as the long copy it is, not a new match."""
    src = list(range(100, 140))
    out = src[:10] + [999] + src[11:]
    d = NgramDrafter(3, 12, extra=src)
    prompt = [1, 2]
    d.begin(prompt)
    d.draft([*prompt, *out[:5]], 8)  # a match: the copy is followed from here
    ctx = [*prompt, *out[:12]]  # ..., 999 in place of 110, then 111 as in the source
    resumed = d.draft(ctx, 5)
    assert resumed.tokens == src[12:17]
    assert resumed.run_len == 12  # the copy's age goes on across the substitution
    assert NgramDrafter(3, 12, extra=src, follow=False).draft(ctx, 5).tokens == []


@pytest.mark.parametrize("gap,foretold,young", [(50, False, False), (12, False, True), (12, True, False)],
                         ids=["breaks far apart", "breaks close together", "the second foretold"])
def test_a_copy_left_twice_in_a_short_span_goes_on_as_old_as_its_last_stretch(gap, foretold, young):
    """An output that leaves the copy it follows for other tokens twice within BREAK_SPAN
    (32) tokens, where nothing foretold either, is no rename made once: the copy it goes
    on with is drafted as old as the tokens since the later break, not as its whole run
    (on a CPU where a long verify costs many one-token times, the old age bet long drafts
    on a text that keeps changing). Breaks further apart keep the age, and so does a
    second one at a foretold site (where the draft stopped)."""
    src = list(range(1000, 1200))
    second = 60 + gap
    out = [*src[:60], 7, *src[61:second], 8, *src[second + 1:]]
    d = NgramDrafter(3, 12, extra=src, prediction=src, unsure={second} if foretold else ())
    prompt = [1, *src, 2]
    d.begin(prompt)
    feed(d, prompt, out, second + 6)
    draft = d.draft([*prompt, *out[: second + 6]], 8)
    assert draft.tokens == src[second + 6 : second + 14]
    assert draft.run_len == 6 if young else draft.run_len > gap  # 6: the changed token and 5 after it


def test_a_substitution_seen_once_stops_the_draft_before_it():
    """A token replaced once is no rule (a class renamed in code, its name kept in a
    docstring): a draft stops before its next occurrence, neither copying nor replacing
    it; once the output's last SURE (2) tokens there were the token kept, it is copied
    again."""
    src = []
    for i in range(6):
        src += [*range(100 + 20 * i, 119 + 20 * i), 7]
    sevens = [i for i, t in enumerate(src) if t == 7]
    out = list(src)
    out[sevens[0]] = 8  # renamed once, kept after
    d = NgramDrafter(3, 12, extra=src)
    prompt = [1, 2]
    d.begin(prompt)
    assert d.draft([*prompt, *out[:5]], 8).tokens  # following the copy
    for i in (1, 2):  # replaced, then kept once before the second 7: unsure
        pos = sevens[i - 1] + 3
        assert d.draft([*prompt, *out[:pos]], 64).tokens == src[pos : sevens[i]]
    pos = sevens[2] + 3  # kept the last two times: copied as it is
    assert d.draft([*prompt, *out[:pos]], 40).tokens == src[pos : pos + 40]


def test_a_substitution_the_output_stopped_making_stops_the_draft_at_once():
    """A name renamed in one function (`add(self, item)` made `product` four times) and
    kept in the next (`for item in ...`): after the first place kept, a draft stops
    before the name instead of drafting it renamed (and breaking there) until a count
    over the whole output turns; kept twice in a row, it is copied as it is."""
    src = []
    for i in range(9):
        src += [*range(100 + 20 * i, 119 + 20 * i), 7]
    sevens = [i for i, t in enumerate(src) if t == 7]
    out = list(src)
    for i in range(4):
        out[sevens[i]] = 8
    d = NgramDrafter(3, 12, extra=src)
    prompt = [1, 2]
    d.begin(prompt)
    pos = sevens[3] + 3  # replaced the last two times (four in all): drafted replaced
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 40).tokens[sevens[4] - pos] == 8
    pos = sevens[4] + 3  # ... then kept once: the target decides
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 64).tokens == src[pos : sevens[5]]
    pos = sevens[5] + 3  # ... kept twice in a row: copied as it is
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 40).tokens == src[pos : pos + 40]


def insert_file(seed: int = 0, sites: int = 8, every: int = 20):
    """A 'file' where the pair (5, 6) comes every `every` tokens, and the output of an
    edit that writes 90, 91 between them at every site (a type hint after a parameter)."""
    rng = random.Random(seed)
    src, out = [], []
    for _ in range(sites):
        body = [rng.randrange(1000, 100000) for _ in range(every - 2)]
        src += [*body, 5, 6]
        out += [*body, 5, 90, 91, 6]
    return src, out


def test_a_repeated_insertion_is_learned_and_drafted_through():
    """A change longer than one for one (two tokens inserted between 5 and 6) is learned
    where the output goes on with the source after it; once made SURE (2) times, drafts
    from the copy write it in: a draft spans a site ahead. Before that, the copy resumes
    as old as it was once the output is back on the source."""
    src, out = insert_file()
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    rounds = copy_rounds(d, prompt, out)
    off = copy_rounds(NgramDrafter(3, 12, extra=src, follow=False), prompt, out)
    assert max(off) < 22  # the copy breaks at every site
    assert max(rounds) >= 60  # three sites in one draft
    assert len(rounds) < len(off) / 2
    # a fresh drafter after two sites: the draft at the third writes the insertion
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    d.draft([*prompt, *out[:5]], 8)
    third = 2 * 22  # output position of the third site's body
    draft = d.draft([*prompt, *out[:third + 5]], 30).tokens
    assert draft == out[third + 5 : third + 35]


def test_a_known_change_written_in_full_goes_on_with_the_source_at_once():
    """Where the output writes a change seen at this kind of place before (90, 91 between
    5 and 6), in full, the copy goes on with the source after it at once: the next draft
    is this site's 6 and the body after it, not the output's own earlier text after the
    same three tokens (the last site's body), and not only after two more tokens agree."""
    src, out = insert_file()
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    pos = 2 * 22 + 21  # the third site: its 5, 90, 91 written
    feed(d, prompt, out, pos)
    draft = d.draft([*prompt, *out[:pos]], 20)
    assert out[pos - 3 : pos] == [5, 90, 91]
    assert draft.tokens == out[pos : pos + 20] and not draft.own


def record_file(lines: int = 6):
    """A JSON-like list: each source line is [20, 21, name, 22, 40..47, 5, 6] with its
    own name token; the edit inserts (22, 40, 91) between 5 and 6 on every line (a field
    added to each object). The inserted tokens 22, 40 also begin the next line's body,
    and the output's previous line copies on with the wrong name."""
    src, out = [], []
    for i in range(lines):
        body = [20, 21, 1000 + i, 22, *range(40, 48), 5]
        src += [*body, 6]
        out += [*body, 22, 40, 91, 6]
    return src, out


def feed(d: NgramDrafter, prompt, out, upto: int) -> None:
    """The output up to `upto` written one token at a time, with a draft each step (as
    the replay's oracle asks): the drafter follows the copy through every token."""
    for n in range(1, upto + 1):
        d.draft([*prompt, *out[:n]], 8)


def test_a_change_begun_again_is_drafted_with_the_source_after_it():
    """A change made once (not sure yet, so the draft stops before it) and begun again at
    the same kind of place: the rest of it is drafted, then the source after it (the next
    line's name), not the earlier output's copy (which goes on with the line after the
    one it was on)."""
    src, out = record_file()
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    line = 17  # output tokens per line
    pos = line + 14  # on line 2, just after the output wrote 22 where the source has 6
    feed(d, prompt, out, pos)
    # the rest of the change, the source's next line up to its site (unsure still)
    assert d.draft([*prompt, *out[:pos]], 20).tokens == out[pos : pos + 16]


def test_a_change_begun_again_is_not_ended_where_its_tokens_recur():
    """The second time a known change is written, its first tokens (22, 40) also occur in
    the source a few tokens on; that is no end of it: the change is learned a second time
    (sure), and from then on a draft writes it in and runs into the next line."""
    src, out = record_file()
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    line = 17
    pos = 2 * line + 4  # line 3, inside its body
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 30).tokens == out[pos : pos + 30]


def test_an_insertion_begun_again_is_not_applied_twice():
    """An insertion rule (nothing of the source replaced) redrafted after the output began
    it goes on with the source at its place, not with the insertion again."""
    src, out = insert_file()
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    pos = 22 + 20  # the second site: the output has just written 90 after 5
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 12).tokens == out[pos : pos + 12]  # 91, 6, the body


def closing_file(values, changed):
    """Lines [20, 21, name, 22, 40..47, value, 5, 6]: each ends in its own value, then 5
    (a line's closing token); the edit writes 50, 51, 52 in place of 5 on the lines in
    `changed` (a field added before the closing brace)."""
    src, out, sites = [], [], []
    for i, v in enumerate(values):
        body = [20, 21, 1000 + i, 22, *range(40, 48), v]
        sites.append(len(out) + len(body))  # the output position of the line's closing
        src += [*body, 5, 6]
        out += [*body, *((50, 51, 52) if i in changed else (5,)), 6]
    return src, out, sites


def test_a_change_made_after_another_token_stops_the_draft_there():
    """Line 1 replaced its closing token after value 300; line 2 closes after 301, so no
    rule fits it there, but the same closing was replaced elsewhere: the draft stops
    before it (the target decides) instead of copying the source through it."""
    src, out, sites = closing_file([300, 301, 301, 301], changed={0, 1, 2, 3})
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    pos = sites[1] - 8  # inside line 2's body
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 30).tokens == out[pos : sites[1]]


def test_a_change_begun_where_it_was_made_after_another_token_is_drafted_to_its_end_only():
    """Lines 1-2 replaced their closing after value 300, line 3 begins the same change
    after 301: the rest of the change is drafted, but not the source after it (what
    follows a change learned elsewhere is a guess: the target decides). Line 4, after
    301 again, where line 3 made it: the rest of the change and the source after it."""
    src, out, sites = closing_file([300, 300, 301, 301], changed={0, 1, 2, 3})
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    pos = sites[2] + 1  # line 3's 50 written
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 20).tokens == [51, 52]
    pos = sites[3] + 1  # line 4's
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 20).tokens == out[pos : pos + 20]


def test_a_place_kept_like_the_changed_one_ends_the_stop():
    """Where the output keeps such a closing token SURE (2) times, drafts copy through the
    others again: an edit that changes some lines does not stop every draft."""
    src, out, sites = closing_file([300, 301, 301, 301, 301], changed={0})
    prompt = [1, 2]
    d = NgramDrafter(3, 12, extra=src)
    d.begin(prompt)
    pos = sites[3] - 8  # line 4: lines 2 and 3 kept their closing
    feed(d, prompt, out, pos)
    assert d.draft([*prompt, *out[:pos]], 30).tokens == out[pos : pos + 30]


def test_a_rule_kept_against_is_dropped():
    """Where the output keeps the source at a rule's place SURE (2) times more often than
    it made the change, drafts copy the source there again."""
    src, changed = insert_file(sites=8)
    out = changed[: 2 * 22] + src[2 * 20 :]  # inserted at two sites, kept at the rest
    d = NgramDrafter(3, 12, extra=src)
    prompt = [1, 2]
    d.begin(prompt)
    d.draft([*prompt, *out[:5]], 8)
    # sites 3 and 4 (kept): the rule (made twice) is sure there, the draft writes it in
    pos = 2 * 22 + 5
    assert 90 in d.draft([*prompt, *out[:pos]], 30).tokens
    for site in (3, 4, 5):  # kept 1-3 times, made twice: unsure, the draft stops before it
        pos = 2 * 22 + (site - 2) * 20 + 5
        assert d.draft([*prompt, *out[:pos]], 30).tokens == out[pos : pos + 14]
    pos = 2 * 22 + 4 * 20 + 5  # kept a fourth time: dropped, the source is copied as it is
    draft = d.draft([*prompt, *out[:pos]], 30).tokens
    assert draft == out[pos : pos + 30] and 90 not in draft



def test_word_of_strips_spaces_and_punctuation():
    from localspec.core.drafters.ngram import word_of

    texts = (" lo", "(lo", "'lo", "lo", " long", "._x1(", "a.b", "(", "")
    assert [word_of(t) for t in texts] == ["lo", "lo", "lo", "lo", "long", "_x1", None, None, None]


TEXTS = {7: " lo", 8: " low", 9: "(lo", 10: "(low"}


def spelled_text(t: int) -> str:
    return TEXTS.get(t, f" w{t}")


def spelled_file(spellings: dict[int, int], seed: int = 0):
    """A 'file' of distinct tokens with " lo" (7) every 30 tokens and "(lo" (9) at the
    given positions, and its output: each 7 renamed " low" (8), each 9 as `spellings`
    says (10: renamed "(low", 9: kept). Token texts: `spelled_text`."""
    rng = random.Random(seed)
    src = [rng.randrange(1000, 100000) for _ in range(240)]
    for i in range(29, 240, 30):
        src[i] = 7
    for i in spellings:
        src[i] = 9
    out = [8 if t == 7 else t for t in src]
    for i, t in spellings.items():
        out[i] = t
    return src, out


def following(d: NgramDrafter, out, prompt=(1, 2)) -> NgramDrafter:
    d.begin(list(prompt))
    d.draft([*prompt, *out[:5]], 8)  # a match: the copy is followed from here
    return d


def test_a_draft_stops_before_another_spelling_of_a_renamed_word():
    """Given the tokens' texts, once the output has renamed " lo" to " low" (SURE times:
    drafted renamed), a draft stops before "(lo", another token holding the word lo,
    instead of copying it as it was and breaking there; without the texts the draft runs
    into it."""
    src, out = spelled_file({100: 10})
    prompt = [1, 2]
    pos = 80  # " lo" renamed at 29 and 59
    d = following(NgramDrafter(3, 12, extra=src, text=spelled_text), out)
    assert d.draft([*prompt, *out[:pos]], 40).tokens == out[pos:100]
    blind = following(NgramDrafter(3, 12, extra=src), out)
    drafted = blind.draft([*prompt, *out[:pos]], 40).tokens
    assert drafted[:20] == out[pos:100] and drafted[20] == 9  # "(lo" copied: rejected there


def test_a_kept_spelling_of_a_renamed_word_is_copied_again():
    """A token holding a renamed word that the output keeps SURE (2) times is copied as
    it is again (" lo" renamed, "(lo" left alone by this edit)."""
    src, out = spelled_file({65: 9, 75: 9, 85: 9, 100: 9})
    prompt = [1, 2]
    d = following(NgramDrafter(3, 12, extra=src, text=spelled_text), out)
    assert d.draft([*prompt, *out[:62]], 20).tokens == out[62:65]  # never kept: unsure
    assert d.draft([*prompt, *out[:72]], 20).tokens == out[72:75]  # kept once
    assert d.draft([*prompt, *out[:80]], 30).tokens == out[80:110]  # kept twice: copied


def test_the_runtime_gives_the_copying_drafter_the_targets_token_texts():
    """make_drafter hands an edit's n-gram drafter (a text to copy given) the target's
    token texts, so it stops before other spellings of a renamed word; with no text to
    copy there is nothing to follow and none are looked up."""
    from fakes import FakeModel

    from localspec.core.config import SamplingConfig, SpecConfig
    from localspec.runtime import make_drafter

    src, out = spelled_file({100: 10})
    target = FakeModel(texts={t: s.encode() for t, s in TEXTS.items()})
    d = make_drafter(SpecConfig(mode="ngram", ngram_min=3, ngram_max=12), SamplingConfig(),
                     None, src, target)
    prompt = [1, 2]
    d = following(d, out)
    assert d.draft([*prompt, *out[:80]], 40).tokens == out[80:100]
    assert make_drafter(SpecConfig(mode="ngram"), SamplingConfig(), None, (), target).subs.word is None


# a source token the output may write in other pieces: `):\n` as `)` then `:\n`, or with a
# type hint inserted inside it (`)`, ` ->`, ` str`, `:\n`); other tokens spell their number
PIECES = {50: "):\n", 51: ")", 52: ":\n", 53: " ->", 54: " str", 55: "    ", 56: '"""', 58: ":",
          59: ".'", 60: "''", 61: ")\n\n", 62: ".''", 63: "')\n\n"}


def pieces_text(t: int) -> str:
    return PIECES.get(t, f"w{t}")


def drafted_after(src, out, upto: int, texts: bool = True, k: int = 20):
    """The draft after the output's first `upto` tokens, the copy of `src` followed from
    its start, with the tokens' texts given or not."""
    d = following(NgramDrafter(3, 12, extra=src, text=pieces_text if texts else None), out)
    feed(d, [1, 2], out, upto)
    return d.draft([1, 2, *out[:upto]], k)


def split_file(written=(51, 52), seed: int = 0, n: int = 200, site: int = 100):
    """(source, output): random word tokens with `):\n` at `site`, which the output
    writes as the `written` tokens."""
    rng = random.Random(seed)
    src = [rng.randrange(100, 400) for _ in range(n)]
    src[site] = 50
    out = src[:site] + list(written) + src[site + 1:]
    return src, out


@pytest.mark.parametrize("written", [(51, 52), (51, 53, 54, 52), (58, 54, 51, 53, 54, 52)],
                         ids=["same text", "hint inside", "hints before and inside"])
def test_a_copy_goes_on_where_the_output_wrote_a_source_token_in_other_pieces(written):
    """Given the tokens' texts, where the output writes `):\n` as `)` and `:\n`, or puts
    ` -> str` between them, or `: str` before them too (a change begun with a token that
    is no piece of it), the copy goes on after `):\n` as soon as `:\n` is written, as
    old as it was; without the texts it waits for two more tokens that agree."""
    src, out = split_file(written)
    end = 100 + len(written)  # the output's tokens up to and including `:\n`
    draft = drafted_after(src, out, end)
    assert draft.tokens == src[101:121] and draft.run_len > 90
    assert drafted_after(src, out, end, texts=False).tokens == []


def test_a_copy_goes_on_where_the_output_splits_the_source_text_across_its_tokens():
    """The source's `.'` `''` `)\n\n` written as `.''` `')\n\n` (the same text, cut
    elsewhere: a docstring's closing quotes) leaves the copy where it was, as old as it
    was: the draft after them is the source after them."""
    rng = random.Random(5)
    src = [rng.randrange(100, 400) for _ in range(200)]
    src[100:103] = [59, 60, 61]
    out = src[:100] + [62, 63] + src[103:]
    draft = drafted_after(src, out, 102)
    assert draft.tokens == src[103:123] and draft.run_len > 90


def test_inside_a_split_source_token_a_match_elsewhere_is_not_drafted():
    """After the output wrote `)` of `):\n` (where a change may begin), a younger n-gram
    match elsewhere in the source that goes on after `)` is not drafted: the target
    decides how the token goes on."""
    src, out = split_file((51, 53, 54, 52))
    src[40:43] = [src[98], src[99], 51]  # the same three tokens earlier, going on otherwise
    out[40:43] = src[40:43]
    assert drafted_after(src, out, 101).tokens == []
    assert drafted_after(src, out, 101, texts=False).tokens == src[43:63]


def test_a_copy_is_not_taken_up_where_two_tokens_of_spaces_and_quotes_recur():
    """A change ends where the output's last two tokens go on with the source after it,
    but not two tokens of only spaces and quotes further on (an indent and a docstring's
    quotes recur everywhere): where the output inserted a docstring, the copy is not
    taken up at the source's next docstring (its words are not what the output writes
    next)."""
    rng = random.Random(3)
    src = [rng.randrange(100, 400) for _ in range(200)]
    src[108:110] = [55, 56]  # the source's next docstring, 8 tokens after the change
    out = src[:100] + [60, 55, 56, 61, 62, 63] + src[100:]  # a docstring inserted at 100
    assert drafted_after(src, out, 103).tokens == []
    assert drafted_after(src, out, 103, texts=False).tokens == src[110:130]


def test_a_match_in_the_outputs_own_text_is_drafted_but_the_file_stays_followed():
    """Where the output begins a docstring like one it wrote above (new text, not in the
    file), the match in its own text is drafted (flagged `own`), but the copy followed
    stays the file's: once the output goes on with the file after the docstring, the copy
    is taken up as old as it was, not as a young match."""
    rng = random.Random(6)
    src = [rng.randrange(1000, 5000) for _ in range(300)]
    src[98:100] = src[148:150] = [7, 8]  # the same two tokens before each (`:\n` and an indent)
    first, second = [500, 501, 502, *range(510, 520)], [500, 501, 502, 530, 531]
    out = [*src[:100], *first, *src[100:150], *second, *src[150:]]
    prompt = [1, 2, *src, 3]
    d = NgramDrafter(3, 12, extra=src)
    end = 100 + len(first) + 50 + 1  # the second docstring's first token written
    feed(d, prompt, out, end)
    mid = d.draft([*prompt, *out[:end]], 8)
    assert mid.own and mid.tokens[:3] == first[1:4]
    end = 100 + len(first) + 50 + len(second) + 2  # ... and two of the file's after it
    feed(d, prompt, out, end)
    after = d.draft([*prompt, *out[:end]], 20)
    assert after.tokens == src[152:172] and not after.own and after.run_len > 100


def inserted_docstring(n_doc: int = 25, other: bool = True):
    """(source, output, where the output returns to the file): random word tokens; the
    output inserts a docstring of `n_doc` new tokens after `:\n` and an indent at 98-99
    (the site, before the body's `return Path` at 100-101). Another function ends its
    signature the same way and has a docstring (the copy a lookup finds when the output
    writes its quotes), and the indent, `return`, `Path` recur later going on otherwise
    (the match a lookup finds when the output comes back). Without the `other` function,
    no match is found while the docstring is written."""
    rng = random.Random(8)
    src = [rng.randrange(1000, 5000) for _ in range(320)]
    src[96:102] = [40, 41, 7, 8, 42, 43]  # `-> Path` `:\n` indent `return` `Path`
    if other:
        src[200:205] = [40, 41, 7, 8, 56]  # another function's, with a docstring
    src[250:253] = [8, 42, 43]  # another `return Path(...)`, going on otherwise
    doc = [56, *range(600, 600 + n_doc - 2), 61]
    out = [*src[:100], *doc, *src[99:]]  # the indent written again after the docstring
    return src, out, 100 + len(doc)


@pytest.mark.parametrize("n_doc,other", [(25, True), (120, True), (25, False)])
@pytest.mark.parametrize("foretold", [True, False], ids=["at a site", "unforeseen"])
def test_a_copy_left_for_an_inserted_docstring_is_taken_up_where_it_was_left(n_doc, other, foretold):
    """Where the output leaves a long-held copy of the file for new text (a docstring
    longer than any change learned as a rule, while a match elsewhere was followed or
    none), the copy is taken up where it was left once the output's last two tokens go
    on with the file there (the indent and `return`): not at the younger match of
    `return Path` elsewhere, and not only after three tokens agree. As old as it was
    where the instruction foretold new text there (a site, sites.py); else as young as
    the tokens that agree."""
    src, out, back = inserted_docstring(n_doc, other)
    prompt = [1, 2, *src, 3]
    d = NgramDrafter(3, 12, extra=src, prediction=src, unsure={100} if foretold else ())
    d.begin(prompt)
    feed(d, prompt, out, back + 2)  # ... the indent and `return` written again
    draft = d.draft([*prompt, *out[: back + 2]], 20)
    assert draft.tokens == src[101:121]
    assert draft.run_len > 90 if foretold else draft.run_len == 2
    feed(d, prompt, out, back + 3)
    assert d.draft([*prompt, *out[: back + 3]], 20).tokens == src[102:122]


@pytest.mark.parametrize("block", range(4))
def test_the_copying_drafter_drafts_only_known_tokens_on_random_edits(block):
    """Every state the copy-following reaches (substitutions, changes learned as rules,
    a copy parked and taken up, a prediction with foretold sites, a rewound context):
    on 100 random edits each, a draft is never longer than asked, and holds only tokens
    that the prompt, the given text or the output written holds (a drafter copies; it
    never invents a token), and drafting never raises."""
    for seed in range(block * 100, block * 100 + 100):
        rng = random.Random(seed)
        src, out, prompt = random_edits.random_edit(rng)
        prediction = None
        if src and rng.random() < 0.4:
            prediction = list(src)
            for _ in range(rng.randint(0, 4)):
                j = rng.randrange(len(prediction))
                prediction[j : j + rng.randint(0, 2)] = [rng.randrange(len(random_edits.PIECES))
                                                        for _ in range(rng.randint(0, 3))]
        unsure = set(rng.sample(range(len(prediction) + 1), min(len(prediction) + 1, rng.randint(0, 5)))) if prediction else ()
        lo = rng.randint(1, 4)
        d = NgramDrafter(lo, rng.randint(lo, 12), extra=src, prediction=prediction, unsure=unsure,
                         text=random_edits.PIECES.__getitem__ if rng.random() < 0.8 else None,
                         renamed=["item"] if rng.random() < 0.3 else (), follow=rng.random() < 0.9)
        d.begin(prompt)
        seen = {*prompt, *src, *(prediction or ())}  # and the output's tokens, once written
        ctx, p = list(prompt), 0
        while p < len(out):
            if p > 3 and rng.random() < 0.02:  # a context rewound
                back = rng.randint(1, min(p, 10))
                p, ctx = p - back, ctx[:-back]
            k = rng.choice([0, 1, 2, 5, 16, 64, 256])
            tokens = list(d.draft(ctx, k).tokens)
            assert len(tokens) <= k, (seed, p)
            assert set(tokens) <= seen, (seed, p)
            a = 0
            while a < len(tokens) and p + a < len(out) and tokens[a] == out[p + a]:
                a += 1
            ctx += out[p : p + a + 1]
            seen.update(out[p : p + a + 1])
            p += a + 1
