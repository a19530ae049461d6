"""The textual chat app. As in textual's mother.py: the UI never touches the model; one
thread worker consumes the runner's event stream and hands the reply to the UI.

The worker never waits for the screen: pieces go into a Coalescer, and the worker
posts a `Flush` message (non-blocking) when one is due and none is pending; the UI
drains everything collected when it gets to it. So text is drawn at most 4 times a
second and the status bar twice, a slow terminal gets fewer, bigger updates, and
generation speed does not depend on drawing speed. (A blocking `call_from_thread` per
update was measured to stall generation for most of its time at 100 tok/s.) The rare
events, the start and end of a reply, use `call_from_thread`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Input

from localspec.chat.commands import (
    WHILE_GENERATING,
    Command,
    CommandError,
    parse,
    unescape,
)
from localspec.chat.runner import ChatRunner, Trimmed
from localspec.chat.streaming import Coalescer
from localspec.chat.widgets import AssistantMessage, Notice, StatusBar, UserMessage
from localspec.core.engine import Done, Token
from localspec.core.errors import LocalspecError
from localspec.core.events import StopReason


@dataclass
class Flush(Message):
    """Posted by the worker: new pieces of `reply` wait in `coalescer`."""

    reply: AssistantMessage
    coalescer: Coalescer


class RenderStats:
    """What keeping the screen up to date cost, for /stats: the UI thread's CPU time
    while replies were generated (drawing included) against their wall time."""

    def __init__(self) -> None:
        self.updates = 0
        self.handler_s = 0.0  # applying updates to widgets
        self.ui_cpu_s = 0.0  # all UI thread CPU time during replies: handlers, layout, drawing
        self.generating_s = 0.0

    def text(self) -> str:
        share = self.ui_cpu_s / self.generating_s if self.generating_s else 0.0
        return (f"screen: {self.updates} updates in {self.generating_s:.1f}s of generation; UI thread "
                f"CPU {self.ui_cpu_s:.2f}s ({share:.1%}), update handlers {self.handler_s * 1000:.0f} ms")


class ChatApp(App):
    """`localspec chat` on a terminal."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses live elsewhere
    TITLE = "localspec chat"
    BINDINGS = [
        Binding("escape", "stop", "stop reply", priority=True),
        Binding("ctrl+c", "stop", "stop reply", show=False, priority=True),
        Binding("f2", "toggle_draft", "draft colours"),
        Binding("f3", "toggle_raw", "markdown/raw"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    # Each screen update costs UI-thread CPU (layout, markdown, the compositor), taken
    # from llama.cpp's threads on a small machine: a few updates a second keep the
    # slowdown small (scripts/bench_chat.py; docs/measurements.md).
    def __init__(self, runner: ChatRunner, *, text_hz: float = 4.0, status_hz: float = 2.0) -> None:
        super().__init__()
        self.runner = runner
        self.text_hz, self.status_hz = text_hz, status_hz
        self.cancel = threading.Event()
        self.generating = False
        self.show_draft = True
        self.raw = False
        self.render_stats = RenderStats()
        self._started = (0.0, 0.0)  # (wall, UI thread CPU) when the reply started

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="log")
        yield Input(placeholder="Message  (/help for commands, Esc stops a reply)", id="prompt")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        log = self.query_one("#log", VerticalScroll)
        log.anchor()
        conv = self.runner.conv
        widgets = []
        if conv.system:
            widgets.append(Notice(f"system: {conv.system}"))
        for i, m in enumerate(conv.messages):
            if i == conv.first and i:
                widgets.append(Notice("(the model's context starts here)", "warning"))
            widgets.append(UserMessage(m.content) if m.role == "user" else self._assistant(m.content))
        if widgets:
            await log.mount_all(widgets)
            await log.mount(Notice(f"resumed {len(conv.messages)} messages"))
        self.update_status()
        self.query_one("#prompt", Input).focus()

    # ----- input ---------------------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        line = event.value
        event.input.clear()
        if not line.strip():
            return
        try:
            cmd = parse(line)
        except CommandError as exc:
            await self.note(str(exc), "hint")
            return
        if cmd is not None:
            await self.run_command(cmd)
        elif self.generating:
            await self.note("still replying: wait, or press Esc to stop it", "hint")
        else:
            await self.send(unescape(line))

    async def send(self, text: str) -> None:
        """Show the user's message and an empty reply, and start generating into it."""
        log = self.query_one("#log", VerticalScroll)
        reply = self._assistant("")
        await log.mount_all([UserMessage(text), reply])
        log.anchor()
        self.cancel.clear()
        self.generating = True
        self._started = (time.perf_counter(), time.thread_time())
        self.generate(text, reply)

    async def run_command(self, cmd: Command) -> None:
        if cmd.name == "quit":
            self.action_quit_chat()
            return
        if self.generating and cmd.name not in WHILE_GENERATING:
            await self.note(f"/{cmd.name} waits until the reply ends (Esc stops it)", "hint")
            return
        try:
            text = self.runner.apply(cmd)
        except CommandError as exc:
            await self.note(str(exc), "hint")
            return
        except (OSError, LocalspecError) as exc:
            await self.note(str(exc), "error")
            return
        if cmd.name == "clear":
            await self.query_one("#log", VerticalScroll).remove_children()
        if cmd.name == "stats":
            text += "\n" + self.render_stats.text()
        await self.note(text)
        self.update_status()

    async def note(self, text: str, kind: str = "info") -> Notice:
        notice = Notice(text, kind)
        await self.query_one("#log", VerticalScroll).mount(notice)
        return notice

    # ----- the worker ---------------------------------------------------------------

    @work(thread=True, exclusive=True, group="reply")
    def generate(self, text: str, reply: AssistantMessage) -> None:
        """Consume the engine stream in this thread; never wait for the screen."""
        co = Coalescer(self.text_hz, self.status_hz)
        stream = self.runner.reply(text, self.cancel.is_set)
        error = None
        try:
            for ev in stream:
                if isinstance(ev, Trimmed):
                    self._call(self._show_trimmed, ev)
                piece = ev.text if isinstance(ev, (Token, Done)) else ""
                if co.add(piece, isinstance(ev, Token) and ev.from_draft):
                    self.post_message(Flush(reply, co))
        except LocalspecError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - shown in the chat, never a crash screen
            error = f"{type(exc).__name__}: {exc}"
        finally:
            stream.close()
            self._call(self._finish, reply, co, error)

    def _call(self, fn: Callable, *args) -> None:
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:
            pass  # the app has exited: nothing to draw on

    def on_flush(self, message: Flush) -> None:
        t = time.perf_counter()
        pieces, status = message.coalescer.take()
        message.reply.add(pieces)
        if status:
            self.query_one(StatusBar).set(self.runner.status_text(stopping=self.cancel.is_set()))
        self.render_stats.updates += 1
        self.render_stats.handler_s += time.perf_counter() - t

    async def _show_trimmed(self, ev: Trimmed) -> None:
        log = self.query_one("#log", VerticalScroll)
        notice = Notice(f"context full: dropped the {ev.dropped} oldest messages from the model's "
                        f"context ({ev.remaining} remain; the transcript keeps them)", "warning")
        user = list(log.query(UserMessage))[-1:]
        await log.mount(notice, before=user[0] if user else None)

    async def _finish(self, reply: AssistantMessage, co: Coalescer, error: str | None) -> None:
        reply.add(co.take()[0])
        turn = self.runner.turns[-1] if self.runner.turns else None
        note = ""
        if turn is not None and not error:
            note = f"{turn.generated} tokens · {turn.tokens_per_s:.1f} tok/s"
            if turn.stop_reason not in (StopReason.EOS, StopReason.STOP):
                note += f" · {'stopped' if turn.stop_reason == StopReason.CANCELLED else turn.stop_reason}"
        reply.finish(note)
        self.update_status()
        self.generating = False
        wall, cpu = self._started
        self.render_stats.generating_s += time.perf_counter() - wall
        self.render_stats.ui_cpu_s += time.thread_time() - cpu
        if error:
            if not reply.pieces:
                await reply.remove()  # nothing was generated: no empty reply box
            await self.note(error, "error")
        elif turn is not None and turn.stop_reason == StopReason.CONTEXT:
            await self.note("the context is full: the oldest turns will be dropped next time", "warning")

    # ----- actions ---------------------------------------------------------------

    def action_stop(self) -> None:
        """Esc / Ctrl-C: stop the reply after the round in flight; keep its text."""
        if self.generating:
            self.cancel.set()  # the engine stops after the round in flight
            self.query_one(StatusBar).set(self.runner.status_text(stopping=True))
        else:
            self.notify("nothing to stop (Ctrl-Q or /quit leaves)", timeout=2)

    def action_toggle_draft(self) -> None:
        self.show_draft = not self.show_draft
        for msg in self.query(AssistantMessage):
            msg.set_view(show_draft=self.show_draft)
        self.notify("draft tokens " + ("highlighted" if self.show_draft else "plain"), timeout=2)

    def action_toggle_raw(self) -> None:
        self.raw = not self.raw
        self.screen.set_class(self.raw, "-raw")
        self.notify("raw tokens" if self.raw else "markdown", timeout=2)

    def action_quit_chat(self) -> None:
        self.cancel.set()
        self.exit()

    async def action_quit(self) -> None:
        self.action_quit_chat()

    def _assistant(self, text: str) -> AssistantMessage:
        return AssistantMessage(text, show_draft=self.show_draft)

    def update_status(self) -> None:
        self.query_one(StatusBar).set(self.runner.status_text())


def run_app(runner: ChatRunner) -> None:
    """Run the app; on exit, wait for the worker to let go of the model."""
    app = ChatApp(runner)
    try:
        app.run()
    finally:
        app.cancel.set()
        if runner.busy.acquire(timeout=30):
            runner.busy.release()
    if runner.session_path is not None:
        print(f"conversation saved to {Path(runner.session_path)}")
