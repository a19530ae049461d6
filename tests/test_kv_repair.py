"""KV bookkeeping on the real SmolLM2 GGUF: after a decode that fails or is interrupted,
what a Model records for each sequence matches the cells llama.cpp really holds, so a
later prefill that reuses the cache never keeps a stale cell (llama.cpp then refuses
the next decode: "sequence positions must remain consecutive")."""

from __future__ import annotations

import numpy as np
import pytest
from test_real_models import GREEDY, assert_same_greedy, plain_greedy

from localspec.core.backend import Model
from localspec.core.backend import llama_model as backend_model
from localspec.core.config import GenerationConfig, ModelConfig, SpecConfig
from localspec.core.drafters.draft_model import ModelDrafter
from localspec.core.engine import collect, generate
from localspec.core.errors import ContextFull
from localspec.core.chat_template import chat_prompt


def _interrupt_decode(monkeypatch, ctx, nth: int) -> dict:
    """Ctrl-C as Python delivers it during llama_decode on `ctx`: the C call finishes
    (its cells are written), and KeyboardInterrupt is raised as soon as it returns.
    Fires on the nth decode of that context (1-based)."""
    real = backend_model._ll.llama_decode
    seen = {"calls": 0, "fired": False}

    def llama_decode(c, batch):
        rc = real(c, batch)
        if c is ctx:
            seen["calls"] += 1
            if seen["calls"] == nth:
                seen["fired"] = True
                raise KeyboardInterrupt
        return rc

    monkeypatch.setattr(backend_model._ll, "llama_decode", llama_decode)
    return seen


def test_interrupted_decode_keeps_the_record_true(smol, monkeypatch):
    smol.rewind(0)
    toks = smol.tokenize("Speculative decoding keeps the agreeing prefix")
    smol.prefill(toks)
    seen = _interrupt_decode(monkeypatch, smol._ctx, 1)
    with pytest.raises(KeyboardInterrupt):
        smol.decode([1, 2, 3], "all")
    monkeypatch.undo()
    assert seen["fired"]
    assert smol.kv_len() == smol.n_past == len(toks)
    smol.decode([1, 2, 3], "all")  # consecutive positions again: llama.cpp accepts it
    assert smol.kv_len() == smol.n_past == len(toks) + 3
    smol.rewind(0)


@pytest.mark.parametrize("nth", [2, 3])  # 1: the draft's prefill; 2, 3: drafting tokens
def test_interrupted_draft_decode_repairs_the_draft_model(smol, smol_draft, monkeypatch, nth):
    smol.rewind(0)
    smol_draft.rewind(0)
    prompt = chat_prompt(smol, "List five fruits and one fact about each.")
    seen = _interrupt_decode(monkeypatch, smol_draft._ctx, nth)
    with pytest.raises(KeyboardInterrupt):
        collect(generate(smol, prompt, ModelDrafter(smol_draft, GREEDY, 0.0), sampling=GREEDY,
                         spec=SpecConfig(mode="model"), gen=GenerationConfig(max_tokens=48),
                         draft_model=smol_draft))
    monkeypatch.undo()
    assert seen["fired"]
    for m in (smol, smol_draft):
        assert m.kv_len() == m.n_past, m.name  # the record matches the cells
    # the next turn extends exactly what the draft model recorded: it reuses that cache
    # as is and decodes after it, which a stale cell past the record would make fail
    prompt2 = list(smol_draft.cached)
    plain, margins = plain_greedy(smol, prompt2, 32)
    ids, _, stats = collect(generate(smol, prompt2, ModelDrafter(smol_draft, GREEDY, 0.0),
                                     sampling=GREEDY, spec=SpecConfig(mode="model"),
                                     gen=GenerationConfig(max_tokens=32), draft_model=smol_draft))
    assert_same_greedy(plain, margins, ids)
    assert stats.drafted > 0
    smol.rewind(0)
    smol_draft.rewind(0)


@pytest.fixture(scope="module")
def two_seqs(smol_path):
    m = Model(ModelConfig(path=smol_path, n_ctx=512, n_seq_max=2, n_threads=1))
    yield m
    m.close()


def test_failed_decode_multi_leaves_no_sequence_ids_behind(two_seqs):
    m = two_seqs
    toks = m.tokenize("The quick brown fox jumps over the lazy dog")
    too_long = list(range(100, 101 + m.n_ctx_seq))  # sequence 0 has no room for it
    with pytest.raises(ContextFull):
        m.decode_multi([(1, toks, 1), (0, too_long, 1)])
    assert m.kv_len(0) == m.kv_len(1) == 0
    # the single-sequence decode writes sequence 0, whatever the failed batch left
    row = m.decode(toks)[0].copy()
    assert m.kv_len(0) == m.n_past == len(toks) and m.kv_len(1) == 0
    m.rewind(0)
    assert np.allclose(row, m.decode(toks)[0], atol=1e-3)
    m.rewind(0)


def test_one_rewind_for_every_sequence(two_seqs):
    m = two_seqs
    a = m.tokenize("one two three four")
    b = m.tokenize("five six seven eight nine")
    m.decode_multi([(0, a, 0), (1, b, 0)])
    assert (m.kv_len(0), m.kv_len(1)) == (len(a), len(b)) == (m.n_past, len(m.seq_tokens(1)))
    m.rewind(2, seq=1)
    assert m.kv_len(1) == 2 and m.seq_tokens(1) == b[:2] and m.kv_len(0) == len(a)
    m.rewind(0, seq=1)
    m.rewind(0)
    assert m.kv_len(0) == m.kv_len(1) == 0


def test_decode_multi_lays_the_batch_out_in_sequence_order(two_seqs):
    # llama.cpp's per-sequence KV cache makes one ubatch only of consecutive, increasing
    # sequence ids: slots handed over in arrival order (1 before 0) must be reordered,
    # and each entry still gets its own rows back
    m = two_seqs
    a = m.tokenize("one two three four")
    b = m.tokenize("five six seven eight nine")
    alone = {}
    for seq, toks in ((0, a), (1, b)):
        alone[seq] = m.decode_multi([(seq, toks, 2)])[0].copy()
        m.rewind(0, seq=seq)
    rows = m.decode_multi([(1, b, 2), (0, a, 2)])
    laid_out = [m._batch.seq_id[i][0] for i in range(len(a) + len(b))]
    assert laid_out == sorted(laid_out) and laid_out[0] == 0
    assert np.allclose(rows[0], alone[1], atol=1e-3) and np.allclose(rows[1], alone[0], atol=1e-3)
    assert (m.kv_len(0), m.kv_len(1)) == (len(a), len(b))
    m.rewind(0, seq=1)
    m.rewind(0)
