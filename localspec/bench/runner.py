"""Run every variant of one workload in this process, interleaved, greedy.

Variants are plain decoding (`none`), each speculative mode at each k, and optionally
the peer. With several repeats the order alternates (A B C, C B A, ...) so drift in
machine load hits every variant alike. Speed is decode speed: tokens after the first
over the time from the first token on (prefill is the same work for every variant and
is left out, as in the engine's stats). Each output is compared with `none` token by
token; batched verification is not bit-identical to one-token decoding in llama.cpp,
so a divergence at a near-tie of the plain run (top-2 logit margin < NEAR_TIE) is
reported as such, anything else as a mismatch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from localspec.acceptance import logdb
from localspec.bench.vcurve import VCurve, expected_tokens
from localspec.bench.workloads import Prepared, Workload, prepare
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.engine import Done, GenerationStats, Token, generate
from localspec.core.runtime import Runtime, make_drafter

if TYPE_CHECKING:
    from localspec.bench.peer import LlamaCppPythonPeer
    from localspec.core.backend import Model

NEAR_TIE = 0.5  # top-2 logit margin; the same threshold as tests/test_real_models.py
GREEDY = SamplingConfig(temperature=0.0)


@dataclass(frozen=True)
class Variant:
    """How to decode: `mode` none | ngram | model | hybrid | auto | peer, `k` drafted
    tokens at most per round; `spec` is what the engine gets (None for the peer)."""

    mode: str
    k: int = 0
    spec: SpecConfig | None = None

    @property
    def label(self) -> str:
        return self.mode if self.mode == "none" else f"{self.mode} k={self.k}"

    @property
    def uses_draft(self) -> bool:
        return self.spec is not None and self.spec.mode in ("model", "hybrid", "auto")


@dataclass(frozen=True)
class Settings:
    n_predict: int = 256  # token limit for prompt workloads
    edit_n: int = 0  # token limit for edit tasks; 0: enough for the file
    repeats: int = 1
    log: bool = True  # append each generation to the acceptance log


class Progress(Protocol):
    def step(self, label: str, budget: int) -> None: ...
    def advance(self, n: int = 1) -> None: ...


class NoProgress:
    def step(self, label: str, budget: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


@dataclass
class Run:
    """One generation, reduced to what the report needs."""

    ids: list[int]
    decode_s: float
    rounds: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    llama_s: float = 0.0
    stop_reason: str = ""
    cpu_s: float = 0.0  # this process's CPU time over the same span as decode_s


@dataclass
class Verdict:
    """The output against `none`: identical, near-tie (diverged where the plain run's
    top-2 margin was tiny), MISMATCH, or baseline (the `none` row itself)."""

    status: str
    index: int | None = None
    margin: float | None = None

    def __str__(self) -> str:
        if self.index is None:
            return self.status
        return f"{self.status} @{self.index} (margin {self.margin:.2f})"


@dataclass
class Result:
    """One variant on one workload, summed over repeats."""

    workload: str
    tag: str
    variant: Variant
    runs: list[Run]
    verdict: Verdict
    base_tps: float | None = None  # `none` on the same workload, same repeats
    base_cpu_tps: float | None = None  # the same, per CPU second
    vcurve: VCurve | None = None
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(len(r.ids) for r in self.runs)

    @property
    def decode_s(self) -> float:
        return sum(r.decode_s for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        if not self.base_tps or not self.tokens_per_s:
            return None
        return self.tokens_per_s / self.base_tps

    @property
    def tokens_per_cpu_s(self) -> float:
        cpu = self._sum("cpu_s")
        return self.tokens / cpu if cpu > 0 else 0.0

    @property
    def cpu_speedup(self) -> float | None:
        """Speedup in CPU time: on a busy machine with one thread per core for us, close
        to what an idle machine would show, since waiting for a core costs no CPU time
        (with more threads than free cores, llama.cpp's spinning inflates it)."""
        if not self.base_cpu_tps or not self.tokens_per_cpu_s:
            return None
        return self.tokens_per_cpu_s / self.base_cpu_tps

    def _sum(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.runs)

    @property
    def acceptance(self) -> float | None:
        drafted = self._sum("drafted")
        return self._sum("accepted") / drafted if drafted else None

    @property
    def k_mean(self) -> float | None:
        """Mean draft length of the rounds that drafted."""
        rounds = self._sum("draft_rounds")
        return self._sum("drafted") / rounds if rounds else None

    @property
    def tokens_per_draft_round(self) -> float | None:
        """Measured: accepted draft tokens + the target's own token, per drafting round."""
        rounds = self._sum("draft_rounds")
        return self._sum("accepted") / rounds + 1.0 if rounds else None

    @property
    def expected(self) -> float | None:
        """Theory E(a, k) for the measured acceptance a and mean draft length k."""
        a, k = self.acceptance, self.k_mean
        return None if a is None or k is None else expected_tokens(a, k)

    @property
    def c(self) -> float | None:
        """Drafting time per drafted token over plain decoding's time per token."""
        drafted = self._sum("drafted")
        if not drafted or not self.base_tps or self.variant.mode == "peer":
            return None
        return (self._sum("draft_s") / drafted) * self.base_tps

    @property
    def predicted_speedup(self) -> float | None:
        """The cost model with this run's numbers: tokens / (rounds' cost in plain decodes),
        a drafting round costing k*c + V(k+1) and a plain round 1."""
        k, c, tpr = self.k_mean, self.c, self.tokens_per_draft_round
        if self.vcurve is None or k is None or c is None or tpr is None:
            return None
        draft_rounds, rounds = self._sum("draft_rounds"), self._sum("rounds")
        plain_rounds = rounds - draft_rounds
        cost = draft_rounds * (k * c + self.vcurve.at(k + 1)) + plain_rounds
        return (draft_rounds * tpr + plain_rounds) / cost if cost else None

    @property
    def overhead(self) -> float | None:
        if self.variant.mode == "peer" or not self.decode_s:
            return None
        return max(0.0, 1.0 - self._sum("llama_s") / self.decode_s)

    def to_dict(self) -> dict:
        def r(x: float | None, nd: int = 4) -> float | None:
            return None if x is None or not math.isfinite(x) else round(x, nd)

        return {
            "workload": self.workload, "tag": self.tag, "mode": self.variant.mode,
            "k": self.variant.k, "label": self.variant.label, "repeats": len(self.runs),
            "tokens": self.tokens, "decode_s": r(self.decode_s),
            "tokens_per_s": r(self.tokens_per_s, 3), "speedup": r(self.speedup, 3),
            "cpu_s": r(self._sum("cpu_s")), "cpu_speedup": r(self.cpu_speedup, 3),
            "acceptance": r(self.acceptance), "k_mean": r(self.k_mean, 3),
            "tokens_per_draft_round": r(self.tokens_per_draft_round, 3),
            "expected_tokens_per_round": r(self.expected, 3),
            "c": r(self.c), "predicted_speedup": r(self.predicted_speedup, 3),
            "overhead": r(self.overhead), "rounds": int(self._sum("rounds")),
            "drafted": int(self._sum("drafted")), "accepted": int(self._sum("accepted")),
            "output": {"status": self.verdict.status, "diverged_at": self.verdict.index,
                       "margin": r(self.verdict.margin)},
            "stop_reason": self.runs[0].stop_reason if self.runs else "", "error": self.error,
        }


# ----- one generation -------------------------------------------------------------------


class _FenceStop:
    """Edit tasks: done once the closing fence line is complete (as `localspec edit`)."""

    def __init__(self, fence: str) -> None:
        from localspec.edit import FenceReader

        self.reader = FenceReader(fence)
        self.reader.feed(fence + "\n")  # the opening fence is in the prompt

    def feed(self, text: str) -> bool:
        return self.reader.feed(text)

    def done(self) -> bool:
        return self.reader.done


def edit_matching(spec: SpecConfig) -> SpecConfig:
    """`spec` with the n-gram match lengths `localspec edit` uses (long matches only: an
    edit copies long runs of the file, and short matches there are mostly noise)."""
    from localspec.commands.edit import EDIT_SPEC_DEFAULTS as d

    return replace(spec, ngram_min=d["ngram_min"], ngram_max=d["ngram_max"])


def run_engine(rt: Runtime, prep: Prepared, variant: Variant, workload: Workload,
               settings: Settings, progress: Progress) -> Run:
    """One localspec generation; logged to the acceptance log as command "bench"."""
    spec = variant.spec or SpecConfig(mode="none")
    if workload.is_edit and spec.mode in ("ngram", "hybrid", "auto"):
        spec = edit_matching(spec)  # n-gram matching as `localspec edit` does it
    draft = rt.draft if variant.uses_draft else None
    drafter = make_drafter(spec, GREEDY, draft, prep.extra, target=rt.target)
    # every variant prefills the whole prompt in one batch, so the first token comes
    # from the same computation (a cached prefix would change the batch shape, and at
    # a near-tie the first token); the prefill is not timed
    rt.target.rewind(0)
    if draft is not None:
        draft.prefill(prep.tokens)  # like the target's prefill: before the clock starts
    fence = _FenceStop(prep.fence) if prep.fence else None
    events = generate(rt.target, prep.tokens, drafter, sampling=GREEDY, spec=spec,
                      gen=GenerationConfig(max_tokens=prep.max_tokens),
                      should_stop=fence.done if fence else None, draft_model=draft)
    ids: list[int] = []
    cut: int | None = None  # tokens accepted in the round that closed the fence don't count
    stats: GenerationStats | None = None
    cpu0 = 0.0
    for ev in events:
        if isinstance(ev, Token):
            cpu0 = cpu0 or time.process_time()  # the first token comes right after prefill
            ids.append(ev.id)
            progress.advance()
            if fence is not None and cut is None and fence.feed(ev.text):
                cut = len(ids)
        elif isinstance(ev, Done):
            stats = ev.stats
    cpu_s = time.process_time() - cpu0 if cpu0 else 0.0
    assert stats is not None  # generate always ends with Done
    _log(rt, stats, spec, workload, draft, settings)
    return Run(ids[:cut] if cut else ids, stats.decode_s, stats.rounds, stats.draft_rounds,
               stats.drafted, stats.accepted, stats.draft_s, stats.llama_s,
               "fence" if cut else stats.stop_reason, cpu_s)


def _log(rt: Runtime, stats: GenerationStats, spec: SpecConfig, workload: Workload,
         draft: Model | None, settings: Settings) -> None:
    logdb.log_generation("bench", stats, target=rt.target.path, draft=draft.path if draft else None,
                   spec=spec, sampling=GREEDY, tag=workload.tag, enabled=settings.log)


def run_peer(peer: LlamaCppPythonPeer, target: Model, prep: Prepared, variant: Variant,
             progress: Progress) -> Run:
    """One generation through the peer, with the same prompt tokens and limits."""
    peer.set_num_pred_tokens(variant.k)
    fence = _FenceStop(prep.fence) if prep.fence else None
    detok = target.detokenizer()

    def stop(tok: int) -> bool:
        progress.advance()
        return fence is not None and fence.feed(detok.add(tok))

    out = peer.generate(prep.tokens, prep.max_tokens, stop)
    return Run(out.ids, out.decode_s, out.rounds, out.rounds, out.drafted, out.accepted,
               stop_reason="fence" if fence and fence.done() else "", cpu_s=out.cpu_s)


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
    runs: dict[Variant, list[Run]] = {v: [] for v in variants}
    errors: dict[Variant, str] = {}
    for rep in range(settings.repeats):
        for v in order(variants, rep):
            if v in errors:
                continue
            progress.step(f"{workload.name} {v.label}", prep.max_tokens)
            if v.mode != "peer":
                runs[v].append(run_engine(rt, prep, v, workload, settings, progress))
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
                              error=errors.get(v, "")))
    return results


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

