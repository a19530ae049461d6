"""Soak, bounded for CI: 16 clients on 4 slots (SmolLM2, in-process uvicorn), mixing
chat and completions, streaming and not, n-gram-friendly prompts and `prediction`
requests, a third of them disconnecting at seeded random moments (cut off at any
point, closed after k chunks, half a body, never read). The driver is
localspec/bench/soak.py (scripts/soak_serve.py runs it for longer); it checks that every completed reply
is the text the request gets alone, that every slot is free with no KV cells left, and
that /metrics balances. Here, in-process, the backend's own records are checked too.
"""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
from test_serve_concurrency import Server
from test_serve_draft import _same_or_near_tie

from localspec.bench import soak
from localspec.core.backend import Model
from localspec.core.config import SpecConfig
from localspec.serve.protocol import parse_chat
from localspec.serve.tools import request_prompt

SLOTS = 4


SLOT_CTX = 512  # cells per sequence of the `model` fixture (conftest)


def test_soak_16_clients_on_4_slots_lose_nothing(model):
    with Server(model, n_slots=SLOTS, queue_size=16, spec=SpecConfig(mode="ngram", draft_max=8),
                spec_disable_by_batch_size=-1) as server:
        load = soak.Load(server.base, clients=16, requests=2, max_tokens=8, seed=1)
        report, problems = soak.run(load)
        print(report)
        # a reply may part from its text alone only at a near-tie: a slot's cells for a
        # prompt's start may have been decoded in another batch (its last request's), and
        # batched kernels differ in the last bits (checked below, the server stopped)
        assert not [p for p in problems if "text differs from alone" not in p], "\n".join(problems)
        parted = [r for r in load.results if r.text is not None and r.text != load.alone[r.spec]]
        # the load was what it claims: every kind of fault, and replies that completed
        assert report["requests"] == 32 + SLOTS and report["refused_busy"] == 0
        assert all(report["faults"].values()), report["faults"]
        assert report["completed"] >= 16
        kinds = {(r.spec.kind, r.stream, r.spec.prediction is not None) for r in load.results
                 if r.text is not None}
        assert len(kinds) >= 5, kinds
        # in-process: llama.cpp's count and the backend's record agree on what every slot
        # holds (a finished reply stays for the slot's next request; nothing more)
        assert server.scheduler.alive and not server.scheduler.active
        for seq in range(SLOTS):
            assert model.kv_len(seq) == len(model.seq_tokens(seq)), seq
        m = soak.metrics(server.base, None)
        assert m[("localspec_accepted_tokens_total", ())] > 0  # drafts were accepted under load
    for r in parted:
        _same_or_near_tie(model, _prompt_tokens(model, r.spec), load.alone[r.spec], r.text, r.spec.max_tokens)


def _prompt_tokens(model: Model, spec) -> list[int]:
    """The request's prompt as the server tokenizes it (chat: the model's template)."""
    text = request_prompt(model, parse_chat(spec.body(False)))[0] if spec.kind == "chat" else spec.prompt
    return model.tokenize(text, add_special=True, parse_special=True)
