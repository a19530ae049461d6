"""Pure numpy tests of localspec.core.sampling: the filter chain and both accept rules.

The lossless stochastic rule is checked statistically (fixed seeds, chi-square and
total-variation bounds) against the exact target distribution, and the same checks
are run against deliberately broken rules to show that they would catch a bug.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import chi2_pvalue, tv_distance

from localspec.core.config import SamplingConfig
from localspec.core.sampling import (
    accept_greedy,
    accept_stochastic,
    probs_from_logits,
    sample,
)


def cfg(**kw) -> SamplingConfig:
    """Temperature 1 with every filter off, unless overridden."""
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    base.update(kw)
    return SamplingConfig(**base)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_probs(logits: np.ndarray, c: SamplingConfig) -> np.ndarray:
    """Independent brute-force implementation of the documented chain: top-k, then
    top-p (smallest prefix whose mass reaches top_p), then min-p, all on the untempered
    softmax of the survivors; temperature last."""
    v = len(logits)
    order = sorted(range(v), key=lambda i: (-logits[i], i))
    if 0 < c.top_k < v:
        order = order[: c.top_k]
    p = softmax(np.array([logits[i] for i in order], dtype=np.float64))
    keep = len(order)
    if c.top_p < 1.0:
        acc = 0.0
        for j, pj in enumerate(p):
            acc += pj
            if acc >= c.top_p:
                keep = min(keep, j + 1)
                break
    if c.min_p > 0.0:
        keep = min(keep, max(1, sum(1 for pj in p if pj >= c.min_p * p[0])))
    kept = order[:keep]
    out = np.zeros(v)
    out[kept] = softmax(np.array([logits[i] for i in kept], dtype=np.float64) / c.temperature)
    return out


# probabilities 0.5, 0.2, 0.15, 0.1, 0.05 on ids 3, 0, 4, 1, 2 (shuffled on purpose)
P5 = np.zeros(5)
P5[[3, 0, 4, 1, 2]] = [0.5, 0.2, 0.15, 0.1, 0.05]
L5 = np.log(P5).astype(np.float32)


# ----- probs_from_logits ------------------------------------------------------------


def test_greedy_is_one_hot_of_argmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9, 0.0], dtype=np.float32)
    out = probs_from_logits(logits, SamplingConfig(temperature=0.0))
    assert out.dtype == np.float64
    assert out.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    # greedy ignores the filters entirely
    out = probs_from_logits(logits, SamplingConfig(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9))
    assert out.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert SamplingConfig(temperature=-1.0).greedy


def test_temperature_one_is_plain_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=20).astype(np.float32)
    np.testing.assert_allclose(probs_from_logits(logits, cfg()), softmax(logits.astype(np.float64)), atol=1e-12)


@pytest.mark.parametrize("temp", [0.25, 0.7, 2.0, 10.0])
def test_temperature_scales_logits(temp):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=30).astype(np.float32)
    out = probs_from_logits(logits, cfg(temperature=temp))
    np.testing.assert_allclose(out, softmax(logits.astype(np.float64) / temp), atol=1e-12)
    assert abs(out.sum() - 1.0) < 1e-12


def test_low_temperature_sharpens_high_temperature_flattens():
    cold = probs_from_logits(L5, cfg(temperature=0.5))
    warm = probs_from_logits(L5, cfg(temperature=1.0))
    hot = probs_from_logits(L5, cfg(temperature=3.0))
    assert cold[3] > warm[3] > hot[3]
    assert cold[2] < warm[2] < hot[2]


@pytest.mark.parametrize("k", [1, 2, 3, 7, 19])
def test_top_k_keeps_exactly_k_largest(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=20).astype(np.float32)
    out = probs_from_logits(logits, cfg(top_k=k))
    kept = set(np.flatnonzero(out).tolist())
    assert len(kept) == k
    assert kept == set(np.argsort(-logits)[:k].tolist())
    # the survivors keep their relative weights
    ids = sorted(kept)
    np.testing.assert_allclose(out[ids], softmax(logits[ids].astype(np.float64)), atol=1e-12)


@pytest.mark.parametrize("k", [0, -1, 20, 100])
def test_top_k_off_or_at_least_vocab_keeps_all(k):
    logits = np.random.default_rng(3).normal(size=20).astype(np.float32)
    assert np.count_nonzero(probs_from_logits(logits, cfg(top_k=k))) == 20


@pytest.mark.parametrize(
    "top_p, n_keep",
    [(0.01, 1), (0.49, 1), (0.51, 2), (0.69, 2), (0.71, 3), (0.84, 3), (0.86, 4), (0.94, 4), (0.96, 5), (0.999, 5)],
)
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, n_keep):
    out = probs_from_logits(L5, cfg(top_p=top_p))
    kept = np.flatnonzero(out).tolist()
    assert sorted(kept) == sorted([3, 0, 4, 1, 2][:n_keep])
    expect = np.zeros(5)
    expect[kept] = P5[kept] / P5[kept].sum()
    np.testing.assert_allclose(out, expect, atol=1e-6)


@pytest.mark.parametrize(
    "min_p, n_keep",
    [(0.01, 5), (0.09, 5), (0.11, 4), (0.19, 4), (0.21, 3), (0.29, 3), (0.31, 2), (0.39, 2), (0.41, 1), (1.0, 1)],
)
def test_min_p_keeps_tokens_above_fraction_of_max(min_p, n_keep):
    # threshold is min_p * 0.5: 0.05 survives below min_p 0.1, 0.1 below 0.2, ...
    out = probs_from_logits(L5, cfg(min_p=min_p))
    kept = np.flatnonzero(out).tolist()
    assert sorted(kept) == sorted([3, 0, 4, 1, 2][:n_keep])


def test_filters_are_decided_before_temperature():
    # untempered top-p 0.6 keeps two tokens (0.5 + 0.2); a hot temperature applied
    # first would flatten the distribution and keep more.
    out = probs_from_logits(L5, cfg(top_p=0.6, temperature=10.0))
    assert sorted(np.flatnonzero(out).tolist()) == [0, 3]
    expect = softmax(np.array([L5[3], L5[0]], dtype=np.float64) / 10.0)
    np.testing.assert_allclose([out[3], out[0]], expect, atol=1e-9)
    # same for min-p: 0.41 * 0.5 keeps only the top token, whatever the temperature
    out = probs_from_logits(L5, cfg(min_p=0.41, temperature=10.0))
    assert out.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_top_p_is_computed_after_top_k_renormalises():
    # top-2 renormalised: 0.5/0.7 = 0.714, 0.2/0.7 = 0.286. top_p 0.7 then keeps one
    # token (0.714 >= 0.7); on the full distribution it would have kept three.
    out = probs_from_logits(L5, cfg(top_k=2, top_p=0.7))
    assert out.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_matches_reference_chain_on_random_configs():
    rng = np.random.default_rng(42)
    for trial in range(300):
        v = int(rng.integers(2, 40))
        logits = (rng.normal(size=v) * rng.uniform(0.1, 5.0)).astype(np.float32)
        c = SamplingConfig(
            temperature=float(rng.choice([0.3, 0.8, 1.0, 1.7])),
            top_k=int(rng.choice([0, 1, 3, 10, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.1])),
            min_p=float(rng.choice([0.0, 0.05, 0.2, 0.6])),
        )
        out = probs_from_logits(logits, c)
        ref = reference_probs(logits, c)
        assert abs(out.sum() - 1.0) < 1e-9, (trial, c)
        assert np.all(out >= 0.0)
        # boundaries exactly at the top-p mass may round either way; compare supports
        # only when no cumulative sum sits within 1e-6 of top_p
        cums = np.cumsum(np.sort(softmax(logits.astype(np.float64)))[::-1])
        if c.top_p < 1.0 and np.any(np.abs(cums - c.top_p) < 1e-6):
            continue
        np.testing.assert_allclose(out, ref, atol=1e-6, err_msg=f"trial {trial}: {c}")


def test_rows_sum_to_one_with_extreme_logits():
    logits = np.array([1e4, -1e4, 0.0, -np.inf, 3e4], dtype=np.float32)
    for c in [cfg(), cfg(temperature=0.1), cfg(top_k=2), cfg(top_p=0.5), cfg(min_p=0.5), SamplingConfig(temperature=0.8)]:
        out = probs_from_logits(logits, c)
        assert np.isfinite(out).all()
        assert abs(out.sum() - 1.0) < 1e-12
        assert out[4] == pytest.approx(1.0)


def test_sample_draws_only_from_support_and_follows_probs():
    rng = np.random.default_rng(7)
    probs = np.array([0.0, 0.6, 0.0, 0.3, 0.1])
    draws = np.array([sample(probs, rng) for _ in range(6000)])
    counts = np.bincount(draws, minlength=5)
    assert counts[0] == counts[2] == 0
    assert tv_distance(counts, probs) < 0.03
    # unnormalised input (e.g. a residual) is normalised by sample()
    draws = [sample(np.array([0.0, 0.2, 0.2]), rng) for _ in range(2000)]
    assert set(draws) == {1, 2}


# ----- accept_greedy ----------------------------------------------------------------


def test_accept_greedy_all_accepted_gives_bonus():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, 8)


def test_accept_greedy_first_mismatch_gives_correction():
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == (0, 4)
    assert accept_greedy([5, 6, 7], [5, 6, 1, 8]) == (2, 1)


def test_accept_greedy_later_agreement_after_mismatch_does_not_count():
    # only the agreeing PREFIX counts: position 2 agrees but position 1 did not
    assert accept_greedy([1, 2, 3, 4], [1, 0, 3, 4, 5]) == (1, 0)


def test_accept_greedy_empty_draft():
    assert accept_greedy([], [42]) == (0, 42)


def test_accept_greedy_returns_python_int():
    n, tok = accept_greedy([1], np.array([1, 2], dtype=np.int64))
    assert (n, tok) == (1, 2) and type(tok) is int


# ----- accept_stochastic: exact cases -----------------------------------------------


def test_accept_stochastic_empty_draft_samples_first_row():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 0.0, 1.0]])
    assert accept_stochastic([], p, None, rng) == (0, 2)
    assert accept_stochastic([], p, np.zeros((0, 3)), rng) == (0, 2)


def test_accept_stochastic_certain_cases():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # p is one-hot on the drafted tokens: always accepted, bonus from the last row
    for _ in range(50):
        assert accept_stochastic([1, 2], p, None, rng) == (2, 0)
    # p(x) == 0: always rejected, correction from p (here forced)
    for _ in range(50):
        assert accept_stochastic([0, 2], p, None, rng) == (0, 1)
    # q(x) == 0 for a drafted token (cannot happen when sampling from q): rejected
    q = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    for _ in range(50):
        assert accept_stochastic([1, 2], p, q, rng) == (0, 1)
    # p == q: never rejected, whatever the token
    pq = np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    for _ in range(200):
        assert accept_stochastic([0, 2], pq, pq[:2], rng) == (2, 1)


# ----- accept_stochastic: statistics -------------------------------------------------

V = 6
P1 = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q1 = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
# the target's second-token distribution depends on the first token (rows differ)
P2 = np.array([np.roll([0.40, 0.25, 0.15, 0.10, 0.10, 0.00], t) for t in range(V)])
Q2 = np.array([np.roll([0.05, 0.05, 0.10, 0.20, 0.30, 0.30], 2 * t) for t in range(V)])
P_BONUS = np.full(V, 1.0 / V)
JOINT = P1[:, None] * P2  # exact target distribution of (t1, t2)
N_TRIALS = 10_000
N_BROKEN = 4_000  # broken rules are far off: fewer trials already fail them
TV_BOUND = 0.025
P_MIN = 1e-4  # seeded, so deterministic; a correct rule is far from this


def always_accept(draft, p, q, rng):
    """BROKEN: keeps every drafted token."""
    return len(draft), sample(p[len(draft)], rng)


def resample_from_p(draft, p, q, rng):
    """BROKEN: right acceptance test, but on rejection samples from p, not the residual."""
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else q[i, x]
        if qx > 0.0 and rng.random() < min(1.0, p[i, x] / qx):
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def accept_ratio_inverted(draft, p, q, rng):
    """BROKEN: accepts with min(1, q/p) instead of min(1, p/q)."""
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else q[i, x]
        if p[i, x] > 0.0 and rng.random() < min(1.0, qx / p[i, x]):
            continue
        residual = np.maximum(p[i] - (np.eye(p.shape[1])[x] if q is None else q[i]), 0.0)
        return i, sample(residual if residual.sum() > 0 else p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Vectorised inverse-CDF draws: one id per uniform in `u` (rows of `probs` may
    be given per draw as a 2-D array)."""
    cdf = np.cumsum(probs, axis=-1)
    cdf[..., -1] = 1.0
    if cdf.ndim == 1:
        return np.searchsorted(cdf, u, side="right")
    return (u[:, None] >= cdf).sum(axis=1)


def first_token_counts(rule, q_mode: str, seed: int, n: int = N_TRIALS) -> np.ndarray:
    """Distribution of the first emitted token after a one-token draft.

    q_mode "model": draft sampled from Q1, q rows passed; "argmax"/"low"/"zero":
    deterministic draft (q=None) of the target's top token, a low-probability token,
    or a token the target gives probability 0 to (P2[0] row)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(V, dtype=np.int64)
    target = P2[0] if q_mode == "zero" else P1
    p = np.stack([target, P_BONUS])
    if q_mode == "model":
        drafts = draw(Q1, rng.random(n)).tolist()
        q = Q1[None, :]
    else:
        drafts = [{"argmax": 0, "low": 4, "zero": 5}[q_mode]] * n
        q = None
    for d in drafts:
        n_acc, tok = rule([d], p, q, rng)
        counts[d if n_acc >= 1 else tok] += 1
    return counts


def two_token_counts(rule, q_mode: str, seed: int, n: int = N_TRIALS) -> np.ndarray:
    """Joint distribution of the first two emitted tokens after a two-token draft.

    Whatever the rule keeps, a token not produced by this round comes from the next
    round, which (plain decoding) samples from the target's conditional row."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    if q_mode == "model":
        d1s = draw(Q1, rng.random(n))
        d2s = draw(Q2[d1s], rng.random(n))
        qs = [np.stack([Q1, Q2[d]]) for d in range(V)]
    else:  # deterministic drafter: a fixed guess per position, q=None
        d1s = np.full(n, 1)
        d2s = np.full(n, 3)
        qs = [None] * V
    ps = [np.stack([P1, P2[d], P_BONUS]) for d in range(V)]
    u_next = rng.random(n)
    for d1, d2, u in zip(d1s.tolist(), d2s.tolist(), u_next.tolist()):
        n_acc, tok = rule([d1, d2], ps[d1], qs[d1], rng)
        if n_acc == 0:
            t1, t2 = tok, int(draw(P2[tok], np.array([u]))[0])  # next round: plain decode
        elif n_acc == 1:
            t1, t2 = d1, tok
        else:
            t1, t2 = d1, d2
        counts[t1, t2] += 1
    return counts


@pytest.mark.parametrize("q_mode", ["model", "argmax", "low", "zero"])
def test_stochastic_first_token_follows_target(q_mode):
    counts = first_token_counts(accept_stochastic, q_mode, seed=11)
    target = P2[0] if q_mode == "zero" else P1
    assert tv_distance(counts, target) < TV_BOUND
    assert chi2_pvalue(counts, target) > P_MIN


@pytest.mark.parametrize("q_mode", ["model", "onehot"])
def test_stochastic_first_two_tokens_follow_target(q_mode):
    counts = two_token_counts(accept_stochastic, q_mode, seed=12)
    assert chi2_pvalue(counts, JOINT) > P_MIN
    # marginals, each a tight TV bound
    assert tv_distance(counts.sum(axis=1), P1) < TV_BOUND
    assert tv_distance(counts.sum(axis=0), JOINT.sum(axis=0)) < TV_BOUND
    # second token given a frequent first token
    for t1 in (0, 1):
        assert tv_distance(counts[t1], P2[t1]) < 0.05


@pytest.mark.parametrize(
    "rule, q_mode",
    [
        (always_accept, "model"),
        (always_accept, "low"),
        (resample_from_p, "model"),
        (resample_from_p, "argmax"),
        (accept_ratio_inverted, "model"),
    ],
)
def test_broken_rules_fail_the_first_token_check(rule, q_mode):
    counts = first_token_counts(rule, q_mode, seed=11, n=N_BROKEN)
    assert tv_distance(counts, P1) > 2 * TV_BOUND
    assert chi2_pvalue(counts, P1) < 1e-9


@pytest.mark.parametrize("rule", [always_accept, resample_from_p])
@pytest.mark.parametrize("q_mode", ["model", "onehot"])
def test_broken_rules_fail_the_two_token_check(rule, q_mode):
    counts = two_token_counts(rule, q_mode, seed=12, n=N_BROKEN)
    assert chi2_pvalue(counts, JOINT) < 1e-9


def test_stochastic_accept_rate_matches_theory():
    # P(accept) for a draft sampled from q is sum_x min(p(x), q(x))
    rng = np.random.default_rng(5)
    p = np.stack([P1, P_BONUS])
    n_acc = 0
    q = Q1[None, :]
    for d in draw(Q1, rng.random(8_000)).tolist():
        n_acc += accept_stochastic([d], p, q, rng)[0]
    expected = np.minimum(P1, Q1).sum()
    assert abs(n_acc / 8_000 - expected) < 0.02
