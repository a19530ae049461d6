"""Serving defaults shared by `localspec serve` and the serve benchmark: the context
each slot gets, and the batch-size rule that turns speculation off under load."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localspec.profile import Profile

# Speculation stays on while at most this many sequences are active when no profile
# exists: on a CPU, n-gram speculation pays for a request alone and decoded slower with
# two or more in the batch (`python -m localspec.bench.serve_bench`;
# docs/measurements.md); `localspec tune` measures this machine's limits by context band.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 1
ALONE = 1  # the least limit tune's synthetic figures may set (see spec_threshold)
PER_SLOT_CTX = 4096  # default context for every slot ...
MAX_DEFAULT_CTX = 32768  # ... up to this much in all (KV memory grows with it)
MAX_MESSAGES = 2048  # OpenAI's own limit on a chat request's messages


def default_n_ctx(n_slots: int) -> int:
    """The total context (-c) serve allocates by default for `n_slots` slots."""
    return min(PER_SLOT_CTX * n_slots, MAX_DEFAULT_CTX)


@dataclass(frozen=True)
class BatchLimits:
    """--spec-disable-by-batch-size by context length: `bands` are (context, limit)
    pairs, context ascending, each the largest number of active sequences at which
    speculation still pays when the active sequences hold about `context` tokens each
    (None: never disable). A long KV cache makes a step more bandwidth-bound, so the
    crossover moves with it. `source` says where the figures come from."""

    bands: tuple[tuple[int, int | None], ...]
    source: str

    def limit(self, context: float = 0.0) -> int | None:
        """The limit for sequences of `context` tokens: the band measured nearest to it
        (on a log scale: 300 tokens is nearer 128 than 2,048)."""
        if len(self.bands) == 1:
            return self.bands[0][1]
        x = math.log(max(context, 1.0))
        return min(self.bands, key=lambda b: abs(math.log(max(b[0], 1)) - x))[1]

    def describe(self) -> str:
        """One line for logs and reports: "off above 2 active (set)", or by band."""
        def one(lim: int | None) -> str:
            return "never off" if lim is None else f"off above {lim} active"
        if len(self.bands) == 1:
            return f"{one(self.bands[0][1])} ({self.source})"
        return ", ".join(f"{one(lim)} at {c:,} tokens of context" for c, lim in self.bands) + f" ({self.source})"

    def to_dict(self) -> dict:
        return {"source": self.source,
                "bands": [{"context": c, "limit": -1 if lim is None else lim} for c, lim in self.bands]}


def spec_threshold(given: int | None, profile: Profile | None, c: float = 0.0) -> BatchLimits:
    """The rule's limits and where they came from. An explicit value wins (every
    context), then what `tune` or `bench --serve` measured on batches of real sequences
    (per context band; not with a draft model, whose own decodes neither timed), then the limit
    implied by the profile's V(n) (and the draft's cost ratio `c`), then the default.

    tune's figures and V(n)'s judge a fixed draft (4 tokens at 60% acceptance); they never
    turn speculation off for a sequence decoding alone (ALONE): there the drafter's own
    policy decides round by round (auto times its rounds and drafts only where they pay),
    and an edit accepting 95% of long drafts would lose what it gains (a tuned profile
    made `serve` 1.2x slower on edits at one client: every limit tune measured was 0)."""
    if given is not None:
        return BatchLimits(((0, None if given < 0 else given),), "set")
    if profile is not None and profile.batch_limits and not c:
        # tune's batches judge synthetic drafts (a fixed acceptance); only a
        # `bench --serve` run timed serve's own drafting, and may find it loses alone
        floor = 0 if profile.batch_limits_by else ALONE
        bands = tuple(sorted((int(ctx), lim if lim is None or lim < 0 else max(floor, lim))
                             for ctx, lim in profile.batch_limits.items()))
        return BatchLimits(bands, f"measured by {profile.batch_limits_by or 'tune'}")
    if profile is not None and profile.vcurve:
        return BatchLimits(((0, max(ALONE, threshold_from_vcurve(profile.vcurve, c=c))),),
                           "calibration profile V(n)")
    return BatchLimits(((0, DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE),), "default: no profile (run localspec tune)")


def crossover_limit(points: list[tuple[int, float, float]], e: float) -> int:
    """The largest batch size up to which speculating still paid in measured step
    times. points: (B, plain step seconds, speculative step seconds), B ascending: a
    plain step of B sequences makes B tokens, a speculative one about B * e. It pays
    while e * plain >= speculative; the limit is the last B of the first such run."""
    best = 0
    for b, off, on in points:
        if e * off < on:
            break
        best = b
    return best


def threshold_from_vcurve(vcurve: list[float], alpha: float = 0.6, k: int = 4, c: float = 0.0) -> int:
    """Largest batch size B at which speculating still pays under a measured verify
    cost curve (vcurve[n - 1] = time to decode n tokens at once, relative to one).

    B sequences decoded plainly cost V(B) per step for B tokens; speculating k tokens
    each costs V(B(k+1)) for B * E tokens, E = (1 - alpha^(k+1)) / (1 - alpha) the
    expected tokens per round. Speculation pays while E * V(B) >= V(B(k+1)).
    alpha = 0.6, k = 4 are typical of n-gram drafting on code and edits. A draft model
    of cost ratio c adds k batched draft decodes of B rows, k * c * V(B) (its own V
    taken to be the target's shape). Only batch sizes whose speculative step lies inside
    the measured curve are judged.
    """
    e = (1 - alpha ** (k + 1)) / (1 - alpha)
    best = 0
    for b in range(1, len(vcurve) // (k + 1) + 1):
        if e * vcurve[b - 1] >= vcurve[b * (k + 1) - 1] + k * c * vcurve[b - 1]:
            best = b
    return best
