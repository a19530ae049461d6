"""Server counters and gauges, rendered in the Prometheus text exposition format.

Written by the scheduler thread (rounds, steps, finished requests) and the HTTP handlers
(request outcomes); read by /metrics. One lock; every update is a few integer adds.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable

from localspec.core.engine import count_round

PREFIX = "localspec_"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, outcome)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0
        self.draft_rounds = 0
        self.drafted_by_pos: list[int] = []
        self.accepted_by_pos: list[int] = []
        self.steps = 0
        self.spec_steps = 0
        self.step_seconds = 0.0
        self.batch_tokens = 0
        self.prefill_tokens = 0
        self.spec_toggles = 0
        self.request_seconds = 0.0
        self.ttft_seconds = 0.0
        self.finished = 0
        # decode-only steps (no prefill in the batch) by (sequences, speculating):
        # [steps, seconds, tokens emitted] -- throughput at each batch size, live
        self.by_batch: dict[tuple[int, bool], list[float]] = defaultdict(lambda: [0, 0.0, 0])

    # ----- updates ------------------------------------------------------------------

    def request(self, endpoint: str, outcome: str) -> None:
        """One HTTP request ended: outcome is ok, cancelled, or an error status."""
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def round(self, n_draft: int, n_accept: int, n_new: int) -> None:
        """One sequence's verify: n_new tokens emitted (accepted + the target's own)."""
        with self._lock:
            self.generated_tokens += n_new
            count_round(self, n_draft, n_accept)  # same counters as GenerationStats

    def first_token(self, n: int) -> None:
        with self._lock:
            self.generated_tokens += n

    def step(self, n_tokens: int, n_prefill: int, seconds: float, speculating: bool) -> None:
        with self._lock:
            self.steps += 1
            self.spec_steps += speculating
            self.step_seconds += seconds
            self.batch_tokens += n_tokens
            self.prefill_tokens += n_prefill

    def decode_step(self, n_seqs: int, speculating: bool, seconds: float, n_new: int) -> None:
        """A step that decoded n_seqs sequences and no prompt tokens, emitting n_new."""
        with self._lock:
            row = self.by_batch[(n_seqs, speculating)]
            row[0] += 1
            row[1] += seconds
            row[2] += n_new

    def batch_throughput(self, n_seqs: int, speculating: bool | None = None) -> tuple[int, float, int]:
        """(steps, seconds, tokens) of decode-only steps with n_seqs sequences."""
        with self._lock:
            rows = [v for (n, sp), v in self.by_batch.items()
                    if n == n_seqs and (speculating is None or sp == speculating)]
            return (int(sum(r[0] for r in rows)), sum(r[1] for r in rows), int(sum(r[2] for r in rows)))

    def toggled(self) -> None:
        with self._lock:
            self.spec_toggles += 1

    def finish(self, prompt_tokens: int, total_s: float, ttft_s: float) -> None:
        """A generation ended (finished, cancelled or failed after admission)."""
        with self._lock:
            self.finished += 1
            self.prompt_tokens += prompt_tokens
            self.request_seconds += total_s
            self.ttft_seconds += ttft_s

    # ----- exposition ---------------------------------------------------------------

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text format; `gauges` maps name -> (help, value) for live state."""
        with self._lock:
            lines: list[str] = []
            _family(lines, "requests_total", "counter", "HTTP generation requests by endpoint and outcome.",
                    ((f'endpoint="{e}",outcome="{o}"', v) for (e, o), v in sorted(self.requests.items())))
            for name, help_, value in (
                ("prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                ("generation_tokens_total", "Tokens generated.", self.generated_tokens),
                ("draft_tokens_total", "Draft tokens verified by the target.", self.drafted),
                ("accepted_tokens_total", "Draft tokens the target accepted.", self.accepted),
                ("rounds_total", "Verify rounds over all sequences.", self.rounds),
                ("draft_rounds_total", "Verify rounds that carried a draft.", self.draft_rounds),
                ("steps_total", "Batched decode steps.", self.steps),
                ("speculative_steps_total", "Steps taken with speculation on.", self.spec_steps),
                ("step_seconds_total", "Time inside batched decode steps.", self.step_seconds),
                ("batch_tokens_total", "Tokens decoded in steps (all sequences, drafts, prefill).",
                 self.batch_tokens),
                ("prefill_tokens_total", "Prompt tokens decoded.", self.prefill_tokens),
                ("speculation_toggles_total", "Times the batch-size rule switched speculation.",
                 self.spec_toggles),
                ("request_seconds_total", "Admission to end, summed over finished requests.",
                 self.request_seconds),
                ("time_to_first_token_seconds_total", "Admission to first token, summed.",
                 self.ttft_seconds),
                ("requests_finished_total", "Generations that ended after admission.", self.finished),
            ):
                _family(lines, name, "counter", help_, [("", value)])
            acc = self.accepted / self.drafted if self.drafted else 0.0
            _family(lines, "acceptance_rate", "gauge", "Accepted / drafted since start.", [("", acc)])
            _family(lines, "drafted_by_position_total", "counter",
                    "Draft tokens verified at each draft position (1-based).",
                    ((f'position="{i + 1}"', v) for i, v in enumerate(self.drafted_by_pos)))
            _family(lines, "accepted_by_position_total", "counter",
                    "Draft tokens accepted at each draft position (1-based).",
                    ((f'position="{i + 1}"', v) for i, v in enumerate(self.accepted_by_pos)))
            _family(lines, "acceptance_by_position", "gauge", "Acceptance rate at each draft position.",
                    ((f'position="{i + 1}"', a / d if d else 0.0)
                     for i, (a, d) in enumerate(zip(self.accepted_by_pos, self.drafted_by_pos))))
            keys = sorted(self.by_batch)
            labels = [f'batch="{n}",speculation="{"on" if sp else "off"}"' for n, sp in keys]
            for name, i, help_ in (
                ("decode_steps_total", 0, "Decode-only steps by batch size (sequences) and speculation."),
                ("decode_step_seconds_total", 1, "Time in those steps."),
                ("decode_step_tokens_total", 2, "Tokens those steps emitted (tokens/seconds = throughput)."),
            ):
                _family(lines, name, "counter", help_,
                        ((lab, self.by_batch[k][i]) for lab, k in zip(labels, keys)))
        for name, (help_, value) in gauges.items():
            _family(lines, name, "gauge", help_, [("", value)])
        return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help_: str,
            samples: Iterable[tuple[str, float]]) -> None:
    full = PREFIX + name
    lines.append(f"# HELP {full} {help_}")
    lines.append(f"# TYPE {full} {kind}")
    for labels, value in samples:
        lines.append(f"{full}{{{labels}}} {_num(value)}" if labels else f"{full} {_num(value)}")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
