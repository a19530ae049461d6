"""Server counters and gauges for /metrics, exposed through prometheus_client.

Written by the scheduler thread (rounds, steps, finished requests) and the HTTP handlers
(request outcomes); read by /metrics. One lock; every update is a few integer adds. The
counters are plain fields because the engine's `count_round` updates them the way it
updates a request's GenerationStats; each Metrics is a prometheus_client Collector in a
registry of its own (not the global one), so apps and tests in one process never share
or collide on metric names.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from localspec.core.engine import count_round

PREFIX = "localspec_"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, outcome)
        # generations handed to the scheduler, and how each ended (finished, cancelled,
        # failed): started - ended = in flight, 0 once the server is idle
        self.started: dict[str, int] = defaultdict(int)
        self.ended: dict[tuple[str, str], int] = defaultdict(int)
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
        self.slot_copies = 0  # prompt starts copied from another slot's cells (serve/slots.py)
        self.copied_tokens = 0
        self.prompt_restores = 0  # prompt starts loaded from the prompt cache (serve/prompt_cache.py)
        self.restored_tokens = 0
        self.spec_toggles = 0
        self.request_seconds = 0.0
        self.ttft_seconds = 0.0
        self.finished = 0
        # decode-only steps (no prefill in the batch) by (sequences, speculating):
        # [steps, seconds, tokens emitted] -- throughput at each batch size, live
        self.by_batch: dict[tuple[int, bool], list[float]] = defaultdict(lambda: [0, 0.0, 0])
        # by drafter (ngram, model): [rounds that drafted, drafted, accepted]
        self.by_drafter: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.draft_model_decodes = 0  # batched draft-model decodes in drafting phases
        self.draft_model_rows = 0  # sequences in them (/ decodes: slots drafted together)
        self.draft_model_seconds = 0.0
        self._render_lock = threading.Lock()
        self._gauges: dict[str, tuple[str, float]] = {}  # live state, set for one render
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ----- updates ------------------------------------------------------------------

    def request(self, endpoint: str, outcome: str) -> None:
        """One HTTP request ended: outcome is ok, cancelled, or an error status."""
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def generation_started(self, endpoint: str) -> None:
        with self._lock:
            self.started[endpoint] += 1

    def generation_ended(self, endpoint: str, outcome: str) -> None:
        """outcome: finished, cancelled (the client left or shutdown cut it) or failed."""
        with self._lock:
            self.ended[(endpoint, outcome)] += 1

    def round(self, n_draft: int, n_accept: int, n_new: int, source: str = "none") -> None:
        """One sequence's verify: n_new tokens emitted (accepted + the target's own);
        `source`: the drafter that made the draft (ngram, model)."""
        with self._lock:
            self.generated_tokens += n_new
            count_round(self, n_draft, n_accept)  # same counters as GenerationStats
            if n_draft:
                row = self.by_drafter[source]
                row[0] += 1
                row[1] += n_draft
                row[2] += n_accept

    def draft_decodes(self, n_decodes: int, n_rows: int, seconds: float) -> None:
        """One drafting phase: n_decodes batched draft-model decodes of n_rows sequences in all."""
        with self._lock:
            self.draft_model_decodes += n_decodes
            self.draft_model_rows += n_rows
            self.draft_model_seconds += seconds

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

    def speed(self) -> dict:
        """What /health (and `localspec ps`) shows of the work done: requests finished,
        tokens generated, decode tok/s of all slots together (decode-only steps) and the
        mean time to the first token."""
        with self._lock:
            seconds = sum(r[1] for r in self.by_batch.values())
            tokens = sum(r[2] for r in self.by_batch.values())
            return {"requests": self.finished, "generated_tokens": self.generated_tokens,
                    "decode_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
                    "ttft_s": round(self.ttft_seconds / self.finished, 3) if self.finished else None}

    def slot_copied(self, n_tokens: int) -> None:
        """A request's first n_tokens prompt tokens were copied from another slot."""
        with self._lock:
            self.slot_copies += 1
            self.copied_tokens += n_tokens

    def prompt_restored(self, n_tokens: int) -> None:
        """A request's first n_tokens prompt tokens were loaded from the prompt cache."""
        with self._lock:
            self.prompt_restores += 1
            self.restored_tokens += n_tokens

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
        with self._render_lock:
            self._gauges = gauges
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._gauges = {}

    def collect(self) -> list[Metric]:
        """The metric families (prometheus_client's Collector protocol); a consistent
        snapshot under the lock."""
        with self._lock:
            out = [self._requests_family(), *self._generation_families()]
            out += [_counter(name, help_, getattr(self, attr)) for name, attr, help_ in COUNTERS]
            acc = self.accepted / self.drafted if self.drafted else 0.0
            out.append(_gauge("acceptance_rate", "Accepted / drafted since start.", acc))
            out += self._position_families()
            out += self._batch_families()
            out += self._drafter_families()
        out += [_gauge(name, help_, value) for name, (help_, value) in self._gauges.items()]
        return out

    def _requests_family(self) -> Metric:
        fam = CounterMetricFamily(PREFIX + "requests_total", "HTTP generation requests by endpoint and outcome.",
                                  labels=["endpoint", "outcome"])
        for (endpoint, outcome), n in sorted(self.requests.items()):
            fam.add_metric([endpoint, outcome], n)
        return fam

    def _generation_families(self) -> list[Metric]:
        started = CounterMetricFamily(PREFIX + "requests_started_total",
                                      "Generations handed to the scheduler.", labels=["endpoint"])
        for endpoint, n in sorted(self.started.items()):
            started.add_metric([endpoint], n)
        ended = CounterMetricFamily(PREFIX + "requests_ended_total", "Started generations that ended, "
                                    "by outcome: finished, cancelled or failed.", labels=["endpoint", "outcome"])
        for (endpoint, outcome), n in sorted(self.ended.items()):
            ended.add_metric([endpoint, outcome], n)
        return [started, ended]

    def _position_families(self) -> list[Metric]:
        drafted = CounterMetricFamily(PREFIX + "drafted_by_position_total",
                                      "Draft tokens verified at each draft position (1-based).", labels=["position"])
        accepted = CounterMetricFamily(PREFIX + "accepted_by_position_total",
                                       "Draft tokens accepted at each draft position (1-based).", labels=["position"])
        rate = GaugeMetricFamily(PREFIX + "acceptance_by_position", "Acceptance rate at each draft position.",
                                 labels=["position"])
        for i, (a, d) in enumerate(zip(self.accepted_by_pos, self.drafted_by_pos)):
            pos = [str(i + 1)]
            drafted.add_metric(pos, d)
            accepted.add_metric(pos, a)
            rate.add_metric(pos, a / d if d else 0.0)
        return [drafted, accepted, rate]

    def _batch_families(self) -> list[Metric]:
        families = [CounterMetricFamily(PREFIX + name, help_, labels=["batch", "speculation"])
                    for name, help_ in BATCH_COUNTERS]
        for (n, spec), row in sorted(self.by_batch.items()):
            for fam, value in zip(families, row):
                fam.add_metric([str(n), "on" if spec else "off"], value)
        return families


    def _drafter_families(self) -> list[Metric]:
        families = [CounterMetricFamily(PREFIX + name, help_, labels=["drafter"])
                    for name, help_ in DRAFTER_COUNTERS]
        rate = GaugeMetricFamily(PREFIX + "drafter_acceptance_rate", "Accepted / drafted by drafter.",
                                 labels=["drafter"])
        for source, row in sorted(self.by_drafter.items()):
            for fam, value in zip(families, row):
                fam.add_metric([source], value)
            rate.add_metric([source], row[2] / row[1])
        return [*families, rate]


# (metric name, attribute, help): plain counters, in exposition order
COUNTERS = (
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("generation_tokens_total", "generated_tokens", "Tokens generated."),
    ("draft_tokens_total", "drafted", "Draft tokens verified by the target."),
    ("accepted_tokens_total", "accepted", "Draft tokens the target accepted."),
    ("rounds_total", "rounds", "Verify rounds over all sequences."),
    ("draft_rounds_total", "draft_rounds", "Verify rounds that carried a draft."),
    ("steps_total", "steps", "Batched decode steps."),
    ("speculative_steps_total", "spec_steps", "Steps taken with speculation on."),
    ("step_seconds_total", "step_seconds", "Time inside batched decode steps."),
    ("batch_tokens_total", "batch_tokens", "Tokens decoded in steps (all sequences, drafts, prefill)."),
    ("prefill_tokens_total", "prefill_tokens", "Prompt tokens decoded."),
    ("slot_copies_total", "slot_copies", "Prompt starts copied from another slot's KV cells."),
    ("copied_prompt_tokens_total", "copied_tokens", "Prompt tokens copied so (not prefilled)."),
    ("prompt_cache_restores_total", "prompt_restores", "Prompt starts loaded from the prompt cache (--cache-ram)."),
    ("prompt_cache_restored_tokens_total", "restored_tokens", "Prompt tokens loaded so (not prefilled)."),
    ("speculation_toggles_total", "spec_toggles", "Times the batch-size rule switched speculation."),
    ("request_seconds_total", "request_seconds", "Admission to end, summed over finished requests."),
    ("time_to_first_token_seconds_total", "ttft_seconds", "Admission to first token, summed."),
    ("requests_finished_total", "finished", "Generations that ended after admission."),
    ("draft_model_decodes_total", "draft_model_decodes", "Batched decodes of the draft model (all slots' drafts)."),
    ("draft_model_decode_sequences_total", "draft_model_rows",
     "Sequences in those decodes (/ decodes: slots drafted per decode)."),
    ("draft_model_seconds_total", "draft_model_seconds", "Time in the drafting phases."),
)
# verify rounds that carried a draft, by drafter: the columns of Metrics.by_drafter
DRAFTER_COUNTERS = (
    ("drafter_rounds_total", "Verify rounds that carried a draft, by drafter."),
    ("drafter_draft_tokens_total", "Draft tokens verified, by drafter."),
    ("drafter_accepted_tokens_total", "Draft tokens accepted, by drafter."),
)
# decode-only steps by (batch size, speculation): the columns of Metrics.by_batch
BATCH_COUNTERS = (
    ("decode_steps_total", "Decode-only steps by batch size (sequences) and speculation."),
    ("decode_step_seconds_total", "Time in those steps."),
    ("decode_step_tokens_total", "Tokens those steps emitted (tokens/seconds = throughput)."),
)


def _counter(name: str, help_: str, value: float) -> Metric:
    return CounterMetricFamily(PREFIX + name, help_, value=value)


def _gauge(name: str, help_: str, value: float) -> Metric:
    return GaugeMetricFamily(PREFIX + name, help_, value=value)
