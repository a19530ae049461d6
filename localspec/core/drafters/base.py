"""The Drafter protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class Draft:
    """Proposed continuation. `probs` holds the draft distribution q per token (rows of
    the vocabulary) when tokens were sampled from it; None means deterministic (one-hot)."""

    tokens: list[int] = field(default_factory=list)
    probs: np.ndarray | None = None
    source: str = "none"  # which drafter produced it (hybrid reports ngram or model)


class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int]) -> None:
        """A new generation starts from `prompt` (reset or realign any state)."""

    def draft(self, context: Sequence[int], k: int) -> Draft:
        """Propose up to k tokens to follow `context` (prompt + generated so far).

        An empty draft is valid: the engine then decodes one token plainly.
        """

    def observe(self, n_draft: int, n_accept: int, verify_s: float | None, draft_s: float) -> None:
        """Feedback after each verify (the auto policy learns from it). `verify_s` is None
        when the decode was shared with other sequences (a server's batch): its time is
        not what this round cost."""

    def report(self) -> dict:
        """Drafter-specific statistics for the end of a generation."""

    def end(self) -> None:
        """The generation is over: keep what it taught (the auto policy stores the verify
        costs it measured). Called once, after `report`."""

    # optional: finished(tokens) -> None. The generation's whole context at its end
    # (prompt + output), before `end` (a memory drafter remembers the output).
    # optional: constrain(grammar) -> None. The generation's output grammar (None: free
    # text), given at its start; at every draft() call it is in its state after `context`.
    # A drafter that drafts within it (ModelDrafter) clones it and never advances it.
    # optional: promise() -> float | None. Tokens the draft just made is expected to yield
    # if verified; withdrawn() -> None: that draft will not be verified (the server's step).


def constrain(drafter: Drafter, grammar: object | None) -> None:
    """Hand `drafter` the output grammar, if it takes one (optional in the protocol)."""
    hook = getattr(drafter, "constrain", None)
    if hook is not None:
        hook(grammar)


def finished(drafter: Drafter, tokens: Sequence[int]) -> None:
    """Hand `drafter` the generation's final context, if it takes it (optional)."""
    hook = getattr(drafter, "finished", None)
    if hook is not None:
        hook(tokens)


def promise(drafter: Drafter) -> float | None:
    """What `drafter` expects its last draft to yield, if it says (optional)."""
    hook = getattr(drafter, "promise", None)
    return hook() if hook is not None else None


def withdrawn(drafter: Drafter) -> None:
    """Tell `drafter` its last draft will not be verified, if it listens (optional)."""
    hook = getattr(drafter, "withdrawn", None)
    if hook is not None:
        hook()


class DrafterBase:
    """No-op feedback hooks for drafters that do not learn, and no grammar."""

    def observe(self, n_draft: int, n_accept: int, verify_s: float | None, draft_s: float) -> None:
        pass

    def constrain(self, grammar: object | None) -> None:
        pass

    def report(self) -> dict:
        return {}

    def end(self) -> None:
        pass

    def promise(self) -> float | None:
        """Tokens the draft just made is expected to yield if verified (its accepted prefix
        and the target's own token), or None: this drafter does not say."""
        return None

    def withdrawn(self) -> None:
        """The draft just made will not be verified (the server's batch could not afford
        it): the round decodes plainly."""


class NoDrafter(DrafterBase):
    """Plain decoding: never proposes anything."""

    name = "none"

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, context: Sequence[int], k: int) -> Draft:
        return Draft()
