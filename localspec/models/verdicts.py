"""What a sha256 check found, per file, so that a file that failed is never used again
and a file found good is not hashed again.

A verdict is kept under the cache dir (verified.json) for the file's real path, its
size and mtime, and the sha256 it was checked against: a file rewritten since (another
size or mtime) has no verdict. Files in other tools' stores get verdicts too: localspec
never deletes those, but it does not use one that failed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from localspec.files import write_atomic
from localspec.models import paths

_FILE = "verified.json"


def _store() -> Path:
    return paths.cache_dir() / _FILE


def _load() -> dict:
    try:
        data = json.loads(_store().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _key(path: Path) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def verdict(path: Path, sha256: str) -> bool | None:
    """True (matched `sha256`), False (did not) or None (never checked as it is now)."""
    key = _key(path)
    if key is None:
        return None
    entry = _load().get(key[0])
    if not isinstance(entry, dict) or (entry.get("size"), entry.get("mtime_ns"), entry.get("sha256")) != (
            key[1], key[2], sha256):
        return None
    return bool(entry.get("ok"))


def record(path: Path, sha256: str, ok: bool) -> None:
    """Keep what checking `path` against `sha256` found (best effort: a verdict that
    cannot be written only means the file is hashed again next time)."""
    key = _key(path)
    if key is None:
        return
    data = _load()
    data[key[0]] = {"size": key[1], "mtime_ns": key[2], "sha256": sha256, "ok": ok}
    try:
        paths.ensure(_store().parent)
        write_atomic(_store(), json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass


def forget(path: Path) -> None:
    """Drop the verdict of a file localspec deleted."""
    data = _load()
    if data.pop(os.path.realpath(path), None) is not None:
        try:
            write_atomic(_store(), json.dumps(data, indent=1, sort_keys=True))
        except OSError:
            pass
