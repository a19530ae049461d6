"""Pure numpy: logits -> probabilities, and the two accept rules.

Filtering follows llama.cpp's default chain: top-k, top-p and min-p are decided on the
untempered distribution, then temperature reshapes what is left. The same function is
applied to the target (p) and the draft (q), which is what keeps speculation lossless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from localspec.core.config import SamplingConfig


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _kept_ids(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Token ids that survive top-k, top-p and min-p, most likely first."""
    n_vocab = logits.shape[0]
    if 0 < cfg.top_k < n_vocab:
        ids = np.argpartition(-logits, cfg.top_k - 1)[: cfg.top_k]
    else:
        ids = np.arange(n_vocab)
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    probs = _softmax(logits[ids].astype(np.float64))
    n_keep = len(ids)
    if cfg.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        n_keep = min(n_keep, int(np.searchsorted(np.cumsum(probs), cfg.top_p)) + 1)
    if cfg.min_p > 0.0:
        n_keep = min(n_keep, max(1, int(np.count_nonzero(probs >= cfg.min_p * probs[0]))))
    return ids[:n_keep]


def probs_from_logits(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """One row of logits -> a dense probability vector (float64) under `cfg`.

    Greedy configs give the one-hot of the argmax, so callers need no special case.
    """
    out = np.zeros(logits.shape[0], dtype=np.float64)
    if cfg.greedy:
        out[int(np.argmax(logits))] = 1.0
        return out
    ids = _kept_ids(logits, cfg)
    out[ids] = _softmax(logits[ids].astype(np.float64) / cfg.temperature)
    return out


def logprobs(logits: np.ndarray, token: int, n_top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the raw distribution softmax(logits) (no temperature or
    truncation), and the `n_top` most likely (id, log p), highest first."""
    m = float(logits.max())
    lse = m + math.log(np.exp(logits - m).sum(dtype=np.float64))  # the softmax's denominator
    n_top = min(n_top, len(logits))
    ids = np.argpartition(logits, -n_top)[-n_top:] if n_top > 0 else np.empty(0, dtype=np.int64)
    ids = ids[np.lexsort((ids, -logits[ids]))]  # by logit, then id: ties in a stable order
    return float(logits[token]) - lse, [(int(i), float(logits[i]) - lse) for i in ids]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one id from a dense probability vector (sparse-aware: draws over the support)."""
    support = np.flatnonzero(probs)
    weights = probs[support]
    return int(support[rng.choice(len(support), p=weights / weights.sum())])


def accept_greedy(draft: Sequence[int], target_ids: Sequence[int]) -> tuple[int, int]:
    """Greedy verification.

    target_ids[i] is the target's argmax after [id_last, *draft[:i]], so there are
    len(draft) + 1 of them. Returns (n_accept, id_next): the agreeing prefix length and
    the target's own token after it (there is always one: the bonus or the correction).
    """
    n_accept = 0
    for d, t in zip(draft, target_ids):
        if d != t:
            break
        n_accept += 1
    return n_accept, int(target_ids[n_accept])


def accept_stochastic(
    draft: Sequence[int],
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    p: (len(draft) + 1, V) target probabilities (or rows computed on demand: row i is
    read only after draft[:i] was accepted, e.g. constrain.GrammarRows); q: (len(draft), V) draft
    probabilities, or None when the draft was deterministic (n-gram, greedy model
    draft), i.e. q is one-hot on the drafted token. Token x is kept with probability
    min(1, p(x) / q(x)); on rejection we sample from normalize(max(0, p - q)); when all
    are kept, a bonus token comes from p's last row. The output then follows p exactly.

    A deterministic draft is verified by drawing the target's own token at each position
    (`sample`, one draw from `rng` a position, as plain decoding does) and keeping the
    draft while they agree: it is kept with probability p(x), as by the rule above, a
    rejection yields a token of p without x, and the output is the very tokens plain
    decoding draws from the same seed, whatever was drafted (so a seeded run repeats
    though auto's drafting depends on timing).
    """
    if q is None:
        for i, x in enumerate(draft):
            own = sample(p[i], rng)
            if own != x:
                return i, own
        return len(draft), sample(p[len(draft)], rng)
    for i, x in enumerate(draft):
        px = p[i][x]
        qx = q[i, x]
        if qx > 0.0 and rng.random() < min(1.0, px / qx):
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0.0:  # p == q: rejection has probability 0; guard rounding
            residual = p[i]
        return i, sample(residual, rng)
    return len(draft), sample(p[len(draft)], rng)
