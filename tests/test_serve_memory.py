"""The server's memory of earlier replies: one per API key, shared by the slots, a
request can opt out; greedy replies are the same with or without it. Real SmolLM2, the
app on uvicorn in a thread, what each request drafted read from the acceptance log."""

from __future__ import annotations

import json
import sqlite3
import time

import httpx
import pytest
from test_serve_concurrency import Server

from localspec.acceptance import logdb
from localspec.core.backend import Model
from localspec.core.config import ModelConfig, SpecConfig
from localspec.serve.app import ServeSettings

KEYS = ("alice-key", "bob-key")
QUESTION = "Write a Python function that returns the squares of a list of numbers."


@pytest.fixture(scope="module")
def model(smol_path):
    m = Model(ModelConfig(path=smol_path, n_ctx=2 * 1024, n_seq_max=2, n_threads=1))
    yield m
    m.close()


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
                queue_size=4, spec_disable_by_batch_size=-1) as server:
        assert _ask(server, "mallory-key").status_code == 401
        replies = [_ask(server, KEYS[0]), _ask(server, KEYS[1]), _ask(server, KEYS[0]),
                   _ask(server, KEYS[0], memory=False)]
        assert _ask(server, KEYS[0], memory="yes").status_code == 400  # a bool or nothing
        server.wait_idle()
    texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert all(r.status_code == 200 for r in replies) and len(set(texts)) == 1  # greedy: the same reply
    alice, bob, alice_again, alice_opted_out = _logged(4)
    assert "memory" not in alice  # nothing remembered yet
    assert "memory" not in bob  # alice's reply is in alice's memory only
    assert alice_again.get("memory", [0, 0])[1] > 16, alice_again  # her own reply, recalled
    assert "memory" not in alice_opted_out
