"""A chat on top of the engine: turns a user message into a prompt (reusing the KV
prefix the previous turn left), streams the engine's events, records the reply, keeps
speed and acceptance numbers, and carries out slash commands. Shared by the textual
app and the line REPL; knows nothing of either."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from localspec.chat.commands import Command, CommandError, help_text
from localspec.chat.session import Conversation
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig, SpecMode
from localspec.core.drafters import Drafter
from localspec.core.backend import Model
from localspec.core.engine import Done, Event, GenerationStats, Round, Token, generate
from localspec.core.events import StopReason, Transcript
from localspec.runtime import Runtime, log_run, make_drafter


@dataclass(frozen=True)
class Trimmed:
    """Chat-level event before a turn: the oldest messages left the model's context."""

    dropped: int
    remaining: int


@dataclass
class Tally:
    """Rounds, drafted and accepted tokens for one draft source (ngram, model, none)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, ev: Round) -> None:
        self.rounds += 1
        self.drafted += ev.n_draft
        self.accepted += ev.n_accept

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


@dataclass
class Live:
    """The numbers of the turn being generated (or the last one), for the status bar."""

    t_start: float = 0.0
    t_first: float | None = None  # first token shown: time to first token
    t_last: float = 0.0
    generated: int = 0
    draft: Tally = field(default_factory=Tally)  # rounds that verified a draft
    k: int = 0
    source: str = ""
    ctx_used: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    running: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    def tok_s(self, now: float) -> float:
        end = now if self.running else self.t_last
        span = end - self.t_first if self.t_first is not None else 0.0
        return (self.generated - 1) / span if span > 0 and self.generated > 1 else 0.0


@dataclass(frozen=True)
class TurnInfo:
    prompt_tokens: int
    prefill_tokens: int
    ttft_s: float | None
    generated: int
    tokens_per_s: float
    decode_s: float
    stop_reason: str


class ChatRunner:
    """One conversation with a loaded target (and draft model). Generation runs in one
    thread at a time; `busy` is held while it does."""

    def __init__(
        self, runtime: Runtime, conversation: Conversation | None = None, *,
        spec: SpecConfig, sampling: SamplingConfig, gen: GenerationConfig,
        session_path: Path | None = None, reuse_prefix: bool = True, log: bool = True,
        tag: str | None = None, memory: object | None = None,
    ) -> None:  # fmt: skip
        self.target = runtime.target
        self.draft_model = runtime.draft
        self.conv = conversation or Conversation()
        self.spec, self.sampling, self.gen = spec, sampling, gen
        self.base_draft_max = spec.draft_max
        # /k N fixes k; None lets it adapt (auto chooses k itself, bounded by draft_max)
        self.k_fixed: int | None = None if spec.adaptive or spec.mode.chooses_k else spec.draft_max
        self.session_path = session_path
        self.reuse_prefix = reuse_prefix
        self.log, self.tag = log, tag
        self.busy = threading.Lock()
        self.live = Live(ctx_used=self.target.n_past)
        self.tallies: dict[str, Tally] = {}
        self.turns: list[TurnInfo] = []
        self._drafter: Drafter | None = None
        self.memory = memory  # earlier replies (memory_store.open_memory), drafted from by auto

    # ----- one turn ---------------------------------------------------------------

    def reserve(self) -> int:
        """Tokens kept free for the reply when fitting the history into the context."""
        n_ctx = self.target.n_ctx
        return min(self.gen.max_tokens if self.gen.max_tokens > 0 else n_ctx // 4, n_ctx // 2)

    def reply(self, text: str, should_stop: Callable[[], bool] | None = None) -> Iterator[Event | Trimmed]:
        """Add the user's message and stream the reply: a Trimmed first when old turns
        had to go, then the engine's Token/Round/Done events. The reply is recorded
        whatever ends it: Done, a cancel, the consumer closing the stream."""
        with self.busy:
            yield from self._reply(text, should_stop)

    def _reply(self, text: str, should_stop: Callable[[], bool] | None) -> Iterator[Event | Trimmed]:
        live = self.live = Live(t_start=time.perf_counter(), running=True, k=self.live.k)
        self.conv.add("user", text)
        try:
            prompt = self.conv.fit(self.target, self.reserve())
        except BaseException:
            self.conv.pop()
            live.running = False
            raise
        if prompt.dropped:
            yield Trimmed(prompt.dropped, len(self.conv.in_context))
        if not self.reuse_prefix:  # measuring what the prompt cache saves
            for m in (self.target, self.draft_model):
                if m is not None:
                    m.rewind(0)
        live.prompt_tokens = live.ctx_used = len(prompt.tokens)
        run = Transcript(generate(self.target, prompt.tokens, self.drafter(), sampling=self.sampling,
                                  spec=self.spec, gen=self.gen, should_stop=should_stop,
                                  draft_model=self._draft_in_use()))
        failed = False
        try:
            for ev in run:
                self._observe(ev, live)
                yield ev
        except GeneratorExit:  # the consumer stopped reading: a cancel, keep the text
            raise
        except BaseException:
            failed = True
            raise
        finally:
            run.close()
            live.running = False
            live.t_last = time.perf_counter()
            if failed and not live.generated:
                self.conv.pop()  # nothing came of this message: as if never sent
            else:
                self._finish(text, run.text, run.stats, live)
                # next turn: reuse these exact ids when the text agrees (no stop string cut it)
                if self.target.detokenize(run.ids) == run.text:
                    self.conv.remember(prompt, run.text, run.ids)

    def _observe(self, ev: Event, live: Live) -> None:
        if isinstance(ev, Token):
            live.generated += 1
            live.ctx_used += 1
            if live.t_first is None:
                live.t_first = time.perf_counter()
        elif isinstance(ev, Round):
            # auto picks k itself each round: its k is what it drafted
            live.k = ev.n_draft if self.spec.mode.chooses_k else ev.k
            live.source = ev.source
            if ev.n_draft:
                live.draft.add(ev)
            self.tallies.setdefault(ev.source if ev.n_draft else "plain", Tally()).add(ev)
        elif isinstance(ev, Done):
            live.prefill_tokens = ev.stats.prefill_tokens

    def _finish(self, user: str, reply: str, stats: GenerationStats | None, live: Live) -> None:
        stop = stats.stop_reason if stats else StopReason.CANCELLED
        self.conv.add("assistant", reply, stop_reason=stop, tokens=live.generated)
        self.turns.append(TurnInfo(
            prompt_tokens=live.prompt_tokens, prefill_tokens=live.prefill_tokens,
            ttft_s=live.ttft, generated=live.generated,
            tokens_per_s=stats.tokens_per_s if stats else live.tok_s(live.t_last),
            decode_s=stats.decode_s if stats else 0.0, stop_reason=stop,
        ))  # fmt: skip
        live.ctx_used = self.target.n_past
        log_run("chat", stats, self.target, self._draft_in_use(), self.spec, self.sampling,
                tag=self.tag, prompt_text=user, output_text=reply, enabled=self.log)
        self.autosave()

    # ----- settings ----------------------------------------------------------------

    def _draft_in_use(self) -> Model | None:
        """The draft model, when the current mode drafts with it."""
        return self.draft_model if self.spec.mode.uses_draft_model else None

    def drafter(self) -> Drafter:
        """The drafter for the current settings, kept across turns (the model drafter's
        KV cache follows the conversation by prefix reuse, like the target's)."""
        if self._drafter is None:
            self._drafter = make_drafter(self.spec, self.sampling, self._draft_in_use(), target=self.target,
                                         memory=self.memory if self.spec.mode.uses_memory else None)
        return self._drafter

    def _respec(self, mode: SpecMode) -> None:
        self.spec = replace(self.spec, mode=mode, draft_max=self.k_fixed or self.base_draft_max,
                            adaptive=self.k_fixed is None)
        self._drafter = None  # the auto policy's learned acceptance goes with it

    def autosave(self) -> None:
        if self.session_path is not None:
            self.conv.save(self.session_path)

    def apply(self, cmd: Command) -> str:
        """Carry out a command (all but /quit, which is the caller's); returns the text to
        show. Raises CommandError for what cannot be done."""
        if cmd.name == "help":
            return help_text()
        if cmd.name == "stats":
            return self.stats_text()
        if cmd.name == "clear":
            self.conv.clear()
            self.autosave()
            return "conversation cleared"
        if cmd.name == "system":
            if not cmd.arg:
                return f"system message: {self.conv.system!r}" if self.conv.system else "no system message"
            self.conv.system = None if cmd.arg == "-" else cmd.arg
            self.autosave()
            return "system message removed" if cmd.arg == "-" else "system message set"
        if cmd.name == "save":
            path = self.conv.save(cmd.arg)
            return f"saved {len(self.conv.messages)} messages to {path}"
        if cmd.name == "k":
            self.k_fixed = None if cmd.value == "auto" else int(cmd.value)
            self._respec(self.spec.mode)
            msg = f"k fixed at {self.k_fixed}" if self.k_fixed else f"k adapts (at most {self.base_draft_max})"
            if self.k_fixed and self.spec.mode.chooses_k:
                msg = f"auto drafts at most {self.k_fixed} tokens"
            return msg + ("" if self.spec.mode.drafts else " (drafting is off: /spec to turn it on)")
        if cmd.name == "spec":
            if cmd.value.needs_draft_model and self.draft_model is None:
                raise CommandError(f"/spec {cmd.value} needs a draft model: start chat with --draft")
            self._respec(cmd.value)
            return f"drafter: {cmd.value}"
        if cmd.name == "temp":
            self.sampling = replace(self.sampling, temperature=float(cmd.value))
            self._drafter = None
            return f"temperature {cmd.value:g}" + (" (greedy)" if cmd.value == 0 else "")
        raise CommandError(f"/{cmd.name} is handled by the interface")

    # ----- text for the user -------------------------------------------------------

    def names(self) -> str:
        target = Path(self.target.path).stem
        if self._draft_in_use() is not None:
            return f"{target} + {Path(self.draft_model.path).stem}"
        return target

    def status_text(self, now: float | None = None, stopping: bool = False) -> str:
        """The status bar: speed, acceptance, k, drafter, models, context."""
        live = self.live
        now = time.perf_counter() if now is None else now
        drafter = self.spec.mode
        if self.spec.mode in (SpecMode.AUTO, SpecMode.HYBRID) and live.source in ("ngram", "model", "none"):
            drafter += f":{live.source}"
        k = (f"{live.k}" if live.k else "?") if self.spec.mode.drafts else "-"
        k += " fixed" if self.k_fixed else ""
        parts = [
            ("stopping" if stopping else "generating") if live.running else "ready",
            f"{live.tok_s(now):.1f} tok/s",
            f"accept {live.draft.acceptance:.0%}" if live.draft.drafted else "accept -",
            f"mean acc {live.draft.mean_accepted:.2f}" if live.draft.rounds else "mean acc -",
            f"k {k}",
            drafter,
            f"ctx {live.ctx_used}/{self.target.n_ctx}",
        ]
        if live.ttft is not None and live.prompt_tokens:
            prefill = f" (prefill {live.prefill_tokens}/{live.prompt_tokens})" if live.prefill_tokens else ""
            parts.append(f"ttft {live.ttft:.2f}s{prefill}")
        parts.append(self.names())  # last: the longest, and the first to be cut off
        return " │ ".join(parts)

    def stats_text(self) -> str:
        """/stats: this conversation's turns, speed and acceptance per draft source."""
        if not self.turns:
            return "no replies yet"
        gen = sum(t.generated for t in self.turns)
        decode = sum(t.decode_s for t in self.turns)
        lines = [f"{len(self.turns)} replies, {gen} tokens"
                 + (f", {gen / decode:.1f} tok/s" if decode else "")]
        lines.append(f"  {'source':<8} {'rounds':>6} {'drafted':>8} {'accepted':>9} {'accept':>7} {'mean acc':>9}")
        for name in sorted(self.tallies):
            t = self.tallies[name]
            if name == "plain":
                lines.append(f"  {'plain':<8} {t.rounds:>6} {'-':>8} {'-':>9} {'-':>7} {'-':>9}")
            else:
                lines.append(f"  {name:<8} {t.rounds:>6} {t.drafted:>8} {t.accepted:>9} "
                             f"{t.acceptance:>7.0%} {t.mean_accepted:>9.2f}")
        last = self.turns[-1]
        if last.ttft_s is not None:
            lines.append(f"last reply: time to first token {last.ttft_s:.2f}s; prefilled "
                         f"{last.prefill_tokens} of {last.prompt_tokens} prompt tokens, "
                         f"{last.prompt_tokens - last.prefill_tokens} reused from the KV cache")
        return "\n".join(lines)
