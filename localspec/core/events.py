"""What a generation yields: typed events (Token, Round, Done) and its statistics.
Every consumer (run, edit, chat, serve, bench, the tests) reads these; the engine
(engine.py) produces them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from localspec.core.config import StrEnum


class StopReason(StrEnum):
    """Why a generation ended (GenerationStats.stop_reason; "" while it runs)."""

    EOS = "eos"  # the model's end-of-generation token
    STOP = "stop"  # a stop string
    LENGTH = "length"  # the token limit (-n, max_tokens)
    CONTEXT = "context"  # the context is full
    CANCELLED = "cancelled"  # the caller stopped it (Ctrl-C, a closed stream, should_stop)
    INDENT = "indent"  # a line began left of n_indent (llama-server's /infill limit; limits.py)
    TIME = "time"  # t_max_predict_ms had passed at a line's end (limits.py)
    FENCE = "fence"  # edit: the closing fence line is complete (bench's runs are cut there)


# cut off by a limit, not ended by the text (OpenAI's finish_reason "length")
TRUNCATED = frozenset({StopReason.LENGTH, StopReason.CONTEXT, StopReason.TIME})


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's raw distribution at its
    position (log-softmax of the logits row it was checked against: no temperature or
    truncation), and the `top` alternatives as (token id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token. `text` is what may be shown now (it can be empty while a
    split UTF-8 character or a possible stop string is held back). `logprob` only when
    the generation asked for it (GenerationConfig.logprobs)."""

    id: int
    text: str
    from_draft: bool
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class Round:
    """One verify step: how many tokens were drafted, and how many the target kept."""

    n_draft: int
    n_accept: int
    source: str
    k: int


class Timed:
    """ttft_s and wall_s from prefill_s, cache_s and decode_s (GenerationStats, and the
    benchmark's per-run record)."""

    prefill_s: float
    cache_s: float
    decode_s: float

    @property
    def ttft_s(self) -> float:
        """Time to first token: prefill, and the prefix cache's restore or store."""
        return self.prefill_s + self.cache_s

    @property
    def wall_s(self) -> float:
        """End to end, from the start of the prefill to the last token."""
        return self.ttft_s + self.decode_s


@dataclass
class GenerationStats(Timed):
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
    stop_reason: StopReason | str = ""  # "" until it ends
    policy: dict = field(default_factory=dict)  # auto: (drafter:k) -> rounds, expected, realised
    # per draft source (ngram, memory, model): [tokens drafted, tokens accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    # set by callers that restore a prompt prefix from the on-disk prefix cache before
    # generate() (which then prefills only the rest); generate() leaves them alone
    restored_tokens: int = 0  # prompt tokens whose KV state came from the prefix cache
    cache_s: float = 0.0  # time spent restoring them (or storing the prefix on a miss)
    stored_tokens: int = 0  # prompt tokens a miss stored in the prefix cache

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


class Transcript:
    """One generation's events, passed on as they come and gathered on the way: the token
    ids, the text (with what Done releases at the end) and, once it ends, the stats.
    Closing it (with, or close()) closes the generation whatever ended the loop (the
    consumer stopping, an exception, Ctrl-C): generate()'s finally then leaves the KV
    cache consistent at once.

        with Transcript(generate(...)) as run:
            for ev in run:
                ...
        run.ids, run.text, run.stats
    """

    def __init__(self, events: Iterator[Event]) -> None:
        self.events = events
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.stats: GenerationStats | None = None  # None until Done (or when cut short)

    def __iter__(self) -> Iterator[Event]:
        for ev in self.events:
            if isinstance(ev, Token):
                self.ids.append(ev.id)
                self.pieces.append(ev.text)
            elif isinstance(ev, Done):
                self.pieces.append(ev.text)
                self.stats = ev.stats
            yield ev

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def close(self) -> None:
        close = getattr(self.events, "close", None)  # a generator; a list's iterator has none
        if close is not None:
            close()

    def __enter__(self) -> Transcript:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
