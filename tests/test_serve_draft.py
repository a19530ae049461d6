"""Draft-model speculation in the server: one sequence of the draft's context per slot,
every slot's draft made in one batched draft decode per token, the auto policy choosing
per slot, acceptance per drafter in /metrics, and the slot's draft cells freed with it.

In process (uvicorn in a thread, the official `openai` client) with SmolLM2 as target
and as its own draft (a second instance with its own context); the CLI once; the
default Qwen pair once (slow).
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from test_real_models import NEAR_TIE, plain_greedy
from test_serve import start_server, stop_server
from test_serve_concurrency import SYSTEM
from test_serve_concurrency import Server as ThreadedServer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from localspec.acceptance import logdb
from localspec.core.backend import Model
from localspec.core.backend import llama_model as backend_model
from localspec.core.config import ModelConfig, SamplingConfig, SpecConfig
from localspec.core.drafters.draft_model import DraftBatch, ModelDrafter
from localspec.core.errors import BackendError
from localspec.core.chat_template import chat_prompt
from localspec.runtime import setup_of
from localspec.profile import Profile, save_profile
from localspec.serve.app import ServeSettings
from localspec.serve.defaults import threshold_from_vcurve

SLOTS = 4
PROMPTS = [
    "Count from one to ten in words.",
    "Write a Python function that reverses a string.",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
]
# the draft always drafts k = 4 (no p_min stop, no adaptive k): every active slot
# takes part in every draft decode of a step
MODEL = SpecConfig(mode="model", draft_max=4, draft_p_min=0.0, adaptive=False)


def _load(path: str) -> Model:
    return Model(ModelConfig(path=path, n_ctx=SLOTS * 512, n_seq_max=SLOTS, n_threads=1))


@pytest.fixture(scope="module")
def target(smol_path):
    m = _load(smol_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def draft(smol_path):
    m = _load(smol_path)
    yield m
    m.close()


class Server(ThreadedServer):
    """The app on uvicorn in a background thread, with the draft model for its slots."""

    client_timeout = 300  # the 1.5B pair's requests too
    idle_timeout = 30

    def __init__(self, target: Model, draft: Model | None, spec: SpecConfig, rule: int = -1,
                 log: bool = False) -> None:
        super().__init__(target, draft=draft, spec=spec, n_slots=SLOTS, spec_disable_by_batch_size=rule,
                         settings=ServeSettings(model_id="smol", log_generations=log, max_tokens_limit=512))


def _messages(p: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": p}]


def _alone(base: str, prompts: list, n: int, ignore_eos: bool = True) -> list[str]:
    """Greedy requests one after another: a str is a chat message, a list token ids for
    /v1/completions; ignore_eos keeps every reply n tokens long."""
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600,
                      http_client=httpx.Client(trust_env=False, verify=False, timeout=600))
    out = []
    for p in prompts:
        if isinstance(p, list):
            r = c.completions.create(model="m", prompt=p, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": ignore_eos})
            out.append(r.choices[0].text)
        else:
            r = c.chat.completions.create(model="m", messages=_messages(p), max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": ignore_eos})
            out.append(r.choices[0].message.content)
    return out


def _together(base: str, prompts: list, n: int, ignore_eos: bool = True) -> list[str]:
    """The same requests as concurrent streams (all n tokens long: they overlap)."""
    async def one(client: openai.AsyncOpenAI, p: str | list[int]) -> str:
        args = {"model": "m", "max_tokens": n, "temperature": 0, "stream": True,
                "extra_body": {"ignore_eos": ignore_eos}}
        if isinstance(p, list):
            stream = await client.completions.create(prompt=p, **args)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])
        stream = await client.chat.completions.create(messages=_messages(p), **args)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600,
                                    http_client=httpx.AsyncClient(trust_env=False, verify=False, timeout=600))
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(main())


def _same_or_near_tie(model: Model, prompt: list[int], solo: str, got: str, n: int) -> None:
    """Equal texts, or the first difference at a token where plain decoding was at a
    near-tie (batched kernels may round differently from one-token decodes)."""
    if got == solo:
        return
    at = len(os.path.commonprefix([solo, got]))
    ids, margins = plain_greedy(model, prompt, n)  # margins[len(ids)]: the end of text's, if it came
    pieces = [model.token_piece(t) for t in ids]
    i = next((j for j in range(len(ids)) if len(b"".join(pieces[: j + 1]).decode(errors="ignore")) > at),
             len(ids))  # the token that made the first differing character
    assert solo.startswith(model.detokenize(ids[:i])), "the reference run is not the solo run"
    assert i < len(margins), "diverged past the reference's end"
    assert margins[i] < NEAR_TIE, (f"diverged at token {i} where the plain margin was {margins[i]:.3f}:"
                                   f" {solo!r} vs {got!r}")
    print(f"near-tie divergence at token {i}, plain margin {margins[i]:.3f}")


def _solo_plain(target: Model, prompts: list[str], n: int) -> list[str]:
    """Each request alone on a server without speculation (--spec none)."""
    with Server(target, None, SpecConfig(mode="none")) as server:
        return _alone(server.base, prompts, n)


@pytest.fixture(scope="module")
def solo(target) -> list[str]:
    """PROMPTS alone on a server without speculation, 16 tokens: the drafted runs' reference."""
    return _solo_plain(target, PROMPTS, 16)


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text; 0 when absent."""
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^localspec_{name}{{{sel}}} (\S+)$" if sel else rf"^localspec_{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _count_draft_decodes(monkeypatch, draft: Model) -> list[int]:
    """Sequences in each llama_decode of the draft's context, as the batch names them."""
    real = backend_model._ll.llama_decode
    seqs: list[int] = []

    def llama_decode(ctx, batch):
        if ctx is draft._ctx:
            seqs.append(len({batch.seq_id[i][0] for i in range(batch.n_tokens)}))
        return real(ctx, batch)

    monkeypatch.setattr(backend_model._ll, "llama_decode", llama_decode)
    return seqs


def _assert_freed(draft: Model) -> None:
    for s in range(SLOTS):
        assert draft.kv_len(s) == 0 and draft.seq_tokens(s) == [], f"draft sequence {s} kept cells"


# ----- the behaviour -----------------------------------------------------------------


def test_four_streams_drafted_by_the_model_match_plain_decoding_alone(target, draft, solo, monkeypatch):
    n = 16
    seqs = _count_draft_decodes(monkeypatch, draft)
    with Server(target, draft, MODEL) as server:
        assert _together(server.base, PROMPTS, n) == solo
        server.wait_idle()
        text = server.metrics()
    monkeypatch.undo()
    drafted = _metric(text, "drafter_draft_tokens_total", drafter="model")
    accepted = _metric(text, "drafter_accepted_tokens_total", drafter="model")
    assert drafted > 0 and accepted > 0  # SmolLM2 drafting for itself: most are accepted
    assert 0 < _metric(text, "drafter_acceptance_rate", drafter="model") <= 1
    assert _metric(text, "drafter_draft_tokens_total", drafter="ngram") == 0
    # one batched draft decode per drafted token for all slots, not one per slot: the
    # four slots drafted together, and there were far fewer decodes than draft tokens
    assert max(seqs) == SLOTS
    assert len(seqs) < 0.5 * drafted, (len(seqs), drafted)
    assert _metric(text, "draft_model_decode_sequences_total") > 2 * _metric(text, "draft_model_decodes_total")
    _assert_freed(draft)  # every slot finished: no draft cell left behind


def test_auto_chooses_the_model_per_slot_where_the_profile_says_it_pays(target, draft, solo):
    n = 16
    auto = SpecConfig(mode="auto", draft_max=8, adaptive=False)
    for v_per_token, c, pays in ((0.0, 0.05, True), (0.6, 1.0, False)):  # GPU-like, then CPU-like
        curve = [1.0 + v_per_token * (i - 1) for i in range(1, 33)]
        setup = setup_of(target, draft)
        save_profile(Profile(key=setup.key, target=setup.target, draft=setup.draft, device=setup.device,
                             n_threads=setup.n_threads, n_gpu_layers=setup.n_gpu_layers, t_token_s=0.01,
                             vcurve=curve, prefill_tok_s=1000.0, draft_t_token_s=0.01 * c))
        with Server(target, draft, auto) as server:
            assert _together(server.base, PROMPTS, n) == solo
            server.wait_idle()
            text = server.metrics()
        assert (_metric(text, "drafter_draft_tokens_total", drafter="model") > 0) is pays, text
    _assert_freed(draft)


def test_the_load_rule_turns_model_drafting_off_under_load(target, draft, monkeypatch):
    n = 12
    seqs = _count_draft_decodes(monkeypatch, draft)
    with Server(target, draft, MODEL, rule=1) as server:  # speculation only while alone
        alone = _alone(server.base, PROMPTS, n)
        assert _together(server.base, PROMPTS, n) == alone
        server.wait_idle()
        text = server.metrics()
    monkeypatch.undo()
    assert seqs and max(seqs) == 1  # the model drafted alone, never for a shared batch
    assert _metric(text, "decode_steps_total", batch=str(SLOTS), speculation="off") > 0


def _hold_slot(base: str) -> tuple[httpx.Client, httpx.Response]:
    """Open a long stream and read until a few pieces came."""
    h = httpx.Client(base_url=base, timeout=120, trust_env=False, verify=False)
    body = {"model": "m", "messages": _messages("Tell me a long story."), "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    r = h.send(h.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    pieces = 0
    for line in r.iter_lines():
        pieces += line.startswith("data: {")
        if pieces >= 6:
            break
    return h, r


def test_the_acceptance_log_names_the_servers_draft_model(target, draft):
    with Server(target, draft, MODEL, log=True) as srv:
        srv.client().chat.completions.create(model="m", messages=_messages(PROMPTS[0]), max_tokens=8,
                                             temperature=0)
        db, rows, deadline = logdb.db_path(), [], time.monotonic() + 20
        while not rows and time.monotonic() < deadline:  # written off the event loop
            time.sleep(0.2)
            if db.exists():
                with closing(sqlite3.connect(db)) as con:
                    rows = con.execute("SELECT command, draft_file, drafter FROM generations").fetchall()
    assert rows == [("serve", Path(draft.path).name, "model")]


def test_cancelled_and_failed_requests_free_their_draft_sequence(target, draft, solo, monkeypatch):
    real = target.decode_multi
    calls = {"n": 0, "fail_at": 0}

    def decode_multi(entries):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise BackendError("llama_decode failed with code -3")
        return real(entries)

    monkeypatch.setattr(target, "decode_multi", decode_multi)
    with Server(target, draft, MODEL) as server:
        h, r = _hold_slot(server.base)  # the client goes away mid-stream, drafts in flight
        r.close()
        h.close()
        server.wait_idle()
        assert _metric(server.metrics(), "drafter_draft_tokens_total", drafter="model") > 0
        _assert_freed(draft)
        # a request whose target decode fails after a few drafted rounds
        calls["fail_at"] = calls["n"] + 5
        with pytest.raises(openai.InternalServerError):
            server.client().chat.completions.create(model="m", messages=_messages(PROMPTS[1]),
                                                    max_tokens=64, extra_body={"ignore_eos": True})
        server.wait_idle()
        _assert_freed(draft)
        assert _alone(server.base, PROMPTS[:1], 16) == solo[:1]  # the slots serve on
        server.wait_idle()
    _assert_freed(draft)


def test_drafts_for_several_sequences_follow_each_context(draft, monkeypatch):
    # contexts longer than a batch in all: the catch-up is split without logits, and
    # each sequence then holds its context and all its draft but the last token
    contexts = [chat_prompt(draft, f"{p} " + "Please be thorough. " * 40) for p in PROMPTS[:3]]
    bulk = sum(len(c) - 1 for c in contexts)
    assert bulk > draft.n_batch
    greedy = SamplingConfig(temperature=0.0)
    for s in range(SLOTS):
        draft.rewind(0, force=True, seq=s)
    batch = DraftBatch(draft)
    drafts = [ModelDrafter(draft, greedy, seq=s, batch=batch).draft(ctx, 5)
              for s, ctx in enumerate(contexts)]
    assert all(d.tokens == [] for d in drafts)  # filled when the batch runs
    n_decodes, n_rows, _, _ = batch.run()
    n_bulk = -(-bulk // draft.n_batch)
    assert n_decodes == n_bulk + 5  # the bulk, then 5 decodes of 3 rows (the last token is not decoded)
    assert n_rows >= n_bulk + 3 * 5
    for s, (ctx, d) in enumerate(zip(contexts, drafts)):
        assert len(d.tokens) == 5
        assert draft.seq_tokens(s) == ctx + d.tokens[:-1] and draft.kv_len(s) == len(ctx) + 4
    # the next round of one sequence: it rewinds to what it shares with its context
    # (two accepted tokens, then the target's correction) and decodes only the new token
    ctx = contexts[0] + drafts[0].tokens[:2] + [drafts[0].tokens[2] ^ 1]
    sizes: list[int] = []
    real = draft.decode_multi
    monkeypatch.setattr(draft, "decode_multi",
                        lambda entries: sizes.append(sum(len(t) for _, t, _ in entries)) or real(entries))
    again = ModelDrafter(draft, greedy, seq=0).draft(ctx, 3)
    assert sizes == [1, 1, 1] and draft.seq_tokens(0) == ctx + again.tokens[:-1]
    assert draft.seq_tokens(1) == contexts[1] + drafts[1].tokens[:-1]  # the others untouched
    for s in range(SLOTS):
        draft.rewind(0, force=True, seq=s)


def test_threshold_counts_the_draft_models_cost():
    flat = [1.0] * 32  # GPU-like: a batch costs one decode whatever its size
    assert threshold_from_vcurve(flat) == threshold_from_vcurve(flat, c=0.05) == 6
    assert threshold_from_vcurve(flat, c=0.5) == 0  # 4 draft tokens cost 2 decodes: E = 2.3 does not cover it
    rising = [1.0 + 0.05 * (n - 1) for n in range(1, 33)]
    assert threshold_from_vcurve(rising, c=0.1) < threshold_from_vcurve(rising)


def test_the_near_tie_allowance_rejects_a_real_divergence(target):
    prompt = chat_prompt(target, PROMPTS[0])
    ids, margins = plain_greedy(target, prompt, 12)
    solo = target.detokenize(ids)
    i = max(range(1, len(ids)), key=lambda j: margins[j])  # the most confident token
    head = target.detokenize(ids[:i])
    wrong = head + ("x" if solo[len(head)] != "x" else "y") + solo[len(head) + 1:]
    assert margins[i] > NEAR_TIE
    with pytest.raises(AssertionError, match=f"diverged at token {i} "):
        _same_or_near_tie(target, prompt, solo, wrong, 12)
    _same_or_near_tie(target, prompt, solo, solo, 12)


# ----- the command ---------------------------------------------------------------------


ARGS = ("--parallel", str(SLOTS), "-c", str(SLOTS * 512), "--no-log", "--spec-disable-by-batch-size", "-1")


def _served_together(model: str, home, prompts: list, n: int, *extra: str,
                     ignore_eos: bool = True) -> tuple[list[str], str, dict]:
    """The prompts as concurrent streams on `serve -m model *extra`: (texts, /metrics, /health)."""
    proc, base = start_server(model, home, *ARGS, *extra)
    try:
        together = _together(base, prompts, n, ignore_eos)
        text = httpx.get(f"{base}/metrics", trust_env=False, verify=False).text
        health = httpx.get(f"{base}/health", trust_env=False, verify=False).json()
    finally:
        assert stop_server(proc) == 0
    return together, text, health


def _cli_pair(model: str, draft: str, home, prompts: list, n: int,
              *extra: str) -> tuple[list[str], list[str], str, dict]:
    """Each prompt alone with --spec none, then all together with `--draft draft *extra`."""
    proc, base = start_server(model, home, *ARGS, "--spec", "none")
    try:
        solo = _alone(base, prompts, n)
    finally:
        assert stop_server(proc) == 0
    return (solo, *_served_together(model, home, prompts, n, "--draft", draft, *extra))


def test_serve_draft_command(smol_path, tmp_path):
    solo, together, text, health = _cli_pair(smol_path, smol_path, tmp_path / "home", PROMPTS, 8, "--spec",
                                             "model", "--draft-p-min", "0", "--draft-max", "4")
    assert together == solo
    assert health["draft"] and health["spec_mode"] == "model"
    assert _metric(text, "drafter_accepted_tokens_total", drafter="model") > 0


@pytest.mark.slow
def test_serve_draft_auto_with_the_default_pair(qwen_target, target_path, tmp_path):
    # --draft auto finds the 0.5B for the 1.5B and loads it with a sequence per slot; token
    # prompts, so the reference (plain greedy here: the 1.5B is loaded, no second 1.5B server)
    # decodes exactly what the server did, up to the end of text (where the reference stops)
    n = 16
    prompts = [chat_prompt(qwen_target, p) for p in PROMPTS]
    solo = [qwen_target.detokenize(plain_greedy(qwen_target, p, n)[0]) for p in prompts]
    together, text, health = _served_together(target_path, tmp_path / "home", prompts, n, "--draft", "auto",
                                              "--spec", "model", ignore_eos=False)
    assert "0.5b" in health["draft"].lower()
    for prompt, alone, got in zip(prompts, solo, together):
        _same_or_near_tie(qwen_target, prompt, alone, got, n)
    assert _metric(text, "drafter_accepted_tokens_total", drafter="model") > 0
    assert _metric(text, "draft_model_decode_sequences_total") > _metric(text, "draft_model_decodes_total")
