"""How llama.cpp splits one decode into ubatches (compute passes over the weights), so
that the server can price a step by the passes it will really make.

With more than one sequence and a KV cache per sequence (llama.cpp's default,
kv_unified off), `llama_kv_cache::init_batch` splits a batch with
`split_equal(n_ubatch, sequential=true)`: a ubatch holds a run of sequences of
consecutive ids, and the SAME number of tokens from each. So a step of eight sequences,
one of them verifying an 8-token draft, is two passes: 8 x 1 tokens, then that
sequence's other 8 alone (it costs about a plain step more, not 8/8 of one); eight
sequences with a 4-token draft each are one pass of 40. A single sequence (one stream)
is split plainly into chunks of n_ubatch (`split_simple`).
"""

from __future__ import annotations

from collections.abc import Iterable


def ubatches(lengths: Iterable[tuple[int, int]], n_ubatch: int, one_stream: bool = False) -> list[int]:
    """Token counts of the ubatches one decode of `lengths` ([(seq, tokens)], each
    sequence once) is split into, in order."""
    rest = {seq: n for seq, n in sorted(lengths) if n > 0}
    if one_stream:
        total = sum(rest.values())
        return [min(n_ubatch, total - i) for i in range(0, total, n_ubatch)]
    out = []
    while rest:
        run: list[int] = []
        for seq in rest:  # the lowest id with tokens left, then the ids that follow it
            if run and seq != run[-1] + 1:
                break
            run.append(seq)
            if len(run) == n_ubatch:
                break
        m = max(1, min(min(rest[s] for s in run), n_ubatch // len(run)))
        out.append(m * len(run))
        for s in run:
            rest[s] -= m
            if not rest[s]:
                del rest[s]
    return out
