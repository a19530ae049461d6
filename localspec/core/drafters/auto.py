"""`--spec auto`: each round, the drafter (n-gram, memory, draft model) and k that
maximise expected tokens per unit of time; k = 0, plain decoding, when nothing pays.

  E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i   tokens a round yields (a_i: P(accept i | i - 1 accepted))
  C(k) = V(k + 1) + k c                   its cost in one-token decode times (c: a draft token's)
  take   argmax_k E(k) / C(k), where it beats plain decoding's 1 / V(1) by MARGIN

A round (`AutoDrafter.draft`): copy_age.py scores earlier n-gram candidates against what the
target produced (in an edit, a draft copying the output's own earlier text apart from one
copying the file: the former at the plain prior, `NgramDraft.own`); each source's best k
is chosen (`choose`) over costs.GRID's verify sizes and the measured curve's dips; the
best source drafts, or a probe of a written-off draft model when one is due (`_plan`).
After the verify (`observe`): its time goes to costs.py, its acceptance to the source's
model, what it lost against plain decoding to the budget.
A verify size nobody measured is tried only where its worst case fits the budget
(`_affordable`); once drafting has lost more than the budget, every draft must promise
that much more (`deficit`). What a run measured goes to `store` at its end; a caller
that runs many short generations (the server) keeps one `Learned` across them. A round
slower than its n one-token decodes stalled and is counted at that bound. The tuning
constants and their reasons: core/tuning.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from localspec.core.drafters.base import Draft, Drafter, DrafterBase, constrain
from localspec.core.drafters.costs import Choice, CostModel, best_k, grid_sizes
from localspec.core.drafters.memory import MemoryDraft, MemoryDrafter
from localspec.core.drafters.ngram import NgramDraft, NgramSource
from localspec.core.drafters.copy_age import CopyAge
from localspec.core.tuning import (
    ACCEPT_DECAY,
    ACCEPT_SMOOTH,
    AUTO_DRAFT_MAX,
    BUDGET,
    BUDGET_FREE,
    EXPLORE_EVERY,
    EXPLORE_MIN,
    MARGIN,
    MIN_EXTRA,
    MODEL_K_MAX,
    MODEL_PRIOR,
    MODEL_REACH,
    MODEL_REACH_GROWTH,
    OPTIMISTIC,
    PROBE_K,
    TRY_BUDGET,
)
from localspec.profile import Profile

__all__ = ["AcceptModel", "AutoDrafter", "Choice", "CostModel", "Learned", "Plan", "best_k",
           "expected_tokens"]


class AcceptModel:
    """Conditional acceptance by draft position, from decaying counts."""

    def __init__(self, prior: float, n_max: int) -> None:
        self.prior = prior
        self.reached = [0.0] * n_max
        self.accepted = [0.0] * n_max

    def rates(self, k: int) -> list[float]:
        out, prev = [], self.prior
        for i in range(k):
            prev = (self.accepted[i] + ACCEPT_SMOOTH * prev) / (self.reached[i] + ACCEPT_SMOOTH)
            out.append(prev)
        return out

    def decay(self) -> None:
        """A new observation begins: older ones weigh less."""
        for i in range(len(self.reached)):
            self.reached[i] *= ACCEPT_DECAY
            self.accepted[i] *= ACCEPT_DECAY

    def count(self, i: int, accepted: bool) -> None:
        """Position i was reached, and accepted or not."""
        if i < len(self.reached):
            self.reached[i] += 1.0
            self.accepted[i] += accepted

    def observe(self, n_draft: int, n_accept: int, planned: int | None = None) -> None:
        """One verified draft: n_accept of its n_draft tokens accepted. A draft that
        stopped short of the `planned` length (the draft model unsure of its next token)
        gained nothing beyond where it stopped: that position counts as not accepted, or
        drafts that stop early but are always right would promise long runs."""
        self.decay()
        reach = n_draft if planned is None else max(n_draft, min(planned, n_accept + 1))
        for i in range(min(reach, n_accept + 1)):
            self.count(i, i < n_accept)


class SpentShare:
    """The share of a draft-model plan's full cost (verify k + 1, draft k) that rounds
    planned at k actually spent, from decaying means per planned k: the draft model
    stops where it is unsure (`--draft-p-min`), so a plan of 8 often drafts 3. Measured,
    not derived from acceptance: a draft that goes wrong without stopping costs in full
    here. A plan length not seen yet takes the share of the next shorter one seen (in
    full, 1.0, below all of them), toward which each mean is pulled by ACCEPT_SMOOTH."""

    def __init__(self) -> None:
        self.weight: dict[int, float] = {}
        self.total: dict[int, float] = {}

    def observe(self, planned: int, share: float) -> None:
        for k in self.weight:
            self.weight[k] *= ACCEPT_DECAY
            self.total[k] *= ACCEPT_DECAY
        self.weight[planned] = self.weight.get(planned, 0.0) + 1.0
        self.total[planned] = self.total.get(planned, 0.0) + min(1.0, share)

    def __call__(self, k: int) -> float:
        out = 1.0
        for m in sorted(self.weight):
            if m > k:
                break
            out = (self.total[m] + ACCEPT_SMOOTH * out) / (self.weight[m] + ACCEPT_SMOOTH)
        return out


class Plan(NamedTuple):
    """One round's choice: which drafter drafts how many tokens, and what it promises."""

    source: str = "none"  # "ngram", "model", or "none" (plain decoding)
    k: int = 0
    expected: float = 1.0  # tokens the round is expected to yield
    probe: bool = False  # a look at a written-off draft model, taken although it scores no better


PLAIN = Plan()


class Drafted(NamedTuple):
    """What a round drafted, as `report` counts it."""

    source: str
    k: int  # tokens drafted (a draft model may stop short of its plan)
    probe: bool


@dataclass
class Tally:
    """The rounds of one kind, and the tokens they were expected to and did yield."""

    rounds: int = 0
    expected: float = 0.0
    realised: float = 0.0


class Learned:
    """What auto learns of a machine and its traffic, carried from one generation to the
    next by a caller that runs many short ones (the server: one per process, shared by
    its slots): the verify times (CostModel) and how long n-gram copies lasted
    (CopyAge's counts). A completion request is a few dozen tokens: too few rounds to
    time the sizes and score candidate runs anew each time, so each began with three
    plain rounds (no one-token time yet) and drafted at the prior's acceptance."""

    def __init__(self) -> None:
        self.cost: CostModel | None = None
        self.runs: dict[bool, tuple[np.ndarray, np.ndarray]] = {}

    def costs(self, profile: Profile | None, k_max: int, learn: bool) -> CostModel:
        """The cost model the generations share (made from `profile` for the first)."""
        if self.cost is None or self.cost.n_max != k_max + 1 or self.cost.learn != learn:
            self.cost = CostModel(profile, k_max, learn=learn)
        return self.cost

    def run_counts(self, copying: bool) -> tuple[np.ndarray, np.ndarray]:
        """CopyAge's counts for generations that copy a given text (`copying`: an edit,
        a request's `prediction`) or not: those runs last far longer."""
        return self.runs.setdefault(copying, CopyAge.fresh_counts())


def expected_tokens(rates: Sequence[float]) -> float:
    """E = 1 + sum_j prod_{i<=j} a_i: tokens a round yields drafting len(rates) tokens."""
    return 1.0 + float(np.cumprod(rates).sum())


class AutoDrafter(DrafterBase):
    """Chooses between n-gram, the memory (when given), the draft model (when loaded)
    and no draft, each round."""

    name = "auto"

    def __init__(self, ngram: NgramSource, model: Drafter | None, profile: Profile | None,
                 k_max: int = AUTO_DRAFT_MAX, learn_costs: bool = True,
                 store: Callable[[dict[int, tuple[float, int]], float], None] | None = None,
                 memory: MemoryDrafter | None = None, learned: Learned | None = None) -> None:
        self.ngram = ngram
        self.model = model
        self.memory = memory  # earlier outputs and the context by frequency (memory.py)
        self.k_max = k_max
        # `learned`: what earlier generations measured, shared with later ones
        self.cost = (learned.costs(profile, k_max, learn_costs) if learned is not None
                     else CostModel(profile, k_max, learn=learn_costs))
        self._grid = np.array(grid_sizes(k_max + 1))  # the verify sizes choose() weighs
        self.runs = CopyAge(learned.run_counts(ngram.copying) if learned is not None else None)
        # ... and of drafts copying the output's own text where a text to copy is given: those
        # last as long as any generation's (NgramDraft.own)
        self.own_runs = CopyAge(learned.run_counts(False) if learned is not None else None)
        self._stakes_gains = learned is None  # whether a trial may spend what drafting gained (`_affordable`)
        self.model_acc = AcceptModel(MODEL_PRIOR, k_max)
        self.model_spent = SpentShare()
        self._model_pays: bool | None = None  # the profile's verdict, when it has one
        if profile is not None and profile.c and profile.vcurve:
            calibrated = CostModel(profile, k_max, learn=False)
            self._model_pays = best_k([OPTIMISTIC] * min(k_max, MODEL_K_MAX), calibrated, profile.c).k > 0
        self.store = store  # called at the end of each generation with what it measured
        self.rounds = 0
        self._model_reach = MODEL_REACH  # longest draft-model plan (MODEL_REACH_GROWTH)
        self._explore_every = EXPLORE_EVERY
        self._last_probe = -EXPLORE_EVERY // 2  # the first probe comes half a wait in
        self.lost = 0.0  # one-token times drafting has cost beyond plain decoding's, measured
        self.produced = 0  # tokens produced (plain decoding's time for them, in one-token times)
        self.tried = 0.0  # one-token times trying unmeasured sizes cost beyond the best measured choice
        self._best_known = 1.0  # the best measured choice's rate when this round was chosen
        self._trying = False  # this round verifies a size not measured before
        self.tally: dict[Drafted, Tally] = {}
        self._last = PLAIN  # this round's plan, for `observe`

    def begin(self, prompt: Sequence[int]) -> None:
        self.cost.context(len(prompt))  # the profile's V(n) measured nearest this context
        self.runs.reset(len(prompt), copying=self.ngram.copying, predicted=self.ngram.predicting)
        self.own_runs.reset(len(prompt))
        self.ngram.begin(prompt)
        if self.model is not None:
            self.model.begin(prompt)
        if self.memory is not None:
            self.memory.begin(prompt)

    def finished(self, tokens: Sequence[int]) -> None:
        if self.memory is not None:
            self.memory.finished(tokens)

    def constrain(self, grammar: object | None) -> None:
        constrain(self.ngram, grammar)
        if self.model is not None:
            constrain(self.model, grammar)

    def draft(self, context: Sequence[int], k: int) -> Draft:
        """One round: score earlier n-gram candidates in hindsight, plan, draft the plan."""
        self.rounds += 1
        k = min(k, self.k_max)
        self.runs.settle(context)  # score earlier candidates against what the target produced
        self.own_runs.settle(context)
        found = self.ngram.draft(context, k)
        recalled = self.memory.draft(context, k) if self.memory is not None else None
        plan = self._plan(context, k, found, recalled)
        self._last = plan
        self._trying = bool(plan.k) and not self.cost.settled(plan.k + 1)
        if plan.source == "ngram":
            return NgramDraft(tokens=found.tokens[:plan.k], source="ngram", match_len=found.match_len,
                              run_len=found.run_len, own=getattr(found, "own", False))
        if plan.source == "memory":
            return MemoryDraft(tokens=recalled.tokens[:plan.k], source="memory",
                               match_len=recalled.match_len, support=recalled.support[:plan.k])
        if plan.source == "model":
            d = self.model.draft(context, plan.k)
            d.source = "model"
            return d
        return Draft(source="none")

    def _plan(self, context: Sequence[int], k: int, found: Draft, recalled: Draft | None) -> Plan:
        """The best-scoring of the n-gram draft, the memory's (`recalled`) and the draft
        model's, each at its best length; it must beat plain decoding by MARGIN. Else a
        probe of the draft model when one is due, else plain decoding."""
        runs = self.own_runs if getattr(found, "own", False) else self.runs
        if found.tokens:
            age = runs.offer(len(context), found.tokens, max(found.run_len, found.match_len))
        plan = PLAIN
        # drafting must beat plain decoding by a margin: where the gain is within the
        # noise of the cost and acceptance estimates, plain decoding is the safe bet
        best_rate = (1.0 + MARGIN) / self.cost.v(1)
        if found.tokens:
            ngram = self.choose(runs.rates(age, len(found.tokens)), 0.0)
            if ngram.k and ngram.rate >= best_rate:
                plan, best_rate = Plan("ngram", ngram.k, ngram.expected), ngram.rate
        if recalled is not None and recalled.tokens:  # weighed by its learned acceptance
            memory = self.choose(self.memory.rates(recalled), 0.0)
            if memory.k and memory.rate > best_rate:
                plan, best_rate = Plan("memory", memory.k, memory.expected), memory.rate
        if self.model is None or not self._model_could_pay(k):
            return plan
        model = self.choose(self.model_acc.rates(min(k, MODEL_K_MAX, self._model_reach)), self.cost.c(),
                            self.model_spent)
        if model.k and model.rate >= best_rate and (plan.source == "none" or model.rate > best_rate):
            return Plan("model", model.k, model.expected)
        if plan.source == "none" and self.rounds - self._last_probe >= self._explore_every:
            # probe: taken although it scores no better, so model_acc can learn; it
            # reports what the acceptance model expects of it, as a probe
            self._last_probe = self.rounds
            kk = min(PROBE_K, k)
            return Plan("model", kk, expected_tokens(self.model_acc.rates(kk)), probe=True)
        return plan

    def choose(self, rates: Sequence[float], c: float,
               spent: Callable[[int], float] | None = None) -> Choice:
        """The best draft length for drafts of up to len(rates) tokens: the best measured
        verify size, or an unmeasured one that may be better still (judged by `hope`)
        where the budgets cover its worst case; k = 0 (plain decoding: 1 token, 1 / V(1))
        when no draft beats plain decoding by MARGIN. `spent(k)`: the share of a k-token
        plan's cost it is expected to spend (a draft model's early stops)."""
        t = self.cost.tables()
        plain = Choice(0, 1.0, 1.0 / float(t.v[1]))
        if not len(rates):
            return plain
        expected = 1.0 + np.cumsum(np.cumprod(rates))  # expected[k - 1] = E(k)
        n_top = len(rates) + 1
        # GRID's sizes (unmeasured ones are tried on a budget) and the measured curve's dips
        ns = self._grid[(self._grid >= 2) & (self._grid < n_top)]
        if t.dips:
            ns = np.union1d(ns, [m for m in t.dips if 2 <= m < n_top]).astype(int)
        ns = np.append(ns, n_top)
        at = np.minimum(ns, self.cost.n_max)  # sizes past the tables priced as their last
        e = expected[ns - 2]
        # rate at a verify time v: scale / (v + drafting), in tokens per one-token time
        scale = e / np.array([spent(n - 1) for n in ns.tolist()]) if spent is not None else e
        drafting = (ns - 1) * c
        settled, known = t.settled[at], t.known[at]
        # settled: at its estimate; timed once or twice: at its worst case, no budget;
        # never timed (and timed once or twice): at its hope, on a budget
        worst = np.where(settled, t.v[at], t.upper[at])
        sure = settled | known
        rates_known = scale / (worst + drafting)
        best = plain
        if sure.any():
            i = int(np.argmax(np.where(sure, rates_known, -np.inf)))
            if rates_known[i] > plain.rate:
                best = Choice(int(ns[i]) - 1, float(e[i]), float(rates_known[i]))
        self._best_known = best.rate
        hopes = scale / (t.hope[at] + drafting)
        for i in np.argsort(-hopes, kind="stable").tolist():
            if settled[i]:
                continue
            if hopes[i] <= best.rate:
                break
            if self._affordable(int(ns[i]), float(e[i]), c, best.rate):
                best = Choice(int(ns[i]) - 1, float(e[i]), float(hopes[i]))
                break
        worth = (best.rate >= (1.0 + MARGIN + self.deficit()) / self.cost.v(1)
                 and best.expected >= 1.0 + MIN_EXTRA)
        return best if worth else plain

    def deficit(self) -> float:
        """What drafting has lost to plain decoding beyond the budget, as a share of plain
        decoding's time for what was produced (0 when within it). While it is positive the
        estimates have proven optimistic on this text, and a draft must promise that much
        more: auto drafts only its surest bets until plain rounds have paid the loss back."""
        if not self.cost.learn or not self.produced:
            return 0.0
        return max(0.0, self.lost - BUDGET * self.produced - BUDGET_FREE) / self.produced

    def _affordable(self, n: int, expected: float, c: float, best_rate: float) -> bool:
        """Whether trying unmeasured size n fits both budgets at its worst case: what
        drafting has lost against plain decoding, and what trying sizes has lost
        against the best measured choice (each round measured, once tried). A size
        tried once is measured and from then on weighed at its worst case with no
        budget, so one failed trial cannot keep a run at plain decoding; a well-accepted
        long copy fits at once (its worst case, n one-token decodes, buys about n
        tokens), so an edit climbs to long drafts in its first rounds. Where what is
        measured is kept for later generations (`Learned`: a server's requests), a trial
        serves them all but is paid by one, often a short one (a keystroke's completion
        within 500 ms): there it stakes none of what drafting gained before it (a request
        that staked its first rounds' gains on a 16-token trial, rejected at once, ended
        behind plain decoding)."""
        if not self.cost.learn:
            return True
        if self.cost.t1() is None:
            return False  # no one-token time yet to judge a trial by: measured sizes only
        worst = self.cost.upper(n) + (n - 1) * c
        lost, tried = self.lost, self.tried
        if not self._stakes_gains:
            lost, tried = max(lost, 0.0), max(tried, 0.0)
        return (lost + worst - expected <= BUDGET * self.produced + BUDGET_FREE
                and tried + worst - expected / best_rate <= TRY_BUDGET * self.produced + BUDGET_FREE)

    def _model_could_pay(self, k: int) -> bool:
        """Whether the draft model would pay even at an optimistic acceptance. Where it
        cannot (a CPU whose V(n) grows steeply, a draft that costs a third of the target),
        drafting with it only costs, and so does probing it: each probe re-syncs its KV
        cache over every token since the last one (docs/measurements.md). With a profile
        that measured the draft, its verdict stands: a few lucky round times must not
        reopen the question."""
        if self._model_pays is None:
            return best_k([OPTIMISTIC] * max(min(k, MODEL_K_MAX), 1), self.cost, self.cost.c()).k > 0
        return self._model_pays

    def promise(self) -> float | None:
        return self._last.expected

    def withdrawn(self) -> None:
        self._last, self._trying = PLAIN, False

    def observe(self, n_draft: int, n_accept: int, verify_s: float | None, draft_s: float) -> None:
        plan = self._last
        t1 = self.cost.t1()
        if verify_s is None:  # decoded with other sequences' rows: not timed, priced at the estimate
            verify_s = self.cost.v(n_draft + 1) * t1 if t1 else 0.0
        else:
            if n_draft and t1:
                # a verify of n tokens costs at most n one-token decodes: a round that took
                # longer stalled (another process had the cores), as plain rounds do too.
                # Taken in full, one stalled round of a size tried once priced it and its
                # neighbours out for good, and its loss shut drafting off for the whole run
                verify_s = min(verify_s, (n_draft + 1) * t1)
            self.cost.observe_verify(n_draft + 1, verify_s)
        if n_draft and t1:  # what this round cost beyond plain decoding of the same tokens
            spent = (verify_s + draft_s) / t1
            self.lost += spent - (n_accept + 1)
            if self._trying:  # ... and beyond the best measured choice
                self.tried += spent - (n_accept + 1) / self._best_known
        self.produced += n_accept + 1
        if plan.probe and n_draft:  # a probe that came back whole: look again sooner
            full = n_accept == n_draft
            self._explore_every = (max(EXPLORE_MIN, self._explore_every // 2) if full
                                   else min(EXPLORE_EVERY, 2 * self._explore_every))
        if plan.source == "model" and n_draft:  # n-gram acceptance is learned in hindsight (copy_age.py)
            self.model_acc.observe(n_draft, n_accept, plan.k)
            c = self.cost.c()
            self.model_spent.observe(plan.k, (self.cost.v(n_draft + 1) + n_draft * c)
                                     / (self.cost.v(plan.k + 1) + plan.k * c))
            self._model_reach = max(self._model_reach, MODEL_REACH_GROWTH * n_accept)
            self.cost.observe_draft(n_draft, draft_s)
        row = self.tally.setdefault(Drafted(plan.source, n_draft, plan.probe), Tally())
        row.rounds += 1
        row.expected += plan.expected
        row.realised += n_accept + 1

    def report(self) -> dict:
        """How often each (drafter, k) was chosen, expected vs realised tokens per round;
        probes of a written-off draft model ("model:2 probe") apart from its choices."""
        return {
            f"{kind.source}:{kind.k}" + (" probe" if kind.probe else ""):
                {"rounds": t.rounds, "expected": t.expected / t.rounds, "realised": t.realised / t.rounds}
            for kind, t in sorted(self.tally.items())
        }

    def end(self) -> None:
        """What this generation measured goes to `store` (the profile)."""
        t1 = self.cost.t1()
        if self.store is not None and t1:
            self.store(self.cost.measured(), t1)
