"""`localspec chat`: the pure parts (block splitting, coalescing, commands, sessions),
the runner on a real model (KV prefix reuse across turns, context trimming), and the
textual app driven headless by its pilot with SmolLM2 drafting for itself."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from localspec.chat.commands import CommandError, help_text, parse, unescape
from localspec.chat.runner import ChatRunner
from localspec.chat.session import Conversation
from localspec.chat.streaming import BlockSplitter, Coalescer
from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.errors import ContextFull
from localspec.runtime import Runtime

GREEDY = SamplingConfig(temperature=0.0)


# ----- streaming helpers ------------------------------------------------------------


def feed_all(chunks):
    s = BlockSplitter()
    done = [s.feed(c) for c in chunks]
    return done, s


def test_blocks_complete_at_blank_lines():
    done, s = feed_all(["Hello wor", "ld.\n", "\nNext para", "graph"])
    assert done == ["", "", "Hello world.\n\n", ""]
    assert s.pending == "Next paragraph"
    assert s.flush() == "Next paragraph" and s.pending == ""


def test_code_fence_is_one_block_even_with_blank_lines():
    text = "Look:\n\n```python\ndef f():\n\n    return 1\n```\nafter"
    done, s = feed_all(list(text))  # one character at a time, as tokens may split anything
    completed = "".join(done)
    assert completed == "Look:\n\n```python\ndef f():\n\n    return 1\n```\n"
    assert s.pending == "after"


def test_fence_split_across_tokens_and_longer_closing_fence():
    done, s = feed_all(["``", "`\ncode\n", "\n", "``", "``\n", "x"])
    assert "".join(done) == "```\ncode\n\n````\n" and s.pending == "x"


def test_coalescer_merges_runs_paces_flushes_and_never_doubles_a_request():
    now = [0.0]
    co = Coalescer(text_hz=10, status_hz=2, clock=lambda: now[0])
    assert co.add("a", True)  # the first status update is due at once: ask for a flush
    assert not co.add("b", True)  # one flush request at a time
    assert not co.add("c", False)
    assert co.take() == ([("ab", True), ("c", False)], True)
    now[0] = 0.05
    assert not co.add("d", True)  # too soon for text, and the status is not due
    now[0] = 0.11
    assert co.add("e", True)  # text due
    assert co.take() == ([("de", True)], False)
    now[0] = 0.6
    assert co.add()  # status only (a Round event): due
    assert co.take() == ([], True)


# ----- slash commands -----------------------------------------------------------------


def test_parse_commands_and_values():
    assert parse("hello") is None
    assert parse("/usr/bin/env is broken") is None  # a path is a message
    assert parse("//k 4") is None and unescape("//k 4") == "/k 4"
    assert parse("/k 4").value == 4
    assert parse("/K auto").value == "auto"
    assert parse("/spec NGRAM").value == "ngram"
    assert parse("/temp 0.7").value == 0.7
    assert parse("/system Be terse.\nVery.").arg == "Be terse.\nVery."
    assert parse("/exit").name == "quit"
    assert parse("/save out.md").arg == "out.md"


@pytest.mark.parametrize("line, hint", [
    ("/hepl", "did you mean /help"),
    ("/frobnicate", "/help lists the commands"),
    ("/k 0", "1-64"),
    ("/k many", "usage: /k"),
    ("/spec magic", "usage: /spec"),
    ("/temp hot", "usage: /temp"),
    ("/save", "usage: /save"),
])  # fmt: skip
def test_bad_commands_give_hints(line, hint):
    with pytest.raises(CommandError, match=hint):
        parse(line)


def test_help_lists_every_command():
    text = help_text()
    for name in ("help", "clear", "system", "k", "spec", "temp", "stats", "save", "quit"):
        assert f"/{name}" in text


# ----- sessions ---------------------------------------------------------------------------


class CountingRenderer:
    """Chat template and tokenizer stand-in: one token per word, plus 3 per message."""

    bos = eos = -1  # no special tokens
    add_bos = add_eos = False

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx

    def chat_template(self, name=None):
        return None if name else "{% for m in messages %}<{{ m.role }}> {{ m.content }} </> {% endfor %}<assistant>"

    def tokenize(self, text, add_special=True, parse_special=True):
        return list(range(len(text.split())))


def make_conv(n_turns: int, words: int = 10) -> Conversation:
    conv = Conversation(system="be brief")
    for i in range(n_turns):
        conv.add("user", " ".join(["q"] * words))
        conv.add("assistant", " ".join(["a"] * words))
    return conv


def test_fit_drops_oldest_turns_and_keeps_the_transcript():
    conv = make_conv(4)
    conv.add("user", "last question")
    prompt = conv.fit(CountingRenderer(n_ctx=70), reserve=16)
    assert prompt.dropped == 6 and conv.first == 6  # three exchanges left the context
    assert len(prompt.tokens) + 16 <= 70
    assert len(conv.messages) == 9  # but the transcript keeps them
    assert conv.chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert conv.in_context[-1].content == "last question"


def test_fit_raises_when_the_message_alone_is_too_long():
    conv = Conversation()
    conv.add("user", " ".join(["w"] * 100))
    with pytest.raises(ContextFull):
        conv.fit(CountingRenderer(n_ctx=50), reserve=10)


def test_prompt_reuses_the_ids_the_model_saw():
    r = CountingRenderer(n_ctx=100)
    conv = Conversation()
    conv.add("user", "hi there")
    first = conv.prompt(r)
    conv.add("assistant", "hello")
    conv.remember(first, " hello", [901, 902])  # generated ids, not what tokenize gives
    conv.add("user", "again")
    second = conv.prompt(r)
    assert second.tokens[: len(first.tokens) + 2] == first.tokens + [901, 902]
    conv.system = "changed"  # the text no longer extends what was seen: tokenize it all
    assert 901 not in conv.prompt(r).tokens
    conv.clear()
    assert not conv.seen.tokens


@pytest.mark.parametrize("name", ["s.json", "s.md"])
def test_save_and_load_round_trip(tmp_path, name):
    conv = make_conv(2)
    conv.messages[1].content = "Code:\n\n```py\nx = 1\n```\n"  # trailing newline kept
    conv.messages[1].meta = {"stop_reason": "eos"}
    conv.first = 2
    path = conv.save(tmp_path / name)
    back = Conversation.load(path)
    assert back.system == conv.system and back.first == 2
    assert [(m.role, m.content) for m in back.messages] == [(m.role, m.content) for m in conv.messages]
    if name.endswith(".json"):
        assert json.loads(path.read_text())["format"] == "localspec-chat"
        assert back.messages[1].meta == {"stop_reason": "eos"}
    else:
        assert "### Assistant" in path.read_text()


def test_load_rejects_foreign_files(tmp_path):
    from localspec.core.errors import UsageError

    (tmp_path / "x.json").write_text('{"hello": 1}')
    (tmp_path / "x.md").write_text("# just notes\n")
    for name in ("x.json", "x.md", "missing.json"):
        with pytest.raises(UsageError):
            Conversation.load(tmp_path / name)


# ----- the runner on a real model ---------------------------------------------------------


def make_runner(target, draft=None, mode="none", max_tokens=16, **kw) -> ChatRunner:
    target.rewind(0)
    spec = SpecConfig(mode=mode, draft_max=4)
    return ChatRunner(Runtime(target, draft), spec=spec, sampling=GREEDY,
                      gen=GenerationConfig(max_tokens=max_tokens), log=False, **kw)


def drain(runner, text, should_stop=None):
    stream = runner.reply(text, should_stop)
    try:
        return list(stream)
    finally:
        stream.close()


def test_turn_two_reuses_the_kv_prefix(smol):
    runner = make_runner(smol)
    drain(runner, "Name a colour.")
    drain(runner, "Name another one.")
    first, second = runner.turns
    history = second.prompt_tokens  # the whole conversation
    assert first.prefill_tokens == first.prompt_tokens
    assert second.prefill_tokens < history
    # only the new turn (and the reply's last token, never decoded) is prefilled
    assert second.prefill_tokens <= history - (first.prompt_tokens + first.generated) + 1

    # the same turn without the cache prefills the whole history
    again = make_runner(smol, reuse_prefix=False)
    drain(again, "Name a colour.")
    drain(again, "Name another one.")
    assert again.turns[1].prefill_tokens == again.turns[1].prompt_tokens
    print(f"turn 2: prefilled {second.prefill_tokens}/{history} tokens with the cache, "
          f"ttft {second.ttft_s:.3f}s vs {again.turns[1].ttft_s:.3f}s re-prefilling")


def test_cancel_keeps_the_partial_reply(smol):
    runner = make_runner(smol, max_tokens=64)
    calls = []

    def stop_after_three_rounds() -> bool:
        calls.append(1)
        return len(calls) > 3

    events = drain(runner, "Count from one to fifty.", should_stop=stop_after_three_rounds)
    assert runner.turns[-1].stop_reason == "cancelled"
    assert runner.conv.messages[-1].role == "assistant"
    assert runner.conv.messages[-1].content.strip()
    assert runner.turns[-1].generated < 64
    assert events  # Token, Round and a Done


def test_context_full_drops_oldest_turns_with_a_notice(smol_path):
    from localspec.chat.runner import Trimmed
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    with Model(ModelConfig(path=smol_path, n_ctx=256)) as small:  # llama.cpp's smallest
        runner = make_runner(small, max_tokens=16)
        padding = " ".join(["Please be precise and brief in what you answer."] * 6)
        notices = []
        for i in range(4):
            events = drain(runner, f"Question {i}: what is {i} + {i}? {padding}")
            notices += [e for e in events if isinstance(e, Trimmed)]
            assert small.n_past <= small.n_ctx
        assert notices and runner.conv.first > 0
        assert len(runner.conv.in_context) < len(runner.conv.messages) == 8  # the transcript is whole


def test_commands_change_settings(smol, smol_draft, tmp_path):
    runner = make_runner(smol, smol_draft, mode="model")
    assert "k fixed at 3" in runner.apply(parse("/k 3"))
    assert runner.spec.draft_max == 3 and not runner.spec.adaptive
    assert "adapts" in runner.apply(parse("/k auto"))
    assert runner.spec.adaptive and runner.spec.draft_max == 4
    runner.apply(parse("/spec ngram"))
    assert runner.spec.mode == "ngram" and runner.drafter().name == "ngram"
    runner.apply(parse("/temp 0.8"))
    assert runner.sampling.temperature == 0.8
    runner.apply(parse("/system Answer in French."))
    assert runner.conv.system == "Answer in French."
    assert "Answer in French." in runner.apply(parse("/system"))
    no_draft = make_runner(smol)
    with pytest.raises(CommandError, match="needs a draft model"):
        no_draft.apply(parse("/spec hybrid"))
    out = runner.apply(parse(f"/save {tmp_path / 'c.json'}"))
    assert "saved" in out and (tmp_path / "c.json").exists()


# ----- the textual app, headless -------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


async def submit(pilot, app, text: str) -> None:
    from textual.widgets import Input

    app.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await pilot.pause()


async def wait_reply(pilot, app, timeout: float = 120.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if not app.generating:
            break
        await pilot.pause(0.05)
    await app.workers.wait_for_complete()
    await pilot.pause()
    assert not app.generating


def notices(app) -> list[str]:
    from localspec.chat.widgets import Notice

    return [str(n.content) for n in app.query(Notice)]


def test_app_streams_a_reply_with_draft_tokens_styled(smol, smol_draft):
    from localspec.chat.app import ChatApp
    from localspec.chat.widgets import AssistantMessage, StatusBar, UserMessage

    runner = make_runner(smol, smol_draft, mode="model", max_tokens=24)

    async def go():
        app = ChatApp(runner, text_hz=1000.0)  # flush every token: the stream is visible
        async with app.run_test(size=(120, 40)) as pilot:
            await submit(pilot, app, "Write one sentence about the sea.")
            assert app.generating or runner.turns  # the worker runs; the UI keeps going
            await wait_reply(pilot, app)
            assert str(app.query_one(UserMessage).content) == "Write one sentence about the sea."
            msg = app.query_one(AssistantMessage)
            assert msg.text.strip() and msg.text == runner.conv.messages[-1].content
            assert app.render_stats.updates >= 2  # streamed, not dropped in at the end
            drafted = "".join(t for t, d in msg.pieces if d)
            assert drafted, "SmolLM2 drafting for itself: greedy drafts are accepted"

            # raw view: the whole reply as generated, draft-sourced runs in the draft style
            await pilot.press("f3")
            assert app.screen.has_class("-raw")
            style = msg.draft_style()
            assert style and (style.color or style.underline)
            texts = [run.content for run in msg.runs() if run.display]
            assert "".join(t.plain for t in texts) == msg.text
            styled = "".join(t.plain[s.start : s.end] for t in texts for s in t.spans if s.style == style)
            assert styled == drafted
            await pilot.press("f2")  # colours off: no styled spans
            assert not [s for run in msg.runs() for s in run.content.spans if s.style]

            status = str(app.query_one(StatusBar).content)
            for part in ("ready", "tok/s", "accept ", "mean acc", "k ", "model",
                         "SmolLM2-135M-Instruct.Q4_1", f"ctx {smol.n_past}/{smol.n_ctx}", "ttft"):
                assert part in status, (part, status)
            assert re.match(r"\d+ tokens · [\d.]+ tok/s", msg.border_subtitle)

    run(go())


def test_app_escape_cancels_and_stays_responsive(smol):
    from localspec.chat.app import ChatApp
    from localspec.chat.widgets import AssistantMessage

    runner = make_runner(smol, mode="ngram", max_tokens=400)
    # On a fast machine the reply could end before the commands below are typed: hold
    # the worker (not the UI) after a few events until the test has acted.
    gate = threading.Event()
    reply = runner.reply

    def held(text, should_stop=None):
        for i, ev in enumerate(reply(text, should_stop)):
            yield ev
            if i == 5:
                gate.wait(60)

    runner.reply = held

    async def go():
        app = ChatApp(runner, text_hz=1000.0)
        async with app.run_test(size=(100, 30)) as pilot:
            await submit(pilot, app, "List the numbers from 1 to 300, one per line.")
            msg = app.query_one(AssistantMessage)
            for _ in range(2400):
                if msg.pieces:
                    break
                await pilot.pause(0.05)
            assert app.generating
            await submit(pilot, app, "/help")  # handled while the worker generates
            assert any("/spec" in n for n in notices(app))
            await submit(pilot, app, "/clear")
            assert any("waits until the reply ends" in n for n in notices(app))
            await pilot.press("escape")
            gate.set()
            await wait_reply(pilot, app, timeout=30)
            turn = runner.turns[-1]
            assert turn.stop_reason == "cancelled" and turn.generated < 400
            assert msg.text == runner.conv.messages[-1].content and msg.text.strip()
            assert "stopped" in msg.border_subtitle

    run(go())


def test_app_slash_commands(smol, tmp_path):
    from localspec.chat.app import ChatApp
    from localspec.chat.widgets import AssistantMessage, UserMessage

    runner = make_runner(smol, mode="ngram", max_tokens=8)

    async def go():
        app = ChatApp(runner)
        async with app.run_test(size=(100, 30)) as pilot:
            await submit(pilot, app, "/k 5")
            assert runner.spec.draft_max == 5 and "k fixed at 5" in notices(app)[-1]
            await submit(pilot, app, "/spec none")
            assert runner.spec.mode == "none"
            await submit(pilot, app, "/temp 0.3")
            assert runner.sampling.temperature == 0.3
            await submit(pilot, app, "/temp 0")
            await submit(pilot, app, "/system Reply in one word.")
            assert runner.conv.system == "Reply in one word."
            await submit(pilot, app, "/nope")
            assert "unknown command /nope" in notices(app)[-1]
            await submit(pilot, app, "Hello")
            await wait_reply(pilot, app)
            await submit(pilot, app, "/stats")
            assert "plain" in notices(app)[-1] and "UI thread CPU" in notices(app)[-1]
            await submit(pilot, app, f"/save {tmp_path / 'chat.md'}")
            saved = Conversation.load(tmp_path / "chat.md")
            assert saved.system == "Reply in one word." and saved.messages[0].content == "Hello"
            await submit(pilot, app, "/clear")
            assert not runner.conv.messages and not app.query(UserMessage)
            assert not app.query(AssistantMessage)
            await submit(pilot, app, "/quit")
            assert app.return_code == 0 or not app.is_running

    run(go())


def test_app_resumes_a_saved_conversation(smol):
    from localspec.chat.app import ChatApp
    from localspec.chat.widgets import AssistantMessage, UserMessage

    conv = Conversation(system="be kind")
    conv.add("user", "What is **markdown**?")
    conv.add("assistant", "A *format*.\n\n```py\nprint(1)\n```\n\nDone.")
    runner = make_runner(smol)
    runner.conv = conv

    async def go():
        app = ChatApp(runner)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            assert len(app.query(UserMessage)) == 1
            msg = app.query_one(AssistantMessage)
            assert msg.text == conv.messages[1].content and msg.finished
            from textual.widgets import Markdown

            assert "print(1)" in msg.query_one(Markdown).source
            assert any("resumed 2 messages" in n for n in notices(app))

    run(go())
