"""The server's memory of earlier replies: one per API key, shared by the slots, a
request can opt out; greedy replies are the same with or without it. Real SmolLM2, the
app on uvicorn in a thread, what each request drafted read from the acceptance log."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
from fakes import fixed_costs
from test_serve_concurrency import Server

from localspec.acceptance import logdb
from localspec.core.config import SpecConfig
from localspec.core.drafters.memory import Memory, static_index
from localspec.serve.app import ServeSettings

KEYS = ("alice-key", "bob-key")
OWN_CONTEXT = 8  # memory tokens a first request may accept from its own context, at most
# auto's verify costs given, not timed: what a request drafts must not hang on this
# machine's load (one noisy round time, shared across requests, priced drafting out)
COSTS = fixed_costs()
QUESTION = "Write a Python function that returns the squares of a list of numbers."


def _ask(server: Server, key: str, **extra) -> httpx.Response:
    body = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 64, "ignore_eos": True, **extra}
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=300, trust_env=False,
                      headers={"Authorization": f"Bearer {key}"})


def _logged(n: int) -> list[dict]:
    """The by-source counts of the first n logged generations, oldest first."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with sqlite3.connect(logdb.db_path()) as db:
                rows = db.execute("SELECT stats_json FROM generations ORDER BY id").fetchall()
        except sqlite3.OperationalError:
            rows = []
        if len(rows) >= n or time.monotonic() > deadline:
            return [json.loads(r[0])["by_source"] for r in rows[:n]]
        time.sleep(0.1)


def test_one_users_replies_never_draft_for_another(model):
    settings = ServeSettings(model_id="smol", api_key=",".join(KEYS), log_generations=True,
                             max_tokens_limit=512)
    with Server(model, settings=settings, spec=SpecConfig(mode="auto", draft_max=16), n_slots=2,
                queue_size=4, spec_disable_by_batch_size=-1, auto_costs=COSTS) as server:
        assert _ask(server, "mallory-key").status_code == 401
        replies = [_ask(server, KEYS[0]), _ask(server, KEYS[1]), _ask(server, KEYS[0]),
                   _ask(server, KEYS[0], memory=False)]
        assert _ask(server, KEYS[0], memory="yes").status_code == 400  # a bool or nothing
        server.wait_idle()
    texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert all(r.status_code == 200 for r in replies) and len(set(texts)) == 1  # greedy: the same reply
    alice, bob, alice_again, alice_opted_out = _logged(4)
    # the memory drafter also drafts from the request's own context (a reply repeating
    # itself), so a first request may accept a few memory tokens; a remembered reply
    # drafts nearly all of its 64
    recalled = [by.get("memory", [0, 0])[1] for by in (alice, bob, alice_again)]
    assert recalled[0] <= OWN_CONTEXT, alice  # nothing remembered yet
    assert recalled[1] <= OWN_CONTEXT, bob  # alice's reply is in alice's memory only
    assert recalled[2] > 16, alice_again  # her own reply, recalled
    assert "memory" not in alice_opted_out


def test_lookup_corpus_drafts_for_every_key_and_keeps_nothing(model):
    """--lookup with --no-memory: a corpus holding the reply drafts it for a key that never
    asked before, and the server remembers nothing of what it generated."""
    settings = ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=512, memory=False)
    with Server(model, settings=settings, spec=SpecConfig(mode="ngram"), n_slots=1, queue_size=2) as server:
        reply = _ask(server, "any").json()["choices"][0]["message"]["content"]
    corpus = static_index([model.tokenize(reply, False, False)])
    settings = ServeSettings(model_id="smol", api_key=",".join(KEYS), log_generations=True,
                             max_tokens_limit=512, memory=False, lookup=corpus)
    with Server(model, settings=settings, spec=SpecConfig(mode="auto", draft_max=16), n_slots=2,
                queue_size=4, spec_disable_by_batch_size=-1, auto_costs=COSTS) as server:
        replies = [_ask(server, KEYS[1]), _ask(server, KEYS[0], memory=False)]
        server.wait_idle()
        memory = server.app.state.api.memories
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == [reply, reply]
    bob, alice_opted_out = _logged(2)
    assert bob.get("memory", [0, 0])[1] > 16, bob  # the corpus, recalled for a first request
    assert "memory" not in alice_opted_out
    assert list(memory) == [None] and len(memory[None].texts) == 0  # one corpus-only memory
    assert memory[None].static is corpus  # shared, not copied


def test_a_memory_that_keeps_nothing_still_drafts_from_its_corpus():
    corpus = static_index([[5, 6, 7, 8, 9, 10, 11, 12]])
    kept, static_only = Memory(static=corpus), Memory(static=corpus, keep=False)
    for m in (kept, static_only):
        m.remember([1, 2, 3], [20, 21, 22])
    assert len(kept.texts) > 0 and len(static_only.texts) == 0
    assert kept.static is static_only.static is corpus and len(corpus) == 9


def test_serve_keeps_auto_without_a_draft_model():
    from localspec.commands.serve import _spec, serve
    from localspec.core.config import SpecMode

    def defaults() -> dict:  # what serve's options give with no --spec
        return dict(serve.make_context("serve", []).params)

    assert _spec(defaults(), None).mode is SpecMode.AUTO  # the memory and --lookup are sources
    # llama.cpp's names still give plain n-gram drafting
    assert _spec(dict(serve.make_context("serve", ["--spec", "ngram"]).params), None).mode is SpecMode.NGRAM
