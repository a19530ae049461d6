"""One request's generation on its own KV sequence of the shared context.

The round (draft -> verify -> accept -> rewind -> events) is the engine's own
`Generation`: the scheduler calls plan() for every decoding sequence, decodes all the
batches in ONE decode_multi, and hands each sequence its rows with accept(). What is
the server's alone is the prefill: a long prompt is fed in chunks that share steps with
the other sequences' rounds, instead of one prefill that would stall them; and it starts
after what the slot already holds of it (a finished request's prompt and reply stay in
its slot: an agent resending the same system prompt, tools and history prefills only
what is new, as llama-server's prompt cache does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.core.backend import Model
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.base import Drafter
from localspec.core.engine import Event, Generation


class SeqState(Generation):
    """A generation in progress on sequence `seq` of `target`, prefilled in chunks."""

    def __init__(self, target: Model, seq: int, prompt: Sequence[int], drafter: Drafter, *,
                 sampling: SamplingConfig, spec: SpecConfig, gen: GenerationConfig) -> None:
        super().__init__(target, prompt, drafter, sampling=sampling, spec=spec, gen=gen, seq=seq)
        # keep what the slot's last user left that this prompt begins with (at least the
        # last prompt token is decoded again: its logits pick the first token)
        self.n_prefilled = target.reuse_prefix(self.prompt, seq=seq, redo_last=True, force=True)
        self.stats.restored_tokens = self.n_prefilled

    @property
    def prefilling(self) -> bool:
        return self.id_last < 0

    def prefill_entry(self, budget: int) -> tuple[int, list[int], int]:
        """The next prompt chunk of at most `budget` tokens; logits only after the last."""
        chunk = self.prompt[self.n_prefilled : self.n_prefilled + budget]
        last = self.n_prefilled + len(chunk) == len(self.prompt)
        return self.seq, chunk, 1 if last else 0

    def prefilled(self, n: int, rows: np.ndarray) -> list[Event]:
        """After a chunk of n prompt tokens was decoded; the first token once complete."""
        self.n_prefilled += n
        self.stats.prefill_tokens += n
        if self.n_prefilled < len(self.prompt):
            return []
        return self.start(rows[-1])

    def release(self, keep: bool = False) -> None:
        """Free this sequence's KV cells (cancelled or failed), or with `keep` (finished)
        leave the cells its record holds for the slot's next request to start from."""
        self.target.rewind(len(self.target.seq_tokens(self.seq)) if keep else 0, force=True, seq=self.seq)
