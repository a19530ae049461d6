"""`--spec auto`: each round, pick the drafter and k that maximise expected tokens per
unit of time, including k = 0 (plain decode) when nothing pays.

  expected tokens  E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i      (a_i: P(accept i | accepted < i))
  cost             C(k) = V(k + 1) + k * c                   (in one-token decode times)
  choose           argmax_k E(k) / C(k); plain decode scores 1 / V(1) = 1, and a
                   draft must score at least 5% above it (within that, estimates
                   are noise and plain decoding is the safe bet)

V(n) comes from the calibration profile (`localspec tune`), or without one a CPU-like
prior, and is replaced by the medians of the verify times this run measures. c is the
draft model's cost ratio (0 for n-gram), from its measured draft times. Acceptance a_i
is estimated per drafter (and, for n-gram drafts, per matched suffix length, since long
matches copy long runs as in suffix decoding), from decaying counts smoothed toward the
previous position's estimate. Every n-gram candidate is
scored in hindsight, drafted or not, against the tokens the target goes on to produce:
how long copied runs last is learned at every depth, also while auto decodes plainly.
The draft model is only learned from its own drafts (probed now and then, where it
could pay at all).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

from localspec.core.drafters.base import Draft, Drafter, DrafterBase, constrain
from localspec.models.profile import Profile

DECAY = 0.98  # per observation: old traffic fades, recent traffic decides
SMOOTH = 2.0  # pseudo-counts pulling a_i toward a_{i-1}
EXPLORE_EVERY = 64  # rounds between probes of a draft model the policy has written off
MARGIN = 0.05  # expected gain over plain decoding below which auto does not draft
WINDOW = 15  # recent verify times kept per batch size (their median is the estimate)
MIN_SEEN = 3  # verify times needed at a batch size before they replace the prior
OPTIMISTIC = 0.9  # acceptance a model draft reaches at best on easy text


def _default_v(n: int) -> float:
    # a CPU-like prior (DESIGN.md: 1.5B on 2 cores), replaced as soon as we measure
    return 1.0 + 0.3 * (min(n, 8) - 1) + 0.02 * max(0, n - 8)


class CostModel:
    """V(n): verify time for n tokens relative to one. From the calibration profile (or a
    CPU-like prior), replaced by the medians of the verify times this run measures once
    there are a few: the profile is measured on a short context, and at 1000 tokens of
    context V(4) is ~20% lower on a CPU. Medians shrug off the odd stalled round."""

    def __init__(self, profile: Profile | None, n_max: int, learn: bool = True) -> None:
        self.learn = learn  # False: the profile/prior only (reproducible decisions)
        self.n_max = n_max + 1
        self.prior = [profile.v(n) if profile else _default_v(n) for n in range(1, self.n_max + 1)]
        self.times: list[deque[float]] = [deque(maxlen=WINDOW) for _ in range(self.n_max + 1)]
        self._ratio: dict[int, float] | None = None  # measured/prior by size; None: stale
        self.c_model = profile.c if profile and profile.c else None
        self.t_token_s = profile.t_token_s if profile else None
        self.draft_token_s: float | None = None

    def observe_verify(self, n: int, seconds: float) -> None:
        if 1 <= n <= self.n_max:
            self.times[n].append(seconds)
            self._ratio = None

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            per = seconds / n_tokens
            old = self.draft_token_s
            self.draft_token_s = per if old is None else 0.8 * old + 0.2 * per

    def seconds(self, n: int) -> float | None:
        """Median measured verify time for n tokens, once there are enough rounds."""
        t = self.times[n]
        return statistics.median(t) if len(t) >= MIN_SEEN else None

    def v(self, n: int) -> float:
        """Measured where this run has measured; elsewhere the profile's (or prior's)
        shape, scaled by the measured/profile ratio interpolated from the nearest
        measured sizes: the profile knows where the kernels switch (a straight line
        from V(2) to V(16) would hide that V(5) costs half of V(10) on this CPU)."""
        n = min(max(n, 1), self.n_max)
        t1 = self.seconds(1)
        if not t1 or not self.learn:
            return self.prior[n - 1]
        if self._ratio is None:  # once per observation, not per v() call (best_k makes ~k)
            self._ratio = {m: s / t1 / self.prior[m - 1]
                           for m in range(1, self.n_max + 1) if (s := self.seconds(m))}
        ratio = self._ratio
        lo = max(m for m in ratio if m <= n)
        hi = min((m for m in ratio if m >= n), default=lo)
        r = ratio[lo] if hi == lo else ratio[lo] + (ratio[hi] - ratio[lo]) * (n - lo) / (hi - lo)
        return max(self.prior[n - 1] * r, 1.0)

    def c(self) -> float:
        t1 = (self.seconds(1) if self.learn else None) or self.t_token_s
        if self.draft_token_s and t1:
            return self.draft_token_s / t1
        return self.c_model if self.c_model is not None else 0.5


class AcceptModel:
    """Conditional acceptance by draft position, from decaying counts."""

    def __init__(self, prior: float, n_max: int) -> None:
        self.prior = prior
        self.reached = [0.0] * n_max
        self.accepted = [0.0] * n_max

    def rates(self, k: int) -> list[float]:
        out, prev = [], self.prior
        for i in range(k):
            prev = (self.accepted[i] + SMOOTH * prev) / (self.reached[i] + SMOOTH)
            out.append(prev)
        return out

    def decay(self) -> None:
        """A new observation begins: older ones weigh less."""
        for i in range(len(self.reached)):
            self.reached[i] *= DECAY
            self.accepted[i] *= DECAY

    def count(self, i: int, accepted: bool) -> None:
        """Position i was reached, and accepted or not."""
        if i < len(self.reached):
            self.reached[i] += 1.0
            self.accepted[i] += accepted

    def observe(self, n_draft: int, n_accept: int) -> None:
        """One verified draft: n_accept of its n_draft tokens accepted."""
        self.decay()
        for i in range(min(n_draft, n_accept + 1)):
            self.count(i, i < n_accept)


def expected_tokens(rates: Sequence[float]) -> float:
    """E = 1 + sum_j prod_{i<=j} a_i: tokens a round yields drafting len(rates) tokens."""
    return 1.0 + float(np.cumprod(rates).sum())


def best_k(rates: Sequence[float], cost: CostModel, c: float) -> tuple[int, float, float]:
    """(k, expected tokens, expected tokens per one-token time); k = 0 is plain decode."""
    best = (0, 1.0, 1.0 / cost.v(1))
    expected, survive = 1.0, 1.0
    for k, a in enumerate(rates, start=1):
        survive *= a
        expected += survive
        rate = expected / (cost.v(k + 1) + k * c)
        if rate > best[2]:
            best = (k, expected, rate)
    return best


# Prior acceptance by matched suffix length (tokens; 6 stands for 6 and more), a little
# below what the built-in workloads measure (first position: 0.22, 0.45, 0.6, 0.75 for
# 1-4 tokens on prompts, 0.95-0.98 for 6+ on edits). Candidates are scored in hindsight
# whether drafted or not, so a low prior costs a few plain rounds before the evidence
# lifts it; a high one costs failed verifies, which on short replies (~100 tokens of
# code) left auto 4-5% behind plain decoding.
NGRAM_PRIOR = {1: 0.2, 2: 0.35, 3: 0.5, 4: 0.6, 5: 0.8, 6: 0.95}


def _bucket(match_len: int) -> int:
    return min(match_len, 6)


class AutoDrafter(DrafterBase):
    """Chooses between n-gram, the draft model (when loaded) and no draft, each round."""

    name = "auto"

    def __init__(self, ngram: Drafter, model: Drafter | None, profile: Profile | None,
                 k_max: int = 32, learn_costs: bool = True) -> None:
        self.ngram = ngram
        self.model = model
        self.k_max = k_max
        self.cost = CostModel(profile, k_max, learn=learn_costs)
        self.ngram_acc = {b: AcceptModel(p, k_max) for b, p in NGRAM_PRIOR.items()}
        self.model_acc = AcceptModel(0.6, k_max)
        self._model_pays: bool | None = None  # the profile's verdict, when it has one
        if profile is not None and profile.c:
            calibrated = CostModel(profile, k_max, learn=False)
            self._model_pays = best_k([OPTIMISTIC] * k_max, calibrated, profile.c)[0] > 0
        self.rounds = 0
        # n-gram candidates not fully scored: (context length, candidate, bucket, scored)
        self._pending: list[tuple[int, list[int], int, int]] = []
        # (source, k, probe) -> [rounds, expected tokens, realised tokens]
        self.choices: dict[tuple[str, int, bool], list[float]] = {}
        self._last = ("none", 0, 1.0, False)  # (source, k, expected tokens, probe)

    def begin(self, prompt: Sequence[int]) -> None:
        self._pending = []
        self.ngram.begin(prompt)
        if self.model is not None:
            self.model.begin(prompt)

    def constrain(self, grammar: object | None) -> None:
        constrain(self.ngram, grammar)
        if self.model is not None:
            constrain(self.model, grammar)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self.rounds += 1
        k = min(k, self.k_max)
        self._settle(context)
        found = self.ngram.draft(context, k)
        plan = ("none", 0, 1.0, False)  # (source, k, expected tokens, probe)
        # drafting must beat plain decoding by a margin: where the gain is within the
        # noise of the cost and acceptance estimates, plain decoding is the safe bet
        best_rate = (1.0 + MARGIN) / self.cost.v(1)
        if found.tokens:
            b = _bucket(found.match_len)
            self.ngram_acc[b].decay()  # scored later against the target's tokens, drafted or not
            self._pending.append((len(context), found.tokens, b, 0))
            kk, exp, rate = best_k(self.ngram_acc[b].rates(len(found.tokens)), self.cost, 0.0)
            if kk and rate >= best_rate:
                plan, best_rate = ("ngram", kk, exp, False), rate
        if self.model is not None and self._model_could_pay(k):
            kk, exp, rate = best_k(self.model_acc.rates(k), self.cost, self.cost.c())
            if kk and rate >= best_rate and (plan[0] == "none" or rate > best_rate):
                plan, best_rate = ("model", kk, exp, False), rate
            elif plan[0] == "none" and self.rounds % EXPLORE_EVERY == EXPLORE_EVERY // 2:
                # probe: taken although it scores no better, so model_acc can learn; it
                # reports what the acceptance model expects of it, as a probe
                kk = min(2, k)
                plan = ("model", kk, expected_tokens(self.model_acc.rates(kk)), True)
        self._last = plan
        source, kk, _, _ = plan
        if source == "ngram":
            return Draft(tokens=found.tokens[:kk], source="ngram", match_len=found.match_len)
        if source == "model":
            d = self.model.draft(context, kk)
            d.source = "model"
            return d
        return Draft(source="none")

    def _settle(self, context: Sequence[int]) -> None:
        """Score earlier n-gram candidates against the tokens the target has produced
        since, position by position as they arrive: whether each would have been
        accepted had all of it been drafted (in greedy decoding exactly; sampled,
        P(token = candidate) is the accept rule's min(1, p / q) for a one-hot q). So
        acceptance at deep positions is learned although auto drafts short, and on text
        where it drafts nothing at all: no n-gram probes are needed."""
        keep = []
        for pos, cand, b, done in self._pending:
            acc, j = self.ngram_acc[b], done
            for tok in context[pos + done : pos + len(cand)]:
                hit = tok == cand[j]
                acc.count(j, hit)
                j += 1
                if not hit:
                    break
            else:
                if j < len(cand):
                    keep.append((pos, cand, b, j))
        self._pending = keep

    def _model_could_pay(self, k: int) -> bool:
        """Whether the draft model would pay even at an optimistic acceptance. Where it
        cannot (a CPU whose V(n) grows steeply, a draft that costs a third of the target),
        drafting with it only costs, and so does probing it: each probe re-syncs its KV
        cache over every token since the last one (~10% of decode time on this CPU at a
        probe per 64 rounds). With a profile that measured the draft, its verdict stands:
        a few lucky round times must not reopen the question."""
        if self._model_pays is None:
            return best_k([OPTIMISTIC] * max(k, 1), self.cost, self.cost.c())[0] > 0
        return self._model_pays

    def observe(self, n_draft: int, n_accept: int, verify_s: float, draft_s: float) -> None:
        source, _, expected, probe = self._last
        self.cost.observe_verify(n_draft + 1, verify_s)
        if source == "model" and n_draft:  # n-gram acceptance is learned in _settle
            self.model_acc.observe(n_draft, n_accept)
            self.cost.observe_draft(n_draft, draft_s)
        row = self.choices.setdefault((source, n_draft, probe), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += expected
        row[2] += n_accept + 1

    def report(self) -> dict:
        """How often each (drafter, k) was chosen, expected vs realised tokens per round;
        probes of a written-off draft model ("model:2 probe") apart from its choices."""
        return {
            f"{src}:{k}" + (" probe" if probe else ""):
                {"rounds": int(n), "expected": e / n, "realised": r / n}
            for (src, k, probe), (n, e, r) in sorted(self.choices.items())
        }
