"""Which model already on disk could draft for a target (`--draft auto`,
`localspec models --drafts-for`).

Decided from GGUF headers, without loading anything: the same vocabulary (tokenizer
type, size, special tokens and a digest of every token's text, the facts
core/compat.check_pair compares after loading), much smaller (a draft's cost per token
is roughly its bytes read), then the same family and a quantisation with fast kernels.
The runtime loads the best one and lets check_pair have the final word.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from localspec.models.gguf_info import VOCAB_BLOCK, GGUFError, GGUFInfo, cached_info

VOCAB_SIZE_SLACK = 128  # as core/compat.py: Qwen2.5 7B+ pad 151,936 tokens to 152,064
MUCH_SMALLER = 0.5  # most draft bytes per target byte for a draft that can pay
# A draft as large as the target is a second copy of it: allowed only for tiny targets,
# where the copy is cheap (the test model drafting for itself); never pays for speed.
SAME_SIZE_MAX_PARAMS = 500_000_000
SLOW_QUANTS = ("F32", "F16", "BF16")  # unquantised: twice the bytes of Q8_0 or more


@dataclass(frozen=True)
class Candidate:
    """One local model judged as a draft for the target."""

    name: str
    path: Path
    source: str
    size: int
    info: GGUFInfo | None
    kept: bool
    reason: str
    rank: tuple = ()  # lower is better; only for kept candidates

    def to_dict(self) -> dict:
        info = self.info
        return {"name": self.name, "path": str(self.path), "source": self.source, "size": self.size,
                "kept": self.kept, "reason": self.reason,
                "architecture": info.architecture if info else None,
                "n_params": info.n_params if info else None, "quant": info.quant if info else None}  # fmt: skip


def vocab_mismatch(target: GGUFInfo, draft: GGUFInfo) -> str | None:
    """Why the draft's vocabulary differs from the target's, or None (same tokens)."""
    if target.tokenizer != draft.tokenizer:
        return f"other tokenizer ({draft.tokenizer or '?'}, the target's is {target.tokenizer or '?'})"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_SLACK:
        return f"other vocabulary ({draft.n_vocab:,} tokens, the target has {target.n_vocab:,})"
    for what, t, d in (("BOS", target.bos, draft.bos), ("EOS", target.eos, draft.eos)):
        if t is not None and d is not None and t != d:
            return f"other special tokens ({what} {d}, the target's is {t})"
    shared = min(target.n_vocab, draft.n_vocab)
    n_blocks = len(target.vocab_digest) if target.n_vocab == draft.n_vocab else shared // VOCAB_BLOCK
    for i, (a, b) in enumerate(zip(target.vocab_digest[:n_blocks], draft.vocab_digest[:n_blocks])):
        if a != b:
            return f"other token texts (ids {i * VOCAB_BLOCK}-{min(shared, (i + 1) * VOCAB_BLOCK) - 1})"
    return None


def judge(target: GGUFInfo, draft: GGUFInfo, *, same_file: bool = False) -> tuple[bool, str, tuple]:
    """(kept, reason, rank) for one draft candidate's header against the target's."""
    if not draft.is_llm:
        return False, f"not a language model ({draft.architecture or 'no architecture'})", ()
    mismatch = vocab_mismatch(target, draft)
    if mismatch:
        return False, mismatch, ()
    ratio = draft.size / max(1, target.size)
    share = f"{ratio:.0%} of the target's size"
    if ratio > 1:
        return False, f"larger than the target ({share}): slower than plain decoding", ()
    tier = 0
    if ratio > MUCH_SMALLER:
        if target.n_params > SAME_SIZE_MAX_PARAMS:
            return False, f"not much smaller than the target ({share}): costs about what it saves", ()
        tier = 1
        share = ("the target itself" if same_file else share) + " (the target is tiny: a copy is cheap)"
    family = _family(target, draft)
    slow = draft.quant.upper() in SLOW_QUANTS or draft.quant.upper().startswith("IQ")
    reason = f"{share}, {('same family', 'same architecture', 'other family')[family]}, {draft.quant or '?'}"
    return True, reason + (" (slow kernels)" if slow else ""), (tier, family, slow, draft.size)


def _family(target: GGUFInfo, draft: GGUFInfo) -> int:
    """0: same family (architecture and base name), 1: same architecture, 2: other."""
    if target.architecture != draft.architecture:
        return 2
    same_base = target.basename and target.basename.lower() == draft.basename.lower()
    return 0 if same_base else 1


def draft_candidates(target: Path) -> list[Candidate]:
    """Every local model judged as a draft for `target`: kept ones best first, then the
    refused ones with their reasons. Headers are cached, so this costs stats after the
    first time."""
    from localspec.models.registry import list_models

    target_info = cached_info(target)
    target_key = os.path.realpath(target)
    out = []
    for row in list_models(header=False):
        if row.path is None:
            continue
        try:
            info = cached_info(row.path)
        except (GGUFError, OSError) as exc:
            out.append(Candidate(row.name, row.path, row.source, row.size, None, False, f"unreadable: {exc}"))
            continue
        same = os.path.realpath(row.path) == target_key
        kept, reason, rank = judge(target_info, info, same_file=same)
        out.append(Candidate(row.name, row.path, row.source, row.size, info, kept, reason, rank))
    return sorted(out, key=lambda c: (not c.kept, c.rank if c.kept else (), c.name))
