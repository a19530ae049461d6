"""The verify cost curve V(n) and the draft cost ratio c, measured on this hardware.

V(n) = time to decode n tokens in one batch (logits for every row, as verification
asks) / time to decode one. Speculation with k drafted tokens pays k*c + V(k+1) per
round for E = (1 - a^(k+1)) / (1 - a) tokens, so V decides how long a draft may be
before it stops paying. On a GPU V(n) ~ 1 for small n; on a CPU it grows, then
flattens where llama.cpp switches to its batched matmul kernels.

Each n is decoded at the same position (after a fixed context, rewound after each
try), so attention cost does not grow with n's turn; the best of `repeats` tries is
kept, since other processes can only add time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localspec.core.backend import Model

FILLER = (
    "The verify step decodes the last accepted token and every drafted token in one "
    "batch, and the target keeps the longest prefix it agrees with. "
)


@dataclass
class VCurve:
    """ms[i]: best time in milliseconds to decode i + 1 tokens with all logits."""

    ms: list[float]
    context: int
    draft_ms: float | None = None  # the draft model's one-token decode, same context

    @property
    def v(self) -> list[float]:
        """V(n) for n = 1..len(ms), normalised so that V(1) = 1."""
        return [m / self.ms[0] for m in self.ms]

    @property
    def c(self) -> float | None:
        """Draft cost ratio: the draft model's per-token time over the target's."""
        return self.draft_ms / self.ms[0] if self.draft_ms else None

    def at(self, n: float) -> float:
        """V at a (possibly fractional) batch size, interpolated; clamped to the range."""
        v = self.v
        n = min(max(n, 1.0), float(len(v)))
        lo = int(n)
        if lo >= len(v):
            return v[-1]
        return v[lo - 1] + (n - lo) * (v[lo] - v[lo - 1])

    def to_dict(self) -> dict:
        return {"n": list(range(1, len(self.ms) + 1)), "ms": [round(m, 3) for m in self.ms],
                "v": [round(x, 4) for x in self.v], "context": self.context,
                "draft_ms": None if self.draft_ms is None else round(self.draft_ms, 3),
                "c": None if self.c is None else round(self.c, 4)}


def _context_tokens(model: Model, n: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += model.tokenize(FILLER, add_special=not tokens, parse_special=False)
    return tokens[:n]


def decode_ms(model: Model, base: list[int], batch: list[int], repeats: int) -> float:
    """Best of `repeats` times (ms) to decode `batch` after `base`, all rows' logits."""
    model.prefill(base)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.decode(batch, "all")
        best = min(best, time.perf_counter() - t0)
        model.rewind(len(base))
    return best * 1000.0


def measure_vcurve(
    target: Model,
    n_max: int = 32,
    *,
    repeats: int = 3,
    context: int = 128,
    draft: Model | None = None,
    on_step: Callable[[int], None] | None = None,
) -> VCurve:
    """V(n) for n = 1..n_max on `target`; with `draft`, also its one-token time (for c)."""
    if n_max < 1 or repeats < 1:
        raise ValueError("n_max and repeats must be at least 1")
    context = max(1, min(context, target.n_ctx - n_max - 1))
    base = _context_tokens(target, context)
    batch = _context_tokens(target, context + n_max)[context:]
    decode_ms(target, base, batch[:1], 1)  # warm-up: first decodes allocate buffers
    ms = []
    for n in range(1, n_max + 1):
        ms.append(decode_ms(target, base, batch[:n], repeats))
        if on_step is not None:
            on_step(n)
    draft_ms = None
    if draft is not None:
        decode_ms(draft, base, batch[:1], 1)
        draft_ms = decode_ms(draft, base, batch[:1], repeats * 3)
    return VCurve(ms, context, draft_ms)


def expected_tokens(alpha: float, k: float) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens per round (accepted drafts + the target's own
    token) when each drafted token is accepted with probability a, independently."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
