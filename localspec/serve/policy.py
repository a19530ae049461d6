"""Serving defaults shared by `localspec serve` and the serve benchmark: the context
each slot gets, and the batch-size rule that turns speculation off under load."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localspec.models.profile import Profile

# Speculation stays on while at most this many sequences are active when no calibration
# profile exists: on a CPU, n-gram speculation pays for a request alone and decoded
# slower with two or more in the batch (`python -m localspec.bench.serve_bench`;
# docs/measurements.md).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 1
PER_SLOT_CTX = 4096  # default context for every slot ...
MAX_DEFAULT_CTX = 32768  # ... up to this much in all (KV memory grows with it)


def default_n_ctx(n_slots: int) -> int:
    """The total context (-c) serve allocates by default for `n_slots` slots."""
    return min(PER_SLOT_CTX * n_slots, MAX_DEFAULT_CTX)


def spec_threshold(given: int | None, profile: Profile | None, c: float = 0.0) -> tuple[int | None, str]:
    """(--spec-disable-by-batch-size, where it came from); None means never disable.
    An explicit value wins, then the calibration profile's V(n) (and the draft model's
    cost ratio `c` when the slots draft with it), then the default."""
    if given is not None:
        return (None if given < 0 else given), "set"
    if profile is not None:
        return threshold_from_vcurve(profile.vcurve, c=c), "calibration profile"
    return DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE, "default"


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
