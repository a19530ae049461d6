"""Calibration: what decoding costs on this machine, measured, and stored per setup.

A profile holds the target's verify cost curve V(n) (time to decode n tokens in one
batch, relative to one), its per-token decode time, prefill speed, and the draft
model's per-token cost ratio c. It is keyed by model file identity, device, threads
and GPU layers, so a profile measured on one setup is never applied to another.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from localspec.core.backend import Model, supports_gpu_offload
from localspec.models import paths

N_MAX = 32


@dataclass
class Profile:
    key: str
    target: str
    draft: str | None
    device: str
    n_threads: int
    n_gpu_layers: int
    t_token_s: float  # target: one token decode
    vcurve: list[float]  # V(n) for n = 1..N_MAX, V(1) = 1
    prefill_tok_s: float
    draft_t_token_s: float | None = None
    created: float = field(default_factory=time.time)
    # V(n) that `--spec auto` measured during real generations: {"n": [V, verify rounds]};
    # a profile no `tune` has measured has only these (vcurve is then [])
    online: dict[str, list[float]] = field(default_factory=dict)

    @property
    def c(self) -> float | None:
        """Draft cost ratio: draft per-token time / target per-token time."""
        return self.draft_t_token_s / self.t_token_s if self.draft_t_token_s else None

    def v(self, n: int) -> float:
        return self.vcurve[min(max(n, 1), len(self.vcurve)) - 1]

    def online_v(self, min_rounds: int = 1) -> dict[int, float]:
        """{n: V(n)} measured on-line at sizes seen in at least `min_rounds` verifies."""
        return {int(n): float(v) for n, (v, w) in self.online.items() if w >= min_rounds}


def _model_id(model: Model) -> str:
    st = model.path.stat()
    return f"{model.name}:{st.st_size}"


def profile_key(target: Model, draft: Model | None = None) -> str:
    device = "gpu" if supports_gpu_offload() and target.info.n_gpu_layers else "cpu"
    parts = [_model_id(target), _model_id(draft) if draft else "-", device,
             str(target.info.n_threads), str(target.info.n_gpu_layers)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _profile_path(key: str) -> Path:
    return paths.state_dir() / "profiles" / f"{key}.json"


def _read(key: str) -> Profile | None:
    try:
        return Profile(**json.loads(_profile_path(key).read_text()))
    except (OSError, ValueError, TypeError):
        return None  # missing, or corrupt: never trusted


def load_profile(target: Model, draft: Model | None = None, online: bool = False) -> Profile | None:
    """The stored profile for this exact setup; falls back to one measured without the
    draft (V(n) is a property of the target alone). Profiles that hold only on-line
    measurements (no `tune` yet) are returned only when `online` is asked for."""
    for key in (profile_key(target, draft), profile_key(target)):
        profile = _read(key)
        if profile is not None and (profile.vcurve or online):
            return profile
    return None


def save_profile(profile: Profile) -> Path:
    """Store atomically. On-line measurements already stored under the key are kept
    when `profile` brings none (a new `tune` does not erase what runs measured)."""
    old = _read(profile.key)
    if old is not None and old.online and not profile.online:
        profile = replace(profile, online=old.online)
    path = paths.ensure(paths.state_dir() / "profiles") / f"{profile.key}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2))
    tmp.replace(path)
    return path


ONLINE_WEIGHT_MAX = 30  # verify rounds an on-line point counts for at most: newer runs move it


def merge_online(online: dict[str, list[float]], measured: dict[int, tuple[float, int]]) -> dict[str, list[float]]:
    """Stored on-line V(n) points updated with one run's {n: (V, rounds)}: a weighted
    mean, old weight capped so the machine's present state wins within a few runs."""
    out = {n: list(p) for n, p in online.items()}
    for n, (v, rounds) in measured.items():
        old_v, old_w = out.get(str(n), (v, 0))
        w_old = min(old_w, ONLINE_WEIGHT_MAX)
        w = w_old + rounds
        out[str(n)] = [(old_v * w_old + v * rounds) / w, min(w, ONLINE_WEIGHT_MAX)]
    return out


def store_online(target: Model, draft: Model | None, measured: dict[int, tuple[float, int]],
                 t_token_s: float) -> None:
    """Merge what a generation measured into this setup's stored profiles (the pair's
    and the target's; a target-only one is created when neither exists yet). Never
    raises on a full or read-only disk: a run must not fail over bookkeeping."""
    if not measured:
        return
    keys = [profile_key(target, draft)] if draft is not None else []
    keys.append(profile_key(target))
    stored = [p for k in dict.fromkeys(keys) if (p := _read(k)) is not None]
    if not stored:
        device = "gpu" if supports_gpu_offload() and target.info.n_gpu_layers else "cpu"
        stored = [Profile(key=profile_key(target), target=target.name, draft=None, device=device,
                          n_threads=target.info.n_threads, n_gpu_layers=target.info.n_gpu_layers,
                          t_token_s=t_token_s, vcurve=[], prefill_tok_s=0.0)]
    for p in stored:
        try:
            save_profile(replace(p, online=merge_online(p.online, measured)))
        except OSError:
            pass


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


def vcurve_sizes(n_max: int) -> list[int]:
    """The batch sizes tune times: each one up to 9 (kernel switches show up there: on
    a 2-core AVX2 CPU V(8) is 1.2-1.9 x V(7)), then every 2nd up to 16 and every 4th
    beyond. The curve need not rise: there, 16 tokens verify faster than 12."""
    sizes = [*range(1, min(n_max, 9) + 1), *range(10, min(n_max, 16) + 1, 2), *range(20, n_max + 1, 4)]
    return sizes if sizes[-1] == n_max else [*sizes, n_max]


def measure_vcurve(model: Model, n_max: int = N_MAX, reps: int = 3,
                   tick: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """(seconds for one token, [V(1)..V(n_max)]) on a short warm context: the median of
    `reps` timings at each of vcurve_sizes(n_max), linear in between."""
    base = model.tokenize("def measure(n):\n    return sum(range(n)) * 2\n" * 4)
    model.rewind(0)
    model.decode(base, "last")
    t1 = _time_decode(model, base, 1, reps * 3)
    sizes = vcurve_sizes(n_max)
    measured = []
    for n in sizes:
        measured.append(_time_decode(model, base, n, reps) / t1 if n > 1 else 1.0)
        if tick:
            tick()
    model.rewind(0)
    curve = np.interp(np.arange(1, n_max + 1), sizes, measured)
    return t1, [float(v) for v in curve]


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


def calibrate(target: Model, draft: Model | None = None, n_max: int = N_MAX,
              tick: Callable[[], None] | None = None) -> Profile:
    """Measure everything a profile holds (under a minute for the default pair on 2 cores)."""
    t1, curve = measure_vcurve(target, n_max, tick=tick)
    prefill = measure_prefill(target)
    if tick:
        tick()
    draft_t = measure_token_time(draft) if draft is not None else None
    if tick:
        tick()
    device = "gpu" if supports_gpu_offload() and target.info.n_gpu_layers else "cpu"
    return Profile(
        key=profile_key(target, draft), target=target.name, draft=draft.name if draft else None,
        device=device, n_threads=target.info.n_threads, n_gpu_layers=target.info.n_gpu_layers,
        t_token_s=t1, vcurve=curve, prefill_tok_s=prefill, draft_t_token_s=draft_t,
    )
