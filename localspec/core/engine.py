"""The draft / verify / accept loop. Yields typed events; owns no I/O.

One round, as in llama.cpp's speculative-simple, lives in ONE place, `Generation`:
  1. draft:  plan() asks the drafter for up to k tokens after the context and returns
             the batch to verify, [id_last, *draft]
  2. batch:  the caller decodes it in ONE call with logits for every row (generate():
             target.decode on sequence 0; the server: one decode_multi for every request)
  3. accept: accept() keeps the agreeing prefix (greedy) or applies the lossless rule
             (sampled); there is always at least one new token: the correction or the bonus
  4. rewind: accept() drops the rejected rows' cells (n_past = the kept length) and
             returns the round's events: Round, then a Token per new token
Invariant between rounds: the sequence's cells hold every context token but id_last,
so n_past == len(tokens) - 1 needs no question to the backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from localspec.core.backend import Grammar, Model
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.constrain import (
    GrammarLike,
    GrammarRows,
    constrained_argmax,
    constrained_probs,
)
from localspec.core.drafters.base import Draft, Drafter, constrain, finished, promise, withdrawn
from localspec.core.errors import ContextFull
from localspec.core.limits import LineLimits
from localspec.core.events import (
    Done,
    Event,
    GenerationStats,
    Round,
    StopReason,
    Token,
    TokenLogprob,
    Transcript,
    count_round,
)
from localspec.core.sampling import (
    accept_greedy,
    accept_stochastic,
    logprobs,
    probs_from_logits,
    sample,
)
from localspec.core.tuning import ADAPTIVE_K_START


class AdaptiveK:
    """Grow k after fully accepted rounds, shrink it after early rejections, when
    SpecConfig.adapts_k (not for `auto`, whose policy chooses k itself up to draft_max)."""

    def __init__(self, spec: SpecConfig) -> None:
        self.lo = max(1, spec.draft_min)
        self.hi = max(self.lo, spec.draft_max)
        self.adaptive = spec.adapts_k
        self.k = min(self.hi, ADAPTIVE_K_START) if self.adaptive else self.hi

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
        self.lines = LineLimits(gen.n_indent, gen.t_max_predict_ms)

    def add(self, token: int, from_draft: bool, logprob: TokenLogprob | None = None) -> Token | None:
        """Returns the event to emit (None for an end-of-generation token); sets
        stats.stop_reason when this token ends the generation."""
        if self.target.is_eog(token) and not self.gen.ignore_eos:
            self.stats.stop_reason = StopReason.EOS
            return None
        self.stats.generated += 1
        text, hit = self.stops.feed(self.detok.add(token))
        limit = None
        if not hit and self.lines.active:
            text, limit = self.lines.feed(text)
        if hit:
            self.stats.stop_reason = StopReason.STOP
        elif limit:
            self.stats.stop_reason = limit
        elif 0 < self.gen.max_tokens <= self.stats.generated:
            self.stats.stop_reason = StopReason.LENGTH
        return Token(token, text, from_draft, logprob)

    def tail(self) -> str:
        if self.stats.stop_reason in (StopReason.STOP, StopReason.INDENT):  # what follows the cut is dropped
            return ""
        return self.stops.feed(self.detok.flush())[0] + self.stops.flush()


def pick(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator,
         grammar: GrammarLike | None = None) -> int:
    """The target's own next token from one row of logits (argmax, or a sample), among
    the tokens `grammar` allows next when there is one (the caller advances it)."""
    if grammar is not None:
        if sampling.greedy:
            return constrained_argmax(logits, grammar)
        return sample(constrained_probs(logits, grammar, sampling), rng)
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
    rows: np.ndarray, draft: Draft, sampling: SamplingConfig, rng: np.random.Generator,
    grammar: GrammarLike | None = None,
) -> tuple[int, int]:
    """(accepted draft tokens, the target's next token): the accept rule on one round's
    rows. Shared by generate() and the server's per-sequence rounds. With a grammar (in
    its state after id_last), row i's choice is among the tokens it allows after
    draft[:i], so a drafted token it forbids is rejected, and it is left advanced over
    exactly the accepted tokens and the target's own."""
    # rows[i]: target logits after [id_last, *draft[:i]]; p: target probs, q: draft probs
    # (q is the distribution the draft was really drawn from: masking it would not be lossless)
    if grammar is not None:
        choose = constrained_argmax if sampling.greedy else (
            lambda row, g: constrained_probs(row, g, sampling))
        target = GrammarRows(rows, draft.tokens, grammar, choose)
    elif sampling.greedy:
        target = _LazyArgmax(rows)
    else:
        target = np.stack([probs_from_logits(r, sampling) for r in rows])
    if sampling.greedy:
        n_accept, id_next = accept_greedy(draft.tokens, target)
    else:
        n_accept, id_next = accept_stochastic(draft.tokens, target, draft.probs, rng)
    if grammar is not None:
        target.advance(n_accept)
        grammar.accept(id_next)
    return n_accept, id_next


class Generation:
    """One generation's state on KV sequence `seq` of `target`, and its round, cut in two
    around the target's batched decode so that generate() and the server's scheduler
    (which decodes every request's batch in one decode_multi) run the same code:

        events = g.start(logits)            # the prompt is cached: the first token
        while not g.done:
            batch = g.plan()                # 1. draft: [id_last, *draft] ([] if full)
            rows = <decode batch on seq, logits for every row>      # 2. verify
            events = g.accept(rows, secs)   # 3. accept, 4. rewind: Round, Token...
        done = g.finish()
    """

    def __init__(self, target: Model, prompt: Sequence[int], drafter: Drafter, *,
                 sampling: SamplingConfig, spec: SpecConfig, gen: GenerationConfig,
                 seq: int = 0) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= target.n_ctx_seq:
            raise ContextFull(f"prompt is {len(prompt)} tokens but the context is "
                              f"{target.n_ctx_seq}; raise -c or shorten it")
        self.t_start = time.perf_counter()
        self.t_first = 0.0  # when the first token was picked (the end of prefill)
        self.target, self.seq, self.prompt, self.drafter = target, seq, list(prompt), drafter
        self.sampling, self.spec, self.gen = sampling, spec, gen
        self.stats = GenerationStats(prompt_tokens=len(prompt), drafter=drafter.name)
        self.out = Output(target, gen, self.stats)
        self.adaptive_k = AdaptiveK(spec)
        self.rng = np.random.default_rng(sampling.seed)
        self.tokens = list(prompt)  # the context: prompt + generated, id_last last
        self.id_last = -1  # -1 until start()
        self.draft, self.k, self.draft_s = Draft(), 0, 0.0  # this round's plan
        # the output's grammar, in its state after every accepted token (None: free text);
        # llama.cpp's sampler is freed with this object
        self.grammar = Grammar(target, gen.grammar) if gen.grammar else None

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    def cancel(self) -> None:
        self.stats.stop_reason = StopReason.CANCELLED

    def start(self, logits: np.ndarray) -> list[Event]:
        """The prompt is in the cache and `logits` is the row after its last token:
        pick the first token (its cell comes with the first round's batch)."""
        self.id_last = pick(logits, self.sampling, self.rng, self.grammar)
        if self.grammar is not None:
            self.grammar.accept(self.id_last)
        self.t_first = self.out.lines.t0 = time.perf_counter()
        self.stats.prefill_s = self.t_first - self.t_start
        self.tokens.append(self.id_last)
        self.drafter.begin(self.prompt)
        constrain(self.drafter, self.grammar)  # a model drafter drafts within it
        event = self.out.add(self.id_last, False, self._logprob(logits, self.id_last))
        return [event] if event is not None else []

    def plan(self, k_cap: int | None = None) -> list[int]:
        """1. draft: the batch to verify, [id_last, *draft]. `k_cap` bounds the draft (the
        server's share of a batch; 0 turns speculation off). [] when the context is full:
        the generation then ends ("context")."""
        return self.batch() if self.propose(k_cap) else []

    def propose(self, k_cap: int | None = None) -> bool:
        """1a. ask the drafter for up to k tokens (False when the context is full). A
        draft model shared by the server's sequences fills its draft in one batched pass
        for all of them (DraftBatch.run) between propose() and batch()."""
        n_past = len(self.tokens) - 1  # cached: every context token but id_last
        room = self.target.n_ctx_seq - n_past - 1  # draft tokens that fit after id_last
        if room < 0:
            self.stats.stop_reason = StopReason.CONTEXT
            return False
        left = self.gen.max_tokens - self.stats.generated if self.gen.max_tokens > 0 else room
        k = 0
        if self.spec.mode.drafts:  # never past -n: the round's own token comes on top
            k = max(0, min(self.adaptive_k.k, room, left - 1, room if k_cap is None else k_cap))
        td = time.perf_counter()
        self.draft = self.drafter.draft(self.tokens, k) if k > 0 else Draft()
        self.k, self.draft_s = k, time.perf_counter() - td
        return True

    def promise(self) -> float | None:
        """What the proposed draft is expected to yield (tokens, its round's own included),
        as its drafter predicts it; None without a draft or a prediction."""
        return promise(self.drafter) if self.draft.tokens else None

    def withdraw(self) -> None:
        """Drop the proposed draft before batch(): this round decodes plainly."""
        self.draft, self.k = Draft(), 0
        withdrawn(self.drafter)

    def batch(self, shared_s: float = 0.0) -> list[int]:
        """1b. the batch to verify, [id_last, *draft], once the draft is complete.
        `shared_s`: this draft's share of a drafting phase it was made in together with
        other sequences' (the server's batched draft-model decodes), counted as drafting."""
        draft = self.draft
        draft.tokens = draft.tokens[: self.k]
        self.draft_s += shared_s
        self.stats.draft_s += self.draft_s
        if len(draft.tokens) < self.spec.draft_min:
            self.draft = Draft()  # too short to be worth a batched verify
        return [self.id_last, *self.draft.tokens]

    def accept(self, rows: np.ndarray, decode_s: float, alone: bool = True) -> list[Event]:
        """3. accept and 4. rewind, given the logits of every row of plan()'s batch (already
        decoded into the sequence's cells) and the decode's time. Returns Round, then a
        Token per new token: the accepted prefix and the target's own (correction/bonus).
        `alone`: whether the decode held this batch only; one shared with other sequences
        (the server's) took longer than this batch costs, so the drafter is told no time
        (auto would learn a one-token decode as dear as a whole batch's)."""
        t0 = time.perf_counter()
        draft, n_draft = self.draft, len(self.draft.tokens)
        n_past = len(self.tokens) - 1
        n_accept, id_next = verify(rows, draft, self.sampling, self.rng, self.grammar)
        self.target.rewind(n_past + 1 + n_accept, seq=self.seq)  # keep id_last + the prefix
        verify_s = decode_s + time.perf_counter() - t0
        self.stats.verify_s += verify_s
        count_round(self.stats, n_draft, n_accept)
        if n_draft:
            row = self.stats.by_source.setdefault(draft.source, [0, 0])
            row[0] += n_draft
            row[1] += n_accept
        self.adaptive_k.update(n_draft, n_accept)
        self.drafter.observe(n_draft, n_accept, verify_s if alone else None, self.draft_s)
        events: list[Event] = [Round(n_draft, n_accept, draft.source, self.k)]
        for i, tok in enumerate([*draft.tokens[:n_accept], id_next]):
            self.tokens.append(tok)
            # rows[i] checked token i, a drafted one included: its logprob is read there
            event = self.out.add(tok, i < n_accept, self._logprob(rows[i], tok))
            if event is not None:
                events.append(event)
            if self.stats.stop_reason:
                # ended inside the accepted run: keep the cells to what was emitted
                self.target.rewind(len(self.tokens) - 1, seq=self.seq)
                break
        self.id_last, self.draft = id_next, Draft()
        return events

    def _logprob(self, row: np.ndarray, token: int) -> TokenLogprob | None:
        """The target's own distribution at an emitted token, when the generation asked
        for it (gen.logprobs); a run that did not pays nothing."""
        if self.gen.logprobs is None:
            return None
        lp, top = logprobs(row, token, self.gen.logprobs)
        return TokenLogprob(token, lp, tuple(top))

    def finish(self) -> Done:
        """The final event: stats (with the drafter's report) and any held-back text."""
        self.stats.decode_s = time.perf_counter() - self.t_first if self.t_first else 0.0
        self.stats.policy = self.drafter.report()
        if self.stats.stop_reason != StopReason.CANCELLED:  # a memory keeps whole replies only
            finished(self.drafter, self.tokens)
        self.drafter.end()
        return Done(self.stats, self.out.tail())


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
    """Generate after `prompt` on the target's sequence 0, speculating with `drafter`.
    Yields Token, Round and a final Done. `draft_model` (the drafter's model, if any)
    is accounted in stats.llama_s and repaired with the target if the run is cut short."""
    g = Generation(target, prompt, drafter, sampling=sampling, spec=spec, gen=gen)
    models = [m for m in (target, draft_model) if m is not None]
    try:
        logits, g.stats.prefill_tokens = target.prefill(prompt)  # reuses a cached prefix
        llama1 = sum(m.llama_s for m in models)
        yield from g.start(logits)
        while not g.done:
            if should_stop is not None and should_stop():
                g.cancel()
                break
            batch = g.plan()
            if not batch:
                break
            t0 = time.perf_counter()
            rows = target.decode(batch, "all")
            yield from g.accept(rows, time.perf_counter() - t0)
        g.stats.llama_s = sum(m.llama_s for m in models) - llama1
        yield g.finish()
    finally:
        # whatever happened (consumer stopped early, Ctrl-C mid-decode or mid-draft),
        # each model's record must match its KV cells: drop any cell past the record
        for m in models:
            m.rewind(m.n_past, force=True)


def collect(events: Iterator[Event]) -> tuple[list[int], str, GenerationStats]:
    """Drain a generation: (token ids, text, stats). For tests and scripts."""
    with Transcript(events) as run:
        for ev in run:
            if isinstance(ev, Done):
                return run.ids, run.text, ev.stats
    raise RuntimeError("generation ended without a Done event")


