"""The memory of `run`, `chat` and `edit` on disk: earlier outputs in SQLite (WAL) in the
state dir, per vocabulary, bounded in tokens with the oldest dropped first; and
`--lookup PATH...` corpora, tokenized as static sources.

SQLite gives what the memory needs from a file: a write is a transaction (a process
killed mid-write leaves the last committed state, never half a text), and WAL lets
processes read while another writes (each write waits up to BUSY_MS for the lock).
The store never breaks a run: an unreadable or locked database means drafting without
memory (or without remembering), with one line on stderr.
"""

from __future__ import annotations

import hashlib
import sqlite3
import sys
import time
from contextlib import closing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from localspec.core.drafters.memory import Memory
from localspec.core.tuning import MEMORY_MAX_TOKENS
from localspec.models import paths

DB_NAME = "memory.db"
BUSY_MS = 5000
LOOKUP_FILE_MAX = 1 << 20  # bytes: a larger file in a --lookup corpus is skipped
LOOKUP_TOKENS_MAX = 1 << 22  # tokens of --lookup corpora in all
SKIP_DIRS = {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox", "build", "dist"}


def db_path() -> Path:
    return paths.state_dir() / DB_NAME


def connect(path: Path | str | None = None) -> sqlite3.Connection:
    """The memory database, created if need be (WAL, a busy timeout)."""
    path = Path(path) if path is not None else db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None)
    db.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
    db.execute("""CREATE TABLE IF NOT EXISTS texts (
        id INTEGER PRIMARY KEY AUTOINCREMENT, vocab TEXT NOT NULL, ts REAL NOT NULL,
        n INTEGER NOT NULL, tokens BLOB NOT NULL)""")
    db.execute("CREATE INDEX IF NOT EXISTS texts_vocab ON texts (vocab, id)")
    return db


def vocab_key(model_path: str | Path) -> str:
    """What a memory is kept by: the target's vocabulary (its GGUF digest), so texts
    written by one model draft for every model that shares its tokens."""
    try:
        from localspec.models.gguf_info import cached_info

        digest = cached_info(model_path).vocab_digest
        if digest:
            return hashlib.sha256("|".join(digest).encode()).hexdigest()[:16]
    except Exception:  # noqa: BLE001 - a header we cannot read: key by the file instead
        pass
    p = Path(model_path)
    return hashlib.sha256(f"{p.name}:{p.stat().st_size if p.exists() else 0}".encode()).hexdigest()[:16]


def append(db: sqlite3.Connection, vocab: str, tokens: Sequence[int], max_tokens: int) -> None:
    """Store one text and drop this vocabulary's oldest texts beyond max_tokens, in one
    transaction."""
    blob = np.asarray(tokens, dtype="<i4").tobytes()
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("INSERT INTO texts (vocab, ts, n, tokens) VALUES (?, ?, ?, ?)",
                   (vocab, time.time(), len(tokens), blob))
        cut = db.execute(
            "SELECT id FROM (SELECT id, SUM(n + 1) OVER (ORDER BY id DESC) AS acc FROM texts "
            "WHERE vocab = ?) WHERE acc > ? ORDER BY id DESC LIMIT 1", (vocab, max_tokens)).fetchone()
        if cut is not None:
            db.execute("DELETE FROM texts WHERE vocab = ? AND id <= ?", (vocab, cut[0]))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def load(db: sqlite3.Connection, vocab: str, max_tokens: int) -> list[np.ndarray]:
    """This vocabulary's newest texts within max_tokens, oldest first."""
    out, total = [], 0
    for n, blob in db.execute("SELECT n, tokens FROM texts WHERE vocab = ? ORDER BY id DESC", (vocab,)):
        if total + n + 1 > max_tokens:
            break
        if len(blob) == 4 * n:
            out.append(np.frombuffer(blob, dtype="<i4"))
            total += n + 1
    return out[::-1]


class StoredMemory(Memory):
    """A Memory whose added texts are also written to the database (best effort); with
    `defer`, only when commit() says so (edit: an answer that was not written is not
    remembered either)."""

    def __init__(self, vocab: str | Callable[[], str], max_tokens: int = MEMORY_MAX_TOKENS,
                 corpora: Sequence[Sequence[int]] = (), path: Path | str | None = None,
                 defer: bool = False) -> None:
        super().__init__(max_tokens, corpora)
        self._vocab = vocab  # a callable is asked once, when the database is first touched
        self.path, self.defer = Path(path) if path else db_path(), defer
        self.pending: list[list[int]] = []
        if not self.path.exists():
            return  # nothing remembered yet: the file is made by the first write
        try:
            with closing(connect(self.path)) as db:
                for text in load(db, self.vocab, max_tokens):
                    super().add(text)
        except sqlite3.Error as exc:
            _warn(f"memory: cannot read {self.path}: {exc}; drafting without it")

    @property
    def vocab(self) -> str:
        if callable(self._vocab):
            self._vocab = self._vocab()
        return self._vocab

    def add(self, text: Sequence[int]) -> None:
        super().add(text)
        if len(text):
            self.pending.append(list(text))
        if not self.defer:
            self.commit()

    def commit(self) -> None:
        """Write the texts added since the last commit."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        try:
            with closing(connect(self.path)) as db:
                for text in pending:
                    append(db, self.vocab, text, self.max_tokens)
        except sqlite3.Error as exc:
            _warn(f"memory: cannot write {self.path}: {exc}")

    def discard(self) -> None:
        """Forget the texts added since the last commit, on disk (this process keeps them)."""
        self.pending = []


def corpus_files(paths_given: Iterable[str]) -> list[Path]:
    """The files of --lookup: each file named, and the text files under each directory
    (hidden and build directories skipped), each at most LOOKUP_FILE_MAX bytes."""
    out: list[Path] = []
    for given in paths_given:
        p = Path(given)
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(p).parts
                if any(part in SKIP_DIRS or part.startswith(".") for part in rel[:-1]) or not f.is_file():
                    continue
                if f.stat().st_size <= LOOKUP_FILE_MAX:
                    out.append(f)
        elif p.is_file():
            out.append(p)
        else:
            from localspec.core.errors import UsageError

            raise UsageError(f"--lookup: no such file or directory: {given}")
    return out


def read_corpus(paths_given: Iterable[str], tokenize) -> list[list[int]]:
    """The --lookup corpora as token texts (binary files skipped), LOOKUP_TOKENS_MAX in all."""
    texts, total = [], 0
    for f in corpus_files(paths_given):
        try:
            raw = f.read_bytes()
            if b"\0" in raw[:8192]:
                continue
            tokens = tokenize(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(tokens) > LOOKUP_TOKENS_MAX:
            _warn(f"memory: --lookup stops at {total} tokens ({f} and later files left out)")
            break
        texts.append(tokens)
        total += len(tokens)
    return texts


def open_memory(target, *, enabled: bool = True, lookup: Sequence[str] = (),
                max_tokens: int = MEMORY_MAX_TOKENS, defer: bool = False) -> Memory | None:
    """The memory a command drafts from: the stored one of the target's vocabulary
    (unless `enabled` is off) and the --lookup corpora; None when neither. `defer`:
    what is added is written only on commit() (StoredMemory)."""
    corpora = read_corpus(lookup, lambda s: target.tokenize(s, False, False)) if lookup else []
    if not enabled:
        return Memory(max_tokens, corpora) if corpora else None
    return StoredMemory(lambda: vocab_key(target.path), max_tokens, corpora, defer=defer)


def _warn(message: str) -> None:
    print(f"localspec: {message}", file=sys.stderr)
