"""Drift alert: has acceptance for a (target, draft, drafter, tag) group clearly fallen?

Acceptance α is a property of the draft/target pair *on this traffic*; a drop is the
leading sign that the draft stopped matching what the user asks (a model swap, a new
prompt style, a new kind of file). Speedup follows α steeply: with k = 8, expected
tokens per round E = (1 − α^(k+1)) / (1 − α) falls from 3.2 at α = 0.7 to 2.5 at 0.6.

The rule, per group, over runs that drafted at least MIN_DRAFTED tokens, in time order:

  recent  = the last RECENT (5) runs
  history = up to HISTORY (20) runs just before them; at least MIN_HISTORY (10)
  drop    = mean(history) − mean(recent)
  se      = sqrt(var(history)/n_history + var(recent)/n_recent)   (Welch)
  alert when drop > max(FLOOR, K · se), FLOOR = 0.10, K = 3

Why this shape:
- Per-run acceptance varies a lot with the prompt (a run that copies its context
  accepts 95%, a free-form one 30%), so a drop must be judged against the group's
  own spread, not a fixed number: hence the standard error of the difference of means.
  Welch's form (each side its own variance) keeps one odd recent run from alarming:
  it raises var(recent) along with lowering the mean. Four 0.72s and one 0.0 move the
  recent mean by 0.14 but also raise the se to 0.14: far from 3 se.
- K = 3: under no change and a normal approximation that is a 0.1% one-sided false
  alarm; with only 5 recent runs the variance estimate is rough (a t with ~4 degrees
  of freedom puts 3.0 near 2%), and `stats` re-checks the same windows every time it
  runs, so the bar is set high. An alert should mean "look at this", not noise.
- FLOOR = 0.10 (10 points of α): on a very steady series a 3-point dip can be
  "significant" yet changes the speedup little; below 10 points it is not worth a
  warning. 10 points is about where E at typical k drops by a fifth.
- RECENT = 5 reacts within a working session while averaging over prompts;
  HISTORY = 20 keeps "its own history" to the recent regime rather than last month's;
  MIN_HISTORY = 10 because a mean and variance from fewer runs are too unsure to
  compare against. Fewer runs than RECENT + MIN_HISTORY: no verdict, no alert.
- MIN_DRAFTED = 8: a run that drafted 2 tokens has an acceptance of 0, 0.5 or 1;
  such runs carry no signal about the pair and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from localspec.acceptance.logdb import Record

RECENT = 5
HISTORY = 20
MIN_HISTORY = 10
FLOOR = 0.10
K_SE = 3.0
MIN_DRAFTED = 8


@dataclass(frozen=True)
class DriftAlert:
    target: str
    draft: str | None
    drafter: str
    tag: str
    before: float  # mean acceptance of the history window
    after: float  # mean acceptance of the recent window
    n_recent: int
    n_history: int
    threshold: float  # the drop that was needed: max(FLOOR, K_SE * se)

    @property
    def pair(self) -> str:
        return pair_label(self.target, self.draft, self.drafter)

    def message(self) -> str:
        return (
            f"acceptance for {self.pair} on {self.tag} fell from {self.before:.0%} to "
            f"{self.after:.0%} over the last {self.n_recent} runs "
            f"(previous {self.n_history} runs; drop > {self.threshold:.0%} needed)"
        )

    def to_dict(self) -> dict:
        return {
            "target": self.target, "draft": self.draft, "drafter": self.drafter,
            "tag": self.tag, "before": self.before, "after": self.after,
            "n_recent": self.n_recent, "n_history": self.n_history,
            "threshold": self.threshold, "message": self.message(),
        }  # fmt: skip


def pair_label(target: str, draft: str | None, drafter: str) -> str:
    """'qwen2.5-coder-1.5b + ngram', or with a draft model '... + qwen2.5-coder-0.5b (hybrid)'."""
    if draft:
        return f"{target} + {draft} ({drafter})"
    return f"{target} + {drafter}"


def check(
    series: Sequence[float],
    *,
    recent: int = RECENT,
    history: int = HISTORY,
    min_history: int = MIN_HISTORY,
    floor: float = FLOOR,
    k: float = K_SE,
) -> tuple[float, float, int, float] | None:
    """Apply the rule to acceptances in time order. Returns (history mean, recent mean,
    history size, threshold) when the recent window fell clearly, else None."""
    if len(series) < recent + min_history:
        return None
    new = list(series[-recent:])
    old = list(series[-recent - history : -recent])
    m_old, m_new = _mean(old), _mean(new)
    se = math.sqrt(_var(old) / len(old) + _var(new) / len(new))
    threshold = max(floor, k * se)
    if m_old - m_new > threshold:
        return m_old, m_new, len(old), threshold
    return None


def detect(records: Iterable[Record], **rule) -> list[DriftAlert]:
    """Drift alerts for every group in `records` (in time order); `rule` overrides
    check()'s parameters."""
    series: dict[tuple, list[float]] = {}
    for r in records:
        if r.acceptance is not None and r.drafted >= MIN_DRAFTED:
            series.setdefault(r.key, []).append(r.acceptance)
    alerts = []
    for key, values in series.items():
        hit = check(values, **rule)
        if hit is not None:
            before, after, n_hist, threshold = hit
            n_recent = rule.get("recent", RECENT)
            alerts.append(DriftAlert(*key, before, after, n_recent, n_hist, threshold))
    return alerts


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _var(xs: Sequence[float]) -> float:
    """Sample variance (n − 1); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
