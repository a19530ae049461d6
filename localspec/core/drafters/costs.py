"""What verifying costs, for the auto policy: V(n), the time to verify n tokens in one
batch relative to decoding one, as far as this machine has shown it.

Where V comes from, best first: the verify times this run measures (medians per batch
size: the odd stalled round does not move them), what earlier runs measured and stored
(`Profile.online`), `localspec tune`'s curve at the context band nearest this
generation's (to 64 after a short context, to 256 after 1,024 tokens), and beyond all
of those a guess. Sizes nobody measured are scaled by the measured/stored ratio at
the nearest measured sizes, so the stored shape (where the kernels switch: V(8) can cost
more than V(16)) survives a change of context length or load.

A size is *known* once measured (tune, a stored run, or a verify in this run). For an
unknown size the policy also needs a worst case: `upper(n)` assumes no better per-token
cost than the largest known size below it shows, less a jag allowance, and never more
than n one-token decodes. The guess itself (`estimate`) is optimistic on purpose: it only
decides which size to try next, and trying is paid from a budget (see auto.py).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from typing import NamedTuple

import numpy as np

from localspec.core.tuning import (
    C_GUESS,
    DIP,
    DRAFT_TIME_WEIGHT,
    GRID,
    JAG,
    MIN_SEEN,
    REBUILD_MOVE,
    STEADY,
    WINDOW,
)
from localspec.profile import Profile


class Choice(NamedTuple):
    """A draft length and what it promises; k = 0 is plain decoding."""

    k: int
    expected: float  # tokens the round yields
    rate: float  # expected tokens per one-token decode time


class CostTables(NamedTuple):
    """What the policy asks of V, for every verify size n (indexed by n; 0 unused)."""

    v: np.ndarray  # the estimate (`CostModel.v`)
    hope: np.ndarray  # optimistic, to choose which size to try (`CostModel.hope`)
    upper: np.ndarray  # a worst case (`CostModel.upper`)
    known: np.ndarray  # measured at all
    settled: np.ndarray  # measured well enough to act on
    dips: list[int]  # settled sizes between GRID's well below their chord (`CostModel.dips`)


def grid_sizes(n_max: int) -> list[int]:
    """Verify sizes (draft length + 1) up to n_max: GRID's, and n_max itself."""
    sizes = [n for n in GRID if n <= n_max]
    return sizes if sizes[-1] == n_max else [*sizes, n_max]


def extend(sizes: list[int], values: list[float], n_max: int) -> np.ndarray:
    """V(1..n_max) from V at `sizes` (ascending, starting at 1): linear between them;
    past the last, m, linear with the slope over the upper half of the measured range
    (exact for a GPU's flat line, a little high for a CPU's concave curve), kept
    between V(m) and V(m) * n / m. From V(1) alone, the guess sqrt(n): between a GPU
    (nearly flat) and a 2-core CPU (nearly linear)."""
    n = np.arange(1, n_max + 1, dtype=float)
    curve = np.interp(n, sizes, values)
    m, vm = sizes[-1], values[-1]
    if m >= n_max:
        return curve
    beyond = n[m:]
    if m == 1:
        curve[m:] = np.sqrt(beyond)
        return curve
    h = max(bisect.bisect_right(sizes, m / 2) - 1, 0)  # the last size in the lower half
    slope = (vm - values[h]) / (m - sizes[h])
    curve[m:] = np.clip(vm + slope * (beyond - m), vm, vm * beyond / m)
    return curve


def _base_curve(profile: Profile | None, n_max: int, n_ctx: int | None = None) -> tuple[list[float], list[int]]:
    """(V(1..n_max), how well each is measured: 0 not, 1 by a round or two of an
    earlier run, 2 by tune or STEADY rounds) from the profile's curve for a context of
    n_ctx tokens (`Profile.curve_for`) and its stored on-line points (extended as
    `extend` does)."""
    points, level = {1: 1.0}, {1: 2}
    if profile is not None:
        points.update({n: float(v) for n, v in enumerate(profile.curve_for(n_ctx)[:n_max], start=1)})
        level.update({n: 2 for n in points})
        for n, v in profile.online_v().items():
            if n <= n_max:
                points[n] = v
                level[n] = 2 if n in profile.online_v(STEADY) else max(level.get(n, 0), 1)
    sizes = sorted(points)
    curve = extend(sizes, [points[m] for m in sizes], n_max)
    return [float(x) for x in curve], [level.get(n, 0) for n in range(1, n_max + 1)]


class CostModel:
    """V(n) for n = 1..n_max + 1: measured, stored, tuned or guessed (module docstring).
    Every table is rebuilt once per observed round, not per query: auto asks ~40
    sizes a round."""

    def __init__(self, profile: Profile | None, n_max: int, learn: bool = True) -> None:
        self.learn = learn  # False: the profile/prior only (reproducible decisions)
        self.n_max = n_max + 1
        self._grid = np.array(grid_sizes(self.n_max))  # where dips() draws its chords
        self.profile = profile
        self.n_ctx: int | None = None  # the context the prior's band was chosen for
        self._set_prior(*_base_curve(profile, self.n_max))
        self.times: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}
        self._t1: tuple[float | None] | None = None  # t1() until a time or the prior changes
        self._tables: CostTables | None = None  # built on first use after a change
        self.c_model = profile.c if profile and profile.c else None
        self.t_token_s = profile.t_token_s if profile else None
        self.draft_token_s: float | None = None

    def context(self, n_ctx: int) -> None:
        """A generation begins at a context of n_ctx tokens: the prior becomes the
        profile's curve measured nearest that context (a short one for a chat turn, a
        long one for an edit). This run's measured times stay as they are."""
        if self.profile is None or self.n_ctx == n_ctx:
            return
        self.n_ctx = n_ctx
        prior, level = _base_curve(self.profile, self.n_max, n_ctx)
        if prior != self.prior:
            self._set_prior(prior, level)
            self._tables = self._t1 = None

    def _set_prior(self, prior: list[float], level: list[int]) -> None:
        """The curve before this run's times (V(1..n_max)) and how well each size of it
        is measured, with what every rebuild of the tables reads of them."""
        self.prior, self.prior_level = prior, np.array([0, *level])  # by n (index 0 unused)
        self._prior_v = np.array(prior)  # by n - 1
        self._prior_known = self.prior_level[1:] > 0  # by n - 1
        self._prior_sizes = set((np.flatnonzero(self._prior_known) + 1).tolist())
        # the stored curve's own dips (sizes well below its chord): see _build
        full, at = np.array([1.0, *prior]), np.arange(self.n_max + 1)
        self._stored_dips = (self.prior_level == 2) & (
            full < (1.0 - DIP) * np.interp(at, self._grid, full[self._grid]))

    def observe_verify(self, n: int, seconds: float) -> None:
        if 1 <= n <= self.n_max:
            t = self.times.setdefault(n, deque(maxlen=WINDOW))
            t.append(seconds)
            self._t1 = None
            old, new = self._median.get(n), statistics.median(t)
            self._median[n] = new
            # rebuild when a size is first timed, settles, or its median moves
            if old is None or len(t) == STEADY or abs(new - old) > REBUILD_MOVE * old:
                self._tables = None

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            per = seconds / n_tokens
            old = self.draft_token_s
            self.draft_token_s = per if old is None else ((1.0 - DRAFT_TIME_WEIGHT) * old
                                                          + DRAFT_TIME_WEIGHT * per)

    def seconds(self, n: int, min_seen: int = MIN_SEEN) -> float | None:
        """Median measured verify time for n tokens, once there are min_seen rounds."""
        return self._median[n] if len(self.times.get(n, ())) >= max(min_seen, 1) else None

    def t1(self) -> float | None:
        """Seconds per one-token decode in this run: measured, or where plain rounds are
        rare (every round drafts), inferred from sizes verified STEADY times whose V the
        profile knows well (tune or STEADY rounds of earlier runs); None until then.
        Asked several times a round: kept until a verify is timed or the prior changes."""
        if self._t1 is None:
            self._t1 = (self._infer_t1(),)
        return self._t1[0]

    def _infer_t1(self) -> float | None:
        own = self.seconds(1, STEADY)
        if own is not None or not self.learn:
            return own
        for level in (2, 1):
            guesses = [self._median[n] / self.prior[n - 1] for n, t in self.times.items()
                       if n > 1 and len(t) >= STEADY and self.prior_level[n] == level]
            if guesses:
                return statistics.median(guesses)
        return None

    def tables(self) -> CostTables:
        """The tables for what has been observed so far."""
        if self._tables is None:
            self._tables = self._build()
        return self._tables

    def _at(self, n: int) -> int:
        return min(max(n, 1), self.n_max)

    def v(self, n: int) -> float:
        """V(n): this run's median where it has verified n tokens (one round is enough
        for an estimate); at sizes the profile measured, its shape scaled by the ratio
        of this run's times to it, interpolated from the nearest sizes measured now (the
        profile knows where kernels switch, which a straight line between the sizes
        measured now would hide); elsewhere as `extend` does."""
        return float(self.tables().v[self._at(n)])

    def hope(self, n: int) -> float:
        """An optimistic V(n), to choose which size to try: for one timed once or twice,
        its estimate less the noise of a round time (an unlucky round must not rule a
        good size out for good); for one never timed, the estimate, or less where the
        nearest measured size below would give V(m) * sqrt(n / m) (a concave CPU
        curve's linear extension is too dear to ever be tried)."""
        return float(self.tables().hope[self._at(n)])

    def upper(self, n: int) -> float:
        """A worst case for V(n): V(n) where settled, JAG x V(n) where timed once or
        twice; else no better per token than the largest measured size below n (less a
        jag of JAG), and at most n decodes."""
        return float(self.tables().upper[self._at(n)])

    def known(self, n: int) -> bool:
        """Measured at all: by tune, by an earlier run, or in this one."""
        return bool(self.tables().known[self._at(n)])

    def settled(self, n: int) -> bool:
        """Measured well enough to act on without a second look: by tune, STEADY rounds
        of earlier runs or of this one (one round time on a busy machine is not enough)."""
        return bool(self.tables().settled[self._at(n)])

    def dips(self) -> list[int]:
        """Settled sizes between GRID's whose V lies DIP or more below the straight line
        between the GRID sizes around them, ascending: a jagged CPU curve's cheap points,
        which auto weighs besides GRID's sizes. A smooth curve has none, so its choices
        stay on GRID. Where the dips lie can move between measurements of one machine
        (docs/measurements.md): a dip is used as measured, and once drafted for it is
        timed on-line like any size, so a lucky measurement costs a few rounds."""
        return self.tables().dips

    def _build(self) -> CostTables:
        rounds = np.zeros(self.n_max + 1, dtype=int)
        if self.learn:
            for m, t in self.times.items():
                rounds[m] = len(t)
        known = (self.prior_level > 0) | (rounds >= MIN_SEEN)
        settled = (self.prior_level == 2) | (rounds >= STEADY) | (not self.learn)
        known[1] = settled[1] = True
        v = np.concatenate(([0.0], self._estimate() if self.learn and self.t1() else self._prior_v))
        below = np.maximum.accumulate(np.where(known, np.arange(self.n_max + 1), 1))
        below = np.concatenate(([1], below[:-1]))  # the largest known size < n
        n = np.arange(self.n_max + 1, dtype=float)
        n[0] = 1.0
        vb = v[below]
        hope = np.where(settled, v, np.where(known, np.maximum(v / JAG, 1.0),
                                             np.maximum(np.minimum(v, vb * np.sqrt(n / below)), 1.0)))
        upper = np.where(settled, v, np.where(known, JAG * v,
                                              np.maximum(np.minimum(n, JAG * vb * n / below), v)))
        # a dip must be one in a single source: the stored curve against its own chord
        # (tune's or earlier runs' measurements), or sizes this run verified STEADY times.
        # Judged on the mix, a stored shape scaled to this run's dearer sizes falls below
        # every chord they end (a profile timed at a short context, an edit verifying
        # after 1,500 tokens) and each size between them is tried in turn
        chord = np.interp(np.arange(self.n_max + 1), self._grid, v[self._grid])
        dip = settled & (v < (1.0 - DIP) * chord) & (self._stored_dips | (rounds >= STEADY))
        dip[self._grid] = dip[:2] = False
        return CostTables(v, hope, upper, known, settled, [int(m) for m in np.flatnonzero(dip)])

    def _estimate(self) -> np.ndarray:
        t1 = self.t1()
        now = {m: s / t1 for m, s in sorted(self._median.items())}
        now[1] = 1.0
        sizes = np.arange(1, self.n_max + 1)
        prior = self._prior_v
        # ratios to the prior only from sizes timed a few times: one stalled round must
        # not rescale every other size
        at = np.array([m for m in sorted(now) if m == 1 or len(self.times[m]) >= STEADY])
        scaled = prior * np.interp(sizes, at, [now[m] / prior[m - 1] for m in at])
        prior_known = self._prior_known
        anchors = sorted(self._prior_sizes.union(now))
        at_scaled = scaled.tolist()
        curve = extend(anchors, [now[m] if m in now else at_scaled[m - 1] for m in anchors], self.n_max)
        curve[prior_known] = scaled[prior_known]
        curve[np.array(sorted(now)) - 1] = [now[m] for m in sorted(now)]
        return np.maximum(curve, 1.0)

    def c(self) -> float:
        t1 = (self.t1() if self.learn else None) or self.t_token_s
        if self.draft_token_s and t1:
            return self.draft_token_s / t1
        return self.c_model if self.c_model is not None else C_GUESS

    def measured(self) -> dict[int, tuple[float, int]]:
        """{n: (V(n), verify rounds)} for every size this run measured: what a profile
        stores so the next run starts informed (a size tried once need not be tried
        again; the rounds weigh it against later runs' measurements)."""
        t1 = self.t1()
        if not t1:
            return {}
        return {n: (s / t1, len(self.times[n])) for n in sorted(self.times)
                if n > 1 and (s := self.seconds(n)) is not None}


def best_k(rates, cost: CostModel, c: float) -> Choice:
    """The best k on the estimates alone; k = 0 is plain decode. (auto's own choice also
    weighs risk.)"""
    best = Choice(0, 1.0, 1.0 / cost.v(1))
    expected, survive = 1.0, 1.0
    for k, a in enumerate(rates, start=1):
        survive *= a
        expected += survive
        rate = expected / (cost.v(k + 1) + k * c)
        if rate > best.rate:
            best = Choice(k, expected, rate)
    return best
