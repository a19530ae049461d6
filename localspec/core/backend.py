"""The only module that imports llama_cpp.

Loads a GGUF (with GPU offload when the build has it, and the AMX workaround on CPUs
where llama.cpp's AMX path crashes), tokenizes, applies the chat template, decodes
batches asking logits only for the rows the caller needs (numpy views, no copies of
150k-float Python lists), and rewinds the KV cache.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import sys
import threading
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from localspec.core.config import ModelConfig
from localspec.core.errors import BackendError, ContextFull

try:
    import llama_cpp as _ll
except ImportError as exc:  # pragma: no cover - install problem, reported once
    raise BackendError(
        "llama-cpp-python is not installed; run: pip install 'llama-cpp-python>=0.3.36,<0.3.37'"
    ) from exc

_log_lock = threading.Lock()
_log_verbose = False
_log_capture: list[str] | None = None  # llama.cpp's messages while captured()


@_ll.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs hundreds of lines while loading: silent unless -v
    if _log_capture is not None and text:
        _log_capture.append(text.decode("utf-8", errors="replace"))
    if _log_verbose and text:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


@contextmanager
def captured() -> Iterator[list[str]]:
    """What llama.cpp says during a call, through its log or straight to stderr (its
    grammar parser fprintf()s): collected into the yielded list instead of the terminal,
    to become one line of an error. One caller at a time; fd 2 is borrowed meanwhile."""
    global _log_capture
    with _log_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        out: list[str] = []
        _log_capture = out
        try:
            yield out
        finally:
            _log_capture = None
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.insert(0, tmp.read().decode("utf-8", errors="replace"))


def set_verbose(verbose: bool) -> None:
    global _log_verbose
    _log_verbose = verbose


@cache
def _init_backend() -> None:
    _ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
    _ll.llama_backend_init()


@cache
def system_info() -> str:
    """llama.cpp's own feature string (CPU features, backends)."""
    _init_backend()
    return _ll.llama_print_system_info().decode("utf-8", errors="replace")


@cache
def has_amx() -> bool:
    """AMX present: llama.cpp's AMX matmul segfaults on multi-token batches (issue #20824).

    Either llama.cpp reports it (built in) or the CPU advertises it (a build that loads
    CPU variants at run time). LOCALSPEC_EXTRA_BUFTS=1 or 0 overrides the decision.
    """
    forced = os.environ.get("LOCALSPEC_EXTRA_BUFTS")
    if forced in ("0", "1"):
        return forced == "0"
    return "AMX_INT8 = 1" in system_info() or _cpu_flag("amx_int8")


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def supports_gpu_offload() -> bool:
    """A GPU (or integrated GPU) device is present to offload layers to. Not
    llama_supports_gpu_offload(): that is also true for a CPU build with RPC compiled in,
    where -ngl would then place every layer on devices that do not exist."""
    return any(d["type"] in ("gpu", "igpu") for d in devices())


# ----- ggml facts llama-cpp-python does not bind (0.3.36 binds no ggml_backend_*) -----
# read through libllama's handle: dlsym on it also finds the ggml libraries it links

_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type


def _ggml_fn(name: str, restype: object, *argtypes: object):
    _init_backend()
    f = getattr(_ll.llama_cpp._lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


def ggml_build() -> dict:
    """ggml's version and the llama.cpp commit it was built from."""
    out = {}
    for key in ("version", "commit"):
        try:
            out[key] = _ggml_fn(f"ggml_{key}", ctypes.c_char_p)().decode()
        except (AttributeError, OSError):
            out[key] = "unknown"
    return out


def devices() -> list[dict]:
    """Every ggml device: name, description, type (cpu/gpu/igpu/accel), backend, memory."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    get = _ggml_fn("ggml_backend_dev_get", vp, sz)
    name = _ggml_fn("ggml_backend_dev_name", ctypes.c_char_p, vp)
    desc = _ggml_fn("ggml_backend_dev_description", ctypes.c_char_p, vp)
    kind = _ggml_fn("ggml_backend_dev_type", ctypes.c_int, vp)
    memory = _ggml_fn("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))
    reg_of = _ggml_fn("ggml_backend_dev_backend_reg", vp, vp)
    reg_name = _ggml_fn("ggml_backend_reg_name", ctypes.c_char_p, vp)
    out = []
    for i in range(_ggml_fn("ggml_backend_dev_count", sz)()):
        dev = get(i)
        free, total = sz(0), sz(0)
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({
            "name": name(dev).decode(), "description": (desc(dev) or b"").decode(),
            "type": _DEV_TYPES.get(kind(dev), "unknown"), "backend": reg_name(reg_of(dev)).decode(),
            "memory_free": free.value, "memory_total": total.value,
        })
    return out


def backends() -> list[str]:
    """Registered ggml backends (CPU, CUDA, Metal, BLAS, RPC, ...)."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    get = _ggml_fn("ggml_backend_reg_get", vp, sz)
    name = _ggml_fn("ggml_backend_reg_name", ctypes.c_char_p, vp)
    return [name(get(i)).decode() for i in range(_ggml_fn("ggml_backend_reg_count", sz)())]


def llama_cpp_version() -> str:
    return getattr(_ll, "__version__", "unknown")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 4


@dataclass(frozen=True)
class LoadInfo:
    """What a loaded model ended up as, for `doctor` and the logs."""

    n_gpu_layers: int
    amx_workaround: bool
    n_threads: int


class Detokenizer:
    """Incremental token -> text: holds back bytes of a multi-byte UTF-8 character that
    is split across tokens, so streamed text never shows replacement characters."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self.decoder.decode(self.model.token_piece(token))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


class PrefixCache:
    """Prefix reuse for anything that keeps `cached` (what its KV cache holds) and has
    `rewind(n_past)` and `decode(tokens, "last")`: Model, and the tests' fake model, so
    the engine tests run this code rather than a copy of it."""

    cached: list[int]

    def common_prefix(self, tokens: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            n += 1
        return n

    def prefill(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
        """Make the cache hold exactly `tokens`, reusing the shared prefix.

        Returns (logits row after the last token, number of tokens actually decoded).
        The last token is always decoded so its logits exist.
        """
        keep = min(self.common_prefix(tokens), len(tokens) - 1)
        self.rewind(keep)
        return self.decode(tokens[keep:], "last")[0], len(tokens) - keep


class Model(PrefixCache):
    """One GGUF with its own context (KV cache) for sequence 0 (or n_seq_max sequences).

    `cached` mirrors what sequence 0's KV cache holds, so a new prompt that shares a
    prefix with it only prefills the rest.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        _init_backend()
        set_verbose(cfg.verbose or _log_verbose)
        self.cfg = cfg
        self.path = Path(cfg.path)
        self.name = self.path.name
        mparams = _ll.llama_model_default_params()
        n_gpu = cfg.n_gpu_layers
        if n_gpu < 0:
            n_gpu = 999 if supports_gpu_offload() else 0
        mparams.n_gpu_layers = n_gpu
        amx = has_amx()
        if amx:
            # extra buffer types = AMX repacking, the path that crashes on batches
            mparams.use_extra_bufts = False
        self._model = _ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise BackendError(f"llama.cpp could not load {self.path} (not a valid GGUF?)")
        self._vocab = _ll.llama_model_get_vocab(self._model)
        n_threads = cfg.n_threads or default_threads()
        cparams = _ll.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx
        cparams.n_batch = min(cfg.n_ctx, 512)
        cparams.n_ubatch = min(cfg.n_ctx, 512)
        cparams.n_seq_max = cfg.n_seq_max
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        self._ctx = _ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            _ll.llama_model_free(self._model)
            raise BackendError(f"llama.cpp could not create a context of {cfg.n_ctx} tokens")
        self._mem = _ll.llama_get_memory(self._ctx)
        self.n_ctx = _ll.llama_n_ctx(self._ctx)
        self.n_batch = _ll.llama_n_batch(self._ctx)
        self.n_vocab = _ll.llama_vocab_n_tokens(self._vocab)
        self._batch = _ll.llama_batch_init(self.n_batch, 0, max(1, cfg.n_seq_max))
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._nseq[:] = 1
        for i in range(self.n_batch):
            self._batch.seq_id[i][0] = 0
        self.info = LoadInfo(n_gpu_layers=n_gpu, amx_workaround=amx, n_threads=n_threads)
        self._seqs: dict[int, list[int]] = {0: []}
        self.cached: list[int] = self._seqs[0]  # sequence 0, used by decode()/prefill()
        self.llama_s = 0.0  # time spent inside llama_decode, for overhead accounting
        self._piece_buf = ctypes.create_string_buffer(256)

    # ----- vocabulary -------------------------------------------------------------

    @property
    def vocab_type(self) -> int:
        return int(_ll.llama_vocab_type(self._vocab))

    @property
    def llama_vocab(self) -> object:
        """llama.cpp's vocabulary handle (for core/grammar.py's grammar sampler)."""
        return self._vocab

    @property
    def bos(self) -> int:
        return int(_ll.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(_ll.llama_vocab_eos(self._vocab))

    @property
    def eot(self) -> int:
        return int(_ll.llama_vocab_eot(self._vocab))

    @property
    def size_bytes(self) -> int:
        return int(_ll.llama_model_size(self._model))

    @property
    def n_params(self) -> int:
        return int(_ll.llama_model_n_params(self._model))

    @property
    def n_layer(self) -> int:
        """Repeating layers (what -ngl counts)."""
        return int(_ll.llama_model_n_layer(self._model))

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        _ll.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        """The vocabulary's stored text for a token (for comparing vocabularies)."""
        raw = _ll.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (_ll.llama_token * n_max)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (_ll.llama_token * n_max)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def token_piece(self, token: int, special: bool = False) -> bytes:
        buf = self._piece_buf
        n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)

    # ----- chat template ----------------------------------------------------------

    def chat_template(self) -> str | None:
        raw = _ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the GGUF's template (llama.cpp's built-in renderers);
        ChatML when the model carries no template llama.cpp knows."""
        tmpl = _ll.llama_model_chat_template(self._model, None)
        enc = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (_ll.llama_chat_message * len(enc))(*[_ll.llama_chat_message(r, c) for r, c in enc])
        size = sum(len(r) + len(c) for r, c in enc) * 2 + 256
        n = -1
        if tmpl:
            buf = ctypes.create_string_buffer(size)
            n = _ll.llama_chat_apply_template(tmpl, arr, len(enc), add_generation_prompt, buf, size)
            if n > size:
                buf = ctypes.create_string_buffer(n)
                n = _ll.llama_chat_apply_template(tmpl, arr, len(enc), add_generation_prompt, buf, n)
        if n < 0:
            return _chatml(messages, add_generation_prompt)
        return buf.raw[:n].decode("utf-8", errors="replace")

    # ----- decoding: one KV record per sequence --------------------------------------
    # _seqs[seq] records the tokens sequence seq's cells hold (sequence 0, `cached`, is the
    # one decode() and prefill() use by default; the server gives each request its own).
    # Every decode either extends the records of the sequences it wrote or leaves their
    # cells as recorded: a failed or interrupted llama_decode (Ctrl-C is raised as soon as
    # the C call returns) may have written cells, and they are dropped before it raises.

    @property
    def n_past(self) -> int:
        return len(self.cached)

    @property
    def n_ctx_seq(self) -> int:
        """Context available to one sequence (n_ctx is split across n_seq_max)."""
        return int(_ll.llama_n_ctx_seq(self._ctx))

    def seq_tokens(self, seq: int = 0) -> list[int]:
        """What sequence `seq`'s KV cells hold (sequence 0 is `cached`)."""
        return self._seqs.setdefault(seq, [])

    def kv_len(self, seq: int = 0) -> int:
        """Positions llama.cpp's KV cache holds for `seq` (its own count, not the record
        kept here: for checking that the two agree)."""
        return int(_ll.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def decode(self, tokens: Sequence[int], logits: str | Sequence[int] = "last", *,
               seq: int = 0) -> np.ndarray:
        """Append `tokens` to sequence `seq` at its n_past and return logits rows.

        logits: "last", "all", or row indices into `tokens`. The result is a
        (rows, n_vocab) float32 view into llama.cpp's buffer, valid until the next
        decode. Long inputs are split into n_batch chunks; only the last chunk's rows
        can be requested.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        self._check_room(seq, n)
        start = 0
        while n - start > self.n_batch:
            self._decode_batch([(seq, tokens[start : start + self.n_batch], ())])
            start += self.n_batch
        chunk = tokens[start:]
        if isinstance(logits, str):
            rows = [len(chunk) - 1] if logits == "last" else list(range(len(chunk)))
        else:
            rows = [r - start for r in logits]
            if rows and min(rows) < 0:
                raise ValueError("logits rows must lie in the last n_batch tokens")
        return self._decode_batch([(seq, chunk, rows)])

    def decode_multi(self, entries: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """One decode for several sequences: entries are (seq_id, tokens, n_logit_rows),
        each appended at its sequence's own position; logits are returned for the last
        n_logit_rows tokens of each entry (views valid until the next decode)."""
        rows = self._decode_batch([(seq, toks, range(len(toks) - n_rows, len(toks)))
                                   for seq, toks, n_rows in entries])
        out, row = [], 0
        for _, _, n_rows in entries:
            out.append(rows[row : row + n_rows])
            row += n_rows
        return out

    def _check_room(self, seq: int, n: int) -> None:
        need = len(self.seq_tokens(seq)) + n
        if need > self.n_ctx_seq:
            raise ContextFull(f"context full: {need} tokens needed, context is {self.n_ctx_seq} (raise -c)")

    def _decode_batch(self, entries: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> np.ndarray:
        """ONE llama_decode. Entries (seq, tokens, rows), one per sequence, append tokens
        at that sequence's next positions and ask logits for `rows` (indices into tokens).
        Returns the requested rows, entry after entry."""
        n = sum(len(toks) for _, toks, _ in entries)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"a batch needs 1..{self.n_batch} tokens, got {n}")
        for seq, toks, _ in entries:  # every check before the first row is written
            self._check_room(seq, len(toks))
        i = 0
        for seq, toks, rows in entries:
            m, base = len(toks), len(self.seq_tokens(seq))
            self._tok[i : i + m] = toks
            self._pos[i : i + m] = np.arange(base, base + m)
            self._out[i : i + m] = 0
            self._out[i + np.asarray(rows, dtype=np.intp)] = 1
            for j in range(i, i + m):  # every row names its sequence: nothing carries over
                self._batch.seq_id[j][0] = seq
            i += m
        self._batch.n_tokens = n
        rc, recorded = -1, False
        t0 = time.perf_counter()
        try:
            rc = _ll.llama_decode(self._ctx, self._batch)
            if rc == 0:
                for seq, toks, _ in entries:
                    self.seq_tokens(seq).extend(toks)
                recorded = True
        finally:
            self.llama_s += time.perf_counter() - t0
            if not recorded:  # failed or interrupted: drop the cells it may have written
                for seq, _, _ in entries:
                    _ll.llama_memory_seq_rm(self._mem, seq, len(self.seq_tokens(seq)), -1)
        if rc == 1:
            raise ContextFull(f"context full: no KV slot for a batch of {n} tokens (raise -c)")
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc}")
        n_rows = sum(len(rows) for _, _, rows in entries)
        if not n_rows:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.ctypeslib.as_array(_ll.llama_get_logits(self._ctx), shape=(n_rows, self.n_vocab))

    def rewind(self, n_past: int, force: bool = False, *, seq: int = 0) -> None:
        """Forget sequence `seq`'s tokens from position n_past on (rejected drafts, an
        edited turn; 0 frees a server slot). `force` clears the cells even when the record
        says there are none."""
        record = self.seq_tokens(seq)
        if n_past < len(record) or force:
            _ll.llama_memory_seq_rm(self._mem, seq, n_past, -1)
            del record[n_past:]


    def close(self) -> None:
        if getattr(self, "_ctx", None):
            _ll.llama_batch_free(self._batch)
            _ll.llama_free(self._ctx)
            _ll.llama_model_free(self._model)
            self._ctx = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _chatml(messages: Sequence[dict], add_generation_prompt: bool) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")
