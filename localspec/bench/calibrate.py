"""The measurements behind a calibration profile (`localspec tune`): the target's
one-token decode time and verify cost curve V(n), its prefill speed, and the draft
model's one-token time. Medians of repeated timings at a few batch sizes
(profile.vcurve_sizes), linear in between; `bench --vcurve` (vcurve.py) measures every
size, best of its repeats, for the report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from localspec.profile import LONG_CONTEXT, LONG_N_MAX, N_MAX, VCURVE_CONTEXT, Profile, Setup, vcurve_sizes

if TYPE_CHECKING:
    from localspec.core.backend import Model


def _time_decode(model: Model, base: list[int], n: int, reps: int) -> float:
    """Median seconds to decode n tokens (all rows' logits) after `base`."""
    times = []
    toks = [base[i % len(base)] for i in range(n)]
    for _ in range(reps):
        model.rewind(len(base))
        t0 = time.perf_counter()
        rows = model.decode(toks, "all")
        float(rows[-1, 0])  # touch the output
        times.append(time.perf_counter() - t0)
    model.rewind(len(base))
    return float(np.median(times))


SHORT_TEXT = "def measure(n):\n    return sum(range(n)) * 2\n" * 4  # the short curve's context


def measure_vcurve(model: Model, n_max: int = N_MAX, reps: int = 3,
                   tick: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """(seconds for one token, [V(1)..V(n_max)]) on a short warm context: the median of
    `reps` timings at each of vcurve_sizes(n_max), linear in between."""
    base = model.tokenize(SHORT_TEXT)
    model.rewind(0)
    model.decode(base, "last")
    return _curve_after(model, base, vcurve_sizes(n_max), n_max, reps, tick)


def _curve_after(model: Model, base: list[int], sizes: list[int], n_max: int, reps: int,
                 tick: Callable[[], None] | None) -> tuple[float, list[float]]:
    """(seconds for one token, [V(1)..V(n_max)]) with `base` in the cache: the median of
    `reps` timings at each of `sizes` (three times as many for one token), linear in
    between, ticking once per size; the cache left empty."""
    t1 = _time_decode(model, base, 1, reps * 3)
    measured = []
    for n in sizes:
        measured.append(_time_decode(model, base, n, reps) / t1 if n > 1 else 1.0)
        if tick:
            tick()
    model.rewind(0)
    curve = np.interp(np.arange(1, n_max + 1), sizes, measured)
    return t1, [float(v) for v in curve]


def band_sizes(n_max: int) -> list[int]:
    """The batch sizes timed after a long context: the short curve's (profile.vcurve_sizes)
    to 64, then the policy's own verify sizes (costs.GRID) up to n_max."""
    from localspec.core.drafters.costs import grid_sizes

    return sorted({*vcurve_sizes(min(n_max, N_MAX)), *grid_sizes(n_max)})


def measure_band(model: Model, context: int = LONG_CONTEXT, n_max: int = LONG_N_MAX, reps: int = 2,
                 tick: Callable[[], None] | None = None) -> tuple[int, list[float]]:
    """(the context timed after, [V(1)..V(n_max)]) after a long context of real text
    (this file's): an edit verifies up to 257 tokens after 1,000-2,500, where attention
    makes every size dearer relative to one token than the short curve says (the AMX
    Xeon: V(64) 7.41 after a short context, 8.29 after 600 tokens). Medians of `reps`
    timings (three times as many for one token), linear in between; ticks once per size."""
    context = min(context, model.n_ctx_seq - n_max - 1)
    text = model.tokenize(Path(__file__).read_text())  # a few thousand tokens: repeated if short
    base = (text * (context // len(text) + 1))[:context]
    model.rewind(0)
    model.prefill(base)
    return context, _curve_after(model, base, band_sizes(n_max), n_max, reps, tick)[1]


def measure_token_time(model: Model, reps: int = 12) -> float:
    base = model.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    model.rewind(0)
    model.decode(base, "last")
    t = _time_decode(model, base, 1, reps)
    model.rewind(0)
    return t


def measure_prefill(model: Model, n_tokens: int = 256) -> float:
    toks = model.tokenize("Speculative decoding drafts, verifies and keeps a prefix. " * 64)[:n_tokens]
    model.rewind(0)
    t0 = time.perf_counter()
    model.decode(toks, "last")
    dt = time.perf_counter() - t0
    model.rewind(0)
    return len(toks) / dt


FA_CONTEXT = 1024  # the context flash attention is compared at: where the kernels part
FA_SIZES = (1, 16)  # plain decode and a typical verify
FA_MARGIN = 0.03  # a setting must be this much faster to replace llama.cpp's own choice


def measure_flash_attn(model: Model, reps: int = 3) -> tuple[str | None, dict[str, float]]:
    """Which flash-attention setting decodes faster on this machine at a long context:
    ("on" or "off", or None where neither wins by FA_MARGIN; {setting: geometric mean
    seconds over FA_SIZES, timed on, off, on again}). Leaves the model on the winner (else llama.cpp's auto),
    with an empty context. On this project's 2-core EPYC, Qwen2.5-Coder-1.5B verified 16
    tokens after 1,000 in 439 ms with it off and 605 ms on; the 0.5B and Gemma-270M
    were within a few percent either way at 64 tokens: it has to be measured."""
    text = model.tokenize(Path(__file__).read_text() * 8)
    n_base = min(FA_CONTEXT, model.n_ctx_seq - max(FA_SIZES) - 1, len(text) - max(FA_SIZES))
    base = text[:n_base]
    logs: dict[str, list[float]] = {"on": [], "off": []}  # log seconds, averaged over FA_SIZES
    for mode in ("on", "off", "on"):  # on twice, around off: a drift in the machine's speed cancels
        model.rewind(0)
        model.set_flash_attn(mode)
        model.prefill(base)
        logs[mode].append(float(np.mean([np.log(_time_decode(model, base, n, reps)) for n in FA_SIZES])))
    times = {mode: float(np.exp(np.mean(x))) for mode, x in logs.items()}
    model.rewind(0)
    fast, slow = sorted(times, key=times.get)
    choice = fast if times[fast] < (1 - FA_MARGIN) * times[slow] else None
    model.set_flash_attn(choice or "auto")
    return choice, times


BATCH_CONTEXTS = (256, 2048)  # the context bands the serve rule's limit is measured at
BATCH_SIZES = (1, 2, 3, 4, 6, 8)  # active sequences tried
BATCH_K, BATCH_ALPHA = 4, 0.6  # the draft each sequence verifies, and its acceptance


def measure_batch_limits(target: Model, contexts: tuple[int, ...] = BATCH_CONTEXTS,
                         sizes: tuple[int, ...] = BATCH_SIZES, reps: int = 2,
                         tick: Callable[[], None] | None = None) -> tuple[dict[str, int], list[dict]]:
    """The serve rule's --spec-disable-by-batch-size at each context length, measured on
    batches of real sequences as the server decodes them (one decode_multi, a second
    copy of the model loaded with max(sizes) sequences): for B sequences of `context`
    tokens each, a plain step (one token each) against a speculative one (1 + BATCH_K
    each). Speculation pays at B while E * plain >= speculative, E the tokens a round
    yields at BATCH_ALPHA. Returns ({"context": limit}, the timings for the report)."""
    from localspec.core.backend import Model as _Model
    from localspec.bench.vcurve import expected_tokens
    from localspec.serve.defaults import crossover_limit

    n_seq = max(sizes)
    fits = [c for c in contexts if c + BATCH_K + 2 < target.n_ctx_seq] or [min(contexts)]
    per_seq = max(fits) + BATCH_K + 64
    multi = _Model(replace(target.cfg, n_seq_max=n_seq, n_ctx=n_seq * per_seq, flash_attn=target.flash_attn))
    text = multi.tokenize(Path(__file__).read_text() * 8)
    e = expected_tokens(BATCH_ALPHA, BATCH_K)
    limits, detail = {}, []
    try:
        for ctx in fits:
            base = (text * (ctx // len(text) + 1))[:ctx]
            for s in range(n_seq):
                multi.rewind(0, force=True, seq=s)
            multi.decode(base, "last", seq=0)
            for s in range(1, n_seq):
                multi.copy_seq(0, s)
            points = []
            for b in sizes:
                off = _time_multi(multi, b, 1, len(base), reps)
                on = _time_multi(multi, b, 1 + BATCH_K, len(base), reps)
                points.append((b, off, on))
                detail.append({"context": ctx, "batch": b, "plain_ms": round(off * 1e3, 2),
                               "spec_ms": round(on * 1e3, 2), "gain": round(e * off / on, 3)})
            limits[str(ctx)] = crossover_limit(points, e)
            if tick:
                tick()
    finally:
        multi.close()
    return limits, detail


def _time_multi(model: Model, b: int, n: int, base: int, reps: int) -> float:
    """Median seconds of one decode_multi of n tokens on each of sequences 0..b-1."""
    entries = [(s, [model.bos if model.bos >= 0 else 0] * n, n) for s in range(b)]
    times = []
    for _ in range(reps + 1):  # the first one warms the graph of this shape
        t0 = time.perf_counter()
        model.decode_multi(entries)
        times.append(time.perf_counter() - t0)
        for s in range(b):
            model.rewind(base, seq=s)
    return float(np.median(times[1:]))


def calibrate(target: Model, draft: Model | None, setup: Setup, n_max: int = N_MAX,
              tick: Callable[[], None] | None = None, long_max: int = LONG_N_MAX) -> Profile:
    """Measure everything a profile of `setup` (runtime.setup_of(target, draft)) holds;
    about five minutes for the default pair on 2 cores. With -fa auto it first
    compares flash attention on and off (measure_flash_attn) and measures the rest with
    the faster one. V(n) is timed twice: to n_max after a short context (a chat turn),
    and to long_max after LONG_CONTEXT tokens (an edit; 0: not), where the context fits."""
    flash = target.cfg.flash_attn  # as asked: -fa auto re-measures whatever an earlier tune chose
    if flash == "auto":
        flash, _ = measure_flash_attn(target)
        if tick:
            tick()
    t1, curve = measure_vcurve(target, n_max, tick=tick)
    bands = {}
    if long_max and target.n_ctx_seq - long_max - 1 >= 4 * VCURVE_CONTEXT:
        at, band = measure_band(target, n_max=long_max, tick=tick)
        bands[str(at)] = band
    prefill = measure_prefill(target)
    if tick:
        tick()
    draft_t = measure_token_time(draft) if draft is not None else None
    if tick:
        tick()
    limits, _ = measure_batch_limits(target, tick=tick)
    return Profile(
        key=setup.key, target=target.name, draft=draft.name if draft else None,
        device=setup.device, n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers,
        t_token_s=t1, vcurve=curve, prefill_tok_s=prefill, draft_t_token_s=draft_t, flash_attn=flash,
        batch_limits=limits, vbands=bands, vcurve_context=len(target.tokenize(SHORT_TEXT)),
    )
