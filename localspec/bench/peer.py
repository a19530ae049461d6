"""The peer in `localspec bench --peer llama-cpp-python`: llama-cpp-python's own
speculative path, `Llama(draft_model=LlamaPromptLookupDecoding(...))`, driven with the
same prompt tokens, greedy, so users see localspec next to the obvious alternative.

This is the one place besides core/backend/ that touches llama_cpp, on purpose: the peer
*is* llama-cpp-python's high-level `Llama` class and its decode loop; routing it
through our backend would measure our code, not theirs. The import stays inside the
functions, so nothing loads it unless the peer is asked for.

Quirks handled here: 0.3.36 raises a numpy broadcast ValueError in the prompt-lookup
path unless `logits_all=True`; `Llama` defaults to half the cores (we pass ours); and
on CPUs with AMX its model load needs the same `use_extra_bufts = False` workaround
as ours, or multi-token batches crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


PEERS = ("llama-cpp-python",)


@dataclass
class PeerRun:
    """What one peer generation produced. `rounds` are batched decodes after the
    prefill; greedy, each yields the accepted draft tokens plus one of the target's."""

    ids: list[int]
    decode_s: float
    rounds: int
    drafted: int
    cpu_s: float = 0.0

    @property
    def accepted(self) -> int:
        return max(0, len(self.ids) - 1 - self.rounds)


class LlamaCppPythonPeer:
    """One `Llama` with prompt-lookup drafting of up to `num_pred_tokens` per round."""

    name = "llama-cpp-python"

    def __init__(self, model_path: str, *, n_ctx: int, n_threads: int, n_gpu_layers: int = 0,
                 num_pred_tokens: int = 10, max_ngram_size: int = 2,
                 amx_workaround: bool | None = None) -> None:
        import llama_cpp

        if amx_workaround is None:  # as the backend decides: on wherever AMX would crash a batch
            from localspec.core.backend import has_amx  # imported here: bench --help needs none

            amx_workaround = has_amx()

        self.drafter = _counting_lookup(max_ngram_size, num_pred_tokens)
        with _no_extra_bufts(amx_workaround):
            self.llm = llama_cpp.Llama(
                model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                n_gpu_layers=n_gpu_layers, logits_all=True, draft_model=self.drafter, verbose=False,
            )

    def set_num_pred_tokens(self, k: int) -> None:
        self.drafter.num_pred_tokens = k

    def generate(self, prompt: Sequence[int], max_tokens: int,
                 stop: Callable[[int], bool] | None = None) -> PeerRun:
        """Greedy tokens after `prompt` until end of generation, `max_tokens`, or
        `stop(token)` is true for a kept token. Time runs from the first token (after
        the prefill), as in localspec's own stats."""
        ids: list[int] = []
        self.drafter.reset()
        self.llm.reset()  # a full prefill every time, as the bench does for localspec
        gen = self.llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0)
        t1 = cpu1 = 0.0
        try:
            for tok in gen:
                if not t1:
                    t1, cpu1 = time.perf_counter(), time.process_time()
                if self._is_eog(tok):
                    break
                ids.append(int(tok))
                if len(ids) >= max_tokens or (stop is not None and stop(tok)):
                    break
        finally:
            gen.close()
        decode_s = time.perf_counter() - t1 if t1 else 0.0
        cpu_s = time.process_time() - cpu1 if t1 else 0.0
        return PeerRun(ids, decode_s, self.drafter.calls, self.drafter.drafted, cpu_s)

    def _is_eog(self, tok: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok))

    def close(self) -> None:
        self.llm.close()


def _counting_lookup(max_ngram_size: int, num_pred_tokens: int) -> Any:
    """Their LlamaPromptLookupDecoding, unchanged, counting calls and drafted tokens."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class CountingLookup(LlamaPromptLookupDecoding):
        """Their prompt lookup, unchanged, counting calls (= verify rounds) and drafts."""

        def reset(self) -> None:
            self.calls = 0
            self.drafted = 0

        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
            out = super().__call__(input_ids, **kwargs)
            self.calls += 1
            self.drafted += len(out)
            return out

    lookup = CountingLookup(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
    lookup.reset()
    return lookup


@contextmanager
def _no_extra_bufts(active: bool) -> Iterator[None]:
    """While `Llama` loads: default model params without extra buffer types (AMX)."""
    if not active:
        yield
        return
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params

    def patched():  # type: ignore[no-untyped-def]
        params = original()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def open_peer(name: str, model_path: str, *, n_ctx: int, n_threads: int, num_pred_tokens: int,
              amx_workaround: bool | None = None, n_gpu_layers: int = 0) -> LlamaCppPythonPeer:
    """The peer called `name` (one of PEERS), loaded on `model_path`."""
    if name != "llama-cpp-python":
        raise ValueError(f"unknown peer {name!r}")
    return LlamaCppPythonPeer(model_path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                              num_pred_tokens=num_pred_tokens, amx_workaround=amx_workaround)
