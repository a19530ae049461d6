"""Calibration profiles: what decoding costs on this machine, stored per setup.

A profile holds the target's verify cost curve V(n) (time to decode n tokens in one
batch, relative to one), its per-token decode time, prefill speed, and the draft
model's per-token cost ratio c. It is keyed by a `Setup` (model files, device, threads
and GPU layers), so a profile measured on one setup is never applied to another.

Pure data and files: no model is loaded here (the `auto` drafter imports this module).
The measurements are in localspec/bench/calibrate.py (`localspec tune`); the setup of
loaded models comes from runtime.py (`setup_of`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from localspec.files import write_atomic
from localspec.models import paths

N_MAX = 64  # tune times V(n) this far: edits draft long copies, and a size known need not be tried
LONG_N_MAX = 256  # ... and this far after a long context (`vbands`): edits draft up to 256
LONG_CONTEXT = 1024  # tokens of that long context: where an edit of a few hundred lines verifies
VCURVE_CONTEXT = 64  # tokens of context the short curve is timed after (about: tune's base text)
# The build whose on-line costs a profile holds. 2: a serve round decoded beside other
# sequences' rows is no longer timed (version 1 timed it at the whole shared step, so a
# one-token decode at two clients was stored about twice as dear, 34.8 ms against 10-17 ms
# real, and every on-line V(n) too low); older on-line costs are dropped on load.
ONLINE_VERSION = 2


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
    online_version: int = ONLINE_VERSION  # the build that timed `online` (a file without it: 1)
    # what measured `batch_limits` and why they are what they are: "" for tune's batches of
    # synthetic drafts, else a line from `bench --serve` (serve's own default drafting, timed)
    batch_limits_by: str = ""
    # flash attention as tune measured it faster at a long context ("on"/"off"), or None:
    # llama.cpp's own choice. Runs with -fa auto (the default) use it
    flash_attn: str | None = None
    # the serve rule's --spec-disable-by-batch-size as tune measured it on batches of
    # sequences, by context length: {"context": limit} (calibrate.measure_batch_limits)
    batch_limits: dict[str, int] = field(default_factory=dict)
    # what `--spec auto` learned of memory drafts' acceptance (drafters/memory.py's
    # MemoryModel counts by match length and support): a property of the target and traffic
    memory_accept: dict = field(default_factory=dict)
    # V(n) after a longer context, {"context": [V(1)..V(m)]}: attention over the context
    # makes large verifies dearer relative to one token there (an edit verifies after
    # 1,000-2,500 tokens), and edits verify up to 257 tokens at once
    vbands: dict[str, list[float]] = field(default_factory=dict)
    vcurve_context: int = VCURVE_CONTEXT  # the context `vcurve` was timed after

    @property
    def c(self) -> float | None:
        """Draft cost ratio: draft per-token time / target per-token time."""
        return self.draft_t_token_s / self.t_token_s if self.draft_t_token_s else None

    def v(self, n: int) -> float:
        return self.vcurve[min(max(n, 1), len(self.vcurve)) - 1]

    def curve_for(self, n_ctx: int | None) -> list[float]:
        """V(n) for a generation at a context of n_ctx tokens: the measured band (the short
        `vcurve` or one of `vbands`) nearest it on a log scale (None: the short one),
        continued past its last size along the longest other band's shape, scaled to
        meet it there (not by a guess), so a short curve to 64 still knows what 256
        tokens cost."""
        bands = {self.vcurve_context: self.vcurve} if self.vcurve else {}
        bands.update({int(c): list(v) for c, v in self.vbands.items() if v and int(c) > 0})
        if not bands:
            return []
        if n_ctx is None:
            n_ctx = self.vcurve_context
        near = min(bands, key=lambda c: (abs(math.log(max(n_ctx, 1) / max(c, 1))), c))
        curve = bands[near]
        longest = max(bands.values(), key=len)
        if len(longest) > len(curve):
            m = len(curve)
            scale = curve[-1] / longest[m - 1]
            curve = [*curve, *(x * scale for x in longest[m:])]
        return curve

    def online_v(self, min_rounds: int = 1) -> dict[int, float]:
        """{n: V(n)} measured on-line at sizes seen in at least `min_rounds` verifies."""
        return {int(n): float(v) for n, (v, w) in self.online.items() if w >= min_rounds}


def model_id(path: str | Path) -> str:
    """A model file's identity in profile keys: its name and size."""
    path = Path(path)
    return f"{path.name}:{path.stat().st_size}"


@dataclass(frozen=True)
class Setup:
    """What a profile is measured on: the target (and draft) file identities (model_id),
    the device ("cpu" or "gpu"), threads and the target's GPU layers."""

    target: str
    draft: str | None
    device: str
    n_threads: int
    n_gpu_layers: int
    rpc: tuple[str, ...] = ()  # --rpc workers: round trips change every cost
    flash_attn: str = "auto"  # -fa as asked: a forced on/off is measured apart from auto

    @property
    def key(self) -> str:
        parts = [self.target, self.draft or "-", self.device, str(self.n_threads), str(self.n_gpu_layers)]
        parts += [f"rpc={','.join(self.rpc)}"] if self.rpc else []
        parts += [f"fa={self.flash_attn}"] if self.flash_attn != "auto" else []
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def alone(self) -> Setup:
        """The same setup without the draft: V(n) is a property of the target alone."""
        return replace(self, draft=None)


def _profiles_dir() -> Path:
    return paths.state_dir() / "profiles"


def _read(key: str, folder: Path | None = None) -> Profile | None:
    try:
        profile = Profile(**{"online_version": 1,
                             **json.loads(((folder or _profiles_dir()) / f"{key}.json").read_text())})
    except (OSError, ValueError, TypeError):
        return None  # missing, or corrupt: never trusted
    if not (isinstance(profile.vbands, dict)
            and all(str(c).isdigit() and isinstance(v, list) for c, v in profile.vbands.items())):
        return None  # a band that is not {"context": [V(1)..]}: corrupt too
    if profile.online_version < ONLINE_VERSION:  # costs timed the old way: tune's curve stays,
        # and so does what is no timing (memory drafts' acceptance); a profile no tune
        # measured had its one-token time timed on-line too: unknown until a run stores one
        profile = replace(profile, online={}, online_version=ONLINE_VERSION,
                          t_token_s=profile.t_token_s if profile.vcurve else 0.0)
    return profile


def load_profile(setup: Setup, online: bool = False) -> Profile | None:
    """The stored profile for this exact setup; falls back to one measured without the
    draft (V(n) is a property of the target alone). Profiles that hold only on-line
    measurements (no `tune` yet: runs' costs, `bench --serve`'s load limits) are returned
    only when `online` is asked for, and then only where neither key has a tuned one."""
    untuned = None
    for key in dict.fromkeys((setup.key, setup.alone().key)):
        profile = _read(key)
        if profile is not None and profile.vcurve:
            return profile
        untuned = untuned or profile
    return untuned if online else None


def save_profile(profile: Profile, folder: Path | None = None) -> Path:
    """Store `profile` under its key, atomically (a reader never sees half a file).
    On-line measurements already stored under the key are kept when `profile` brings
    none (a new `tune` does not erase what runs measured), unless tune changed the
    attention kernel they were measured with."""
    old = _read(profile.key, folder)
    if old is not None and old.online and not profile.online and old.flash_attn == profile.flash_attn:
        profile = replace(profile, online=old.online)
    path = paths.ensure(folder or _profiles_dir()) / f"{profile.key}.json"
    write_atomic(path, json.dumps(asdict(profile), indent=2))
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


def store_online(setup: Setup, target_name: str, measured: dict[int, tuple[float, int]],
                 t_token_s: float, folder: Path | None = None, memory: dict | None = None) -> None:
    """Merge what a generation measured into this setup's stored profiles (the pair's
    and the target's; a target-only one is created when neither exists yet); `memory`:
    the memory drafts' acceptance counts, which replace the stored ones (they started
    from them). Never raises on a full or read-only disk: a run must not fail over
    bookkeeping."""
    if not measured and not memory:
        return
    keys = dict.fromkeys((setup.key, setup.alone().key))
    stored = [p for k in keys if (p := _read(k, folder)) is not None]
    if not stored:
        stored = [Profile(key=setup.alone().key, target=target_name, draft=None, device=setup.device,
                          n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers,
                          t_token_s=t_token_s, vcurve=[], prefill_tok_s=0.0)]
    for p in stored:
        try:
            # a profile no tune measured has the on-line one-token time: the latest run's
            save_profile(replace(p, online=merge_online(p.online, measured),
                                 t_token_s=p.t_token_s if p.vcurve else t_token_s,
                                 memory_accept=memory or p.memory_accept), folder)
        except OSError:
            pass


_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localspec-profiles")


def store_online_later(setup: Setup, target_name: str, measured: dict[int, tuple[float, int]],
                       t_token_s: float, memory: dict | None = None) -> Future:
    """`store_online` off the caller's thread: the server's scheduler (which ends every
    request's generation) must not wait on the disk. One writer, so two stores of one
    profile never interleave; the folder is fixed now (not when the write runs), and
    writes still pending when the process exits are finished first."""
    return _writer.submit(store_online, setup, target_name, dict(measured), t_token_s, _profiles_dir(),
                          memory)


def store_batch_limits(setup: Setup, target_name: str, limits: dict[str, int], by: str,
                       t_token_s: float) -> Future:
    """Keep serve's load limits as `bench --serve` measured them ({"context": limit}, `by`
    the line saying how) in the setup's profile, created with only these when there is
    none yet; on the profile writer's thread, so an on-line store of the same file
    pending there is not lost."""
    def store() -> None:
        p = _read(setup.key, folder) or Profile(
            key=setup.key, target=target_name, draft=setup.draft, device=setup.device,
            n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers, t_token_s=t_token_s,
            vcurve=[], prefill_tok_s=0.0)
        save_profile(replace(p, batch_limits=dict(limits), batch_limits_by=by), folder)

    folder = _profiles_dir()
    return _writer.submit(store)


def vcurve_sizes(n_max: int) -> list[int]:
    """The batch sizes tune times: each one up to 9 (kernel switches show up there,
    docs/measurements.md), then every 2nd up to 16 and every 4th beyond. The curve
    need not rise: on some CPUs 16 tokens verify faster than 12."""
    sizes = [*range(1, min(n_max, 9) + 1), *range(10, min(n_max, 16) + 1, 2), *range(20, n_max + 1, 4)]
    return sizes if sizes[-1] == n_max else [*sizes, n_max]
