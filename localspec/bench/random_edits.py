"""Random dense edits: outputs that copy a text while changing it every few tokens, each
change short and made inconsistently (a token replaced by 0-3 others most times it
recurs, spans deleted, an insertion repeated or new, a jump elsewhere in the text), as a
trace the replay takes (bench/replay.py). No model writes edits this hostile; they are
where a drafting policy's bets on a copy's age are most often wrong, so they check the
promise that auto is not slower than plain decoding (`scripts/replay_policy.py
random-edits`) and exercise every state of the copy-following drafter (tests).
"""

from __future__ import annotations

import random
import statistics

from localspec.bench.replay import replay, trace_ngram, tuned
from localspec.core.drafters.auto import AutoDrafter
from localspec.core.drafters.base import NoDrafter

# token texts (token i is PIECES[i]): a few words, code punctuation and whitespace, so
# that renamed words and the texts' pieces are exercised too
PIECES = ("def", " x", " y", "(", ")", ":", "\n", "    ", " return", " =", " self", ".", ",",
          ' "', '"""', " int", " ->", " bool", "Item", "Product", " item", " product", "_",
          "a", "b", " ", "  ", "#", " the", " of")


def random_edit(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """(source, output, prompt): a text of 0-120 random tokens, an edit's output of it
    (up to ~400 tokens; one in ten unrelated to the source), and a prompt holding the
    source between a few other tokens."""
    v = len(PIECES)
    src = [rng.randrange(v) for _ in range(rng.randint(0, 120))]
    subs = {rng.randrange(v): [rng.randrange(v) for _ in range(rng.randint(0, 3))]
            for _ in range(rng.randint(0, 3))}
    insertion = [rng.randrange(v) for _ in range(rng.randint(1, 6))]
    out: list[int] = []
    i = 0
    while i < len(src) and len(out) < 400:
        r = rng.random()
        if src[i] in subs and rng.random() < 0.8:
            out += subs[src[i]]
            i += 1
        elif r < 0.03:
            i += rng.randint(1, 5)
        elif r < 0.07:
            out += insertion if rng.random() < 0.6 else [rng.randrange(v) for _ in range(rng.randint(1, 30))]
        elif r < 0.08:
            i = rng.randrange(len(src))
        else:
            out.append(src[i])
            i += 1
    if rng.random() < 0.1:
        out = [rng.randrange(v) for _ in range(rng.randint(0, 60))]
    prompt = [*(rng.randrange(v) for _ in range(rng.randint(0, 10))), *src,
              *(rng.randrange(v) for _ in range(rng.randint(0, 10)))]
    return src, out, prompt


def random_traces(count: int, seed: int = 0, min_len: int = 20) -> list[dict]:
    """`count` random edits (seeds seed, seed + 1, ...; those whose output is shorter
    than min_len tokens skipped) as replayable edit traces."""
    traces = []
    pieces = {str(i): p for i, p in enumerate(PIECES)}
    s = seed
    while len(traces) < count:
        src, out, prompt = random_edit(random.Random(s))
        if len(out) >= min_len:
            traces.append({"name": f"random-{s}", "tag": "edit", "prompt": prompt, "ids": out,
                           "extra": src, "pieces": pieces})
        s += 1
    return traces


def against_plain(traces: list[dict], v: list[float], k_max: int = 256, noise: float = 0.1,
                  sizes: tuple[int, int] = (3, 12)) -> dict[str, list[float]]:
    """auto's modelled decode time over plain decoding's, per trace: informed by a tune
    profile of the curve, and fresh (no profile). One noise seed per trace."""
    out: dict[str, list[float]] = {"informed": [], "fresh": []}
    profiles = (("informed", tuned(v, 0.0, long=v)), ("fresh", None))
    for i, tr in enumerate(traces):
        plain = replay(tr, NoDrafter(), v, 0.0, 1, False)
        for kind, profile in profiles:
            auto = AutoDrafter(trace_ngram(tr, sizes), None, profile, k_max=k_max)
            out[kind].append(replay(tr, auto, v, 0.0, k_max, False, noise, i) / plain)
    return out


def summary(ratios: list[float]) -> dict[str, float]:
    """Median, 95th percentile and worst of auto's time over plain's, and the share of
    traces more than 5% slower than plain."""
    xs = sorted(ratios)
    return {"median": statistics.median(xs), "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))],
            "worst": xs[-1], "slower": sum(x > 1.05 for x in xs) / len(xs)}
