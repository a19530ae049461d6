"""Tool-call parsing (whole replies and streamed pieces) and tool_choice checks: pure
code, no model; then the default target asked a weather question with a weather tool."""

from __future__ import annotations

import itertools
import json

import pytest

from localspec.core.chat_template import render_chat
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters import NoDrafter
from localspec.core.engine import Done, Token, generate
from localspec.core.errors import UsageError
from localspec.core.toolcalls import (
    HERMES,
    MISTRAL,
    ContentDelta,
    ToolCallDelta,
    ToolCallParser,
    ToolChoice,
    ToolChoiceError,
    detect_format,
    parse_tool_calls,
    resolve_tool_choice,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

TWO_CALLS = (
    'Let me check.\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris </tool_call> \\" {", '
    '"opts": {"units": ["c", {"deep": [1, 2]}]}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(text: str, sizes, fmt=HERMES) -> list:
    """Feed `text` in pieces of the given sizes (cycled), then finish."""
    parser = ToolCallParser(fmt, ids())
    out, i = [], 0
    for n in itertools.cycle(sizes):
        if i >= len(text):
            break
        out += parser.feed(text[i:i + n])
        i += n
    return out + parser.finish()


def assemble(deltas) -> tuple[str, list[dict]]:
    """What an OpenAI client rebuilds from the deltas."""
    content, calls = "", {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
            continue
        chunk = d.to_openai()
        call = calls.setdefault(chunk["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = chunk.get("id", call["id"])
        call["name"] += chunk["function"].get("name", "")
        call["arguments"] += chunk["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_whole_reply_two_calls_with_nested_json_and_a_closing_tag_in_a_string():
    reply = parse_tool_calls(TWO_CALLS, new_id=ids())
    assert reply.content == "Let me check."
    assert [c.to_openai() for c in reply.tool_calls] == [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
            {"city": 'Paris </tool_call> " {', "opts": {"units": ["c", {"deep": [1, 2]}]}})}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]


@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (5, 1), (7,), (11, 2, 1), (len(TWO_CALLS),)])
def test_stream_reassembles_to_the_whole_reply_for_any_split(sizes):
    whole = parse_tool_calls(TWO_CALLS, new_id=ids())
    content, calls = assemble(stream(TWO_CALLS, sizes))
    assert content == whole.content
    assert calls == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.tool_calls]


def test_stream_sends_name_first_then_arguments_in_openai_shape():
    deltas = [d for d in stream(TWO_CALLS, (4,)) if isinstance(d, ToolCallDelta)]
    first, then = deltas[0].to_openai(), deltas[1].to_openai()
    assert first == {"index": 0, "id": "call_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert set(then) == {"index", "function"} and set(then["function"]) == {"arguments"}
    assert json.loads(then["function"]["arguments"])["city"].startswith("Paris")
    assert deltas[2].to_openai()["index"] == 1 and deltas[2].name == "get_time"


def test_content_streams_at_once_but_a_possible_tag_start_is_held():
    parser = ToolCallParser(HERMES, ids())
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" may open a call
    assert parser.feed("box> is a word") == [ContentDelta(" <toolbox> is a word")]
    assert parser.feed(" <tool_ca") == []
    assert parser.feed('ll>{"name": "f", "arguments": {"x": 1}}') == []  # held until closed
    deltas = parser.feed("</tool_call>")
    assert [d.name for d in deltas] == ["f", None] and deltas[1].arguments == '{"x": 1}'
    assert parser.feed("\n  done") == [ContentDelta("done")]
    assert parser.finish() == []


def test_text_that_only_looks_like_a_tag_start_comes_out_at_the_end():
    assert parse_tool_calls("compare a <tool").content == "compare a <tool"
    assert stream("x <tool_c", (1,)) == [ContentDelta("x"), ContentDelta(" <tool_c")]


def test_malformed_call_is_left_as_content_streamed_or_not():
    text = 'A <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> B'
    whole = parse_tool_calls(text)
    assert whole.tool_calls == [] and whole.content == text
    assert assemble(stream(text, (3,))) == (text, [])
    bad_bodies = ("3", '[{"name": "f", "arguments": {}}]', '{"name": "f"}', '{"arguments": {}}',
                  '{"name": 3, "arguments": {}}', '{"name": "f", "arguments": [1]}', "not json")
    for bad in bad_bodies:
        reply = parse_tool_calls(f"<tool_call>{bad}</tool_call>")
        assert reply.tool_calls == [] and bad in reply.content


def test_unclosed_call_at_the_end_of_the_reply_still_parses():
    reply = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"q": "</tool"}}', new_id=ids())
    assert reply.content is None and reply.tool_calls[0].arguments == '{"q": "</tool"}'


def test_arguments_given_as_a_json_string_or_as_parameters():
    a = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').tool_calls
    b = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>').tool_calls
    assert a[0].arguments == b[0].arguments == '{"x": 1}'


def test_mistral_format_is_a_list_to_the_end_of_the_reply():
    text = 'ok[TOOL_CALLS][{"name": "a", "arguments": {"s": "]"}}, {"name": "b", "arguments": {}}]'
    reply = parse_tool_calls(text, MISTRAL, new_id=ids())
    assert reply.content == "ok" and [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("a", '{"s": "]"}'), ("b", "{}")]
    assert assemble(stream(text, (2,), MISTRAL))[1][1]["name"] == "b"


def test_format_is_detected_from_the_template():
    assert detect_format("...<tool_call>\\n{...}</tool_call>...") is HERMES
    assert detect_format("{%- if message.tool_calls %}[TOOL_CALLS]{{ ... }}") is MISTRAL
    assert detect_format(None) is HERMES


def test_forced_prefix_is_continued_by_the_reply():
    choice = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, [WEATHER, CLOCK])
    prefix = choice.prefix(HERMES)
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments":'
    parser = ToolCallParser(HERMES, ids())
    assert parser.feed(prefix) == []
    parser.feed(' {"city": "Paris"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]
    required = resolve_tool_choice("required", [WEATHER, CLOCK]).prefix(HERMES)
    assert required == '<tool_call>\n{"name": "'  # the model names the function
    parser = ToolCallParser(HERMES, ids())
    assert parser.feed(required) == [] and parser.feed('get_time", "arguments": {}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", "{}")]
    assert resolve_tool_choice("auto", [WEATHER]).prefix(HERMES) == ""


def test_tool_choice_semantics():
    assert resolve_tool_choice(None, [WEATHER]) == ToolChoice("auto")
    assert resolve_tool_choice(None, None) == ToolChoice("none")
    assert resolve_tool_choice("auto", []) == ToolChoice("none")
    assert not resolve_tool_choice("none", [WEATHER]).parses
    assert resolve_tool_choice("required", [WEATHER]).parses


@pytest.mark.parametrize("choice, tools, message", [
    ({"type": "function", "function": {"name": "nope"}}, [WEATHER, CLOCK],
     "'nope', which is not among the tools (get_weather, get_time)"),
    ("required", [], "needs tools"),
    ("sometimes", [WEATHER], "tool_choice must be"),
    ({"type": "function"}, [WEATHER], "tool_choice must be"),
    ("auto", [{"type": "function", "function": {}}], "each tool must be"),
])
def test_bad_tool_choice_is_a_clear_usage_error(choice, tools, message):
    with pytest.raises(ToolChoiceError) as err:
        resolve_tool_choice(choice, tools)
    assert message in str(err.value) and isinstance(err.value, UsageError)


FENCED = 'Here:\n```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


def test_a_json_block_is_a_call_only_when_it_names_a_requested_tool():
    # what qwen2.5-coder-1.5b answers (greedy) to a weather question with a weather tool
    reply = parse_tool_calls(FENCED, tool_names=["get_weather"], new_id=ids())
    assert reply.content == "Here:" and [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert assemble(stream(FENCED, (3, 1), HERMES)) == (FENCED, [])  # no tool names given
    assert parse_tool_calls(FENCED, tool_names=["get_time"]).content == FENCED
    config = 'Use:\n```json\n{"name": "x", "port": 80}\n```\nthen restart.'
    assert parse_tool_calls(config, tool_names=["x"]).content == config


def test_streamed_json_block_reassembles_like_the_whole_reply():
    parser = ToolCallParser(HERMES, ids(), ["get_weather"])
    deltas = [d for i in range(0, len(FENCED), 2) for d in parser.feed(FENCED[i:i + 2])] + parser.finish()
    assert assemble(deltas) == ("Here:", [{"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'}])


# ----- the default target, greedy ----------------------------------------------------------


def _reply(model, text: str, n: int = 48) -> list[str]:
    """Greedy pieces of the reply to the prompt `text`, as the engine streams them."""
    prompt = model.tokenize(text, add_special=True, parse_special=True)
    events = generate(model, prompt, NoDrafter(), sampling=SamplingConfig(temperature=0.0),
                      spec=SpecConfig(mode="none"), gen=GenerationConfig(max_tokens=n))
    return [ev.text for ev in events if isinstance(ev, (Token, Done))]


@pytest.mark.slow
def test_default_target_calls_the_weather_tool(qwen_target):
    fmt = detect_format(qwen_target.chat_template())
    assert fmt is HERMES
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = render_chat(qwen_target, ask, tools=[WEATHER, CLOCK])
    pieces = _reply(qwen_target, text)
    whole = parse_tool_calls("".join(pieces), fmt, ["get_weather", "get_time"], new_id=ids())
    assert [c.name for c in whole.tool_calls] == ["get_weather"], pieces
    assert "Paris" in json.loads(whole.tool_calls[0].arguments).values()
    parser = ToolCallParser(fmt, ids(), ["get_weather", "get_time"])
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    assert assemble(deltas)[1] == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
    # tool_choice names the function: the prompt ends inside a <tool_call> tag
    prefix = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, [WEATHER]).prefix(fmt)
    pieces = _reply(qwen_target, render_chat(qwen_target, ask, tools=[WEATHER]) + prefix, n=24)
    forced = parse_tool_calls(prefix + "".join(pieces), fmt)
    assert [c.name for c in forced.tool_calls] == ["get_weather"], pieces
    assert "Paris" in json.loads(forced.tool_calls[0].arguments).values()
