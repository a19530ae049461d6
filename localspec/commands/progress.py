"""Progress of one generation on stderr: a bar of generated vs expected tokens with
live tokens/s and acceptance, then a one-line summary. Consumes the engine's events."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from localspec.core.engine import Done, Event, GenerationStats, Round, Token


class EditProgress:
    """Call it with each engine event. `enabled=False` keeps the counters (for the
    summary) but draws nothing, for pipes and -q."""

    def __init__(self, label: str, expected: int, enabled: bool = True) -> None:
        self.label = label
        self.expected = max(1, expected)
        self.enabled = enabled
        self.generated = 0
        self.drafted = 0
        self.accepted = 0
        self.t_start: float | None = None
        self.t_last: float | None = None
        self.plain_s = 0.0  # time of rounds that verified no draft: plain decode speed
        self.plain_rounds = 0
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> EditProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} tok"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.expected, rate="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __call__(self, ev: Event) -> None:
        now = time.perf_counter()
        if isinstance(ev, Token):
            if self.t_start is None:
                self.t_start = self.t_last = now  # the first token comes from prefill
            self.generated += 1
        elif isinstance(ev, Round):
            if ev.n_draft == 0 and self.t_last is not None:
                self.plain_s += now - self.t_last
                self.plain_rounds += 1
            self.t_last = now
            self.drafted += ev.n_draft
            self.accepted += ev.n_accept
        elif isinstance(ev, Done):
            return
        if self._progress is not None:
            done = min(self.generated, self.expected)
            if self.generated > self.expected:  # a longer answer than the original
                self._progress.update(self._task, total=self.generated)
                done = self.generated
            self._progress.update(self._task, completed=done, rate=self._rate(now))

    def _rate(self, now: float) -> str:
        elapsed = now - (self.t_start or now)
        tps = self.generated / elapsed if elapsed > 0 else 0.0
        acc = f" acc {self.accepted / self.drafted:.0%}" if self.drafted else ""
        return f"{tps:.1f} tok/s{acc}"

    def speedup_estimate(self, stats: GenerationStats) -> float | None:
        """tok/s over the plain decode speed seen in this run's undrafted rounds."""
        if self.plain_rounds < 2 or stats.tokens_per_s <= 0:
            return None
        return stats.tokens_per_s * self.plain_s / self.plain_rounds


def summary_line(stats: GenerationStats, speedup: float | None = None) -> str:
    """tokens, tok/s, speedup estimate, acceptance, mean accepted length."""
    parts = [f"{stats.generated} tokens", f"{stats.tokens_per_s:.1f} tok/s"]
    if speedup is not None:
        parts.append(f"~{speedup:.1f}x plain (est.)")
    if stats.drafted:
        parts += [
            f"acceptance {stats.acceptance:.0%} ({stats.accepted}/{stats.drafted})",
            f"mean accepted {stats.mean_accepted:.2f}",
        ]
    parts.append(f"drafter {stats.drafter}")
    return " | ".join(parts)
