"""Can this draft model speculate for that target? Checked before any drafting."""

from __future__ import annotations

import sys

from localspec.core.backend import Model
from localspec.core.errors import IncompatibleModels

VOCAB_SIZE_SLACK = 128  # Qwen2.5 7B+ report 152,064 tokens vs 151,936 for 0.5B-3B
N_SAMPLE = 2000


def check_pair(target: Model, draft: Model) -> None:
    """Raise IncompatibleModels naming both models when their vocabularies differ."""

    def fail(reason: str) -> None:
        raise IncompatibleModels(
            f"draft model {draft.name} cannot draft for {target.name}: {reason}"
            " (use a draft of the same model family, or --spec ngram)"
        )

    if target.vocab_type != draft.vocab_type:
        fail(f"vocabulary types differ ({target.vocab_type} vs {draft.vocab_type})")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_SLACK:
        fail(f"vocabulary sizes differ ({target.n_vocab} vs {draft.n_vocab})")
    if target.bos != draft.bos or target.eos != draft.eos:
        fail(f"special tokens differ (BOS {target.bos}/{draft.bos}, EOS {target.eos}/{draft.eos})")
    shared = min(target.n_vocab, draft.n_vocab)
    step = max(1, shared // N_SAMPLE)
    for tok in range(0, shared, step):
        if target.token_text(tok) != draft.token_text(tok):
            fail(
                f"token {tok} is {target.token_text(tok)!r} in the target"
                f" but {draft.token_text(tok)!r} in the draft"
            )
    if draft.size_bytes > target.size_bytes:
        print(
            f"warning: the draft {draft.name} is larger than the target {target.name};"
            " speculation will be slower than plain decoding",
            file=sys.stderr,
        )
