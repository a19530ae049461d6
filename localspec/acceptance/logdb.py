"""The acceptance log: one SQLite row per generation, in `state_dir()/logs.db`.

Schema changes are numbered migrations recorded in a `_migrations` table (as simonw/llm
and sqlite-utils do): append a new `mNNN_...` function, never edit an applied one.
The database runs in WAL mode with a busy timeout, so several localspec processes can
append at once and none loses its record (each insert is one short transaction; a
writer that finds the lock taken waits for it instead of failing).

Writing is best effort: a locked, read-only or corrupt database (or a full disk) prints
ONE warning line on stderr per process and returns. Logging never breaks a generation.
Only numbers and model identities are stored, never prompt or output text.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import time
from collections.abc import Callable
from contextlib import closing, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localspec import __version__, models
from localspec.core.config import SamplingConfig, SpecConfig
from localspec.models import paths

if TYPE_CHECKING:
    from localspec.core.engine import GenerationStats

DB_NAME = "logs.db"
BUSY_TIMEOUT_MS = 15000  # a writer waits this long for another process's transaction
NO_LOG_ENV = "LOCALSPEC_NO_LOG"

_warned: set[str] = set()  # db paths already warned about in this process
_identities: dict[tuple[str, int, float], dict] = {}  # (path, size, mtime) -> identity


def db_path() -> Path:
    """Where the log lives: LOCALSPEC_HOME/logs.db, else the XDG state dir."""
    return paths.state_dir() / DB_NAME


def logging_disabled() -> bool:
    """True when LOCALSPEC_NO_LOG is set to a true value (1, true, yes, on)."""
    return os.environ.get(NO_LOG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ----- migrations -------------------------------------------------------------------

MIGRATIONS: list[tuple[str, Callable[[sqlite3.Connection], None]]] = []


def _migration(fn: Callable[[sqlite3.Connection], None]) -> Callable[[sqlite3.Connection], None]:
    MIGRATIONS.append((fn.__name__, fn))
    return fn


@_migration
def m001_generations(db: sqlite3.Connection) -> None:
    # acceptance and mean_accepted are NULL when nothing was drafted (undefined, not 0)
    db.execute("""
        CREATE TABLE generations (
            id INTEGER PRIMARY KEY,
            ts REAL NOT NULL,
            datetime_utc TEXT NOT NULL,
            command TEXT NOT NULL,
            version TEXT,
            target_name TEXT NOT NULL, target_file TEXT, target_size INTEGER,
            target_sha256 TEXT, target_identity TEXT, target_mtime REAL,
            draft_name TEXT, draft_file TEXT, draft_size INTEGER,
            draft_sha256 TEXT, draft_identity TEXT, draft_mtime REAL,
            drafter TEXT NOT NULL,
            spec_mode TEXT, draft_min INTEGER, draft_max INTEGER, adaptive INTEGER,
            temperature REAL, top_k INTEGER, top_p REAL, min_p REAL, seed INTEGER,
            prompt_tokens INTEGER, generated INTEGER, rounds INTEGER, draft_rounds INTEGER,
            drafted INTEGER, accepted INTEGER, acceptance REAL, mean_accepted REAL,
            acceptance_by_pos TEXT, tokens_per_s REAL, decode_s REAL, prefill_s REAL,
            stop_reason TEXT,
            tag TEXT NOT NULL, tag_source TEXT NOT NULL,
            stats_json TEXT
        )""")
    db.execute("CREATE INDEX generations_ts ON generations (ts)")
    db.execute("CREATE INDEX generations_group "
               "ON generations (target_name, draft_name, drafter, tag, ts)")


def _pending(db: sqlite3.Connection) -> list[str]:
    names = [name for name, _ in MIGRATIONS]
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = '_migrations'").fetchone():
        return names
    done = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    return [n for n in names if n not in done]


def migrate(db: sqlite3.Connection) -> None:
    """Apply the migrations not yet recorded. BEGIN IMMEDIATE makes concurrent first
    opens take turns: the second one re-reads `_migrations` and finds nothing to do."""
    if not _pending(db):
        return  # the common case: no write lock taken
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS _migrations "
                   "(name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
        todo = set(_pending(db))
        for name, fn in MIGRATIONS:
            if name in todo:
                fn(db)
                db.execute("INSERT INTO _migrations VALUES (?, ?)", (name, _utc_iso(time.time())))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def connect(path: Path | str | None = None) -> sqlite3.Connection:
    """Open (creating if needed) the log in WAL mode, migrated to the current schema.
    Autocommit connection: each statement is its own short transaction."""
    path = Path(path) if path is not None else db_path()
    paths.ensure(path.parent)
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_MS)}")
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode = WAL")  # persistent: set once per file
            db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: no corruption, fewer fsyncs
            migrate(db)
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            # switching a new file to WAL while other processes open it can be refused at
            # once ("database is locked": SQLite does not wait where waiting could
            # deadlock): try again, within the same timeout
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.02, 0.05))  # apart from the others retrying
        except BaseException:
            db.close()
            raise


# ----- writing ----------------------------------------------------------------------


def log_generation(command: str, stats: GenerationStats, *, enabled: bool = True, **record: Any) -> None:
    """Append one generation to the acceptance log; `record` is build_record's keyword
    arguments (target, draft, spec, sampling, tag, prompt_text, output_text). Never raises
    (except Ctrl-C): a failure prints one warning line on stderr. `tag` None: classified
    from the text. Nothing is written when `enabled` is False or LOCALSPEC_NO_LOG=1."""
    if not enabled or logging_disabled():
        return
    path = db_path()
    try:
        insert(build_record(command, stats, **record), path)
    except Exception as exc:  # noqa: BLE001 - logging must not break generation
        _warn(path, exc)


def build_record(
    command: str,
    stats: GenerationStats,
    *,
    target: Path | str,
    draft: Path | str | None,
    spec: SpecConfig,
    sampling: SamplingConfig,
    tag: str | None = None,
    prompt_text: str = "",
    output_text: str = "",
    now: float | None = None,
) -> dict:
    """The row for one generation (column -> value), without touching the database."""
    from localspec.acceptance import classify

    now = time.time() if now is None else now
    if tag and tag.strip():
        tag, tag_source = tag.strip().lower(), "user"
    else:
        tag, tag_source = classify.classify(prompt_text, output_text, command), "auto"
    stats_dict = stats.to_dict()
    row = {
        "ts": now, "datetime_utc": _utc_iso(now), "command": command, "version": __version__,
        **_prefixed("target", model_identity(target)),
        **_prefixed("draft", model_identity(draft) if draft else {}),
        "drafter": stats.drafter,
        "spec_mode": spec.mode, "draft_min": spec.draft_min, "draft_max": spec.draft_max,
        "adaptive": int(spec.adapts_k),
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
        "min_p": sampling.min_p, "seed": sampling.seed,
        "prompt_tokens": stats.prompt_tokens, "generated": stats.generated,
        "rounds": stats.rounds, "draft_rounds": stats.draft_rounds,
        "drafted": stats.drafted, "accepted": stats.accepted,
        "acceptance": stats.acceptance if stats.drafted else None,
        "mean_accepted": stats.mean_accepted if stats.draft_rounds else None,
        "acceptance_by_pos": json.dumps([round(a, 4) for a in stats.acceptance_by_pos()]),
        "tokens_per_s": stats.tokens_per_s, "decode_s": stats.decode_s,
        "prefill_s": stats.prefill_s, "stop_reason": stats.stop_reason,
        "tag": tag, "tag_source": tag_source, "stats_json": json.dumps(stats_dict),
    }  # fmt: skip
    return row


def insert(row: dict, path: Path | str | None = None) -> None:
    """Insert one row (raises on failure; log_generation is the forgiving wrapper)."""
    insert_many([row], path)


def insert_many(rows: list[dict], path: Path | str | None = None) -> None:
    """Insert rows with the same columns in one transaction (imports, synthetic data)."""
    if not rows:
        return
    cols = list(rows[0])
    sql = f"INSERT INTO generations ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    with closing(connect(path)) as db:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(sql, [[row[c] for c in cols] for row in rows])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


def model_identity(path: Path | str) -> dict:
    """name, file, size, sha256, identity kind and mtime of a model file. Uses
    models.file_identity (manifest sha256 or a quick hash), else name + size + mtime
    when that fails; a path that is not a file gives its name only."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return {"name": _display_name(p.name, None), "file": p.name}
    key = (str(p.resolve()), st.st_size, st.st_mtime)
    if key not in _identities:
        ident = {"name": _display_name(p.name, None), "file": p.name, "size": st.st_size,
                 "sha256": None, "identity": "stat", "mtime": st.st_mtime}  # fmt: skip
        with suppress(Exception):  # unreadable, odd manifest: keep the stat identity
            full = models.file_identity(p)
            ident |= {"name": _display_name(p.name, full.get("manifest_name")),
                      "sha256": full.get("sha256"),
                      "identity": full.get("sha256_kind") or "quick"}  # fmt: skip
        _identities[key] = ident
    return dict(_identities[key])


def _display_name(filename: str, manifest_name: str | None) -> str:
    if manifest_name:
        return manifest_name
    return filename[: -len(".gguf")] if filename.lower().endswith(".gguf") else filename


def _prefixed(prefix: str, ident: dict) -> dict:
    keys = ("name", "file", "size", "sha256", "identity", "mtime")
    return {f"{prefix}_{k}": ident.get(k) for k in keys}


def _utc_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def _warn(path: Path, exc: Exception) -> None:
    if str(path) in _warned:
        return
    _warned.add(str(path))
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    with suppress(Exception):  # stderr itself may be gone (a closed pipe)
        print(f"localspec: warning: acceptance log not written ({reason}): {path} "
              f"(set {NO_LOG_ENV}=1 to turn logging off)", file=sys.stderr, flush=True)


# ----- reading ----------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One logged generation, as `stats` and `drift` read it."""

    id: int
    ts: float
    command: str
    target: str
    draft: str | None
    drafter: str
    tag: str
    generated: int
    drafted: int
    accepted: int
    acceptance: float | None
    mean_accepted: float | None
    tokens_per_s: float
    decode_s: float

    @property
    def key(self) -> tuple[str, str | None, str, str]:
        """The group stats and drift aggregate over: (target, draft, drafter, tag)."""
        return (self.target, self.draft, self.drafter, self.tag)


_READ_COLS = ("id", "ts", "command", "target_name", "draft_name", "drafter", "tag",
              "generated", "drafted", "accepted", "acceptance", "mean_accepted",
              "tokens_per_s", "decode_s")  # fmt: skip


def read_records(since: float | None = None, path: Path | str | None = None) -> list[Record]:
    """Logged generations in time order, optionally only those at or after `since`
    (unix time). A missing database reads as empty and is not created."""
    path = Path(path) if path is not None else db_path()
    if not path.exists():
        return []
    sql = f"SELECT {', '.join(_READ_COLS)} FROM generations"
    args: tuple = ()
    if since is not None:
        sql, args = sql + " WHERE ts >= ?", (since,)
    with closing(connect(path)) as db:
        rows = db.execute(sql + " ORDER BY ts, id", args).fetchall()
    # NULL counts and speeds (not acceptance: NULL there means "nothing drafted") read as 0
    return [Record(*r[:7], *(x or 0 for x in r[7:10]), r[10], r[11], r[12] or 0.0, r[13] or 0.0)
            for r in rows]


def tokens_by_source(since: float | None = None, path: Path | str | None = None) -> dict[str, list[int]]:
    """{draft source (ngram, memory, model): [tokens drafted, tokens accepted]} over the
    logged generations since `since`, from each one's stats (runs logged before the
    counts existed add nothing)."""
    path = Path(path) if path is not None else db_path()
    if not path.exists():
        return {}
    sql, args = "SELECT stats_json FROM generations", ()
    if since is not None:
        sql, args = sql + " WHERE ts >= ?", (since,)
    out: dict[str, list[int]] = {}
    with closing(connect(path)) as db:
        for (raw,) in db.execute(sql, args):
            try:
                rows = json.loads(raw or "{}").get("by_source") or {}
                for source, (drafted, accepted) in rows.items():
                    total = out.setdefault(str(source), [0, 0])
                    total[0] += int(drafted)
                    total[1] += int(accepted)
            except (ValueError, TypeError, AttributeError):
                continue  # a row written by another version: skipped
    return dict(sorted(out.items()))
