"""Records of the running `localspec serve` processes, for `localspec ps`.

A server writes one JSON file in the state dir's `servers/` once it listens (its
address, pid, model, slots) and removes it when it stops. A server killed without
its cleanup leaves its file behind: readers drop files whose pid is no longer
alive, and remove them. What a server is doing now is its own /health."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from localspec.files import write_atomic
from localspec.models.paths import state_dir


@dataclass(frozen=True)
class ServerRecord:
    pid: int
    host: str
    port: int
    model: str  # the id /v1/models reports
    model_path: str
    slots: int
    n_ctx_seq: int
    draft: str | None
    started: float  # unix time

    @property
    def url(self) -> str:
        """Where this machine reaches the server: a wildcard bind is reached on loopback."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"


def records_dir() -> Path:
    return state_dir() / "servers"


def register(record: ServerRecord) -> Path:
    """Write this server's record (atomically); returns its path for unregister()."""
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record.pid}-{record.port}.json"
    write_atomic(path, json.dumps(asdict(record), indent=2) + "\n")
    return path


def unregister(path: Path) -> None:
    path.unlink(missing_ok=True)


def running() -> list[ServerRecord]:
    """The recorded servers whose process is alive, oldest first. Records of dead
    processes, and unreadable ones, are removed."""
    folder = records_dir()
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = ServerRecord(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)  # a torn or foreign file: nothing to show
            continue
        if not pid_alive(record.pid):
            path.unlink(missing_ok=True)
            continue
        out.append(record)
    return sorted(out, key=lambda r: r.started)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0 checks without sending)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def health(record: ServerRecord, timeout: float = 2.0) -> dict | None:
    """The server's /health body (also a draining server's 503 body), or None when it
    does not answer in time."""
    request = urllib.request.Request(record.url + "/health", headers={"Accept": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def uptime(record: ServerRecord, now: float | None = None) -> float:
    return max(0.0, (time.time() if now is None else now) - record.started)
