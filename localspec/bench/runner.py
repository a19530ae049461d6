"""Run every variant of one workload in this process, interleaved, greedy.

Variants are plain decoding (`none`), each speculative mode at each k, and optionally
the peer. With several repeats the order alternates (A B C, C B A, ...) so drift in
machine load hits every variant alike. Speed is decode speed: tokens after the first
over the time from the first token on (prefill is the same work for every variant and
is left out, as in the engine's stats); the prefill is timed too, for the time to first
token and the end-to-end (wall) speedup. With `Settings.prefix_cache`, edit tasks
restore their file's KV state from the prefix cache (stored once, untimed, before the
variants run), as a second `localspec edit` of the file would.

Each output is compared with `none` token by token; batched verification is not
bit-identical to one-token decoding in llama.cpp, so a divergence at a near-tie of the
plain run (top-2 logit margin < NEAR_TIE) is reported as such, anything else as a
mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from localspec.bench.results import Result, Run, Variant, Verdict
from localspec.bench.vcurve import VCurve
from localspec.bench.workloads import Prepared, Workload, prepare
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig, SpecMode
from localspec.core.engine import Token, Transcript, generate
from localspec.core.events import StopReason
from localspec.runtime import Runtime, log_run, make_drafter
from localspec.edit import EDIT_SPEC_DEFAULTS, FenceStop

if TYPE_CHECKING:
    from localspec.bench.peer import LlamaCppPythonPeer
    from localspec.core.backend import Model
    from localspec.prefix_store import PrefixStore

__all__ = ["NEAR_TIE", "Result", "Run", "Settings", "Variant", "Verdict", "compare",
           "run_engine", "run_peer", "run_workload"]

NEAR_TIE = 0.5  # top-2 logit margin; the same threshold as tests/test_real_models.py
GREEDY = SamplingConfig(temperature=0.0)


@dataclass(frozen=True)
class Settings:
    n_predict: int = 256  # token limit for prompt workloads
    edit_n: int = 0  # token limit for edit tasks; 0: enough for the file
    repeats: int = 1
    log: bool = True  # append each generation to the acceptance log
    prefix_cache: bool = False  # edit tasks: the file's KV state from the prefix cache


class Progress(Protocol):
    def step(self, label: str, budget: int) -> None: ...
    def advance(self, n: int = 1) -> None: ...


class NoProgress:
    def step(self, label: str, budget: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


# ----- one generation -------------------------------------------------------------------


def edit_matching(spec: SpecConfig) -> SpecConfig:
    """`spec` with the n-gram match lengths `localspec edit` uses (long matches only: an
    edit copies long runs of the file, and short matches there are mostly noise)."""
    d = EDIT_SPEC_DEFAULTS
    return replace(spec, ngram_min=d["ngram_min"], ngram_max=d["ngram_max"])


def run_engine(rt: Runtime, prep: Prepared, variant: Variant, workload: Workload,
               settings: Settings, progress: Progress, cache: PrefixStore | None = None) -> Run:
    """One localspec generation; logged to the acceptance log as command "bench". With a
    `cache`, an edit task's prefix is restored from it (timed, as the first token's)."""
    from localspec.prefix_store import warm_prefix

    spec = variant.spec or SpecConfig(mode=SpecMode.NONE)
    if workload.is_edit and spec.mode.uses_ngram:
        spec = edit_matching(spec)  # n-gram matching as `localspec edit` does it
    draft = rt.draft if variant.uses_draft else None
    drafter = make_drafter(spec, GREEDY, draft, prep.extra, target=rt.target,
                           instruction=workload.instruction, filename=workload.file)
    # every variant prefills the whole prompt in one batch (or restores the same prefix
    # and prefills the rest), so the first token comes from the same computation (a
    # prefix kept from the last variant would change the batch shape, and at a near-tie
    # the first token)
    rt.target.rewind(0)
    use = warm_prefix(rt.target, prep.tokens[: prep.n_prefix], cache) if cache else None
    if draft is not None:
        draft.prefill(prep.tokens)  # like the target's prefill: before the clock starts
    fence = FenceStop(prep.fence) if prep.fence else None  # as `localspec edit` stops
    cpu0 = 0.0
    with Transcript(generate(rt.target, prep.tokens, drafter, sampling=GREEDY, spec=spec,
                             gen=GenerationConfig(max_tokens=prep.max_tokens),
                             should_stop=(lambda: fence.done) if fence else None,
                             draft_model=draft)) as run:
        for ev in run:
            if isinstance(ev, Token):
                cpu0 = cpu0 or time.process_time()  # the first token comes right after prefill
                progress.advance()
            if fence is not None:
                fence.add(ev)
    cpu_s = time.process_time() - cpu0 if cpu0 else 0.0
    stats = run.stats
    assert stats is not None  # generate always ends with Done
    if use is not None:
        use.add_to(stats)
    log_run("bench", stats, rt.target, draft, spec, GREEDY, tag=workload.tag, enabled=settings.log)
    # tokens accepted in the round that closed the fence are not part of the answer
    cut = fence.cut if fence is not None else None
    return Run(run.ids[:cut] if cut else run.ids, stats.decode_s, stats.rounds, stats.draft_rounds,
               stats.drafted, stats.accepted, stats.draft_s, stats.llama_s,
               StopReason.FENCE if cut else stats.stop_reason, cpu_s, stats.prefill_s,
               stats.prefill_tokens, stats.restored_tokens, stats.cache_s)


def run_peer(peer: LlamaCppPythonPeer, target: Model, prep: Prepared, variant: Variant,
             progress: Progress) -> Run:
    """One generation through the peer, with the same prompt tokens and limits."""
    peer.set_num_pred_tokens(variant.k)
    fence = FenceStop(prep.fence) if prep.fence else None
    detok = target.detokenizer()

    def stop(tok: int) -> bool:
        progress.advance()
        return fence is not None and fence.feed(detok.add(tok))

    out = peer.generate(prep.tokens, prep.max_tokens, stop)
    return Run(out.ids, out.decode_s, out.rounds, out.rounds, out.drafted, out.accepted,
               stop_reason=StopReason.FENCE if fence and fence.done else "", cpu_s=out.cpu_s)


# ----- comparing outputs ----------------------------------------------------------------


def compare(target: Model, prompt: Sequence[int], plain: Sequence[int], ids: Sequence[int]) -> Verdict:
    """`ids` against the plain greedy `plain`: the first differing index and the plain
    run's top-2 logit margin there (recomputed with a one-token decode, as plain ran)."""
    n = min(len(plain), len(ids))
    i = next((j for j in range(n) if plain[j] != ids[j]), None)
    if i is None:
        if len(plain) == len(ids):
            return Verdict("identical")
        i = n  # one stopped earlier (end of text, or a token limit cut)
    if i == 0:  # the first token comes from the prefill: redo it the same way
        target.rewind(0)
        logits = target.prefill(prompt)[0]
    else:
        seq = [*prompt, *plain[:i]]
        target.prefill(seq[:-1])
        logits = target.decode(seq[-1:], "last")[0]
    top2 = np.partition(logits, -2)[-2:]
    margin = float(top2[1] - top2[0])
    return Verdict("near-tie" if margin < NEAR_TIE else "MISMATCH", i, margin)


# ----- one workload ---------------------------------------------------------------------


def order(variants: Sequence[Variant], repeat: int) -> list[Variant]:
    """A B C, then C B A, ...: alternate so slow drift in load cancels over repeats."""
    return list(variants) if repeat % 2 == 0 else list(reversed(variants))


def run_workload(rt: Runtime, workload: Workload, variants: Sequence[Variant], settings: Settings,
                 progress: Progress | None = None, peer: LlamaCppPythonPeer | None = None,
                 vcurve: VCurve | None = None) -> list[Result]:
    """All variants of `workload` (the first must be `none`), `settings.repeats` times."""
    if not variants or variants[0].mode != "none":
        raise ValueError("the first variant must be 'none' (the baseline)")
    progress = progress or NoProgress()
    prep = prepare(workload, rt.target, settings.n_predict, settings.edit_n)
    cache = _primed_cache(rt.target, prep) if settings.prefix_cache and prep.n_prefix else None
    runs: dict[Variant, list[Run]] = {v: [] for v in variants}
    errors: dict[Variant, str] = {}
    for rep in range(settings.repeats):
        for v in order(variants, rep):
            if v in errors:
                continue
            progress.step(f"{workload.name} {v.label}", prep.max_tokens)
            if v.mode != "peer":
                runs[v].append(run_engine(rt, prep, v, workload, settings, progress, cache))
                continue
            try:
                assert peer is not None, "peer variant without a peer"
                runs[v].append(run_peer(peer, rt.target, prep, v, progress))
            except Exception as exc:  # noqa: BLE001 - a broken peer must not end the bench
                errors[v] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    plain = runs[variants[0]]
    base = Result(workload.name, workload.tag, variants[0], plain, Verdict("baseline"))
    results = []
    for v in variants:
        verdict = Verdict("baseline") if v.mode == "none" else _verdict(rt.target, prep, plain, runs[v])
        results.append(Result(workload.name, workload.tag, v, runs[v], verdict, vcurve=vcurve,
                              base_tps=base.tokens_per_s, base_cpu_tps=base.tokens_per_cpu_s,
                              base_wall_tps=base.wall_tokens_per_s, error=errors.get(v, "")))
    return results


def _primed_cache(target: Model, prep: Prepared) -> PrefixStore:
    """The prefix cache, holding this task's prefix (stored now, untimed, when absent)."""
    from localspec.prefix_store import PrefixStore, warm_prefix

    cache = PrefixStore()
    target.rewind(0)
    warm_prefix(target, prep.tokens[: prep.n_prefix], cache)
    return cache


def _verdict(target: Model, prep: Prepared, plain: list[Run], runs: list[Run]) -> Verdict:
    if not runs:
        return Verdict("error")
    worst = Verdict("identical")
    for run, ref in zip(runs, plain):
        v = compare(target, prep.tokens, ref.ids, run.ids)
        if v.status == "MISMATCH":
            return v
        if v.status == "near-tie" and worst.status == "identical":
            worst = v
    return worst

