"""Chat templates rendered from the GGUF's own Jinja source.

The expected prompts in tests/data/chat_templates.json were recorded once from
llama.cpp's own server (`llama-server --jinja`, its /apply-template endpoint, the
llama.cpp vendored in llama-cpp-python 0.3.36) by scripts/compare_templates.py
--record; the test renders the same conversations and wants the same bytes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localspec.core.chat_template import (
    ChatTemplate,
    SpecialTokens,
    TemplateError,
    compiled,
    normalize_messages,
    render_chat,
    special_tokens,
)
from localspec.core.chat_template import chat_prompt

DATA = json.loads((Path(__file__).parent / "data" / "chat_templates.json").read_text())
GEMMA2 = DATA["templates"]["file:google-gemma-2-2b-it"]["source"]  # no system role, roles alternate


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    m = Model(ModelConfig(path=gemma_path, n_ctx=256))
    yield m
    m.close()


def _recorded(label: str) -> list[dict]:
    return [p for p in DATA["prompts"] if p["template"] == label]


def _check(model, label: str) -> int:
    """Render every recorded conversation of template `label` with `model`'s tokens;
    the number checked."""
    source = DATA["templates"][label]["source"]
    records = _recorded(label)
    for record in records:
        case = DATA["cases"][record["case"]]
        args = dict(tools=case.get("tools"), add_generation_prompt=case.get("add_generation_prompt", True),
                    **DATA["kwargs"])
        if source is None:  # the GGUF's own template, through the function run/chat/edit use
            got = render_chat(model, case["messages"], strict=True, **args)
        else:
            got = compiled(source, special_tokens(model)).render(case["messages"], **args)
        assert got == record["expected"], (label, record["case"])
    return len(records)


@pytest.mark.slow
def test_qwen_prompts_equal_llama_servers(qwen_target):
    assert _check(qwen_target, "gguf:qwen2.5-coder-1.5b") == len(DATA["cases"])


def test_qwen_small_prompts_equal_llama_servers(qwen_draft):
    # default system prompt, tools, a tool call and its result, prefill: all 8 cases
    assert {r["case"] for r in _recorded("gguf:qwen2.5-coder-0.5b")} >= {
        "user", "system", "tools", "tool_round", "tool_round_answered"}
    assert _check(qwen_draft, "gguf:qwen2.5-coder-0.5b") == len(DATA["cases"])


def test_smollm2_and_gemma_prompts_equal_llama_servers(smol, gemma):
    assert _check(smol, "gguf:smollm2-135m") == len(DATA["cases"])
    assert _check(gemma, "gguf:gemma3-270m") == len(DATA["cases"])  # no template: ChatML


def test_other_families_equal_llama_servers(gemma):
    # Gemma 2 (no system role, BOS in the template), Llama 3.1 (tools, date), Mistral
    # Nemo ([TOOL_CALLS]), Qwen3: templates from llama.cpp's models/templates
    for label in ("file:google-gemma-2-2b-it", "file:meta-llama-Llama-3.1-8B-Instruct",
                  "file:mistralai-Mistral-Nemo-Instruct-2407", "file:Qwen-Qwen3-0.6B"):
        assert _check(gemma, label) >= 3, label


def test_capabilities_of_the_gguf_templates(smol, qwen_draft):
    qwen, smollm = compiled(qwen_draft.chat_template(), special_tokens(qwen_draft)), compiled(smol.chat_template())
    assert qwen.caps.tools and qwen.caps.object_arguments and qwen.caps.system_role
    assert not smollm.caps.tools and not smollm.caps.object_arguments and smollm.caps.system_role
    # GET /props' chat_template_caps as llama-server (vendored build, --jinja) reports them
    assert qwen.caps.to_llama() == {
        "supports_object_arguments": True, "supports_parallel_tool_calls": True, "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False, "supports_string_content": True, "supports_system_role": True,
        "supports_tool_calls": True, "supports_tools": True, "supports_typed_content": False}
    assert smollm.caps.to_llama() == {
        "supports_object_arguments": False, "supports_parallel_tool_calls": False, "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False, "supports_string_content": True, "supports_system_role": True,
        "supports_tool_calls": False, "supports_tools": False, "supports_typed_content": False}


def test_probes_see_typed_content_reasoning_and_a_single_tool_call():
    source = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}"
              "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
              "{{ m.reasoning_content or '' }}{% for c in (m.tool_calls or [])[:1] %}{{ c.function.name }}{% endfor %}"
              "{% endfor %}{{ reasoning_effort or '' }}")
    caps = ChatTemplate(source).caps
    assert caps.typed_content and caps.string_content and caps.preserve_reasoning and caps.reasoning_effort
    assert caps.tool_calls and not caps.parallel_tool_calls and not caps.tools


def test_template_default_system_prompt_reaches_the_tokens(smol):
    # the built-in renderer drops it; llama-server (and now localspec) keep it
    text = smol.detokenize(chat_prompt(smol, "hi"))
    assert "You are a helpful AI assistant named SmolLM" in text
    assert "SmolLM" not in smol.apply_chat_template([{"role": "user", "content": "hi"}])


def test_leading_bos_is_left_to_the_tokenizer(gemma):
    tmpl = ChatTemplate(GEMMA2, special_tokens(gemma))
    text = tmpl.render([{"role": "user", "content": " hi "}])
    assert text == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.tokenize(text, add_special=True, parse_special=True)
    assert ids.count(gemma.bos) == 1 and ids[0] == gemma.bos


def test_system_message_folds_into_the_first_turn_where_the_template_has_no_system_role():
    tmpl = ChatTemplate(GEMMA2, SpecialTokens("<bos>", "<eos>", add_bos=True))
    assert not tmpl.caps.system_role
    text = tmpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == "<start_of_turn>user\nBe brief.\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_jinja_environment_matches_transformers():
    source = (
        "{{ tools | tojson }}|{{ {'b': 'é', 'a': [1, 2]} | tojson(indent=1) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}|{{ bos_token }}{{ eos_token }}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = ChatTemplate(source, SpecialTokens("<s>", "</s>")).render(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], tools=tools)
    # tojson: json.dumps spacing, keys in their order, no HTML escaping, no ASCII escaping
    assert out == ('[{"type": "function", "function": {"name": "f", "description": "", "parameters": '
                   '{"type": "object"}}}]|{\n "b": "é",\n "a": [\n  1,\n  2\n ]\n}|one|4|<s></s>')


def test_template_errors_are_clear_and_the_sandbox_holds():
    with pytest.raises(TemplateError, match="chat template: no tools here"):
        ChatTemplate("{{ raise_exception('no tools here') }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="unsafe|SecurityError|Undefined"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="needs content or tool_calls"):
        ChatTemplate("{{ messages }}").render([{"role": "user"}])


class BrokenTemplate:
    """The real SmolLM2 model, but its GGUF's template replaced by one that fails."""

    def __init__(self, model, source: str) -> None:
        self._model, self._source = model, source

    def chat_template(self, name=None):
        return None if name else self._source

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_failing_template_falls_back_to_llama_cpp_once_with_a_warning(smol, caplog):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    broken = BrokenTemplate(smol, "{{ messages[0].content.nope() }}")
    with caplog.at_level(logging.WARNING, logger="localspec.chat_template"):
        first = render_chat(broken, messages)
        again = render_chat(broken, messages)
    assert first == again == smol.apply_chat_template(messages)
    warnings = [r for r in caplog.records if "built-in renderer" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(TemplateError):
        render_chat(broken, messages, strict=True)
    with pytest.raises(TemplateError):  # the built-in renderer cannot show tools
        render_chat(broken, messages, tools=[{"type": "function", "function": {"name": "f"}}])


# ----- hostile templates: bounded time and size, refused with a clear error ---------------

NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GIGABYTES = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"  # 10 GB emitted
HOSTILE = {
    "nested loop": NESTED_LOOP,
    "gigabytes emitted": GIGABYTES,
    "one huge value": "{{ 'x' * 10000000000 }}",
    "a huge pad": "{{ 'x'|center(10000000000) }}{{ 'x'.ljust(10000000000) }}",
    "a huge format width": "{{ '{:>10000000000}'.format('x') }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "a huge number": "{{ 2 ** 100000000 }}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_stopped_within_its_bounds(name, smol, monkeypatch):
    from localspec.core import template_sandbox
    from localspec.core.chat_template import TemplateLimitError

    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 1.0)
    hostile = BrokenTemplate(smol, "{{ messages[0].content }}" + HOSTILE[name])
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match="hostile or broken|more than any model's context") as err:
        render_chat(hostile, [{"role": "user", "content": "hi"}])  # no fallback for it
    assert time.monotonic() - t0 < 3.0
    assert "\n" not in str(err.value)
    with pytest.raises(TemplateLimitError):  # and refused again at once
        render_chat(hostile, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 3.5


def test_the_bounds_leave_real_templates_their_speed():
    """Bounded rendering is jinja2's own speed: the deadline is a watchdog thread, not
    a trace function (which made it 3-4x slower)."""
    source = DATA["templates"]["file:Qwen-Qwen3-0.6B"]["source"]
    tmpl = ChatTemplate(source)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello world " * 100}
                for i in range(2047)]
    normalized = normalize_messages(messages, tmpl.caps)
    variables = {"bos_token": "", "eos_token": "", "add_generation_prompt": True}

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    plain = best(lambda: tmpl._template.render(messages=normalized, **variables))
    bounded = best(lambda: tmpl._render(normalized, variables))
    assert tmpl._render(normalized, variables) == tmpl._template.render(messages=normalized, **variables)
    assert bounded < 2.0 * plain + 0.01, (bounded, plain)


@pytest.fixture(scope="module")
def hostile_ggufs(smol_path, tmp_path_factory):
    """The real SmolLM2 GGUF with its chat template replaced (gguf's own
    gguf_new_metadata script): one that loops, one that emits gigabytes."""
    out = {}
    for name, source in (("loop", NESTED_LOOP), ("gigabytes", GIGABYTES)):
        tmp = tmp_path_factory.mktemp(f"hostile-{name}")
        (tmp / "template.jinja").write_text(source)
        path = tmp / f"hostile-{name}.gguf"
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", smol_path, str(path),
                        "--chat-template-file", str(tmp / "template.jinja"), "--force"],
                       check=True, capture_output=True, timeout=300)
        out[name] = str(path)
    return out


def test_run_refuses_a_hostile_template_in_one_line(hostile_ggufs, tmp_path):
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", hostile_ggufs["loop"], "-t", "1",
                        "-n", "4", "hi"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "ran longer than 5 s" in lines[-1] and "hostile or broken" in lines[-1], r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60


def test_serve_refuses_a_hostile_template_at_load(hostile_ggufs, tmp_path):
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "localspec", "serve", "-m", hostile_ggufs["gigabytes"], "-t", "1",
                        "-c", "512", "--parallel", "1", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "rendered more than" in r.stderr and "Traceback" not in r.stderr
    assert "http://" not in r.stderr  # refused before it listened
