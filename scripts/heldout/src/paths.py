"""Where localspec keeps user state: LOCALSPEC_HOME if set, else the XDG directories."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIR = PACKAGE_DIR.parent


def _xdg(var: str, default: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / default)


def home() -> Path | None:
    """LOCALSPEC_HOME, when the user (or a test) redirects all state there."""
    value = os.environ.get("LOCALSPEC_HOME")
    return Path(value).expanduser() if value else None


def state_dir() -> Path:
    """Logs and calibration profiles."""
    base = home()
    return base if base else _xdg("XDG_STATE_HOME", ".local/state") / "localspec"


def cache_dir() -> Path:
    """Downloaded weights and other re-creatable files."""
    base = home()
    return base / "cache" if base else _xdg("XDG_CACHE_HOME", ".cache") / "localspec"


def checkout_models_dir() -> Path | None:
    """`models/` of a source checkout (holds manifest.json), or None for a wheel install."""
    candidate = CHECKOUT_DIR / "models"
    return candidate if (candidate / "manifest.json").is_file() else None


def models_dirs() -> list[Path]:
    """Directories searched for weights, in order; the first is where pulls go."""
    dirs: list[Path] = []
    if os.environ.get("LOCALSPEC_MODELS"):
        dirs.append(Path(os.environ["LOCALSPEC_MODELS"]).expanduser())
    checkout = checkout_models_dir()
    if checkout is not None:
        dirs.append(checkout)
    dirs.append(cache_dir() / "models")
    return dirs


def ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
