"""Draft with a small model of the same family, on one KV sequence of its context per
generation. Its cells follow the context by prefix reuse: each round it rewinds to what
it shares with the context and decodes only the new tokens (the accepted ones and the
target's correction), then one token per decode while it drafts.

The same code drafts for one generation (run, edit, chat: sequence 0, at once) and for
every active slot of the server (one sequence per slot): there each ModelDrafter leaves
its request in a shared DraftBatch and the scheduler runs them all together, so k draft
tokens for N slots cost k batched decodes of N rows, not N * k one-row decodes.

Under an output grammar it drafts within it (a clone of the generation's grammar per
draft, advanced over its own tokens): the target would reject anything else, and q is
then the constrained distribution the tokens were really drawn from, as the lossless
rule needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import SamplingConfig
from localspec.core.constrain import GrammarLike, constrained_argmax, constrained_probs
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.errors import GrammarError
from localspec.core.sampling import probs_from_logits, sample

log = logging.getLogger("localspec.drafters")


def _top_prob(logits: np.ndarray) -> float:
    # the untempered softmax's largest probability: 1 / sum(exp(l - max))
    return float(1.0 / np.exp(logits - logits.max()).sum())


class ModelDrafter(DrafterBase):
    """Drafts on sequence `seq` of `model`; with a `batch`, the draft is filled in when
    the batch runs (the server's drafting phase), else at once."""

    name = "model"

    def __init__(self, model: Model, sampling: SamplingConfig, p_min: float = 0.0, *,
                 seq: int = 0, batch: DraftBatch | None = None) -> None:
        self.model = model
        self.sampling = sampling
        self.p_min = p_min
        self.seq = seq
        self.batch = batch
        seed = None if sampling.seed is None else sampling.seed + 1
        self.rng = np.random.default_rng(seed)
        self.grammar = None  # the generation's output grammar (constrain())

    def begin(self, prompt: Sequence[int]) -> None:
        pass  # synced lazily by prefix reuse when it drafts

    def constrain(self, grammar: GrammarLike | None) -> None:
        self.grammar = grammar

    def draft(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or len(context) + k > self.model.n_ctx_seq:
            return Draft(source=self.name)
        grammar = self.grammar.clone() if self.grammar is not None else None
        req = _Request(self, list(context), k, grammar)
        if self.batch is None:
            draft_together(self.model, [req])
        else:
            self.batch.pending.append(req)
        return req.draft

    def choose(self, logits: np.ndarray, rows: list[np.ndarray], grammar: GrammarLike | None) -> int | None:
        """The next draft token from one row of logits, within `grammar` if any (None:
        too unsure to go on); sampled drafts keep the distribution q they were drawn
        from in `rows`."""
        if self.p_min > 0.0 and _top_prob(logits) < self.p_min:
            return None  # the draft is unsure: verifying further tokens would be waste
        if self.sampling.greedy:
            return int(np.argmax(logits)) if grammar is None else constrained_argmax(logits, grammar)
        q = (probs_from_logits(logits, self.sampling) if grammar is None
             else constrained_probs(logits, grammar, self.sampling))
        rows.append(q)
        return sample(q, self.rng)


@dataclass
class _Request:
    drafter: ModelDrafter
    context: list[int]
    k: int
    grammar: GrammarLike | None = None  # a clone of the output grammar, advanced over the draft
    draft: Draft = field(default_factory=lambda: Draft(source="model"))
    rows: list[np.ndarray] = field(default_factory=list)  # q per token, when sampled
    n_fed: int = 0  # tokens decoded for it in the draft's context: its share of a phase

    @property
    def seq(self) -> int:
        return self.drafter.seq

    def take(self, logits: np.ndarray) -> int | None:
        """Add the next token from `logits`; returns it while more are wanted."""
        try:
            tok = self.drafter.choose(logits, self.rows, self.grammar)
            if tok is None:
                return None
            self.draft.tokens.append(tok)
            if len(self.draft.tokens) >= self.k:
                return None
            if self.grammar is not None:
                self.grammar.accept(tok)
        except GrammarError:
            return None  # a dead end for the grammar: the draft so far stands
        return tok

    def close(self) -> None:
        self.draft.probs = np.stack(self.rows) if self.rows else None
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None


def draft_together(model: Model, reqs: Sequence[_Request]) -> tuple[int, int]:
    """Draft for every request (at most one per sequence) on `model`: one catch-up
    decode of each sequence's new context tokens, then one decode of one row per
    sequence still drafting, until each has its k tokens. Returns (decodes made,
    sequence-rows in them): k tokens for N sequences are k decodes of N rows."""
    if len({r.seq for r in reqs}) < len(reqs):
        raise ValueError("one draft per sequence and batch")
    feeds = []
    for r in reqs:  # each sequence's cells follow its context by prefix reuse
        keep = model.reuse_prefix(r.context, seq=r.seq, redo_last=True)
        feeds.append((r.seq, r.context[keep:]))
        r.n_fed = len(r.context) - keep
    rows, n_decodes, n_rows = _catch_up(model, feeds)
    live = list(reqs)
    try:
        while live:
            nxt = [(r, r.take(row)) for r, row in zip(live, rows)]
            live = [r for r, tok in nxt if tok is not None]
            for r in live:
                r.n_fed += 1
            if live:  # the last draft token is never decoded: the target verifies it
                rows = model.decode_multi([(r.seq, [tok], 1) for r, tok in nxt if tok is not None])
                rows = [row[0] for row in rows]
                n_decodes, n_rows = n_decodes + 1, n_rows + len(live)
    finally:
        for r in reqs:
            r.close()
    return n_decodes, n_rows


def _catch_up(model: Model, feeds: list[tuple[int, list[int]]]) -> tuple[list[np.ndarray], int, int]:
    """Decode each sequence's new tokens; the logits row after each one's last token,
    decodes and sequence-rows. One decode when they fit in a batch; else the bulk
    first, in batches without logits."""
    n_decodes = n_rows = 0
    if sum(len(t) for _, t in feeds) > model.n_batch:
        bulk = [(seq, toks[:-1]) for seq, toks in feeds if len(toks) > 1]
        for batch in _pack(bulk, model.n_batch):
            model.decode_multi([(seq, toks, 0) for seq, toks in batch])
            n_decodes, n_rows = n_decodes + 1, n_rows + len(batch)
        feeds = [(seq, toks[-1:]) for seq, toks in feeds]
    rows = model.decode_multi([(seq, toks, 1) for seq, toks in feeds])
    return [r[0] for r in rows], n_decodes + 1, n_rows + len(feeds)


def _pack(feeds: list[tuple[int, list[int]]], n_batch: int) -> list[list[tuple[int, list[int]]]]:
    """Split (seq, tokens) into batches of at most n_batch tokens, in order, a sequence
    at most once per batch (a long one continues in the next)."""
    batches: list[list[tuple[int, list[int]]]] = [[]]
    room = n_batch
    for seq, toks in feeds:
        while toks:
            if room == 0:
                batches.append([])
                room = n_batch
            batches[-1].append((seq, toks[:room]))
            toks, room = toks[room:], room - len(toks[:room])
    return [b for b in batches if b]


class DraftBatch:
    """The drafts the server's slots asked of one draft model this step, made together
    by run(): k batched decodes of one row per slot (the slots' sequences of the draft
    context), before the target's batched verify."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.pending: list[_Request] = []

    def run(self) -> DraftPhase:
        """Fill every pending draft. A failed draft decode leaves the drafts empty (plain
        decoding this round: nothing is lost) and the draft cells as recorded (the
        backend drops what a failed decode wrote)."""
        reqs, self.pending = self.pending, []
        if not reqs:
            return DraftPhase(0, 0, 0.0, {})
        t0 = time.perf_counter()
        done = (0, 0)
        try:
            done = draft_together(self.model, reqs)
        except Exception as exc:  # noqa: BLE001 - drafting is optional: verify no draft
            log.warning("batched draft decode failed (%s); these rounds decode plainly", exc)
            for r in reqs:
                r.draft.tokens, r.draft.probs = [], None
        fed = sum(r.n_fed for r in reqs)
        shares = {r.seq: r.n_fed / fed if fed else 1 / len(reqs) for r in reqs}
        return DraftPhase(*done, time.perf_counter() - t0, shares)


class DraftPhase(NamedTuple):
    """What one drafting phase did: batched decodes, sequence-rows in them, its time, and
    each sequence drafted for with its share of the tokens decoded (catch-up and draft
    tokens): every one of them waited for the whole phase, but the phase's decodes were
    shared, so what drafting cost one sequence is its share of the time."""

    decodes: int
    rows: int
    seconds: float
    shares: dict[int, float]

    def seconds_of(self, seq: int) -> float:
        """The drafting time charged to sequence `seq` (0 when it was not drafted for)."""
        return self.seconds * self.shares.get(seq, 0.0)
