"""One request's generation on its own KV sequence of a shared context.

This is engine.generate's round cut in two around the batched decode that every active
sequence shares, built from the engine's own pieces (AdaptiveK, Output with its
detokenizer and StopMatcher, verify, count_round, GenerationStats):

  plan()    1. draft up to k tokens; return this sequence's batch entry [id_last, *draft]
            2. (the scheduler decodes all entries in ONE decode_multi)
  accept()  3. verify the rows: the agreeing prefix plus the target's own next token
            4. rewind this sequence's rejected cells (n_past = kept length)

Invariant between steps, as in the engine: the sequence's cells hold every context
token but id_last.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.base import Draft, Drafter
from localspec.core.engine import (
    AdaptiveK,
    Done,
    GenerationStats,
    Output,
    Token,
    count_round,
    pick,
    verify,
)


class SeqState:
    """A generation in progress on sequence `seq` of `target`."""

    def __init__(self, target: Model, seq: int, prompt: Sequence[int], drafter: Drafter, *,
                 sampling: SamplingConfig, spec: SpecConfig, gen: GenerationConfig) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        self.target = target
        self.seq = seq
        self.prompt = list(prompt)
        self.drafter = drafter
        self.sampling = sampling
        self.spec = spec
        self.gen = gen
        self.stats = GenerationStats(prompt_tokens=len(prompt), drafter=drafter.name)
        self.out = Output(target, gen, self.stats)
        self.policy = AdaptiveK(spec)
        self.rng = np.random.default_rng(sampling.seed)
        self.tokens = list(prompt)  # the context: prompt + generated (id_last last)
        self.n_prefilled = 0
        self.id_last = -1
        self.draft = Draft()
        self.round_draft_s = 0.0
        self.last_round = (0, 0)  # (n_draft, n_accept) of the latest accept()
        self.t_start = time.perf_counter()
        self.t_first = 0.0
        target.rewind_seq(seq, 0)

    @property
    def prefilling(self) -> bool:
        return self.id_last < 0

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    # ----- prefill (chunked: a long prompt shares steps with the others) -------------

    def prefill_entry(self, budget: int) -> tuple[int, list[int], int]:
        """The next prompt chunk of at most `budget` tokens; logits only after the last."""
        chunk = self.prompt[self.n_prefilled : self.n_prefilled + budget]
        last = self.n_prefilled + len(chunk) == len(self.prompt)
        return self.seq, chunk, 1 if last else 0

    def prefilled(self, n: int, rows: np.ndarray) -> list[Token]:
        """After a chunk of n prompt tokens was decoded; the first token once complete."""
        self.n_prefilled += n
        self.stats.prefill_tokens += n
        if self.n_prefilled < len(self.prompt):
            return []
        self.id_last = pick(rows[-1], self.sampling, self.rng)
        self.tokens.append(self.id_last)
        self.drafter.begin(self.prompt)
        self.t_first = time.perf_counter()
        self.stats.prefill_s = self.t_first - self.t_start
        event = self.out.add(self.id_last, False)
        return [event] if event is not None else []

    # ----- decode rounds ------------------------------------------------------------

    def plan(self, speculate: bool, k_cap: int) -> list[int]:
        """Phase 1: this sequence's batch entry, [id_last] or [id_last, *draft].
        Empty when the sequence has no room left (it is then done: "context")."""
        n_past = len(self.target.seq_tokens(self.seq))  # == len(tokens) - 1
        room = self.target.n_ctx_seq - n_past - 1
        if room < 0:
            self.stats.stop_reason = "context"
            return []
        left = self.gen.max_tokens - self.stats.generated if self.gen.max_tokens > 0 else room
        k = 0
        if speculate and self.spec.mode != "none":
            k = max(0, min(self.policy.k, room, left - 1, k_cap))
        td = time.perf_counter()
        draft = self.drafter.draft(self.tokens, k) if k > 0 else Draft()
        draft.tokens = draft.tokens[:k]
        if len(draft.tokens) < self.spec.draft_min:
            draft = Draft()  # too short to be worth a batched verify
        self.round_draft_s = time.perf_counter() - td
        self.stats.draft_s += self.round_draft_s
        self.draft = draft
        return [self.id_last, *draft.tokens]

    def accept(self, rows: np.ndarray, verify_s: float) -> list[Token]:
        """Phases 3 and 4 for this sequence's rows of the shared decode. There is always
        at least one new token: the correction or the bonus."""
        draft = self.draft
        n_past = len(self.target.seq_tokens(self.seq)) - 1 - len(draft.tokens)
        n_accept, id_next = verify(rows, draft, self.sampling, self.rng)
        self.target.rewind_seq(self.seq, n_past + 1 + n_accept)  # keep id_last and the prefix
        self.stats.verify_s += verify_s
        count_round(self.stats, len(draft.tokens), n_accept)
        self.policy.update(len(draft.tokens), n_accept)
        observe = getattr(self.drafter, "observe", None)  # drafters that learn (auto)
        if observe is not None:
            observe(len(draft.tokens), n_accept, verify_s, self.round_draft_s)
        self.last_round = (len(draft.tokens), n_accept)
        events = []
        for i, tok in enumerate([*draft.tokens[:n_accept], id_next]):
            self.tokens.append(tok)
            event = self.out.add(tok, i < n_accept)
            if event is not None:
                events.append(event)
            if self.stats.stop_reason:
                # ended inside the accepted run: keep the cells to what was emitted
                kept = min(len(self.target.seq_tokens(self.seq)), len(self.tokens) - 1)
                self.target.rewind_seq(self.seq, kept)
                break
        self.id_last = id_next
        self.draft = Draft()
        return events

    def finish(self) -> Done:
        """The final event: stats and any text held back (split character, stop prefix)."""
        end = time.perf_counter()
        self.stats.decode_s = end - self.t_first if self.t_first else 0.0
        return Done(self.stats, self.out.tail())

    def release(self) -> None:
        """Free this sequence's KV cells (finished, cancelled or failed)."""
        self.target.rewind_seq(self.seq, 0)
