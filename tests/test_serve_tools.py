"""Tools and logprobs through `localspec serve`: the real console command, the official
`openai` client, raw HTTP for bodies the client would not send.

SmolLM2 (fast; its template shows no tools) for logprobs and bad input, served twice:
with n-gram drafting and without, so the logprobs of drafted tokens can be checked
against plain decoding. The default target, Qwen2.5-Coder-1.5B, for the tool calls
themselves (slow: minutes on 2 cores)."""

from __future__ import annotations

import json
import math

import pytest
from test_serve import client, http, start_server, stop_server

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
CHAT = [{"role": "user", "content": "List the days of the week, one per line."}]
# SmolLM2 goes on to repeat "a fruit that is": the n-gram drafter drafts, the target accepts
REPEAT = " ".join(["apple banana cherry"] * 5)


@pytest.fixture(scope="module")
def smol(smol_path, tmp_path_factory):
    """(base URL drafting with n-grams, base URL without drafting): the same model."""
    home = tmp_path_factory.mktemp("tools-home")
    common = ("--parallel", "1", "-c", "1024", "--no-log", "--spec-disable-by-batch-size", "-1")
    spec, spec_base = start_server(smol_path, home, *common, "--spec", "ngram")
    try:
        plain, plain_base = start_server(smol_path, home, *common, "--spec", "none")
    except BaseException:
        stop_server(spec)
        raise
    yield spec_base, plain_base
    assert stop_server(spec) == 0 and stop_server(plain) == 0


def _error(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


# ----- logprobs ----------------------------------------------------------------------


def test_chat_logprobs_of_a_greedy_reply_are_the_top_of_their_alternatives(smol):
    c = client(smol[0])
    out = c.chat.completions.create(model="m", messages=CHAT, max_tokens=24, temperature=0,
                                    logprobs=True, top_logprobs=5)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens > 0
    for e in content:
        top = e.top_logprobs
        assert len(top) == 5 and [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert (e.token, e.bytes) == (top[0].token, top[0].bytes)  # greedy: the argmax
        assert e.logprob == pytest.approx(top[0].logprob, abs=1e-9) and e.logprob <= 0
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-6
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8")
    assert text == out.choices[0].message.content
    # streamed: the same entries, spread over the chunks
    stream = c.chat.completions.create(model="m", messages=CHAT, max_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=5, stream=True)
    streamed = [e for ch in stream for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                      for e in content]
    # logprobs without top_logprobs: the chosen token's alone
    bare = c.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * 4
    assert [e.logprob for e in bare.choices[0].logprobs.content] == [e.logprob for e in content[:4]]
    plain = c.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def _legacy(base: str, prompt: str, n: int, top: int, **kw):
    return client(base).completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                           logprobs=top, **kw)


def test_completion_logprobs_legacy_shape_streamed_or_not(smol):
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    out = _legacy(smol[0], prompt, 16, 2)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n > 0
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == len(prompt)  # OpenAI counts from the prompt's start
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for tok, value, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(alts) <= 3 and alts[tok] == value == max(alts.values())  # greedy
    chunks = [ch.choices[0].logprobs for ch in _legacy(smol[0], prompt, 16, 2, stream=True)
              if ch.choices and ch.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for ch in chunks for x in getattr(ch, field)] == getattr(lp, field), field
    # logprobs 0: no alternatives, but the chosen token is always there (OpenAI's rule)
    none = _legacy(smol[0], prompt, 4, 0).choices[0].logprobs
    assert none.top_logprobs == [{t: v} for t, v in zip(lp.tokens[:4], lp.token_logprobs[:4])]


def test_logprobs_are_the_same_with_and_without_speculation(smol):
    """Drafted tokens' logprobs come from their rows in the verify batch: equal to what
    plain decoding gives, up to the batched kernels' small differences (docs/architecture.md).
    The plain reply goes back as the `prediction` the n-gram drafter copies, so most of
    the reply is drafted and verified in batches whatever this machine's model writes."""
    def ask(base: str, **kw):
        return client(base).chat.completions.create(model="m", messages=CHAT, max_tokens=32, temperature=0,
                                                    logprobs=True, top_logprobs=3, **kw)
    plain = ask(smol[1])
    text = plain.choices[0].message.content
    spec = ask(smol[0], prediction={"type": "content", "content": text})
    drafted = spec.usage.model_extra["speculation"]
    assert plain.usage.model_extra["speculation"]["drafted"] == 0 and plain.usage.completion_tokens >= 24
    assert drafted["accepted"] >= plain.usage.completion_tokens // 2, drafted
    a, b = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x.token != y.token), len(b))
    if n < len(b):  # greedy diverged: only at a near-tie of the plain run
        margin = sorted((t.logprob for t in b[n].top_logprobs), reverse=True)
        assert margin[0] - margin[1] < 0.1, (n, a[n].token, b[n].token, b[n].top_logprobs)
    assert n >= 16, ([x.token for x in a], [y.token for y in b])
    assert [x.logprob for x in a[:n]] == pytest.approx([y.logprob for y in b[:n]], abs=0.02)
    for x, y in zip(a[:n], b[:n]):
        xs, ys = ({t.token: t.logprob for t in e.top_logprobs} for e in (x, y))
        both = set(xs) & set(ys)
        assert len(both) >= 2 and [xs[k] for k in both] == pytest.approx([ys[k] for k in both], abs=0.02)


@pytest.mark.parametrize("path, extra, param", [
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 2}, "logprobs"),  # chat's logprobs is a boolean
    ("completions", {"logprobs": True}, "logprobs"),  # the legacy one a number
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_are_400(smol, path, extra, param):
    body = {"model": "m", **({"messages": CHAT} if path == "chat" else {"prompt": "hi"}), **extra}
    route = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    _error(http(smol[0], key=None).post(route, json=body), param)


# ----- tools: the reply, whole or streamed (no model) ------------------------------------

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _reply(body: dict, prefix: str = ""):
    from localspec.core.toolcalls import HERMES
    from localspec.serve.protocol import parse_chat
    from localspec.serve.reply import Reply
    from localspec.serve.tools import ToolPlan

    req = parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, CLOCK], **body})
    plan = ToolPlan(HERMES, ("get_weather", "get_time"), prefix, req.parallel_tool_calls)
    return Reply(req, "chatcmpl-1", 0, "m", None, plan, "")


def _stream_chunks(reply, text: str, size: int, stop: str = "eos") -> tuple[str, list[dict], list]:
    from localspec.core.events import GenerationStats

    chunks = reply.opening()
    for i in range(0, len(text), size):
        chunks += reply.piece(text[i:i + size], ())
    chunks += reply.closing("", GenerationStats(stop_reason=stop))
    content, calls = "", {}
    for ch in chunks:
        delta = ch["choices"][0]["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls", ()):
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["id"] = d.get("id") or call.get("id")
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], [ch["choices"][0]["finish_reason"] for ch in chunks]


def _whole(reply, text: str, stop: str = "eos") -> dict:
    from localspec.core.events import GenerationStats

    reply.add(text, ())
    return reply.body("", GenerationStats(stop_reason=stop))["choices"][0]


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_streamed_tool_calls_reassemble_to_the_whole_reply(size):
    whole = _whole(_reply({}), TWO_CALLS)
    msg = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and msg["content"] == "Let me check."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, streamed, reasons = _stream_chunks(_reply({}), TWO_CALLS, size)
    assert content == msg["content"] and reasons[-1] == "tool_calls" and reasons[:-1] == [None] * (len(reasons) - 1)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    assert all(c["id"].startswith("call_") for c in streamed) and len({c["id"] for c in streamed}) == 2
    # parallel_tool_calls false: the first call only, streamed or not
    one = _whole(_reply({"parallel_tool_calls": False}), TWO_CALLS)["message"]["tool_calls"]
    _, first, _ = _stream_chunks(_reply({"parallel_tool_calls": False}), TWO_CALLS, size)
    assert [c["function"]["name"] for c in one] == [c["name"] for c in first] == ["get_weather"]


def test_forced_prefix_is_read_as_the_start_of_the_reply_and_a_cut_call_is_content():
    prefix = '<tool_call>\n{"name": "get_weather", "arguments":'
    rest = ' {"city": "Paris"}}\n</tool_call>'
    whole = _whole(_reply({}, prefix), rest)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    _, calls, _ = _stream_chunks(_reply({}, prefix), rest, 3)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    # max_tokens inside the call: no call, the text (prefix included) is content, "length"
    cut = _whole(_reply({}, prefix), ' {"city": "Pa', stop="length")
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"] == prefix + ' {"city": "Pa'
    content, calls, reasons = _stream_chunks(_reply({}, prefix), ' {"city": "Pa', 2, stop="length")
    assert (content, calls, reasons[-1]) == (cut["message"]["content"], [], "length")


# ----- tools: bad input -----------------------------------------------------------------

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # required without tools
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*ASK, {"role": "tool", "content": "18C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[1]"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages[1].content"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[1].tool_calls[0].function"),
    # SmolLM2's template shows no tools: it cannot render them, nor calls and results
    ({"tools": [WEATHER]}, "tools"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]}, "messages"),
])
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(smol, extra, param):
    body = {"model": "m", "messages": ASK, "max_tokens": 4, **extra}
    err = _error(http(smol[0], key=None).post("/v1/chat/completions", json=body), param)
    assert f"'{param}'" in err["message"] or param in ("tools", "messages"), err
    out = client(smol[0]).chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_the_openai_client_sees_a_bad_tool_choice_as_bad_request(smol):
    with pytest.raises(openai.BadRequestError) as e:
        client(smol[0]).chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


# ----- tools with the default target (slow) ----------------------------------------------


@pytest.fixture(scope="module")
def qwen(target_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("qwen-tools-home")
    proc, base = start_server(target_path, home, "--parallel", "1", "-c", "2048", "--no-log")
    yield base
    assert stop_server(proc) == 0


def reassemble(stream) -> tuple[str, list[dict], list]:
    """A streamed chat reply: its content, its tool calls put together from their
    deltas (by index), and the finish reasons seen."""
    content, calls, reasons = [], {}, []
    for ch in stream:
        for choice in ch.choices:
            content.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            reasons.append(choice.finish_reason)
    return "".join(content), [calls[i] for i in sorted(calls)], reasons


@pytest.mark.slow
def test_tool_round_trip_with_the_default_target(qwen):
    c = client(qwen)
    kw = dict(model="m", temperature=0, max_tokens=48)
    first = c.chat.completions.create(messages=ASK, tools=[WEATHER, CLOCK], **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the deltas reassemble to the same call
    content, calls, reasons = reassemble(c.chat.completions.create(messages=ASK, tools=[WEATHER, CLOCK],
                                                                   stream=True, **kw))
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    # the client runs the tool and sends its result back: the model answers from it.
    # (With the tools listed again this 1.5B coder repeats its call instead of answering,
    # written as the template's own {{...}} example: the prompt is llama-server's.)
    history = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id,
                                      "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    answer = c.chat.completions.create(messages=history, **kw).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "18" in answer.message.content and "Paris" in answer.message.content, answer.message.content


@pytest.mark.slow
def test_tool_choice_required_and_named_force_a_call(qwen):
    c = client(qwen)
    hello = [{"role": "user", "content": "Say hello to me."}]
    kw = dict(model="m", messages=hello, tools=[WEATHER, CLOCK], temperature=0, max_tokens=32)
    auto = c.chat.completions.create(**kw).choices[0]
    assert auto.finish_reason == "stop" and not auto.message.tool_calls and auto.message.content
    required = c.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert required.finish_reason == "tool_calls", required
    assert [x.function.name for x in required.message.tool_calls] in (["get_weather"], ["get_time"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, reasons = reassemble(c.chat.completions.create(tool_choice=named, stream=True, **kw))
    assert reasons[-1] == "tool_calls" and [x["name"] for x in calls] == ["get_weather"], (content, calls)
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


@pytest.mark.slow
def test_a_call_the_template_cannot_render_is_400(qwen):
    bad = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": "not json"}}
    body = {"model": "m", "max_tokens": 4, "tools": [WEATHER],
            "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [bad]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]}
    err = _error(http(qwen, key=None).post("/v1/chat/completions", json=body), "tools")
    assert "not JSON" in err["message"]
