"""Which slot a request goes to, and where the start of its prompt comes from.

The server's context keeps one KV stream per slot (n_seq_max sequences, not unified), and
llama.cpp puts only sequences of consecutive, increasing ids in one ubatch (its
split_equal for a cache of several streams). Every gap between the busy slots' ids costs
one more pass over the weights each step: four decoding slots 0, 2, 4, 6 step 1.46x
slower than 0, 1, 2, 3 (docs/measurements.md). So a request goes to the free slot that
leaves the busy ids in the fewest runs of consecutive ids; among those, to the one that
holds the longest start of its prompt, else to the one holding the fewest tokens (the
cells other requests left stay for later ones), then to the lowest id.

When another slot, busy or free, holds a longer start of the prompt than the chosen one,
its cells are copied over rather than prefilled again (llama-server restores a prefix
from its prompt cache into whichever slot it picked, to the same end). A copy between
streams moves the whole stream at the next decode: about 2.5 prefill tokens' time for
SmolLM2-135M on 2 cores, less for larger models, hence a small minimum (SLOT_COPY_MIN).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def runs(ids: Iterable[int]) -> int:
    """How many runs of consecutive ids `ids` make ({0, 1, 3} is two)."""
    s = set(ids)
    return sum(1 for i in s if i - 1 not in s)


@dataclass(frozen=True)
class Placement:
    slot: int  # the KV sequence the request gets
    held: int  # tokens of its prompt the slot holds once placed (after any copy)
    source: int | None = None  # the slot whose cells are copied into it first, if any


def place(free: Sequence[int], busy: Iterable[int], held: Callable[[int], int],
          cached: Callable[[int], int], n_slots: int, min_copy: int) -> Placement:
    """The slot for a request among `free` (non-empty), `busy` the slots in use; held(s):
    how many leading tokens of its prompt slot s holds (any slot, busy ones too);
    cached(s): how many tokens slot s holds in all. Among the free slots that leave the
    fewest runs: the one holding the most of the prompt (when that is worth keeping),
    else the one holding the least (another request's cells stay for a later request),
    then the lowest id. A copy from the slot holding the most of the prompt is planned
    when that beats the chosen slot by at least `min_copy` tokens (0: never)."""
    busy = set(busy)
    have = {s: held(s) for s in range(n_slots)}
    worth = max(1, min_copy)

    def rank(s: int) -> tuple[int, int, int, int]:
        useful = have[s] if have[s] >= worth else 0
        return runs(busy | {s}), -useful, cached(s) if not useful else 0, s

    slot = min(free, key=rank)
    source = max((s for s in have if s != slot), key=lambda s: (have[s], -s), default=None)
    if source is not None and min_copy > 0 and have[source] - have[slot] >= min_copy:
        return Placement(slot, have[source], source)
    return Placement(slot, have[slot])
