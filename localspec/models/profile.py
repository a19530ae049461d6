"""Calibration profiles: what decoding costs on this machine, stored per setup.

A profile holds the target's verify cost curve V(n) (time to decode n tokens in one
batch, relative to one), its per-token decode time, prefill speed, and the draft
model's per-token cost ratio c. It is keyed by a `Setup` (model files, device, threads
and GPU layers), so a profile measured on one setup is never applied to another.

Pure data and files: no model is loaded here (the `auto` drafter imports this module).
The measurements are in localspec/bench/calibrate.py (`localspec tune`); the setup of
loaded models comes from core/runtime.py (`setup_of`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from localspec.files import write_atomic
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

    @property
    def c(self) -> float | None:
        """Draft cost ratio: draft per-token time / target per-token time."""
        return self.draft_t_token_s / self.t_token_s if self.draft_t_token_s else None

    def v(self, n: int) -> float:
        return self.vcurve[min(max(n, 1), len(self.vcurve)) - 1]


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

    @property
    def key(self) -> str:
        parts = [self.target, self.draft or "-", self.device, str(self.n_threads), str(self.n_gpu_layers)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def alone(self) -> Setup:
        """The same setup without the draft: V(n) is a property of the target alone."""
        return replace(self, draft=None)


def _profile_path(key: str) -> Path:
    return paths.state_dir() / "profiles" / f"{key}.json"


def load_profile(setup: Setup) -> Profile | None:
    """The stored profile for this exact setup; falls back to one measured without the
    draft (V(n) is a property of the target alone)."""
    for key in dict.fromkeys((setup.key, setup.alone().key)):
        try:
            data = json.loads(_profile_path(key).read_text())
            return Profile(**data)
        except (OSError, ValueError, TypeError):
            continue
    return None


def save_profile(profile: Profile) -> Path:
    """Store `profile` under its key (atomically: a reader never sees half a file)."""
    path = paths.ensure(paths.state_dir() / "profiles") / f"{profile.key}.json"
    write_atomic(path, json.dumps(asdict(profile), indent=2))
    return path


def vcurve_sizes(n_max: int) -> list[int]:
    """The batch sizes tune times: each one up to 9 (kernel switches show up there: on
    a 2-core AVX2 CPU V(8) is 1.2-1.9 x V(7)), then every 2nd up to 16 and every 4th
    beyond. The curve need not rise: there, 16 tokens verify faster than 12."""
    sizes = [*range(1, min(n_max, 9) + 1), *range(10, min(n_max, 16) + 1, 2), *range(20, n_max + 1, 4)]
    return sizes if sizes[-1] == n_max else [*sizes, n_max]
