"""llama-server's own endpoints on `localspec serve`, in-process (uvicorn in a thread, real
GGUFs): /infill with the request shapes llama.vim and llama.vscode send (their field
names copied from their sources), whole and streamed, speculating on what the request
carries; the FIM-less SmolLM2 gets a 400; /completion, /tokenize, /detokenize,
/apply-template, /props, /slots in llama-server's documented shapes; OpenAI requests
without `model` and with llama.cpp's extra fields. Generations are short (2 cores)."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("uvicorn")

from test_serve_concurrency import Server  # noqa: E402

from localspec.core.backend import Model  # noqa: E402
from localspec.core.config import ModelConfig, SpecConfig  # noqa: E402
from localspec.core.limits import LineLimits  # noqa: E402
from localspec.serve import protocol  # noqa: E402
from localspec.serve.app import ServeSettings  # noqa: E402
from localspec.serve.tools import request_prompt  # noqa: E402

N = 24

# a file cut in the middle of a function whose twin is in the suffix and in another open
# file: the middle repeats text the request carries, so the n-gram drafter has it
PREFIX = ("import math\n\n\ndef area_of_circle(radius):\n    \"\"\"Area of a circle.\"\"\"\n"
          "    return math.pi * radius * radius\n\n\ndef area_of_square(side):\n")
SUFFIX = ("\n\n\ndef area_of_rectangle(width, height):\n    \"\"\"Area of a rectangle.\"\"\"\n"
          "    return width * height\n")
EXTRA = [{"text": "def area_of_square(side):\n    \"\"\"Area of a square.\"\"\"\n    return side * side\n",
          "time": [1733000000, 0], "filename": "shapes_old.py"}]
# llama.vim (autoload/llama.vim, llama#fim): every field it sends
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                    "tokens_cached"]


def llama_vim(**over) -> dict:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "",
            "n_predict": N, "stop": [], "n_indent": 0, "top_k": 40, "top_p": 0.90, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 3000, "response_fields": LLAMA_VIM_FIELDS}
    return {**body, **over}


def llama_vscode(**over) -> dict:
    # llama.vscode (src/llama-server.ts, getFIMCompletion / getLlamaCompletion)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "",
            "n_predict": N, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 0,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 3000, "model": "qwen2.5-coder-0.5b"}
    return {**body, **over}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=120, trust_env=False)


def stream(server: Server, path: str, body: dict) -> list[dict]:
    """The `data: {...}` events of a streamed reply (llama-server sends no [DONE])."""
    events = []
    with httpx.stream("POST", server.base + path, json={**body, "stream": True}, timeout=120,
                      trust_env=False) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert line != "data: [DONE]"
                events.append(json.loads(line[6:]))
    return events


def _server(path: str, spec: str, slots: int = 2) -> tuple[Model, Server]:
    m = Model(ModelConfig(path=path, n_ctx=slots * 2048, n_seq_max=slots, n_threads=2))
    settings = ServeSettings(model_id="test-alias", log_generations=False, max_tokens_limit=256)
    return m, Server(m, settings=settings, n_slots=slots, spec=SpecConfig(mode=spec, draft_max=8))


@pytest.fixture(scope="module")
def qwen(draft_path):
    m, s = _server(draft_path, "ngram")
    with s:
        yield s
    m.close()


@pytest.fixture(scope="module")
def smol_server(smol_path):
    m, s = _server(smol_path, "ngram")
    with s:
        yield s
    m.close()


# ----- /infill ------------------------------------------------------------------------


def test_llama_vim_request_gets_a_completion_with_the_fields_it_reads_and_speculates(qwen):
    r = post(qwen, "/infill", llama_vim(t_max_predict_ms=0))  # no budget: compared below
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == set(LLAMA_VIM_FIELDS)  # response_fields: only those, keyed by path
    assert body["content"].strip() and body["truncated"] is False
    assert body["timings/predicted_n"] > 0 and body["timings/prompt_n"] > 0
    assert body["tokens_cached"] >= body["timings/prompt_n"]
    full = post(qwen, "/infill", llama_vim(response_fields=None, t_max_predict_ms=0)).json()
    assert full["content"] == body["content"]  # greedy (the server's default temperature 0)
    # the middle repeats the other file's function: drafted from the request, accepted
    assert full["timings"]["draft_n"] > 0 and full["timings"]["draft_n_accepted"] > 0
    assert full["timings"]["cache_n"] > 0  # the second request reused the first's cells
    assert full["stop_type"] in ("eos", "limit") and full["stop"] is True


def test_streamed_infill_reassembles_to_the_whole_reply(qwen):
    whole = post(qwen, "/infill", llama_vscode(t_max_predict_ms=0)).json()
    events = stream(qwen, "/infill", llama_vscode(t_max_predict_ms=0))
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    last = events[-1]
    assert last["content"] == "" and last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]
    for key in ("tokens_cached", "truncated", "stop_type", "id_slot", "tokens_predicted", "tokens_evaluated"):
        assert key in last


def test_llama_vscode_request_and_the_warm_up_requests(qwen):
    body = post(qwen, "/infill", llama_vscode()).json()
    for key in ("content", "tokens_cached", "truncated", "generation_settings"):
        assert key in body
    assert {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
            "predicted_per_second"} <= set(body["timings"])
    # llama.vim's ring-buffer update: n_predict 0 caches the extra context, replies nothing
    warm = post(qwen, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA * 3,
                                  "prompt": "", "n_predict": 0, "temperature": 0.0, "stream": False,
                                  "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
                                  "t_max_predict_ms": 1, "response_fields": [""], "id_slot": 0})
    assert warm.status_code == 200 and warm.json() == {}
    quiet = post(qwen, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA * 3,
                                   "n_predict": 0}).json()
    assert quiet["content"] == "" and quiet["tokens_predicted"] == 0 and quiet["timings"]["predicted_n"] == 0
    again = post(qwen, "/infill", llama_vscode(input_extra=EXTRA * 3, n_predict=4)).json()
    assert again["timings"]["cache_n"] > 20  # the warmed extra context was not prefilled again


def test_infill_is_lossless_with_speculation(qwen, draft_path):
    spec = post(qwen, "/infill", llama_vim(response_fields=None, n_predict=32, t_max_predict_ms=0)).json()
    m, plain = _server(draft_path, "none", slots=1)
    try:
        with plain:
            base = post(plain, "/infill", llama_vim(response_fields=None, n_predict=32, t_max_predict_ms=0)).json()
    finally:
        m.close()
    assert "draft_n" not in base["timings"] and spec["timings"]["draft_n"] > 0
    assert spec["content"] == base["content"]


def test_t_max_predict_ms_ends_at_the_first_line_end_past_the_budget(qwen):
    free = post(qwen, "/infill", llama_vim(response_fields=None, n_predict=48, t_max_predict_ms=0)).json()
    assert free["content"].count("\n") >= 2, free["content"]  # several lines when unbounded
    cut = post(qwen, "/infill", llama_vim(response_fields=None, n_predict=48, t_max_predict_ms=1)).json()
    assert cut["stop_type"] == "limit" and cut["stopped_by"] == "t_max_predict_ms"
    first_line = free["content"][: free["content"].index("\n") + 1]
    assert cut["content"].startswith(first_line) and free["content"].startswith(cut["content"])
    assert cut["content"].rstrip("\n").count("\n") == 0  # the first line, ended by the newline token


def test_infill_refused_clearly_by_a_model_without_fim_tokens(smol_server):
    r = post(smol_server, "/infill", llama_vim())
    assert r.status_code == 400
    err = r.json()["error"]
    assert "Infill is not supported by this model" in err["message"] and "prefix" in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "x"}]}, "input_extra[0].text"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": "8"}, "n_predict"),
])
def test_infill_bad_bodies_are_400_naming_the_field(qwen, body, param):
    r = post(qwen, "/infill", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_line_limits_cut_a_line_indented_less_than_n_indent():
    lim = LineLimits(n_indent=4)
    assert lim.feed("x = 1\n") == ("x = 1\n", None)  # the first line is never checked
    assert lim.feed("    y = 2\n  ") == ("    y = 2\n  ", None)
    assert lim.feed("z") == ("", "indent")  # a line starting at indent 2 < 4: cut before it
    assert LineLimits(n_indent=0).feed("a\nb") == ("a\nb", None)


# ----- llama-server's other endpoints -------------------------------------------------


def test_completion_native_shape_whole_and_streamed(smol_server):
    body = {"prompt": "The capital of France is", "n_predict": 8, "cache_prompt": True, "samplers": ["top_k"]}
    whole = post(smol_server, "/completion", body).json()
    for key in ("content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                "generation_settings", "prompt", "has_new_line", "truncated", "stop_type",
                "stopping_word", "tokens_cached", "timings"):
        assert key in whole, key
    assert whole["model"] == "test-alias" and whole["tokens_predicted"] <= 8
    events = stream(smol_server, "/completion", body)
    assert "".join(e["content"] for e in events) == whole["content"]
    ids = post(smol_server, "/tokenize", {"content": body["prompt"]}).json()["tokens"]
    by_ids = post(smol_server, "/completion", {**body, "prompt": ids}).json()
    assert by_ids["content"] == whole["content"] and by_ids["tokens_evaluated"] == len(ids)


def test_tokenize_detokenize_apply_template(smol_server):
    toks = post(smol_server, "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    pieces = post(smol_server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == "Hello world"
    assert post(smol_server, "/detokenize", {"tokens": toks}).json() == {"content": "Hello world"}
    assert post(smol_server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    prompt = post(smol_server, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert set(prompt) == {"prompt"} and "hi" in prompt["prompt"] and prompt["prompt"].endswith("assistant\n")


def test_props_slots_and_models(smol_server):
    props = httpx.get(smol_server.base + "/props", trust_env=False).json()
    assert props["total_slots"] == 2 and props["model_alias"] == "test-alias"
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert {"chat_template", "bos_token", "eos_token", "build_info", "model_path", "modalities"} <= set(props)
    assert props["infill"] is False
    assert props["model_ftype"] == "Q4_1" and props["media_marker"].startswith("<__media_")
    assert props["chat_template_caps"]["supports_system_role"] and not props["chat_template_caps"]["supports_tools"]
    assert len(props["chat_template_caps"]) == 9 and props["ui"] is False
    r = post(smol_server, "/completion", {"prompt": "Once upon a time", "n_predict": 3, "top_k": 7})
    assert r.status_code == 200, r.text
    slots = httpx.get(smol_server.base + "/slots", trust_env=False).json()
    assert [s["id"] for s in slots] == [0, 1]
    last = max((s for s in slots if "id_task" in s), key=lambda s: s["id_task"])  # idle: its last task
    assert not last["is_processing"] and last["params"]["n_predict"] == 3 and last["params"]["top_k"] == 7
    assert last["next_token"][0]["has_next_token"] is False and last["next_token"][0]["n_decoded"] == 3
    assert all({"n_ctx", "is_processing", "speculative"} <= set(s) for s in slots)
    assert httpx.post(smol_server.base + "/slots", json={}, trust_env=False).status_code == 405  # read-only
    models = httpx.get(smol_server.base + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["test-alias"]


def test_openai_requests_without_model_and_with_llama_cpp_fields(smol_server):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "cache_prompt": True,
            "samplers": ["top_k", "temperature"], "id_slot": -1, "n_probs": 0, "t_max_predict_ms": 500,
            "reasoning_format": "none", "timings_per_token": False, "chat_template_kwargs": {"x": 1}}
    r = post(smol_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r = post(smol_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "cache_prompt": True})
    assert r.status_code == 200, r.text
    r = post(smol_server, "/v1/chat/completions", {**body, "made_up_field": 1})
    assert r.status_code == 400  # the OpenAI routes stay strict about the rest
    r = post(smol_server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


class _Template:
    """The real SmolLM2, its template replaced by one that shows a template variable."""

    def __init__(self, model) -> None:
        self._model = model

    def chat_template(self, name=None):
        return None if name else "{{ 'thinking' if enable_thinking else 'plain' }}:{{ messages[0].content }}"

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_chat_template_kwargs_reach_the_template(smol):
    body = {"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"enable_thinking": False}}
    assert request_prompt(_Template(smol), protocol.parse_chat(body))[0] == "plain:q"
    body.pop("chat_template_kwargs")  # llama-server's default: enable_thinking true
    assert request_prompt(_Template(smol), protocol.parse_chat(body))[0] == "thinking:q"


def test_infill_prompt_is_llama_servers_layout(qwen_draft):
    from localspec.serve.infill import infill_prompt
    from localspec.serve.llamacpp_schema import InfillBody

    m = qwen_draft
    fim = m.fim_tokens()
    tok = lambda s: m.tokenize(s, add_special=False, parse_special=False)
    body = InfillBody.model_validate({"input_prefix": "def f(x):\n", "input_suffix": "\nprint(f(1))\n",
                                      "prompt": "    ", "input_extra": [{"filename": "a.py", "text": "A = 1\n"}]})
    want = [fim["rep"], *tok("myproject\n"), fim["sep"], *tok("a.py\n"), *tok("A = 1\n"),
            fim["sep"], *tok("filename\n"), fim["pre"], *tok("def f(x):\n"), *m.tokenize("    ", False, True),
            fim["suf"], *tok("\nprint(f(1))\n"), fim["mid"]]
    assert infill_prompt(m, body, n_batch=2048, n_ctx=4096, n_predict=128) == want
    # the windows: the prefix keeps its end (3/4 of a batch), the suffix its start, the
    # extra chunks what the context leaves (none here), newest last
    short = infill_prompt(m, body, n_batch=16, n_ctx=16 + 2 * 128, n_predict=128)
    pre = short.index(fim["pre"])
    assert short[:pre] == [] and short[pre + 1 : short.index(fim["suf"])][-1:] == m.tokenize("    ", False, True)[-1:]
    typed = m.tokenize("    ", False, True)
    assert len(short[short.index(fim["suf"]) + 1 : -1]) == min(len(tok("\nprint(f(1))\n")), 16 // 4 - 2 - len(typed))


def test_cache_reuse_moves_a_cached_run_by_kv_shifting(smol):
    """--cache-reuse: the prefix window scrolled (its first lines dropped); the cached
    rest moves left instead of being prefilled again, and the next token is the one a
    fresh prefill gives."""
    import numpy as np

    m = smol
    tok = lambda s: m.tokenize(s, add_special=False, parse_special=False)
    head = tok("# file: shapes.py\n")
    drop = tok("import os\nimport sys\n")
    keep = tok("".join(f"def area_{i}(x):\n    return {i} * x * x\n\n" for i in range(8)))
    tail = tok("def area_9(x):\n    return")
    m.rewind(0, force=True)
    fresh = m.decode(head + keep + tail, "last")[-1].copy()
    m.rewind(0, force=True)
    m.decode(head + drop + keep + tok("\n# old end\n"), "last")
    prompt = head + keep + tail
    assert m.reuse_chunks(0, prompt, len(head), min_chunk=len(keep) + 1) == len(head)  # no run that long
    m.rewind(0, force=True)
    m.decode(head + drop + keep + tok("\n# old end\n"), "last")
    held = m.reuse_chunks(0, prompt, len(head), min_chunk=16)
    assert held == len(head) + len(keep)
    assert m.seq_tokens(0) == prompt[:held] and m.kv_len(0) == held  # cells moved, the gap closed
    row = m.decode(prompt[held:], "last")[-1]
    assert int(np.argmax(row)) == int(np.argmax(fresh))
    # close to a fresh prefill, not equal: the moved run's cells were computed after the
    # dropped lines (unmoved cells, their positions left as they were, are ~8 logits off)
    assert float(np.max(np.abs(row - fresh))) < 3.0
    m.rewind(0, force=True)


def test_serve_cache_reuse_skips_the_moved_run_at_prefill(smol_path):
    m = Model(ModelConfig(path=smol_path, n_ctx=2048, n_seq_max=1, n_threads=2))
    settings = ServeSettings(model_id="smol", log_generations=False, max_tokens_limit=64)
    body = "".join(f"def area_{i}(x):\n    return {i} * x * x\n\n" for i in range(8))
    try:
        for reuse, expect_moved in ((0, False), (16, True)):
            with Server(m, settings=settings, n_slots=1, spec=SpecConfig(mode="ngram"), cache_reuse=reuse) as s:
                post(s, "/completion", {"prompt": "# shapes\nimport os\nimport sys\n" + body, "n_predict": 1})
                t = post(s, "/completion", {"prompt": "# shapes\n" + body + "def", "n_predict": 1}).json()["timings"]
                assert (t["cache_n"] > 40) == expect_moved, t
            m.rewind(0, force=True)
    finally:
        m.close()
