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

    @property
    def plain_token_s(self) -> float | None:
        """Seconds per token of plain decoding, as this run's undrafted rounds took them
        (each yields one token); None with fewer than two such rounds."""
        return self.plain_s / self.plain_rounds if self.plain_rounds >= 2 else None


def summary_line(stats: GenerationStats, plain_token_s: float | None = None,
                 saved_s: float | None = None) -> str:
    """Tokens; time to first token (prefill, and what the prefix cache restored); decode
    speed and its speedup over plain decoding; wall time and its speedup over a plain
    edit with a cold prefill; acceptance, mean accepted length, drafter.

    The speedups are estimates: plain decoding's time per token from this run's undrafted
    rounds (`plain_token_s`), a cold prefill's time from this run or, for restored tokens,
    from when they were stored (`saved_s`)."""
    parts = [f"{stats.generated} tokens", "first token " + _ttft(stats)]
    decode = f"decode {stats.tokens_per_s:.1f} tok/s"
    if plain_token_s and stats.tokens_per_s > 0:
        decode += f" ~{stats.tokens_per_s * plain_token_s:.2f}x plain (est.)"
    parts.append(decode)
    wall = f"wall {stats.wall_s:.1f} s"
    cold = stats.prefill_s + (saved_s or 0.0)
    if plain_token_s and stats.wall_s > 0 and (saved_s is not None or not stats.restored_tokens):
        plain_wall = cold + stats.generated * plain_token_s
        wall += f" ~{plain_wall / stats.wall_s:.2f}x a plain cold edit (est.)"
    parts.append(wall)
    if stats.drafted:
        parts += [
            f"acceptance {stats.acceptance:.0%} ({stats.accepted}/{stats.drafted})",
            f"mean accepted {stats.mean_accepted:.2f}",
        ]
    parts.append(f"drafter {stats.drafter}")
    return " | ".join(parts)


def _ttft(stats: GenerationStats) -> str:
    """"0.6 s (prefill 38 tok 0.4 s, 1,824 tok from the prefix cache 0.2 s)"."""
    inner = f"prefill {stats.prefill_tokens:,} tok {stats.prefill_s:.1f} s"
    if stats.restored_tokens:
        inner += f", {stats.restored_tokens:,} tok from the prefix cache {stats.cache_s:.2f} s"
    elif stats.stored_tokens:
        inner += f", stored in the prefix cache {stats.cache_s:.2f} s"
    return f"{stats.ttft_s:.1f} s ({inner})"
