"""Test doubles and statistics helpers shared by the pure (no model loaded) tests.

FakeModel implements the part of `localspec.core.backend.Model` that the engine and the
model drafter use on sequence 0: n_ctx, n_ctx_seq, n_batch, n_vocab, n_past, cached,
seq_tokens, llama_s, decode, decode_multi, rewind, is_eog and detokenizer; prefill and
common_prefix are the backend's own (PrefixReuse), so the engine tests exercise the real prefix reuse. Its logits come from
a deterministic function of the context, so the "true" continuation of any context is
known to the tests. It keeps real KV bookkeeping (`cached`) plus the simulated KV cells
(`cells`), which can run ahead of `cached` when a decode is interrupted, exactly like
llama.cpp's cache can.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from localspec.core.backend import Detokenizer, PrefixReuse
from localspec.core.drafters.base import Draft, DrafterBase
from localspec.core.errors import ContextFull
from localspec.profile import Profile

# ----- costs ------------------------------------------------------------------------


def fixed_costs(slope: float = 0.3, n_max: int = 64) -> Profile:
    """A profile whose verify curve V(n) = 1 + slope (n - 1), for auto to take as given
    (learn_costs=False, the server's SchedulerConfig.auto_costs): whether drafting pays
    must not hang on this machine's load while a test runs (at 0.3 a long right draft
    pays on any curve; a wrong one does not)."""
    return Profile(key="fixed", target="t", draft=None, device="cpu", n_threads=1, n_gpu_layers=0,
                   t_token_s=0.1, vcurve=[1.0 + slope * (n - 1) for n in range(1, n_max + 1)],
                   prefill_tok_s=100.0)


# ----- statistics -------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty; good to a few % of
    the p-value in the range that matters here, df >= 2)."""
    if df <= 0:
        return 1.0 if x <= 0 else 0.0
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * df))) / math.sqrt(2.0 / (9.0 * df))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed `counts` to `probs` (same shape, any dims). Cells
    with an expected count under `min_expected` are pooled; an observation in a cell of
    probability 0 gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert abs(probs.sum() - 1.0) < 1e-9, probs.sum()
    n = counts.sum()
    if np.any(counts[probs <= 0.0] > 0):
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    small = (~big) & (probs > 0.0)
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return chi2_sf(stat, len(obs_a) - 1)


def tv_distance(counts: np.ndarray, probs: np.ndarray) -> float:
    """Total variation distance between the empirical distribution and `probs`."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


# ----- fake target / draft model ----------------------------------------------------

V_DEFAULT = 50


def token_text(i: int) -> str:
    """A distinct, multi-character text per token id (so stop strings can span tokens)."""
    return f"t{i};"


def periodic_next(context: Sequence[int], n_vocab: int = V_DEFAULT) -> int:
    """Depends on the last token only: the continuation soon repeats (n-gram friendly)."""
    return (context[-1] * 7 + 3) % n_vocab


def mixed_next(context: Sequence[int], n_vocab: int = V_DEFAULT) -> int:
    """Depends on the last token and, coarsely, the position: n-gram drafts are right
    for a while, then wrong, then right again (mixed acceptance)."""
    return (context[-1] * 7 + len(context) // 6) % n_vocab


def onehot_logits(nxt: int, n_vocab: int) -> np.ndarray:
    """Logits whose argmax is `nxt`, with a non-trivial rest (not a pure one-hot)."""
    row = np.linspace(-1.0, 0.0, n_vocab, dtype=np.float32)
    row[nxt] = 4.0
    return row


class Interrupted(Exception):
    """Raised by FakeModel.decode to simulate Ctrl-C in the middle of llama_decode."""


class FakeModel(PrefixReuse):
    """A deterministic stand-in for backend.Model.

    logits_fn(context) -> (n_vocab,) logits for the token after `context`. The default
    is greedy-friendly: the argmax is next_fn(context).
    """

    def __init__(
        self,
        n_vocab: int = V_DEFAULT,
        n_ctx: int = 512,
        eos: int | None = None,
        next_fn: Callable[[Sequence[int], int], int] = periodic_next,
        logits_fn: Callable[[Sequence[int]], np.ndarray] | None = None,
        texts: dict[int, bytes] | None = None,
    ) -> None:
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.eos = eos
        self.next_fn = next_fn
        self.logits_fn = logits_fn or (lambda ctx: onehot_logits(next_fn(ctx, n_vocab), n_vocab))
        self.texts = texts or {}
        self.cached: list[int] = []  # the bookkeeping (what backend.Model calls `cached`)
        self.cells: list[int] = []  # what the simulated KV cache really holds
        self.llama_s = 0.0
        self.calls: list[tuple[str, int]] = []  # ("prefill"|"decode", batch size)
        self.interrupt_on_decode: int | None = None  # raise Interrupted on this decode call
        self._call_kind = "decode"  # "prefill" while the backend's prefill decodes

    # --- reference ---------------------------------------------------------------

    def continuation(self, context: Sequence[int], n: int) -> list[int]:
        """The greedy continuation (argmax chain) of `context`, n tokens."""
        ctx = list(context)
        out = []
        for _ in range(n):
            tok = int(np.argmax(self.logits_fn(ctx)))
            out.append(tok)
            ctx.append(tok)
        return out

    # --- vocabulary --------------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        return self.eos is not None and token == self.eos

    def token_piece(self, token: int) -> bytes:
        return self.texts.get(token, token_text(token).encode())

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)  # the real one: it needs only token_piece()

    # --- decoding ----------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return len(self.cached)

    @property
    def n_ctx_seq(self) -> int:
        return self.n_ctx  # one sequence has the whole context

    @property
    def decode_sizes(self) -> list[int]:
        return [n for kind, n in self.calls if kind == "decode"]

    def decode(self, tokens: Sequence[int], logits: str | Sequence[int] = "last") -> np.ndarray:
        self.calls.append((self._call_kind, len(tokens)))
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        if self.n_past + n > self.n_ctx:
            raise ContextFull(f"context full: {self.n_past + n} > {self.n_ctx}")
        assert self.cells == self.cached, "KV cells and bookkeeping diverged before a decode"
        base = self.n_past
        self.cells.extend(tokens)  # the cells are written first ...
        if self.interrupt_on_decode is not None:
            self.interrupt_on_decode -= 1
            if self.interrupt_on_decode < 0:
                self.interrupt_on_decode = None
                raise Interrupted("interrupted inside decode")
        self.cached.extend(tokens)  # ... and the bookkeeping only on success
        if isinstance(logits, str):
            rows = [n - 1] if logits == "last" else list(range(n))
        else:
            rows = list(logits)
        ctx = self.cached
        out = np.stack([np.asarray(self.logits_fn(ctx[: base + r + 1]), dtype=np.float32) for r in rows])
        return out

    n_batch = 512

    def seq_tokens(self, seq: int = 0) -> list[int]:
        assert seq == 0, "the fake holds one sequence"
        return self.cached

    def decode_multi(self, entries: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """The backend's batched decode, for the one sequence the fake holds."""
        (seq, tokens, n_rows), = entries
        assert seq == 0, "the fake holds one sequence"
        if not n_rows:
            self.decode(tokens, "last")
            return [np.empty((0, self.n_vocab), dtype=np.float32)]
        return [self.decode(tokens, list(range(len(tokens) - n_rows, len(tokens))))]

    def rewind(self, n_past: int, force: bool = False, *, seq: int = 0) -> None:
        assert seq == 0, "the fake holds one sequence"
        if n_past < self.n_past or force:
            del self.cells[n_past:]
            del self.cached[n_past:]

    def prefill(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """The backend's prefill; its decode is recorded as ("prefill", tokens decoded)."""
        self._call_kind = "prefill"
        try:
            out = super().prefill(tokens)
        finally:
            self._call_kind = "decode"
        # its contract: the cache now holds exactly `tokens` (a kept stale cell would
        # not show in the output of a lossless engine, only in what drafts are based on)
        assert self.cached == list(tokens), "prefill left the cache holding other tokens"
        return out


# ----- drafters ---------------------------------------------------------------------


class PerfectDrafter(DrafterBase):
    """Proposes exactly the fake target's greedy continuation."""

    name = "perfect"

    def __init__(self, model: FakeModel) -> None:
        self.model = model
        self.calls = 0

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, context: Sequence[int], k: int) -> Draft:
        self.calls += 1
        return Draft(tokens=self.model.continuation(context, k), source=self.name)


class GarbageDrafter(DrafterBase):
    """Proposes k tokens of which the first is always wrong (never the target's argmax)."""

    name = "garbage"

    def __init__(self, model: FakeModel) -> None:
        self.model = model

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, context: Sequence[int], k: int) -> Draft:
        true = self.model.continuation(context, k)
        return Draft(tokens=[(t + 1) % self.model.n_vocab for t in true], source=self.name)


class OverlongDrafter(DrafterBase):
    """Ignores k and always proposes far too many (correct) tokens."""

    name = "overlong"

    def __init__(self, model: FakeModel, n: int = 40) -> None:
        self.model = model
        self.n = n

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, context: Sequence[int], k: int) -> Draft:
        return Draft(tokens=self.model.continuation(context, self.n), source=self.name)
