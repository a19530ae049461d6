"""What one benchmark run measured, and the figures derived from it: decode speed and
its speedup over plain decoding, CPU-time speedup, time to first token (prefill, or the
prefix cache's restore), end-to-end wall speedup, acceptance against theory."""

from __future__ import annotations

import math
from dataclasses import dataclass

from localspec.bench.vcurve import VCurve, expected_tokens
from localspec.core.config import SpecConfig
from localspec.core.events import StopReason, Timed


@dataclass(frozen=True)
class Variant:
    """How to decode: `mode` none | ngram | model | hybrid | auto | peer, `k` drafted
    tokens at most per round; `spec` is what the engine gets (None for the peer)."""

    mode: str
    k: int = 0
    spec: SpecConfig | None = None

    @property
    def label(self) -> str:
        return self.mode if self.mode == "none" else f"{self.mode} k={self.k}"

    @property
    def uses_draft(self) -> bool:
        return self.spec is not None and self.spec.mode.uses_draft_model


@dataclass
class Run(Timed):
    """One generation, reduced to what the report needs."""

    ids: list[int]
    decode_s: float
    rounds: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    llama_s: float = 0.0
    stop_reason: StopReason | str = ""
    cpu_s: float = 0.0  # this process's CPU time over the same span as decode_s
    prefill_s: float = 0.0  # prompt tokens decoded before the first token
    prefill_tokens: int = 0
    restored: int = 0  # prompt tokens restored from the prefix cache instead
    cache_s: float = 0.0  # restoring them


@dataclass
class Verdict:
    """The output against `none`: identical, near-tie (diverged where the plain run's
    top-2 margin was tiny), MISMATCH, or baseline (the `none` row itself)."""

    status: str
    index: int | None = None
    margin: float | None = None

    def __str__(self) -> str:
        if self.index is None:
            return self.status
        return f"{self.status} @{self.index} (margin {self.margin:.2f})"


@dataclass
class Result:
    """One variant on one workload, summed over repeats."""

    workload: str
    tag: str
    variant: Variant
    runs: list[Run]
    verdict: Verdict
    base_tps: float | None = None  # `none` on the same workload, same repeats
    base_cpu_tps: float | None = None  # the same, per CPU second
    base_wall_tps: float | None = None  # the same, end to end (prefill included)
    vcurve: VCurve | None = None
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(len(r.ids) for r in self.runs)

    @property
    def decode_s(self) -> float:
        return sum(r.decode_s for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        if not self.base_tps or not self.tokens_per_s:
            return None
        return self.tokens_per_s / self.base_tps

    @property
    def wall_s(self) -> float:
        return self._sum("wall_s")

    @property
    def wall_tokens_per_s(self) -> float:
        """Tokens per second end to end: the prefill (or the prefix cache's restore) too."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wall_speedup(self) -> float | None:
        """End-to-end tok/s over `none`'s (the peer's prefill is not timed: None)."""
        if not self.base_wall_tps or not self.wall_tokens_per_s or self.variant.mode == "peer":
            return None
        return self.wall_tokens_per_s / self.base_wall_tps

    def mean(self, name: str) -> float | None:
        """A Run field or property averaged over the repeats (ttft_s, prefill_s, restored)."""
        return self._sum(name) / len(self.runs) if self.runs else None

    @property
    def tokens_per_cpu_s(self) -> float:
        cpu = self._sum("cpu_s")
        return self.tokens / cpu if cpu > 0 else 0.0

    @property
    def cpu_speedup(self) -> float | None:
        """Speedup in CPU time: on a busy machine with one thread per core for us, close
        to what an idle machine would show, since waiting for a core costs no CPU time
        (with more threads than free cores, llama.cpp's spinning inflates it)."""
        if not self.base_cpu_tps or not self.tokens_per_cpu_s:
            return None
        return self.tokens_per_cpu_s / self.base_cpu_tps

    def _sum(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.runs)

    @property
    def acceptance(self) -> float | None:
        drafted = self._sum("drafted")
        return self._sum("accepted") / drafted if drafted else None

    @property
    def k_mean(self) -> float | None:
        """Mean draft length of the rounds that drafted."""
        rounds = self._sum("draft_rounds")
        return self._sum("drafted") / rounds if rounds else None

    @property
    def tokens_per_draft_round(self) -> float | None:
        """Measured: accepted draft tokens + the target's own token, per drafting round."""
        rounds = self._sum("draft_rounds")
        return self._sum("accepted") / rounds + 1.0 if rounds else None

    @property
    def expected(self) -> float | None:
        """Theory E(a, k) for the measured acceptance a and mean draft length k."""
        a, k = self.acceptance, self.k_mean
        return None if a is None or k is None else expected_tokens(a, k)

    @property
    def c(self) -> float | None:
        """Drafting time per drafted token over plain decoding's time per token."""
        drafted = self._sum("drafted")
        if not drafted or not self.base_tps or self.variant.mode == "peer":
            return None
        return (self._sum("draft_s") / drafted) * self.base_tps

    @property
    def predicted_speedup(self) -> float | None:
        """The cost model with this run's numbers: tokens / (rounds' cost in plain decodes),
        a drafting round costing k*c + V(k+1) and a plain round 1."""
        k, c, tpr = self.k_mean, self.c, self.tokens_per_draft_round
        if self.vcurve is None or k is None or c is None or tpr is None:
            return None
        draft_rounds, rounds = self._sum("draft_rounds"), self._sum("rounds")
        plain_rounds = rounds - draft_rounds
        cost = draft_rounds * (k * c + self.vcurve.at(k + 1)) + plain_rounds
        return (draft_rounds * tpr + plain_rounds) / cost if cost else None

    @property
    def overhead(self) -> float | None:
        if self.variant.mode == "peer" or not self.decode_s:
            return None
        return max(0.0, 1.0 - self._sum("llama_s") / self.decode_s)

    def to_dict(self) -> dict:
        def r(x: float | None, nd: int = 4) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, nd)

        return {
            "workload": self.workload, "tag": self.tag, "mode": self.variant.mode,
            "k": self.variant.k, "label": self.variant.label, "repeats": len(self.runs),
            "tokens": self.tokens, "decode_s": r(self.decode_s),
            "tokens_per_s": r(self.tokens_per_s, 3), "speedup": r(self.speedup, 3),
            "cpu_s": r(self._sum("cpu_s")), "cpu_speedup": r(self.cpu_speedup, 3),
            "ttft_s": r(self.mean("ttft_s")), "prefill_s": r(self.mean("prefill_s")),
            "prefill_tokens": r(self.mean("prefill_tokens"), 1),
            "restored_tokens": r(self.mean("restored"), 1), "wall_s": r(self.wall_s),
            "wall_speedup": r(self.wall_speedup, 3),
            "acceptance": r(self.acceptance), "k_mean": r(self.k_mean, 3),
            "tokens_per_draft_round": r(self.tokens_per_draft_round, 3),
            "expected_tokens_per_round": r(self.expected, 3),
            "c": r(self.c), "predicted_speedup": r(self.predicted_speedup, 3),
            "overhead": r(self.overhead), "rounds": int(self._sum("rounds")),
            "drafted": int(self._sum("drafted")), "accepted": int(self._sum("accepted")),
            "output": {"status": self.verdict.status, "diverged_at": self.verdict.index,
                       "margin": r(self.verdict.margin)},
            "stop_reason": self.runs[0].stop_reason if self.runs else "", "error": self.error,
        }
