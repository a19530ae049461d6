"""GGUF files other tools already downloaded: the Hugging Face hub cache, llama.cpp's
cache, LM Studio's models folder and Ollama's blob store. Read-only: nothing here
writes, moves or deletes anything in another tool's store.

Each file gets a name `-m` accepts:
    hub        org/repo:file.gguf              models--org--repo/snapshots/<rev>/file.gguf
    llama.cpp  llama.cpp:file.gguf              LLAMA_CACHE or ~/.cache/llama.cpp (flat), or
                                               a hub-cache layout there (llama.cpp >= 2025)
    lmstudio   lmstudio:publisher/repo/file.gguf   ~/.lmstudio/models (or ~/.cache/lm-studio/models)
    ollama     ollama:name:tag                  manifests/<host>/<namespace>/<name>/<tag> JSON
                                               naming the model layer's blobs/sha256-<hex>
A split model (NAME-00001-of-00003.gguf) is one entry: its first part, which llama.cpp
loads the others from. A broken manifest or a dangling link is skipped with a warning.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from localspec.models.gguf_info import SPLIT_NAME, split_parts

SOURCES = ("hub", "llama.cpp", "lmstudio", "ollama")
PREFIXES = {"hf": "hub", "llama.cpp": "llama.cpp", "lmstudio": "lmstudio", "ollama": "ollama"}
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
_DIGEST = re.compile(r"^sha256[:-](?P<hex>[0-9a-fA-F]{64})$")
_warned: set[str] = set()


@dataclass(frozen=True)
class Found:
    """One model file in another tool's store."""

    name: str  # what -m accepts
    path: Path  # what llama.cpp opens (the first part of a split model)
    source: str  # hub | llama.cpp | lmstudio | ollama
    size: int  # bytes, all parts
    parts: int = 1


def warn(message: str) -> None:
    """One line on stderr, once per process: discovery never fails a command."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr)


# --- where each tool keeps its files ---------------------------------------------------


def hub_dir() -> Path:
    from localspec.models.hub import hub_cache_dir

    return hub_cache_dir()


def llama_cpp_dir() -> Path:
    """LLAMA_CACHE, else llama.cpp's platform cache dir (fs_get_cache_directory)."""
    if os.environ.get("LLAMA_CACHE"):
        return Path(os.environ["LLAMA_CACHE"]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "llama.cpp"
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home()) / "llama.cpp"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp"


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models dirs: the home named by ~/.lmstudio-home-pointer, ~/.lmstudio,
    and the pre-0.3 ~/.cache/lm-studio."""
    home = Path.home()
    dirs = []
    try:
        pointed = (home / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip()
        if pointed:
            dirs.append(Path(pointed).expanduser() / "models")
    except OSError:
        pass
    dirs += [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    return _unique(dirs)


def ollama_dirs() -> list[Path]:
    """OLLAMA_MODELS, else ~/.ollama/models (and the Linux service's store)."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    dirs = [Path.home() / ".ollama" / "models"]
    if sys.platform.startswith("linux"):
        dirs.append(Path("/usr/share/ollama/.ollama/models"))
    return _unique(dirs)


def _unique(dirs: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


# --- discovery ---------------------------------------------------------------------------


def discover(sources: Iterable[str] = SOURCES) -> list[Found]:
    """Every GGUF model in the other tools' stores, each file once."""
    scans = {
        "hub": lambda: scan_hub(hub_dir(), "hub"),
        "llama.cpp": lambda: [*scan_flat(llama_cpp_dir(), "llama.cpp", depth=1),
                              *scan_hub(llama_cpp_dir(), "llama.cpp")],
        "lmstudio": lambda: [f for d in lmstudio_dirs() for f in scan_flat(d, "lmstudio", depth=3)],
        "ollama": lambda: [f for d in ollama_dirs() for f in scan_ollama(d)],
    }  # fmt: skip
    found, seen = [], set()
    for source in sources:
        for item in scans[source]():
            key = os.path.realpath(item.path)
            if key not in seen:
                seen.add(key)
                found.append(item)
    return found


def scan_hub(root: Path, source: str) -> list[Found]:
    """models--org--repo/snapshots/<rev>/**.gguf (links into blobs/); the revision
    refs/main names comes first, so its files keep the plain names."""
    files: list[tuple[str, Path]] = []
    for repo_dir in _subdirs(root, "models--*"):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/")
        named: set[str] = set()
        for snapshot in _snapshots(repo_dir):
            for path in sorted(snapshot.rglob("*.gguf")):
                rel = path.relative_to(snapshot).as_posix()
                if rel not in named:
                    named.add(rel)
                    files.append((f"{repo}:{rel}", path))
    return list(fold(files, source))


def _snapshots(repo_dir: Path) -> list[Path]:
    snapshots = _subdirs(repo_dir / "snapshots", "*")
    try:
        main = (repo_dir / "refs" / "main").read_text().strip()
    except OSError:
        return snapshots
    return sorted(snapshots, key=lambda p: p.name != main)


def scan_flat(root: Path, source: str, *, depth: int) -> list[Found]:
    """*.gguf files `depth` levels down (LM Studio: publisher/repo/file; llama.cpp: file)."""
    if not root.is_dir():
        return []
    files = [(f"{source}:{p.relative_to(root).as_posix()}", p)
             for p in sorted(root.glob("/".join(["*"] * (depth - 1) + ["*.gguf"])))]  # fmt: skip
    return list(fold(files, source))


def scan_ollama(root: Path) -> list[Found]:
    """manifests/<host>/<namespace>/<name>/<tag>: the model layer's blob, if it is a GGUF."""
    found = []
    for manifest in sorted(p for p in root.glob("manifests/*/*/*/*") if p.is_file()):
        host, namespace, name, tag = manifest.relative_to(root / "manifests").parts
        blob = _ollama_blob(root, manifest)
        if blob is None or not _is_gguf(blob):
            continue  # warned, or a layer in a format llama.cpp does not load
        found.append(Found(ollama_name(host, namespace, name, tag), blob, "ollama", blob.stat().st_size))
    return found


def _ollama_blob(root: Path, manifest: Path) -> Path | None:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except StopIteration:
        return None  # not a language model (no model layer)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warn(f"skipped Ollama manifest {manifest}: unreadable ({type(exc).__name__}: {exc})")
        return None
    match = _DIGEST.match(str(digest))
    if match is None:
        warn(f"skipped Ollama manifest {manifest}: bad digest {digest!r}")
        return None
    blob = root / "blobs" / f"sha256-{match['hex'].lower()}"
    if not blob.is_file():
        warn(f"skipped Ollama manifest {manifest}: its blob {blob.name} is missing")
        return None
    return blob


def ollama_name(host: str, namespace: str, name: str, tag: str) -> str:
    """ollama:qwen2.5-coder:1.5b for the library; ollama:user/name:tag; ollama:host/ns/name:tag."""
    if host == OLLAMA_REGISTRY:
        prefix = "" if namespace == OLLAMA_NAMESPACE else f"{namespace}/"
    else:
        prefix = f"{host}/{namespace}/"
    return f"ollama:{prefix}{name}:{tag}"


def normalize(spec: str) -> str:
    """A spec in the form discover() names it: ollama's default tag and library prefix."""
    prefix, _, rest = spec.partition(":")
    if prefix.lower() != "ollama" or not rest:
        return spec
    for lead in (f"{OLLAMA_REGISTRY}/{OLLAMA_NAMESPACE}/", f"{OLLAMA_REGISTRY}/", f"{OLLAMA_NAMESPACE}/"):
        rest = rest.removeprefix(lead)
    if ":" not in rest.rsplit("/", 1)[-1]:
        rest += ":latest"
    return f"ollama:{rest}"


# --- helpers -------------------------------------------------------------------------------


def _subdirs(root: Path, pattern: str) -> list[Path]:
    try:
        return sorted(p for p in root.glob(pattern) if p.is_dir())
    except OSError:
        return []


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def fold(files: list[tuple[str, Path]], source: str) -> Iterator[Found]:
    """(name, path) -> Found: dangling links warned and dropped, split parts folded into
    their first part (or dropped with a warning when a part is missing)."""
    for name, path in files:
        if not path.exists():
            warn(f"skipped {path}: a dangling link (its target is gone)")
            continue
        match = SPLIT_NAME.match(path.name)
        if match is None:
            yield Found(name, path, source, path.stat().st_size)
            continue
        if int(match["no"]) != 1:
            continue  # counted with the first part
        parts = split_parts(path) or [path]
        missing = [p.name for p in parts if not p.exists()]
        if missing:
            warn(f"skipped {path}: split model without {', '.join(missing[:3])}")
            continue
        yield Found(name, path, source, sum(p.stat().st_size for p in parts), len(parts))
