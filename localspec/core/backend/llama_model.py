"""Models on llama.cpp: one GGUF with its context and KV sequences.

Loads a GGUF (layers placed by placement.py: GPU offload when the build has it, RPC
workers when given --rpc; the AMX workaround on CPUs where llama.cpp's AMX path crashes),
tokenizes, applies the chat template, decodes batches asking logits only for the rows the
caller needs (numpy views, no copies of 150k-float Python lists), and rewinds the KV cache.
"""

from __future__ import annotations

import codecs
import ctypes
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from localspec.core.backend.ggml import (
    Owned,
    _ll,  # llama_cpp, imported there with a one-line error when it is missing
    default_threads,
    has_amx,
    init_backend,
    is_verbose,
    set_verbose,
)
from localspec.core.backend.placement import LoadInfo, placement
from localspec.core.backend.prefix import PrefixReuse
from localspec.core.backend.ubatch import ubatches
from localspec.core.config import ModelConfig
from localspec.core.errors import BackendError, ContextFull
from localspec.core.tuning import N_BATCH


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


class Model(PrefixReuse, Owned):
    """One GGUF with its own context (KV cache) for sequence 0 (or n_seq_max sequences).

    `cached` mirrors what sequence 0's KV cache holds, so a new prompt that shares a
    prefix with it only prefills the rest.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        init_backend()
        set_verbose(cfg.verbose or is_verbose())
        self.cfg = cfg
        self.path = Path(cfg.path)
        self.name = self.path.name
        mparams = _ll.llama_model_default_params()
        n_gpu, offload, keep_alive = placement(cfg, mparams)
        amx = has_amx()
        if amx:
            # extra buffer types = AMX repacking, the path that crashes on batches
            mparams.use_extra_bufts = False
        self._model = _ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise BackendError(f"llama.cpp could not load {self.path} (not a valid GGUF?)")
        del keep_alive  # the device list and split are read during the load only
        self._vocab = _ll.llama_model_get_vocab(self._model)
        n_threads = cfg.n_threads or default_threads()
        self.flash_attn = cfg.flash_attn
        try:
            self._ctx = self._new_context(n_threads)
        except BackendError:
            _ll.llama_model_free(self._model)
            raise
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
        self.info = LoadInfo(n_gpu_layers=n_gpu, amx_workaround=amx, n_threads=n_threads,
                             offload=offload, rpc=cfg.rpc)
        self._seqs: dict[int, list[int]] = {0: []}
        self.cached: list[int] = self._seqs[0]  # sequence 0, used by decode()/prefill()
        self.llama_s = 0.0  # time spent inside llama_decode, for overhead accounting
        self._piece = threading.local()  # a buffer per thread: the server's threads all read pieces

    def _new_context(self, n_threads: int) -> object:
        cparams = _ll.llama_context_default_params()
        cparams.n_ctx = self.cfg.n_ctx
        cparams.n_batch = min(self.cfg.n_ctx, N_BATCH)
        cparams.n_ubatch = min(self.cfg.n_ctx, N_BATCH)
        cparams.n_seq_max = self.cfg.n_seq_max
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        cparams.flash_attn_type = {"on": _ll.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": _ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                                   "auto": _ll.LLAMA_FLASH_ATTN_TYPE_AUTO}[self.flash_attn]
        ctx = _ll.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise BackendError(f"llama.cpp could not create a context of {self.cfg.n_ctx} tokens")
        return ctx

    def set_flash_attn(self, mode: str) -> None:
        """Use flash attention ("on"), not ("off"), or let llama.cpp choose ("auto"):
        a new context (the KV layout differs), so only while no sequence holds tokens.
        Which is faster depends on the model, the machine and the context length
        (`localspec tune` measures it)."""
        if mode == self.flash_attn:
            return
        if any(self._seqs.values()):
            raise ValueError("set_flash_attn needs an empty context")
        _ll.llama_free(self._ctx)
        self._ctx = None
        self.flash_attn = mode
        try:
            self._ctx = self._new_context(self.info.n_threads)
        except BackendError:  # the model is unusable now: free what close() would have
            _ll.llama_batch_free(self._batch)
            _ll.llama_model_free(self._model)
            raise
        self._mem = _ll.llama_get_memory(self._ctx)

    # ----- vocabulary -------------------------------------------------------------

    @property
    def vocab_type(self) -> int:
        return int(_ll.llama_vocab_type(self._vocab))

    @property
    def llama_vocab(self) -> object:
        """llama.cpp's vocabulary handle (for grammar.py's grammar sampler)."""
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

    def ftype(self) -> str:
        """The weights' file type as llama.cpp names it (e.g. "Q4_K - Medium")."""
        return _ll.llama_ftype_name(_ll.llama_model_ftype(self._model)).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_eog(self._vocab, token))

    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle token ids llama.cpp found for this vocabulary (the
        GGUF's tokenizer.ggml.fim_*_token_id, else tokens it knows by name such as
        Qwen2.5-Coder's <|fim_prefix|>): pre, suf, mid, pad, rep, sep; -1 when absent."""
        names = ("pre", "suf", "mid", "pad", "rep", "sep")
        return {n: int(getattr(_ll, f"llama_vocab_fim_{n}")(self._vocab)) for n in names}

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
        buf = getattr(self._piece, "buf", None)
        if buf is None:
            buf = self._piece.buf = ctypes.create_string_buffer(256)
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

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF's Jinja chat template (`name`: a named variant such as "tool_use")."""
        raw = _ll.llama_model_chat_template(self._model, name.encode() if name else None)
        return raw.decode("utf-8", errors="replace") if raw else None

    @property
    def add_bos(self) -> bool:
        """tokenize(add_special=True) prepends BOS (so a template's bos_token is dropped)."""
        return bool(_ll.llama_vocab_get_add_bos(self._vocab))

    @property
    def add_eos(self) -> bool:
        return bool(_ll.llama_vocab_get_add_eos(self._vocab))

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

    def ubatches(self, lengths: Iterable[tuple[int, int]]) -> list[int]:
        """The ubatches (token counts) one decode_multi of [(seq, tokens)] is split into:
        runs of consecutive sequence ids, equal tokens each (ubatch.py)."""
        return ubatches(lengths, self.n_batch, one_stream=self.cfg.n_seq_max == 1)  # n_ubatch = n_batch

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
        n_logit_rows tokens of each entry (views valid until the next decode).

        The batch is laid out in sequence-id order: llama.cpp's per-sequence KV cache
        puts only sequences of consecutive, increasing ids in one ubatch, so the slots
        in the order requests happened to arrive would cost a pass over the weights
        per out-of-order run."""
        order = sorted(range(len(entries)), key=lambda i: entries[i][0])
        rows = self._decode_batch([(entries[i][0], entries[i][1], range(len(entries[i][1]) - entries[i][2],
                                                                        len(entries[i][1]))) for i in order])
        out: list[np.ndarray] = [rows[:0]] * len(entries)
        row = 0
        for i in order:
            n_rows = entries[i][2]
            out[i] = rows[row : row + n_rows]
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

    def reuse_chunks(self, seq: int, prompt: Sequence[int], start: int, min_chunk: int) -> int:
        """llama-server's --cache-reuse N: past the `start` tokens sequence `seq` shares
        with `prompt`, every cached run of at least `min_chunk` tokens that `prompt`
        repeats further on is moved to its place in it (KV shifting: llama.cpp moves the
        cells' positions and re-rotates their keys) and the cells between are dropped.
        Returns how many leading tokens of `prompt` the sequence now holds. Approximate,
        as in llama.cpp: a moved run's cells were computed after other text than the
        prompt now puts before it. A model whose cache cannot shift keeps `start`."""
        if min_chunk <= 0 or not _ll.llama_memory_can_shift(self._mem):
            return start
        cached = self.seq_tokens(seq)
        head_c = head_p = start
        while head_c < len(cached) and head_p < len(prompt):
            n = 0
            while (head_c + n < len(cached) and head_p + n < len(prompt)
                   and cached[head_c + n] == prompt[head_p + n]):
                n += 1
            if n >= min_chunk:
                _ll.llama_memory_seq_rm(self._mem, seq, head_p, head_c)
                _ll.llama_memory_seq_add(self._mem, seq, head_c, head_c + n, head_p - head_c)
                cached[head_p : head_p + n] = cached[head_c : head_c + n]
                head_c, head_p = head_c + n, head_p + n
            else:
                head_c += 1
        _ll.llama_memory_seq_rm(self._mem, seq, head_p, -1)
        del cached[head_p:]
        return head_p

    def rewind(self, n_past: int, force: bool = False, *, seq: int = 0) -> None:
        """Forget sequence `seq`'s tokens from position n_past on (rejected drafts, an
        edited turn; 0 frees a server slot). `force` clears the cells even when the record
        says there are none."""
        record = self.seq_tokens(seq)
        if n_past < len(record) or force:
            _ll.llama_memory_seq_rm(self._mem, seq, n_past, -1)
            del record[n_past:]

    def copy_seq(self, src: int, dst: int) -> None:
        """Make sequence `dst` hold what `src` holds (its cells copied, not decoded again)."""
        if src == dst:
            return
        _ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
        _ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self.seq_tokens(dst)[:] = self.seq_tokens(src)

    # ----- a sequence's KV state as bytes (the on-disk prefix cache, the server's prompt cache) --

    def state_bytes(self, seq: int = 0) -> bytearray:
        """Sequence `seq`'s KV cells (the state of its record), serialised by llama.cpp."""
        n = _ll.llama_state_seq_get_size(self._ctx, seq)
        data = bytearray(n)
        if n and _ll.llama_state_seq_get_data(self._ctx, _u8(data), n, seq) != n:
            raise BackendError("llama.cpp could not copy the sequence state")
        return data

    def load_state(self, data: bytearray, tokens: Sequence[int], *, seq: int = 0) -> int:
        """Make sequence `seq` hold `tokens` from `data` (state_bytes() of a sequence that
        held exactly them, of this context or another of the same model and cache shape).
        Returns len(tokens), or 0 when llama.cpp refuses the data or it does not cover
        positions 0..len(tokens)-1: sequence `seq` is then empty."""
        n = len(data)
        _ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        read = _ll.llama_state_seq_set_data(self._ctx, _u8(data), n, seq) if n else 0
        lo = _ll.llama_memory_seq_pos_min(self._mem, seq)
        record = self.seq_tokens(seq)
        if read != n or not tokens or (lo, self.kv_len(seq)) != (0, len(tokens)):
            _ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
            record.clear()
            return 0
        record[:] = tokens  # in place: `cached` is the list sequence 0 is tracked by
        return len(tokens)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            _ll.llama_batch_free(self._batch)
            _ll.llama_free(self._ctx)
            _ll.llama_model_free(self._model)
            self._ctx = None


def _u8(data: bytearray) -> ctypes.Array:
    """A ctypes view of a bytearray, no copy (llama.cpp reads or fills it in place)."""
    return (ctypes.c_uint8 * len(data)).from_buffer(data)


def _chatml(messages: Sequence[dict], add_generation_prompt: bool) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")
