"""The draft / verify / accept loop. Yields typed events; owns no I/O.

One round, as in llama.cpp's speculative-simple:
  1. draft:  the drafter proposes up to k tokens after the context
  2. batch:  the target decodes [id_last, *draft] in ONE call, logits for every row
  3. accept: keep the agreeing prefix (greedy) or apply the lossless rule (sampled);
             there is always at least one new token: the correction or the bonus
  4. rewind: drop the rejected rows from the target's KV cache (n_past = kept length)
Invariant between rounds: the target's cache holds every context token but id_last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.base import Draft, Drafter
from localspec.core.errors import ContextFull
from localspec.core.sampling import (
    accept_greedy,
    accept_stochastic,
    probs_from_logits,
    sample,
)


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token. `text` is what may be shown now (it can be empty while a
    split UTF-8 character or a possible stop string is held back)."""

    id: int
    text: str
    from_draft: bool


@dataclass(frozen=True, slots=True)
class Round:
    """One verify step: how many tokens were drafted, and how many the target kept."""

    n_draft: int
    n_accept: int
    source: str
    k: int


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # decoded at prefill; fewer than prompt_tokens when a prefix was cached
    prefill_s: float = 0.0
    generated: int = 0
    rounds: int = 0
    draft_rounds: int = 0  # rounds that verified a non-empty draft
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # time in the drafter
    verify_s: float = 0.0  # time in the target's batched decode
    llama_s: float = 0.0  # time inside llama_decode, target and draft model together
    decode_s: float = 0.0  # wall time from first token to the end
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    drafter: str = "none"
    stop_reason: str = ""
    policy: dict = field(default_factory=dict)  # auto: (drafter:k) -> rounds, expected, realised
    # set by callers that restore a prompt prefix from the on-disk prefix cache before
    # generate() (which then prefills only the rest); generate() leaves them alone
    restored_tokens: int = 0  # prompt tokens whose KV state came from the prefix cache
    cache_s: float = 0.0  # time spent restoring them (or storing the prefix on a miss)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per round that drafted."""
        return self.accepted / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def overhead(self) -> float:
        """Share of decode time spent outside llama.cpp (Python, numpy, drafting)."""
        return max(0.0, 1.0 - self.llama_s / self.decode_s) if self.decode_s > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token: prefill, and the prefix cache's restore or store."""
        return self.prefill_s + self.cache_s

    @property
    def wall_s(self) -> float:
        """End to end, from the start of the prefill to the last token."""
        return self.ttft_s + self.decode_s

    def acceptance_by_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("acceptance", "mean_accepted", "tokens_per_round", "tokens_per_s", "overhead",
                     "ttft_s", "wall_s"):
            out[name] = getattr(self, name)
        out["acceptance_by_pos"] = self.acceptance_by_pos()
        return out


@dataclass(frozen=True, slots=True)
class Done:
    """End of a generation. `text` is held-back text released at the end."""

    stats: GenerationStats
    text: str = ""


Event = Token | Round | Done


class AdaptiveK:
    """Grow k after fully accepted rounds, shrink it after early rejections."""

    def __init__(self, spec: SpecConfig) -> None:
        self.lo = max(1, spec.draft_min)
        self.hi = max(self.lo, spec.draft_max)
        self.adaptive = spec.adaptive
        self.k = min(self.hi, 8) if spec.adaptive else self.hi

    def update(self, n_draft: int, n_accept: int) -> None:
        if not self.adaptive or n_draft == 0:
            return
        if n_accept == n_draft and n_draft >= self.k:
            self.k = min(self.hi, self.k * 2)
        elif n_accept < n_draft // 2:
            self.k = max(self.lo, (self.k + n_accept + 1) // 2)


class StopMatcher:
    """Finds stop strings that may span tokens; holds back text that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Output:
    """Turns accepted token ids into text, and decides when generation ends."""

    def __init__(self, target: Model, gen: GenerationConfig, stats: GenerationStats) -> None:
        self.target = target
        self.gen = gen
        self.stats = stats
        self.detok = target.detokenizer()
        self.stops = StopMatcher(gen.stop)

    def add(self, token: int, from_draft: bool) -> Token | None:
        """Returns the event to emit (None for an end-of-generation token); sets
        stats.stop_reason when this token ends the generation."""
        if self.target.is_eog(token) and not self.gen.ignore_eos:
            self.stats.stop_reason = "eos"
            return None
        self.stats.generated += 1
        text, hit = self.stops.feed(self.detok.add(token))
        if hit:
            self.stats.stop_reason = "stop"
        elif 0 < self.gen.max_tokens <= self.stats.generated:
            self.stats.stop_reason = "length"
        return Token(token, text, from_draft)

    def tail(self) -> str:
        if self.stats.stop_reason == "stop":
            return ""
        return self.stops.feed(self.detok.flush())[0] + self.stops.flush()


def pick(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> int:
    """The target's own next token from one row of logits (argmax, or a sample)."""
    if sampling.greedy:
        return int(np.argmax(logits))
    return sample(probs_from_logits(logits, sampling), rng)


class _LazyArgmax:
    """rows[i].argmax() computed on demand: greedy verification stops at the first
    mismatch, so a rejected long draft costs one or two row scans, not k + 1."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> int:
        return int(self.rows[i].argmax())

    def __iter__(self):
        return (int(r.argmax()) for r in self.rows)


def verify(
    rows: np.ndarray, draft: Draft, sampling: SamplingConfig, rng: np.random.Generator
) -> tuple[int, int]:
    """(accepted draft tokens, the target's next token): the accept rule on one round's
    rows. Shared by generate() and the server's per-sequence rounds."""
    # rows[i]: target logits after [id_last, *draft[:i]]; p: target probs, q: draft probs
    if sampling.greedy:
        return accept_greedy(draft.tokens, _LazyArgmax(rows))
    p = np.stack([probs_from_logits(r, sampling) for r in rows])
    return accept_stochastic(draft.tokens, p, draft.probs, rng)


def generate(
    target: Model,
    prompt: Sequence[int],
    drafter: Drafter,
    *,
    sampling: SamplingConfig = SamplingConfig(),
    spec: SpecConfig = SpecConfig(),
    gen: GenerationConfig = GenerationConfig(),
    should_stop: Callable[[], bool] | None = None,
    draft_model: Model | None = None,
) -> Iterator[Event]:
    """Generate after `prompt`, speculating with `drafter`. Yields Token, Round and a
    final Done. `draft_model` is only used to account its llama.cpp time."""
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) >= target.n_ctx:
        raise ContextFull(
            f"prompt is {len(prompt)} tokens but the context is {target.n_ctx}; raise -c or shorten it"
        )
    stats = GenerationStats(prompt_tokens=len(prompt), drafter=drafter.name)
    rng = np.random.default_rng(sampling.seed)
    out = Output(target, gen, stats)
    policy = AdaptiveK(spec)
    models = [m for m in (target, draft_model) if m is not None]
    t0 = time.perf_counter()
    try:
        logits, stats.prefill_tokens = target.prefill(prompt)
        id_last = pick(logits, sampling, rng)
        t1 = time.perf_counter()
        stats.prefill_s = t1 - t0
        llama1 = sum(m.llama_s for m in models)
        tokens = list(prompt)
        tokens.append(id_last)
        drafter.begin(prompt)
        event = out.add(id_last, False)
        if event is not None:
            yield event
        while not stats.stop_reason:
            if should_stop is not None and should_stop():
                stats.stop_reason = "cancelled"
                break
            n_past = target.n_past  # == len(tokens) - 1: everything but id_last is cached
            room = target.n_ctx - n_past - 1
            if room < 0:
                stats.stop_reason = "context"
                break
            left = gen.max_tokens - stats.generated if gen.max_tokens > 0 else room
            k = min(policy.k, room, max(0, left - 1)) if spec.mode != "none" else 0
            td = time.perf_counter()
            draft = drafter.draft(tokens, k) if k > 0 else Draft()
            draft.tokens = draft.tokens[:k]
            if len(draft.tokens) < spec.draft_min:
                draft = Draft()  # too short to be worth a batched verify
            tv = time.perf_counter()
            rows = target.decode([id_last, *draft.tokens], "all")
            n_accept, id_next = verify(rows, draft, sampling, rng)
            target.rewind(n_past + 1 + n_accept)  # keep id_last and the accepted prefix
            t_verify = time.perf_counter() - tv
            stats.draft_s += tv - td
            stats.verify_s += t_verify
            count_round(stats, len(draft.tokens), n_accept)
            policy.update(len(draft.tokens), n_accept)
            drafter.observe(len(draft.tokens), n_accept, t_verify, tv - td)
            yield Round(len(draft.tokens), n_accept, draft.source, k)
            for i, tok in enumerate([*draft.tokens[:n_accept], id_next]):
                tokens.append(tok)
                event = out.add(tok, i < n_accept)
                if event is not None:
                    yield event
                if stats.stop_reason:
                    # ended inside the accepted run: keep the cache to what was emitted
                    target.rewind(min(target.n_past, len(tokens) - 1))
                    break
            id_last = id_next
        stats.decode_s = time.perf_counter() - t1
        stats.llama_s = sum(m.llama_s for m in models) - llama1
        stats.policy = drafter.report()
        yield Done(stats, out.tail())
    finally:
        # whatever happened (consumer stopped early, Ctrl-C mid-decode), the cache
        # bookkeeping must match the KV cells: drop any cells past what is recorded
        target.rewind(target.n_past, force=True)


def count_round(stats, n_draft: int, n_accept: int) -> None:
    """Add one verify round to round/draft/acceptance counters (GenerationStats or any
    object with the same fields, e.g. the server's metrics)."""
    stats.rounds += 1
    if n_draft == 0:
        return
    stats.draft_rounds += 1
    stats.drafted += n_draft
    stats.accepted += n_accept
    while len(stats.drafted_by_pos) < n_draft:
        stats.drafted_by_pos.append(0)
        stats.accepted_by_pos.append(0)
    for i in range(n_draft):
        stats.drafted_by_pos[i] += 1
        if i < n_accept:
            stats.accepted_by_pos[i] += 1


def collect(events: Iterator[Event]) -> tuple[list[int], str, GenerationStats]:
    """Drain a generation: (token ids, text, stats). For tests, bench and edit."""
    ids: list[int] = []
    parts: list[str] = []
    for ev in events:
        if isinstance(ev, Token):
            ids.append(ev.id)
            parts.append(ev.text)
        elif isinstance(ev, Done):
            parts.append(ev.text)
            return ids, "".join(parts), ev.stats
    raise RuntimeError("generation ended without a Done event")


