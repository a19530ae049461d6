"""Replaying recorded greedy generations through the drafting policies under a cost
curve: what scripts/replay_policy.py runs and the tests check. Greedy output does not
depend on the drafter (lossless), so one plain generation fixes every policy's rounds;
only the cost is modelled (V(n) per verify of n tokens, c per draft-model token).
"""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np

from localspec.core.config import SpecConfig
from localspec.core.drafters.auto import AutoDrafter, Learned
from localspec.core.drafters.base import Draft, DrafterBase, NoDrafter, finished
from localspec.core.drafters.copy_age import age_bin
from localspec.core.drafters.memory import Memory, MemoryDrafter, MemoryModel
from localspec.core.drafters.ngram import NgramDrafter
from localspec.core.engine import AdaptiveK
from localspec.core.tuning import EDGES
from localspec.profile import LONG_CONTEXT, LONG_N_MAX, N_MAX, Profile, merge_online

# the fixed k auto is judged against, adaptive and fixed (15 fixed: edit's old default)
FIXED_K = (4, 8, 15, 16, 32, 64, 128, 256)


class ReplayModelDrafter(DrafterBase):
    """The draft model's recorded greedy tokens (stops below p_min like ModelDrafter)."""

    name = "model"

    def __init__(self, trace: dict, p_min: float = 0.75) -> None:
        self.trace, self.p_min, self.n0 = trace, p_min, 0

    def begin(self, prompt):
        self.n0 = len(prompt)

    def draft(self, context, k):
        j = len(context) - self.n0  # the draft predicts ids[j] next
        ids, arg, top = self.trace["ids"], self.trace["d_arg"], self.trace["d_p"]
        toks: list[int] = []
        for i in range(j, min(j + k, len(arg))):
            if toks and top[i] < self.p_min:
                break
            toks.append(arg[i])
            if i < len(ids) and arg[i] != ids[i]:
                toks += [-1] * (k - len(toks))  # off the target's path: wrong from here on
                break
        return Draft(tokens=toks, source="model")



def replay(trace: dict, drafter, v: list[float], c: float, k_max: int, adaptive: bool,
           noise: float = 0.0, seed: int = 0, accepted: dict[str, int] | None = None) -> float:
    """Modelled decode time (in one-token times) of the trace's output with `drafter`;
    v[n - 1] is the true V(n) (len(v) > k_max). `accepted` counts the drafted tokens
    accepted, by source."""
    ids, rng = trace["ids"], random.Random(seed)
    policy = AdaptiveK(SpecConfig(draft_max=k_max, adaptive=adaptive))  # auto: adaptive=False
    drafter.begin(trace["prompt"])
    tokens, done, total = [*trace["prompt"], ids[0]], 1, 0.0
    while done < len(ids):
        k = min(policy.k, len(ids) - done - 1)
        d = drafter.draft(tokens, k) if k > 0 else Draft()
        n = len(d.tokens[:k])
        a = 0
        while a < n and d.tokens[a] == ids[done + a]:
            a += 1
        verify = v[n]
        draft_cost = n * c if d.source == "model" else 0.0
        total += verify + draft_cost
        seen = verify * (math.exp(rng.gauss(0, noise)) if noise else 1.0)
        policy.update(n, a)
        drafter.observe(n, a, seen, draft_cost)
        if accepted is not None and n:
            accepted[d.source] = accepted.get(d.source, 0) + a
        tokens += ids[done : done + a + 1]
        done += a + 1
    finished(drafter, tokens)  # a memory remembers the output
    drafter.end()  # the end of a generation: auto hands what it measured to `store`
    return total



def oracle(trace: dict, drafter, v: list[float], k_max: int, perfect: bool = False) -> float:
    """The least modelled decode time any drafting policy could reach with `drafter`: an
    oracle that knows how much of each draft the target accepts drafts exactly that
    prefix, cut where the curve is cheapest (dynamic programming over the output).
    `perfect`: a drafter that always proposes the target's own continuation (the cap of
    speculative decoding itself on this curve)."""
    return oracle_plan(trace, drafter, v, k_max, perfect)[1][1]


def oracle_plan(trace: dict, drafter, v: list[float], k_max: int,
                perfect: bool = False) -> tuple[list[int], list[float]]:
    """`oracle`'s tables: accept[i], how much of `drafter`'s draft at output position i
    the target accepts, and cost[i], the oracle's least time from position i on."""
    ids = trace["ids"]
    n = len(ids)
    accept = [n - 1 - i for i in range(n)] if perfect else [0] * n
    if not perfect:
        drafter.begin(trace["prompt"])
        tokens = [*trace["prompt"], ids[0]]
        for done in range(1, n):
            d = drafter.draft(tokens, min(k_max, n - done - 1)).tokens
            a = 0
            while a < len(d) and d[a] == ids[done + a]:
                a += 1
            accept[done] = a
            tokens.append(ids[done])
    cost = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        cost[i] = min(v[m] + cost[i + m + 1] for m in range(min(accept[i], k_max) + 1))
    return accept, cost


def hindsight(trace: dict, ng, model, profile: Profile | None, v: list[float], c: float,
              k_max: int) -> float:
    """auto's modelled decode time when how long the trace's copies last is known ahead:
    its run-age counts (CopyAge) are those one earlier pass over the same trace left
    (`Learned`, as a server's requests share them; the cost model is not carried over).
    Between auto and the oracle: what a perfect estimate of the copies' hazard by age
    could give, apart from what only knowing where each copy breaks gives."""
    learned = Learned()
    replay(trace, AutoDrafter(ng(), model(), profile, k_max=k_max, learned=learned), v, c, k_max, False)
    learned.cost = None  # only the run ages are known ahead
    return replay(trace, AutoDrafter(ng(), model(), profile, k_max=k_max, learned=learned), v, c,
                  k_max, False)


def rounds_against_oracle(trace: dict, drafter, oracle_drafter, v: list[float], c: float,
                          k_max: int) -> list[dict]:
    """Each round of `drafter` (auto) beside the n-gram oracle: where it stood (pos), what
    it drafted and got accepted, what the oracle's drafter would have had accepted
    there, and its regret: the round's time plus the oracle's least time from where it
    ended, less the oracle's least time from where it began. The regrets add up to the
    run's time less the oracle's, so they show where a policy loses (drafts too long
    after a change, cut short in a long copy, plain rounds where a match was)."""
    accept, best = oracle_plan(trace, oracle_drafter, v, k_max)
    ids = trace["ids"]
    drafter.begin(trace["prompt"])
    tokens, done, out = [*trace["prompt"], ids[0]], 1, []
    while done < len(ids):
        k = min(k_max, len(ids) - done - 1)
        d = drafter.draft(tokens, k) if k > 0 else Draft()
        n = len(d.tokens[:k])
        a = 0
        while a < n and d.tokens[a] == ids[done + a]:
            a += 1
        spent = v[n] + (n * c if d.source == "model" else 0.0)
        out.append({"pos": done, "drafted": n, "accepted": a, "oracle": accept[done],
                    "age": max(getattr(d, "run_len", 0), getattr(d, "match_len", 0)),
                    "regret": spent + best[done + a + 1] - best[done]})
        drafter.observe(n, a, spent, n * c if d.source == "model" else 0.0)
        tokens += ids[done : done + a + 1]
        done += a + 1
    drafter.end()
    return out



def true_curve(spec: str, n_max: int, profile: Profile | None) -> list[float]:
    """V(1..n_max) for the replay's cost: "gpu" (1 + 0.02 n), "profile" (the tune profile,
    extended linearly), or a file from `vcurve` (linear between its sizes)."""
    n = np.arange(1, n_max + 1)
    if spec == "gpu":
        return [float(x) for x in 1 + 0.02 * n]
    if spec == "profile":
        sizes, v = np.arange(1, len(profile.vcurve) + 1), np.asarray(profile.vcurve)
    else:
        with open(spec) as f:
            data = json.load(f)
        sizes, v = np.asarray(data["sizes"]), np.asarray(data["v"])
    slope = (v[-1] - v[len(v) // 2]) / (sizes[-1] - sizes[len(v) // 2])
    out = np.interp(n, sizes, v)
    out[n > sizes[-1]] = v[-1] + slope * (n[n > sizes[-1]] - sizes[-1])
    return [float(x) for x in out]



def tuned(v: list[float], c: float, n: int = N_MAX, long: list[float] | None = None) -> Profile:
    """The profile `localspec tune` would measure on that curve (V(1..64) after a short
    context, c) and, with `long`, on that one after 1,024 tokens (V(1..256), a band)."""
    bands = {str(LONG_CONTEXT): long[:LONG_N_MAX]} if long else {}
    return Profile(key="replay", target="t", draft="d", device="cpu", n_threads=2, n_gpu_layers=0,
                   t_token_s=1.0, vcurve=v[:n], prefill_tok_s=0.0, draft_t_token_s=c, vbands=bands)



def _long_band(args, v: list[float]) -> list[float] | None:
    """The tuned profile's long-context band: --tuned-long-curve's, the true curve where
    none was given, or none (`none`: a profile of a tune that timed only the short curve)."""
    long = getattr(args, "tuned_long_v", v)
    return None if long == "none" else (long or v)


def fresh_then_stored(tr: dict, ng, model, v: list[float], c: float, k: int, noise: float,
                      seed: int) -> tuple[float, float]:
    """(first run with no profile, a second run informed by what the first stored)."""
    stored: dict = {}

    def keep(measured, t1):
        stored.update(merge_online({}, measured))

    t_first = replay(tr, AutoDrafter(ng(), model(), None, k_max=k, store=keep), v, c, k, False,
                     noise, seed)
    second = Profile(key="replay", target="t", draft=None, device="cpu", n_threads=2,
                     n_gpu_layers=0, t_token_s=1.0, vcurve=[], prefill_tok_s=0.0, online=stored)
    t_second = replay(tr, AutoDrafter(ng(), model(), second, k_max=k), v, c, k, False, noise, seed + 1)
    return t_first, t_second



def token_text(tr: dict):
    """token -> its text, from a trace's "pieces" ({id: text} for the tokens in it, as
    `replay_policy.py pieces` adds them), or None for a trace without them."""
    pieces = tr.get("pieces")
    return None if not pieces else (lambda t: pieces.get(str(t), ""))


def trace_ngram(tr: dict, sizes: tuple[int, int]) -> NgramDrafter:
    """The n-gram drafter a trace's generation ran with: its `extra` text to copy and,
    where the trace has them, the tokens' texts (as the runtime gives the target's) and
    the instruction's foretold changes made to the text ("predicted", "renamed": renames.py)
    and the places it changes with text it does not give ("unsure": sites.py)."""
    return NgramDrafter(*sizes, extra=tr["extra"], text=token_text(tr), prediction=tr.get("predicted"),
                        renamed=tr.get("renamed", ()), unsure=tr.get("unsure", ()))


def replay_trace(tr: dict, v: list[float], c: float, args) -> dict[str, float]:
    """Speedups over plain decoding of every fixed choice and of auto (informed by a tune
    profile, fresh, and second run), mean over the noise seeds."""
    sizes = args.edit_ngram if tr["tag"] == "edit" else (1, 4)

    def ng(sizes=sizes) -> NgramDrafter:
        return trace_ngram(tr, sizes)

    def model(tr=tr) -> ReplayModelDrafter | None:
        return ReplayModelDrafter(tr) if args.model else None

    plain = replay(tr, NoDrafter(), v, c, 1, False)
    out = {}
    for k in FIXED_K:
        out[f"ngram {k}"] = plain / replay(tr, ng(), v, c, k, True)
        out[f"ngram ={k}"] = plain / replay(tr, ng(), v, c, k, False)
        if args.model and k <= 16:
            out[f"model {k}"] = plain / replay(tr, ReplayModelDrafter(tr), v, c, k, True)
    seeds = range(args.seeds if args.noise else 1)
    # the profile tune measured: of the true curve, or of another (--tuned-curve),
    # and after a long context (--tuned-long-curve: by default the true curve)
    profile = tuned(getattr(args, "tuned_v", None) or v, c, long=_long_band(args, v))
    if args.bound:
        out["bound"] = plain / oracle(tr, ng(), v, max(args.k_max))
        out["perfect"] = plain / oracle(tr, None, v, max(args.k_max), perfect=True)
        out["hindsight"] = plain / hindsight(tr, ng, model, profile, v, c, max(args.k_max))
    for k in args.k_max:
        informed = [replay(tr, AutoDrafter(ng(), model(), profile, k_max=k), v, c, k, False,
                           args.noise, s) for s in seeds]
        runs = [fresh_then_stored(tr, ng, model, v, c, k, args.noise, s) for s in seeds]
        out[f"auto {k}"] = plain / statistics.mean(informed)
        out[f"fresh {k}"] = plain / statistics.mean(r[0] for r in runs)
        out[f"second {k}"] = plain / statistics.mean(r[1] for r in runs)
    return out


def replay_session(session: dict, v: list[float], c: float, k_max: int = 64, noise: float = 0.0,
                   seed: int = 0, tuned_v: list[float] | None = None) -> list[dict]:
    """One recorded session (`requests`: prompt and greedy ids each) through plain
    decoding, `auto` on the context alone and `auto` with a memory of the session's
    earlier requests, as `localspec bench --sessions` runs it on a fresh state dir: each
    request's auto starts from the profile the ones before stored (on-line V(n) points
    and the memory's acceptance counts); `tuned_v`: with a tune profile of that curve
    too. Per request: speedups over plain, memory tokens accepted."""
    memory, online, mem_counts, rows = Memory(), {}, None, []

    def keep(measured, t1):
        online.update(merge_online(online, measured))

    for i, req in enumerate(session["requests"]):
        tr = {"prompt": req["prompt"], "ids": req["ids"]}
        plain = replay(tr, NoDrafter(), v, c, 1, False)
        profile = Profile(key="replay", target="t", draft=None, device="cpu", n_threads=2, n_gpu_layers=0,
                          t_token_s=1.0, vcurve=list(tuned_v or [])[:64], prefill_tok_s=0.0, online=dict(online),
                          memory_accept=mem_counts or {})
        auto = replay(tr, AutoDrafter(NgramDrafter(1, 4), None, profile, k_max=k_max), v, c, k_max, False,
                      noise, seed + i)
        recall = MemoryDrafter(memory, model=MemoryModel(mem_counts))
        accepted: dict[str, int] = {}
        with_memory = replay(tr, AutoDrafter(NgramDrafter(1, 4), None, profile, k_max=k_max, store=keep,
                                             memory=recall), v, c, k_max, False, noise, seed + i, accepted)
        mem_counts = recall.model.to_dict()
        rows.append({"request": i + 1, "tokens": len(req["ids"]), "auto": plain / auto,
                     "memory": plain / with_memory, "accepted": accepted})
    return rows


def copy_hazard(traces: list[dict], sizes: tuple[int, int]) -> dict[tuple[str, int], list[int]]:
    """How often an edit's n-gram copy breaks, by the age of the run it continues: at every
    position of each edit trace's output, the drafter's next token (drafting at every
    position, as the oracle asks) against the one the target wrote. Keyed by ("predicted",
    "copy" for a copy of the file itself, or "own" for a copy of the output's own earlier
    text; the first age of the run's bin in EDGES), as [positions drafted at, breaks]."""
    out: dict[tuple[str, int], list[int]] = {}
    for tr in traces:
        if tr.get("tag") != "edit":
            continue
        d = trace_ngram(tr, sizes)
        prompt, ids = list(tr["prompt"]), tr["ids"]
        d.begin(prompt)
        for pos in range(len(ids)):
            draft = d.draft(prompt + ids[:pos], 1)
            if not draft.tokens:
                continue
            edge = EDGES[age_bin(max(draft.run_len, draft.match_len))]
            kind = "own" if draft.own else "predicted" if d.predicting else "copy"
            row = out.setdefault((kind, edge), [0, 0])
            row[0] += 1
            row[1] += draft.tokens[0] != ids[pos]
    return out

