"""Continuous batching: ONE thread owns the llama.cpp context and runs every request.

Each step:
  1. admit queued jobs into free slots (one KV sequence id per slot); drop cancelled ones
  2. speculation rule: on while at most `spec_disable_by_batch_size` sequences are
     decoding (vLLM's --speculative-disable-by-batch-size; one still prefilling does not
     count: its chunk makes the step large already): with a full batch the machine is
     compute-bound, and a rejected draft token is compute taken from another user; above
     the limit auto's drafts are still verified where the step pays for them (_keep_paying:
     a step priced by the ubatches llama.cpp splits it into, V timed from the server's own
     steps, an untimed size tried twice), and beside a prompt being prefilled drafts
     lengthen the step by at most a half
  3. every decoding sequence plans its round, [id_last] or [id_last, *draft] (the
     engine's Generation.propose and .batch: the same round generate() runs); between
     the two, the drafting phase makes every slot's draft-model draft at once (with
     --draft: one KV sequence per slot in the draft's context; k draft tokens for N
     slots are k batched draft decodes of N rows); prompts still prefilling add a chunk
     (at most `prefill_chunk` tokens per step in all, so a long prompt delays the
     others by one chunk per step, not by its whole length)
  4. ONE decode_multi for all of it; each sequence accepts from its own rows
     (Generation.accept: verify, rewind its rejected cells, the round's events)
  5. finished, cancelled and failed sequences free their cells (target and draft) at once
A failure while planning, decoding or accepting fails only the request it belongs to: a
failed batched decode is retried one sequence at a time to find the culprit.

The HTTP side talks to this thread only through `submit()` and each job's `sink`
(called from this thread; the app makes it thread-safe with call_soon_threadsafe).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from localspec.core.backend import Model, shared_prefix
from localspec.core.config import SamplingConfig, SpecConfig, SpecMode
from localspec.core.drafters.auto import Learned
from localspec.core.drafters.base import Drafter
from localspec.core.drafters.draft_model import DraftBatch, DraftPhase
from localspec.core.engine import Round, Token
from localspec.core.events import StopReason
from localspec.core.tuning import (
    BATCH_GAIN,
    FIRST_TOKEN_SHARE,
    GRID,
    KEPT_DECAY,
    KEPT_PRIOR,
    PREFILL_RESERVE,
    PROMPT_CACHE_MIB,
    QUIET_MAX,
    SLOT_COPY_MIN,
    TRIAL_GAIN,
    TRIALS,
)
from localspec.profile import Profile
from localspec.runtime import make_drafter
from localspec.serve.jobs import Failed, Finished, Job, QueueFull, Text, Unavailable
from localspec.serve.metrics import Metrics
from localspec.serve.prompt_cache import PromptCache
from localspec.serve.defaults import BatchLimits
from localspec.serve.sequence import SeqState
from localspec.serve.slots import Placement, place

log = logging.getLogger("localspec.serve")


@dataclass(frozen=True)
class SchedulerConfig:
    n_slots: int = 4
    queue_size: int = 16  # jobs waiting for a slot; past it submit() raises QueueFull
    spec: SpecConfig = field(default_factory=SpecConfig)
    spec_disable_by_batch_size: int | None = None  # None or < 0: never disable
    # the limit by context length (policy.spec_threshold); when given it replaces the one above
    spec_limits: BatchLimits | None = None
    prefill_chunk: int = 256
    cache_reuse: int = 0  # --cache-reuse N: move cached runs of >= N tokens (KV shifting); 0: off
    slot_copy: bool = True  # copy a prompt's start from another slot that holds more of it
    # --cache-ram: bytes of overwritten slots' KV states kept to restore prompts from
    # (serve/prompt_cache.py); None: no limit, 0: off
    prompt_cache_bytes: int | None = PROMPT_CACHE_MIB << 20
    # auto's verify costs taken as given (a profile's curve), never timed: None, timed and
    # learned across requests. Tests whose drafting must not hang on the machine's load
    auto_costs: Profile | None = None
    # above the limit, auto's drafts the step still pays for are verified (_keep_paying)
    sure_bets: bool = True


@dataclass
class _Active:
    job: Job
    state: SeqState
    failure: Failed | None = None  # handed over when the request is retired
    # above the limit: steps this sequence skips drafting for since its last draft was
    # withdrawn (doubling to QUIET_MAX; a kept draft resets it), and the step it resumes at
    quiet: int = 0
    quiet_until: int = 0
    promised: float = 0.0  # the promise of its draft kept above the limit this step (0: none)

    @property
    def failed(self) -> bool:
        return self.failure is not None


def _task_view(a: _Active) -> dict:
    """A request as llama-server's /slots shows a slot's task (id_task, prompt counts,
    sampling params, next_token)."""
    st, job = a.state.stats, a.job
    s = job.sampling
    return {"id_task": job.task, "n_prompt_tokens": st.prompt_tokens,
            "n_prompt_tokens_processed": st.prefill_tokens, "n_prompt_tokens_cache": st.restored_tokens,
            "params": {"n_predict": job.gen.max_tokens, "temperature": s.temperature, "top_k": s.top_k,
                       "top_p": s.top_p, "min_p": s.min_p, "seed": -1 if s.seed is None else s.seed,
                       "stop": list(job.gen.stop), "ignore_eos": job.gen.ignore_eos},
            "next_token": [{"has_next_token": not (a.state.done or a.failed), "n_decoded": st.generated,
                            "n_remain": max(0, job.gen.max_tokens - st.generated)}]}


class Scheduler:
    """`draft`: the draft model, loaded with a sequence per slot (n_seq_max >= n_slots).
    `drafter_factory` (spec, sampling, extra) -> Drafter replaces the slots' drafters
    (the default: make_drafter for the slot's sequence of `draft`)."""

    def __init__(self, target: Model, cfg: SchedulerConfig, metrics: Metrics | None = None,
                 drafter_factory: Callable[[SpecConfig, SamplingConfig, list[int]], Drafter] | None = None,
                 draft: Model | None = None) -> None:
        for role, m in (("target", target), ("draft", draft)):
            if m is None:
                continue
            if cfg.n_slots > m.cfg.n_seq_max:
                raise ValueError(f"{cfg.n_slots} slots need a {role} loaded with n_seq_max >= {cfg.n_slots}")
            if cfg.n_slots >= m.n_batch:
                raise ValueError(f"at most {m.n_batch - 1} slots with a batch of {m.n_batch}")
        self.target = target
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.drafter_factory = drafter_factory
        self.draft = draft
        self.drafts = DraftBatch(draft) if draft is not None else None  # this step's model drafts
        # auto's verify costs and copy acceptance, learned over every request: a keystroke's
        # completion is too short to learn them anew
        self.learned = Learned()
        limit = cfg.prompt_cache_bytes
        self.prompt_cache = PromptCache(limit) if limit is None or limit > 0 else None
        self.queue: deque[Job] = deque()
        self.active: list[_Active] = []
        self.free = list(range(cfg.n_slots))  # sequence ids
        self._last: dict[int, dict] = {}  # slot -> the last request it served (GET /slots)
        self._tasks = itertools.count()
        self._steps = 0  # steps run, for _Active.quiet_until
        self._tried: dict[int, int] = {}  # pass size -> drafts tried at it (_keep_paying)
        # tokens beyond the plain one that drafts kept above the limit gave, and promised
        # (decayed sums): promises are scaled by their ratio (_kept)
        self._kept_gave = self._kept_promised = 0.0
        self.speculating = cfg.spec.mode.drafts
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        # llama.cpp's own count of the cells each slot held when it was last freed: all 0
        # unless a finished, cancelled or failed request left cells behind (/health shows it)
        self.kv_tokens = [0] * cfg.n_slots

    # ----- the HTTP side --------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="localspec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; jobs still queued or running get Failed(503)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain(self) -> None:
        """Refuse new jobs (Unavailable); queued and running ones carry on. Only sets a
        flag, so a signal handler may call it."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining or self._stopping

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, job: Job) -> None:
        """Queue a job (thread-safe). Raises QueueFull or Unavailable."""
        with self._cv:
            if not self.alive or self._draining:
                raise Unavailable("the server is shutting down" if self.draining else "the scheduler stopped")
            if len(self.queue) >= self.cfg.queue_size + len(self.free):
                # clients that left while waiting must not keep the others out
                self.queue = deque(j for j in self.queue if not j.cancelled.is_set())
            if len(self.queue) >= self.cfg.queue_size + len(self.free):
                raise QueueFull(f"all {self.cfg.n_slots} slots are busy and {len(self.queue)} requests are queued")
            self.queue.append(job)
            self._cv.notify()

    def room(self) -> int:
        """How many more jobs submit() would take now (clients that left while waiting
        do not count): requests being prepared are admitted against it."""
        with self._cv:
            self.queue = deque(j for j in self.queue if not j.cancelled.is_set())
            return self.cfg.queue_size + len(self.free) - len(self.queue)

    def snapshot(self) -> dict:
        """Live state for /health and /metrics (read without stopping the loop)."""
        limit = self._limit()
        limits = self.cfg.spec_limits
        return {"slots": self.cfg.n_slots, "active": len(self.active), "queued": len(self.queue),
                # idle: the rule's answer for zero load, even before the loop re-evaluates
                "speculation": self.speculating if self.active else self.cfg.spec.mode.drafts,
                "spec_mode": self.cfg.spec.mode,
                "draft": self.draft.name if self.draft is not None else None,
                "spec_disable_by_batch_size": -1 if limit is None or limit < 0 else limit,
                "spec_limits": limits.to_dict() if limits is not None else
                {"source": "set", "bands": [{"context": 0, "limit": -1 if limit is None or limit < 0 else limit}]},
                # above the limit: auto's drafts verified only where the step pays for them
                "spec_above_limit": "drafts the step pays for" if self.sure_bets else "off",
                "alive": self.alive, "draining": self.draining, "kv_tokens": list(self.kv_tokens),
                "prompt_cache": self.prompt_cache.snapshot() if self.prompt_cache is not None else None}

    def slots(self) -> list[dict]:
        """Each slot as llama-server's GET /slots shows it (read without stopping the loop):
        a busy slot its request, an idle one the last request it served."""
        busy = {a.state.seq: a for a in list(self.active)}
        out = []
        for seq in range(self.cfg.n_slots):
            a = busy.get(seq)
            slot = {"id": seq, "n_ctx": self.target.n_ctx_seq, "speculative": self.speculating,
                    "is_processing": a is not None, "n_tokens_cached": self.kv_tokens[seq]}
            slot.update(_task_view(a) if a is not None else self._last.get(seq, {}))
            out.append(slot)
        return out

    # ----- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if not self.queue and not self.active:
                        self._speculate()  # load dropped to zero: the rule applies again
                    while not self._stopping and not self.queue and not self.active:
                        self._cv.wait()
                    if self._stopping:
                        break
                    self._admit()
                self._step()
        except BaseException as exc:  # a bug in the loop itself: report it, refuse new work
            self.error = exc
            log.exception("scheduler stopped")
        finally:
            with self._cv:
                self._stopping = True
                pending, self.queue = list(self.queue), deque()
            for job in pending:
                job.emit(Failed("the server is shutting down", 503))
            for a in self.active:
                self._safe_release(a)
                self._count_kv(a.state.seq)
                a.job.emit(a.failure or Failed("the server is shutting down", 503))
            self.active = []

    def _admit(self) -> None:
        while self.queue and self.free:
            job = self.queue.popleft()
            if job.cancelled.is_set():
                continue
            # busy ids kept in few runs (one ubatch each), the longest start of the prompt
            # reused, copied from another slot when one holds more (serve/slots.py)
            where = place(self.free, (a.state.seq for a in self.active),
                          lambda s: shared_prefix(self.target.seq_tokens(s), job.prompt),
                          lambda s: len(self.target.seq_tokens(s)), self.cfg.n_slots,
                          SLOT_COPY_MIN if self.cfg.slot_copy else 0)
            seq = where.slot
            self.free.remove(seq)
            job.slot = seq
            job.task = next(self._tasks)
            try:
                if not self._restore(job, where) and where.source is not None:
                    self.target.copy_seq(where.source, seq)
                    self.metrics.slot_copied(where.held)
                if self.cfg.cache_reuse > 0:  # the rest of the prompt may be further on in the slot
                    self.target.reuse_chunks(seq, job.prompt, where.held, self.cfg.cache_reuse)
                self._free_draft(seq)  # whatever the slot's last user left
                drafter = self._drafter(job, seq)
                state = SeqState(self.target, seq, job.prompt, drafter, sampling=job.sampling,
                                 spec=self.cfg.spec, gen=job.gen)
            except Exception as exc:
                log.exception("could not start a request")
                self.free.append(seq)
                job.emit(Failed(f"could not start the request: {exc}"))
                continue
            self.active.append(_Active(job, state))

    def _restore(self, job: Job, where: Placement) -> bool:
        """The prompt cache's part in placing `job`: the slot's own cells saved when the
        request is to lose most of them, and an entry holding more of the prompt than the
        placement gives (the slot's cells or the copy planned) loaded into the slot.
        Returns whether it loaded one (the planned copy is then not made)."""
        cache = self.prompt_cache
        if cache is None:
            return False
        seq = where.slot
        entry = cache.find(job.prompt, where.held)
        own = shared_prefix(self.target.seq_tokens(seq), job.prompt)
        cache.keep(self.target, seq, 0 if entry is not None or where.source is not None else own)
        if entry is None:
            return False
        n = cache.restore(self.target, seq, entry, job.prompt)
        if n:
            self.metrics.prompt_restored(n)
            return True
        # refused: the slot is empty now; a planned copy still gives what it held
        return False

    def _drafter(self, job: Job, seq: int) -> Drafter:
        if self.drafter_factory is not None:
            return self.drafter_factory(self.cfg.spec, job.sampling, job.extra)
        return make_drafter(self.cfg.spec, job.sampling, self.draft, job.extra, self.target,
                            seq=seq, batch=self.drafts, memory=job.memory, learned=self.learned,
                            costs=self.cfg.auto_costs)

    def _decoding(self) -> list[_Active]:
        """The sequences the rule counts: those decoding. A prompt still prefilling is not
        load the limit was measured on (steps of C decoding sequences); a step that carries
        its chunk is already a large batch, so a decoding slot's draft adds little to it."""
        return [a for a in list(self.active) if not a.state.prefilling]

    def _limit(self) -> int | None:
        """The rule's limit now: by the decoding sequences' mean context when the limits
        come by context band (a long KV cache moves the crossover)."""
        limits = self.cfg.spec_limits
        if limits is None:
            return self.cfg.spec_disable_by_batch_size
        decoding = self._decoding()
        context = sum(len(a.state.tokens) for a in decoding) / len(decoding) if decoding else 0.0
        return limits.limit(context)

    def _speculate(self) -> bool:
        limit = self._limit()
        n = len(self._decoding())
        on = self.cfg.spec.mode.drafts and (limit is None or limit < 0 or n <= limit)
        if on != self.speculating:
            self.speculating = on
            self.metrics.toggled()
            log.info("speculation %s: %d decoding sequences (spec-disable-by-batch-size %s)",
                     "on" if on else "off", n, limit)
        return on

    def _step(self) -> None:
        for a in self.active:
            if a.job.cancelled.is_set() and not a.state.done:
                a.state.cancel()
        self._retire()
        if not self.active:
            return
        speculate = self._speculate()
        n_batch = self.target.n_batch
        decoding = [a for a in self.active if not a.state.prefilling]
        prefilling = [a for a in self.active if a.state.prefilling]
        reserve = min(self.cfg.prefill_chunk, PREFILL_RESERVE) if prefilling else 0
        k_cap = max(0, (n_batch - reserve) // max(1, len(decoding)) - 1)
        entries: list[tuple[int, list[int], int]] = []
        owners: list[_Active] = []
        sure = not speculate and self._sure_bets_only()
        self._steps += 1
        asked = {id(a) for a in decoding if speculate or (sure and self._steps >= a.quiet_until)}
        proposed = [a for a in decoding if self._guard(a, a.state.propose, k_cap if id(a) in asked else 0)]
        plain = {a.state.seq: 1 for a in decoding}  # the step's layout without drafts
        if sure:
            self._keep_paying(proposed, plain)
            self._quieten([a for a in proposed if id(a) in asked])
        if prefilling and (speculate or sure) and self.learned.cost is not None:
            room = min(self.cfg.prefill_chunk, n_batch - len(decoding))
            for a in prefilling:  # the chunks this step will carry, as below
                plain[a.state.seq] = n = max(0, min(room, len(a.state.prompt) - a.state.n_prefilled))
                room -= n
            self._spare_first_tokens(proposed, plain)
        phase = self._draft_phase()
        drafted = False
        for a in proposed:  # a slot is charged its share of the shared drafting phase
            toks = self._guard(a, a.state.batch, phase.seconds_of(a.state.seq))
            if toks:
                entries.append((a.state.seq, toks, len(toks)))
                owners.append(a)
                drafted = drafted or len(toks) > 1
        budget = min(self.cfg.prefill_chunk, n_batch - sum(len(e[1]) for e in entries))
        for a in prefilling:
            if budget <= 0:
                break
            entry = a.state.prefill_entry(budget)
            entries.append(entry)
            owners.append(a)
            budget -= len(entry[1])
        if entries:
            self._decode(entries, owners, speculate or drafted)
        self._retire()
        self._speculate()  # load may have dropped: /metrics shows the rule's state now

    @property
    def sure_bets(self) -> bool:
        """Whether, above the limit, auto's n-gram drafts may still be verified where the
        step pays for them (_keep_paying): with `auto` and no draft model (its decodes
        are not priced here), under limits measured or defaulted (`spec_limits`), not set
        (--spec-disable-by-batch-size, or a bare `spec_disable_by_batch_size`: off above
        it, as asked)."""
        limits = self.cfg.spec_limits
        return (self.cfg.sure_bets and self.cfg.spec.mode is SpecMode.AUTO and self.drafts is None
                and limits is not None and limits.source != "set")

    def _sure_bets_only(self) -> bool:
        return self.sure_bets and self.learned.cost is not None  # auto has priced a verify

    def _price(self, layout: dict[int, int], how: str = "worst") -> float:
        """What a step of `layout` ({seq: tokens}) costs in one-token decodes: the V of
        each ubatch llama.cpp splits it into (backend ubatch.py: with a KV cache per
        sequence, a draft beside plain rows is a pass of its own), by auto's learned
        curve; a size not yet settled at its worst case (`how` "worst"), its estimate
        ("estimate"), or where never timed its hope ("hope": a trial); past the curve's
        end as if linear from it."""
        cost = self.learned.cost
        total = 0.0
        for n in self.target.ubatches(layout.items()):
            m = min(n, cost.n_max)
            if cost.settled(m) or how == "estimate":
                v = cost.v(m)
            else:
                v = cost.hope(m) if how == "hope" and not cost.known(m) else cost.upper(m)
            total += v * n / m
        return total

    def _learn_step(self, layout: list[tuple[int, int]], seconds: float) -> None:
        """What a decode-only step of several sequences showed of V(n), for _price: a step
        of one pass is a verify of its tokens (the plain steps of C sequences time V(C));
        of two passes whose first is settled, the second took the rest. (A sequence
        decoding alone is timed by its own round, in accept.) As for a round, a step is
        taken as at most its tokens' one-token decodes: one stalled by another process
        must not price a size out."""
        cost = self.learned.cost
        t1 = cost.t1() if cost is not None else None
        if not t1:
            return
        passes = self.target.ubatches(layout)
        if len(passes) == 1:
            n, rest = passes[0], seconds
        elif len(passes) == 2 and cost.settled(passes[0]) and passes[0] <= cost.n_max:
            n, rest = passes[1], seconds - cost.v(passes[0]) * t1
        else:
            return
        if 1 < n <= cost.n_max and rest > 0:
            cost.observe_verify(n, min(rest, n * t1))

    def _keep_paying(self, proposed: list[_Active], plain: dict[int, int]) -> None:
        """Of the drafts proposed above the limit, keep those the step pays for: by the
        tokens each is expected to add (auto's own promise, its accepted prefix) against
        what it adds to the step's time (_price: the ubatches it makes), best first, each
        lifting the step's tokens per time by BATCH_GAIN over what it was without it; the
        rest decode plainly. On a CPU with a KV cache per sequence a draft beside others
        costs about its own verify, so only long sure copies are kept (or ones that fill
        a pass the step makes anyway); where a pass of more tokens costs little more (a
        GPU, an AMX Xeon), more are."""
        offers = []
        trust = self._trust()
        for a in proposed:
            promise = a.state.promise()
            if promise is None:  # nothing drafted, or no prediction to price it by
                a.state.withdraw()
                continue
            k = len(a.state.draft.tokens)
            a.promised, promise = promise, 1.0 + trust * (promise - 1.0)  # auto's, and trusted
            if promise > 1.0:
                offers.append(((promise - 1.0) / k, k, promise, a))
            else:
                self._withdraw(a)
        layout = dict(plain)
        tokens = float(len(plain))
        rate = tokens / self._price(layout, "estimate")
        kept, ranked = 0, sorted(offers, key=lambda o: -o[0])
        for i, (_, k, promise, a) in enumerate(ranked):
            layout[a.state.seq] = 1 + k
            with_it = tokens + promise - 1.0
            if (new_rate := with_it / self._price(layout)) >= (1.0 + BATCH_GAIN) * rate:
                tokens, rate, kept = with_it, new_rate, kept + 1
                continue
            n = self._trial(layout, plain) if not kept else None
            if n is not None and with_it / self._price(layout, "hope") >= (1.0 + TRIAL_GAIN) * rate:
                # a size never timed: verified once or twice alone beside the plain pass,
                # which _learn_step then times (the worst case would never let it be tried);
                # only where even its hope must clear a wide margin: a trial that merely
                # breaks even costs a pass and teaches little
                self._tried[n] = self._tried.get(n, 0) + 1
                for *_, b in ranked[i + 1:]:
                    self._withdraw(b)
                return
            layout[a.state.seq] = 1
            self._withdraw(a)

    @staticmethod
    def _withdraw(a: _Active) -> None:
        """The step does not verify this sequence's draft, nor counts its promise."""
        a.state.withdraw()
        a.promised = 0.0

    def _kept(self, gave: int, promised: float) -> None:
        """A draft kept above the limit gave `gave` tokens beyond its round's own, where
        it promised `promised`."""
        self._kept_gave = KEPT_DECAY * self._kept_gave + gave
        self._kept_promised = KEPT_DECAY * self._kept_promised + promised

    def _trust(self) -> float:
        """How much of what auto promises the drafts kept above the limit gave (at most
        all of it; KEPT_PRIOR promised tokens of full trust before any evidence): auto's
        promise is made for a sequence alone, and copies in one request's reply (a code
        review quoting its prompt) can hold less often than its counts say."""
        return min(1.0, (self._kept_gave + KEPT_PRIOR) / (self._kept_promised + KEPT_PRIOR))

    def _trial(self, layout: dict[int, int], plain: dict[int, int]) -> int | None:
        """The pass size a draft would be tried at (TRIALS times at most): where the step
        without it is one settled pass and the draft makes one pass more, of one of GRID's
        sizes never timed; else None."""
        cost = self.learned.cost
        base, passes = self.target.ubatches(plain.items()), self.target.ubatches(layout.items())
        if len(base) != 1 or len(passes) != 2 or not cost.settled(min(base[0], cost.n_max)):
            return None
        n = passes[1]
        if n not in GRID or n > cost.n_max or cost.known(n) or self._tried.get(n, 0) >= TRIALS:
            return None  # GRID's sizes only: the curve between them is interpolated
        return n

    def _quieten(self, asked: list[_Active]) -> None:
        """Above the limit, a sequence whose draft was not kept (or that drafted nothing)
        is not asked again for 1, 2, 4 ... QUIET_MAX steps; a kept one is asked every
        step. Drafting costs the scheduler thread ~0.5 ms a sequence, 2-4% of a step of
        8 sequences on a CPU, where drafts seldom pay at that load."""
        for a in asked:
            a.quiet = 0 if a.state.draft.tokens else min(QUIET_MAX, max(1, 2 * a.quiet))
            a.quiet_until = self._steps + a.quiet

    def _spare_first_tokens(self, proposed: list[_Active], plain: dict[int, int]) -> None:
        """While prompts prefill beside them (`plain`: the step's layout with their chunks),
        the decoding sequences' drafts may add at most FIRST_TOKEN_SHARE to the step's
        time (_price): a request waiting for its first token waits for the whole step
        (2-core AMD EPYC, 1.5B, two streaming clients of 50-token requests: mean time to
        first token 360 ms with this rule, 450 ms without, 337 ms with speculation off).
        Drafts are cut, the surest kept first."""
        layout = dict(plain)
        cap = (1.0 + FIRST_TOKEN_SHARE) * self._price(layout)
        offers = [(a.state.promise() or 1.0, len(a.state.draft.tokens), a) for a in proposed if a.state.draft.tokens]
        for promise, k, a in sorted(offers, key=lambda o: -(o[0] - 1.0) / o[1]):
            keep = min(k, a.state.k)
            while keep > 0:
                layout[a.state.seq] = 1 + keep
                if self._price(layout) <= cap:
                    break
                keep -= 1
            layout[a.state.seq] = 1 + keep
            if keep < k:
                a.promised = 0.0  # auto's promise was for the whole draft
            if keep == 0:
                a.state.withdraw()
            else:
                a.state.k = keep  # batch() verifies the first `keep` tokens

    def _draft_phase(self) -> DraftPhase:
        """Every slot's draft-model draft this step, in one pass of batched decodes."""
        if self.drafts is None:
            return DraftPhase(0, 0, 0.0, {})
        phase = self.drafts.run()
        if phase.decodes:
            self.metrics.draft_decodes(phase.decodes, phase.rows, phase.seconds)
        return phase

    def _decode(self, entries: list[tuple[int, list[int], int]], owners: list[_Active],
                speculate: bool) -> None:
        t0 = time.perf_counter()
        llama0 = self.target.llama_s
        try:
            rows = self.target.decode_multi(entries)
        except Exception as exc:  # noqa: BLE001 - retried one by one below
            if len(entries) == 1:
                self._fail(owners[0], exc)
                return
            log.warning("batched decode failed (%s); retrying one sequence at a time", exc)
            for entry, owner in zip(entries, owners):
                self._decode([entry], [owner], speculate)
            return
        dt = time.perf_counter() - t0
        dl = self.target.llama_s - llama0
        n_prefill = sum(len(t) for (_, t, _), a in zip(entries, owners) if a.state.prefilling)
        self.metrics.step(sum(len(t) for _, t, _ in entries), n_prefill, dt, speculate)
        n_new = 0
        for (_, toks, _), a, r in zip(entries, owners, rows):
            n_new += self._guard(a, self._take, a, len(toks), r, dt, dl, len(entries) == 1) or 0
        if not n_prefill:
            self.metrics.decode_step(len(entries), speculate, dt, n_new)
            if len(entries) > 1 and self.sure_bets:
                self._learn_step([(seq, len(toks)) for seq, toks, _ in entries], dt)

    def _take(self, a: _Active, n: int, rows: np.ndarray, dt: float, dl: float, alone: bool) -> int:
        """Hand this sequence its rows; returns how many tokens it emitted. `alone`: the
        decode held its rows only (else `dt` is the shared step's, not its round's cost)."""
        st = a.state
        before = st.stats.generated
        st.stats.llama_s += dl  # the shared decode's time, as this sequence experienced it
        if st.prefilling:
            events = st.prefilled(n, rows)
            self.metrics.first_token(st.stats.generated - before)
        else:
            events = st.accept(rows, dt, alone)
            rnd: Round = events[0]  # accept() returns the Round first, then the tokens
            self.metrics.round(rnd.n_draft, rnd.n_accept, st.stats.generated - before, rnd.source)
            if a.promised and rnd.n_draft:
                self._kept(rnd.n_accept, a.promised - 1.0)
            a.promised = 0.0
        tokens = [ev for ev in events if isinstance(ev, Token)]
        text = "".join(ev.text for ev in tokens)
        logprobs = tuple(ev.logprob for ev in tokens if ev.logprob is not None)
        if text or logprobs:  # a token whose text is held back still has its logprob
            a.job.emit(Text(text, len(tokens), logprobs))
        return st.stats.generated - before

    def _retire(self) -> None:
        """Retire finished, failed and cancelled requests. The reply (or the failure) is
        handed over only after the books are done (slot freed, metrics counted): a client
        that reads /metrics or /health right after its reply sees its request gone."""
        keep, replies = [], []
        for a in self.active:
            if not (a.failed or a.state.done):
                keep.append(a)
                continue
            st = a.state
            if not a.failed and st.stats.stop_reason != StopReason.CANCELLED:
                done = self._guard(a, st.finish)
                if done is not None:
                    replies.append((a.job, Finished(done.stats, done.text)))
            if a.failure is not None:
                replies.append((a.job, a.failure))
            self._last[st.seq] = _task_view(a)
            self._safe_release(a)
            self._count_kv(st.seq)
            t_first = st.t_first or time.perf_counter()
            self.metrics.finish(st.stats.prompt_tokens, time.perf_counter() - a.job.t_submit,
                                t_first - a.job.t_submit)
            with self._cv:
                self.free.append(st.seq)
        self.active = keep
        for job, reply in replies:
            job.emit(reply)

    def _count_kv(self, seq: int) -> None:
        try:
            self.kv_tokens[seq] = self.target.kv_len(seq)
        except Exception:  # a health figure must not stop the loop
            log.debug("could not count KV cells", exc_info=True)

    # ----- failures stay with the request that caused them --------------------------

    def _guard(self, a: _Active, fn: Callable, *args: object) -> object:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure stays with its request
            self._fail(a, exc)
            return None

    def _fail(self, a: _Active, exc: Exception) -> None:
        if a.failed:
            return
        log.error("request failed: %s", exc, exc_info=exc)
        a.failure = Failed(f"generation failed: {exc}")  # sent once its slot is freed

    def _safe_release(self, a: _Active) -> None:
        try:
            # a finished reply stays in its slot for the next request to start from
            st = a.state
            st.release(keep=st.done and not a.failed and st.stats.stop_reason != StopReason.CANCELLED)
            self._free_draft(a.state.seq)
        except Exception:  # the context is broken beyond one sequence; nothing better to do
            log.exception("could not free sequence %d", a.state.seq)

    def _free_draft(self, seq: int) -> None:
        """Drop the slot's cells in the draft's context too: a stale cell past the draft
        sequence's record would break the next user's first draft decode."""
        if self.draft is not None:
            self.draft.rewind(0, force=True, seq=seq)
