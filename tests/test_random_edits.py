"""auto against plain decoding on random dense edits (bench/random_edits.py): outputs that
change a copied text every few tokens, inconsistently, where its bets on a copy's age go
wrong most. Replayed on curves (no model, no timing)."""

from __future__ import annotations

from pathlib import Path

from localspec.bench.random_edits import against_plain, random_traces, summary
from localspec.bench.replay import true_curve

CURVES = Path(__file__).resolve().parent.parent / "scripts" / "curves"
TRACES = random_traces(120)


def test_random_edits_are_replayable_edit_traces():
    assert len(TRACES) == 120
    for tr in TRACES:
        assert tr["tag"] == "edit" and len(tr["ids"]) >= 20
        assert set(tr["extra"]) <= set(tr["prompt"])  # the text copied is in the prompt
        assert all(str(t) in tr["pieces"] for t in tr["ids"])


def test_on_a_flat_curve_auto_is_never_slower_than_plain():
    ratios = against_plain(TRACES, true_curve("gpu", 300, None))
    for kind in ("informed", "fresh"):
        s = summary(ratios[kind])
        assert s["worst"] <= 1.03, kind
        assert s["median"] < 0.7, kind  # most of these edits still copy long enough to pay


def test_on_a_steep_curve_a_text_that_keeps_changing_costs_auto_little():
    """The AVX-512 EPYC's curve (V(16) = 7.8 one-token times): a 15-token draft rejected
    at once costs 6.8 of them. Copies followed across changes made every few tokens used
    to keep their age and were bet on long; an output that left its copy twice within
    BREAK_SPAN tokens now has its copies drafted as old as its last stretch (ngram.py).
    With a tune profile: the 95th percentile was 1.29x plain's time and 36% of these edits
    were more than 5% slower than plain."""
    ratios = against_plain(TRACES, true_curve(str(CURVES / "avx512_2core.json"), 300, None))
    s = summary(ratios["informed"])
    assert s["p95"] <= 1.2
    assert s["slower"] <= 0.3
    assert summary(ratios["fresh"])["p95"] <= 1.15
