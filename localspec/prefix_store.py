"""The prefix cache (PrefixStore): KV states of prompt prefixes kept on disk, so a
prompt that starts with a prefix seen before (an edit of the same unchanged file)
prefills only the rest. (In-memory prefix reuse is backend.PrefixReuse's.)

An entry is one file, `<key>.kv` under `cache_dir()/prefix`, where the key hashes the
model's identity and the prefix tokens. It holds a magic, a JSON header, the tokens
and the state llama.cpp serialised for them:

    MAGIC | u32 header length | header JSON | int32 tokens | state bytes

The header names the model key, the token count, the state's size and a sha256 of
tokens + state. A restore checks all of it (and llama.cpp checks the state's shape) and
treats any difference as a miss: a wrong state would silently corrupt the output.
Entries are written atomically (files.write_atomic); a torn file could only fail the
checksum anyway. The total
size is capped (LOCALSPEC_PREFIX_CACHE_MB, default 1024; 0 turns the cache off); the
least recently used entries (by mtime, touched on every hit) go first.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localspec.core import backend
from localspec.core.backend import Model
from localspec.core.events import GenerationStats
from localspec.files import write_atomic
from localspec.models import paths

MAGIC = b"LSPREFX1"
FORMAT = 1
DEFAULT_CAP_MB = 1024
MIN_TOKENS = 128  # shorter prefixes prefill faster than a file round trip is worth
STALE_TMP_S = 3600.0  # temp files older than this were left by a crashed writer


def model_key(model: Model) -> str:
    """Who computed a state: the weights (a rewritten file misses, even if identical),
    the llama.cpp build, CPU or GPU layers (KV values computed on another backend differ
    slightly), the KV cache's shape."""
    from localspec.models.registry import file_identity

    ident = file_identity(model.path)
    parts = {"sha256": ident["sha256"], "size": ident["size"], "mtime": ident["mtime"],
             "llama_cpp": backend.llama_cpp_version(),
             "ggml": backend.ggml_build()["commit"], "n_gpu_layers": model.info.n_gpu_layers,
             "n_layer": model.n_layer, "format": FORMAT}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def default_cap() -> int:
    """The size cap in bytes from LOCALSPEC_PREFIX_CACHE_MB (a bad value: the default)."""
    try:
        mb = float(os.environ.get("LOCALSPEC_PREFIX_CACHE_MB", DEFAULT_CAP_MB))
    except ValueError:
        mb = DEFAULT_CAP_MB
    return max(0, int(mb * 2**20))


@dataclass(frozen=True)
class Hit:
    """A restored prefix: its length, and how long prefilling it took when stored."""

    n_tokens: int
    prefill_s: float | None


class PrefixStore:
    """Entries under `root` (default: cache_dir()/prefix), at most `cap` bytes in all."""

    def __init__(self, root: Path | None = None, cap: int | None = None,
                 min_tokens: int = MIN_TOKENS) -> None:
        self.root = root or paths.cache_dir() / "prefix"
        self.cap = default_cap() if cap is None else cap
        self.min_tokens = min_tokens
        self._keys: weakref.WeakKeyDictionary[Model, str] = weakref.WeakKeyDictionary()

    @property
    def enabled(self) -> bool:
        return self.cap > 0

    def _model_key(self, model: Model) -> str:
        if model not in self._keys:  # by the object: an id may be reused by another model
            self._keys[model] = model_key(model)
        return self._keys[model]

    def path_for(self, model: Model, tokens: Sequence[int]) -> Path:
        digest = hashlib.sha256(self._model_key(model).encode() + _tokens_bytes(tokens))
        return self.root / f"{digest.hexdigest()[:40]}.kv"

    # ----- reading ------------------------------------------------------------------

    def restore(self, model: Model, tokens: Sequence[int]) -> Hit | None:
        """Load the state of `tokens` into `model`'s sequence 0; None on a miss (no entry,
        another model, a corrupt or stale file: the model's sequence 0 may then have
        been emptied)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return None
        path = self.path_for(model, tokens)
        found = self._read(path, self._model_key(model), tokens)
        if found is None:
            return None
        data, header = found
        if model.load_state(data, tokens) == 0:
            _unlink(path)  # llama.cpp refused it: it will never load
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        prefill_s = header.get("prefill_s")
        return Hit(len(tokens), prefill_s if isinstance(prefill_s, (int, float)) else None)

    @staticmethod
    def _read(path: Path, key: str, tokens: Sequence[int]) -> tuple[bytearray, dict] | None:
        """The state bytes and the header, when every check passes; else None."""
        want = _tokens_bytes(tokens)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                (n_header,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(n_header))
                n_state = header["state_bytes"]
                if (header.get("model") != key or header.get("n_tokens") != len(tokens)
                        or size != len(MAGIC) + 4 + n_header + len(want) + n_state):
                    return None
                if f.read(len(want)) != want:
                    return None
                data = bytearray(n_state)
                if f.readinto(data) != n_state:
                    return None
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None
        if hashlib.sha256(want + data).hexdigest() != header.get("sha256"):
            return None
        return data, header

    # ----- writing ------------------------------------------------------------------

    def store(self, model: Model, tokens: Sequence[int], prefill_s: float | None = None) -> bool:
        """Save `model`'s sequence 0, which must hold exactly `tokens` (`prefill_s`: what
        computing them took, for reports); then evict down to the cap. False when not
        stored (off, too short, too big, or a write error)."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return False
        if list(model.cached) != list(tokens):
            raise ValueError("store(): the model's cache does not hold exactly these tokens")
        data = model.state_bytes()
        toks = _tokens_bytes(tokens)
        header = json.dumps({
            "model": self._model_key(model), "n_tokens": len(tokens), "state_bytes": len(data),
            "sha256": hashlib.sha256(toks + data).hexdigest(), "model_file": model.name,
            "prefill_s": prefill_s, "created": time.time(),
        }).encode()
        total = len(MAGIC) + 4 + len(header) + len(toks) + len(data)
        if total > self.cap:
            return False
        path = self.path_for(model, tokens)
        try:
            paths.ensure(self.root)
            write_atomic(path, b"".join([MAGIC, struct.pack("<I", len(header)), header, toks, data]))
        except OSError:
            return False
        self.evict(keep=path)
        return True

    def evict(self, keep: Path | None = None) -> None:
        """Delete the least recently used entries until the total fits the cap (never
        `keep`, the entry just written), and temp files a crashed writer left."""
        now = time.time()
        entries = []
        for p in self.root.glob("*"):
            try:
                st = p.stat()
            except OSError:
                continue
            if p.suffix == ".tmp":
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(p)
            elif p.suffix == ".kv":
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.cap:
                break
            if p != keep:
                _unlink(p)
                total -= size

    def entries(self) -> list[Path]:
        return sorted(self.root.glob("*.kv"))


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ----- using it: a prompt's prefix in the model's KV cache -----------------------------


@dataclass
class PrefixUse:
    """How a prompt's prefix got into the KV cache: `restored` tokens from the cache,
    or `decoded` tokens prefilled here (then `stored` says whether it was saved)."""

    restored: int = 0
    decoded: int = 0
    prefill_s: float = 0.0  # prefilling the decoded tokens
    cache_s: float = 0.0  # restoring, or storing
    stored: bool = False
    saved_s: float | None = None  # a hit: what prefilling the restored tokens took once

    def add_to(self, stats: GenerationStats) -> None:
        """Count the prefix in a generation's stats (generate() saw it as cached)."""
        stats.prefill_tokens += self.decoded
        stats.prefill_s += self.prefill_s
        stats.restored_tokens += self.restored
        stats.cache_s += self.cache_s
        stats.stored_tokens += self.decoded if self.stored else 0


def warm_prefix(model: Model, prefix: Sequence[int], cache: PrefixStore | None,
                should_stop: Callable[[], bool] | None = None) -> PrefixUse:
    """Make `model`'s sequence 0 hold exactly `prefix`: what it already holds is kept,
    else the cache restores it, else it is prefilled (in batches of its own, so a later
    restore yields exactly the KV values this cold run computed) and stored, unless
    `should_stop` says the user gave up meanwhile (Ctrl-C writes nothing)."""
    use = PrefixUse()
    if not prefix:
        return use
    if model.common_prefix(prefix) < len(prefix) and cache is not None:
        t0 = time.perf_counter()
        hit = cache.restore(model, prefix)
        use.cache_s = time.perf_counter() - t0
        if hit is not None:
            use.restored, use.saved_s = hit.n_tokens, hit.prefill_s
            return use
    keep = model.reuse_prefix(prefix)
    if keep == len(prefix):
        return use
    t0 = time.perf_counter()
    try:
        model.decode(prefix[keep:], logits=())
    except BaseException:  # Ctrl-C between llama_decode and the bookkeeping
        model.rewind(model.n_past, force=True)
        raise
    use.decoded = len(prefix) - keep
    use.prefill_s = time.perf_counter() - t0
    if cache is not None and not (should_stop and should_stop()):
        t1 = time.perf_counter()
        use.stored = cache.store(model, prefix, use.prefill_s if keep == 0 else None)
        use.cache_s += time.perf_counter() - t1
    return use


def restore_prefix(model: Model | None, prefix: Sequence[int], cache: PrefixStore | None) -> bool:
    """`model`'s state of `prefix` from the cache when it has it; nothing is prefilled on
    a miss (edit's draft model: an auto drafter may never ask it)."""
    return model is not None and cache is not None and cache.restore(model, prefix) is not None


def store_prefix(model: Model | None, prefix: Sequence[int], cache: PrefixStore | None) -> bool:
    """After a generation: keep `model`'s state of `prefix` when its cells still hold all
    of it (the cells past it are dropped: the model follows its context by prefix reuse,
    so that costs nothing)."""
    if model is None or cache is None or model.common_prefix(prefix) < len(prefix):
        return False
    model.rewind(len(prefix))
    return cache.store(model, prefix)
