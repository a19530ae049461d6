"""The textual chat app. As in textual's mother.py: the UI never touches the model; one
thread worker consumes the runner's event stream and posts coalesced updates to the UI
with `call_from_thread` (text ~20 times a second, the status bar ~4 times)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Input

from localspec.chat.commands import WHILE_GENERATING, Command, CommandError, parse, unescape
from localspec.chat.runner import ChatRunner, Trimmed
from localspec.chat.streaming import Coalescer, Piece
from localspec.chat.widgets import AssistantMessage, Notice, StatusBar, UserMessage
from localspec.engine import Done, Token
from localspec.errors import LocalspecError


class RenderStats:
    """What keeping the screen up to date cost the generation, for /stats."""

    def __init__(self) -> None:
        self.updates = 0
        self.handler_s = 0.0  # in the UI thread, applying updates to widgets
        self.blocked_s = 0.0  # in the worker, waiting on call_from_thread
        self.generating_s = 0.0  # wall time of all replies

    def text(self) -> str:
        share = self.blocked_s / self.generating_s if self.generating_s else 0.0
        return (f"screen updates: {self.updates} in {self.generating_s:.1f}s of generation; "
                f"generation waited {self.blocked_s * 1000:.0f} ms on the UI ({share:.2%}), "
                f"update handlers took {self.handler_s * 1000:.0f} ms")


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

    def __init__(self, runner: ChatRunner, *, text_hz: float = 20.0, status_hz: float = 4.0) -> None:
        super().__init__()
        self.runner = runner
        self.text_hz, self.status_hz = text_hz, status_hz
        self.cancel = threading.Event()
        self.generating = False
        self.show_draft = True
        self.raw = False
        self.render_stats = RenderStats()

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
        """Consume the engine stream in this thread; post coalesced updates to the UI."""
        co = Coalescer(self.text_hz, self.status_hz)
        stream = self.runner.reply(text, self.cancel.is_set)
        t0 = time.perf_counter()
        error = None
        try:
            for ev in stream:
                if isinstance(ev, Token):
                    co.add(ev.text, ev.from_draft)
                elif isinstance(ev, Done):
                    co.add(ev.text, False)
                elif isinstance(ev, Trimmed):
                    self._post(self._show_trimmed, ev)
                text_due, status_due = co.due()
                if text_due or status_due:
                    status = self.runner.status_text(stopping=self.cancel.is_set()) if status_due else None
                    self._post(self._apply, reply, co.take(status_due), status)
        except LocalspecError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - shown in the chat, never a crash screen
            error = f"{type(exc).__name__}: {exc}"
        finally:
            stream.close()
            self.render_stats.generating_s += time.perf_counter() - t0
            self._post(self._finish, reply, co.take(True), self.runner.status_text(), error)

    def _post(self, fn: Callable, *args) -> None:
        t = time.perf_counter()
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:
            pass  # the app has exited: nothing to draw on
        self.render_stats.blocked_s += time.perf_counter() - t

    def _apply(self, reply: AssistantMessage, pieces: list[Piece], status: str | None) -> None:
        t = time.perf_counter()
        reply.add(pieces)
        if status is not None:
            self.query_one(StatusBar).update(status)
        self.render_stats.updates += 1
        self.render_stats.handler_s += time.perf_counter() - t

    async def _show_trimmed(self, ev: Trimmed) -> None:
        log = self.query_one("#log", VerticalScroll)
        notice = Notice(f"context full: dropped the {ev.dropped} oldest messages from the model's "
                        f"context ({ev.remaining} remain; the transcript keeps them)", "warning")
        user = list(log.query(UserMessage))[-1:]
        await log.mount(notice, before=user[0] if user else None)

    async def _finish(self, reply: AssistantMessage, pieces: list[Piece], status: str,
                      error: str | None) -> None:
        reply.add(pieces)
        turn = self.runner.turns[-1] if self.runner.turns else None
        note = ""
        if turn is not None and not error:
            note = f"{turn.generated} tokens · {turn.tokens_per_s:.1f} tok/s"
            if turn.stop_reason not in ("eos", "stop"):
                note += f" · {'stopped' if turn.stop_reason == 'cancelled' else turn.stop_reason}"
        reply.finish(note)
        self.query_one(StatusBar).update(status)
        self.generating = False
        if error:
            if not reply.pieces:
                await reply.remove()  # nothing was generated: no empty reply box
            await self.note(error, "error")
        elif turn is not None and turn.stop_reason == "context":
            await self.note("the context is full: the oldest turns will be dropped next time", "warning")

    # ----- actions ---------------------------------------------------------------

    def action_stop(self) -> None:
        """Esc / Ctrl-C: stop the reply after the round in flight; keep its text."""
        if self.generating:
            self.cancel.set()  # the engine stops after the round in flight
            self.query_one(StatusBar).update(self.runner.status_text(stopping=True))
        else:
            self.notify("nothing to stop (Ctrl-Q or /quit leaves)", timeout=2)

    def action_toggle_draft(self) -> None:
        self.show_draft = not self.show_draft
        self._set_views()
        self.notify("draft tokens " + ("highlighted" if self.show_draft else "plain"), timeout=2)

    def action_toggle_raw(self) -> None:
        self.raw = not self.raw
        self._set_views()
        self.notify("raw tokens" if self.raw else "markdown", timeout=2)

    def action_quit_chat(self) -> None:
        self.cancel.set()
        self.exit()

    async def action_quit(self) -> None:
        self.action_quit_chat()

    def _set_views(self) -> None:
        for msg in self.query(AssistantMessage):
            msg.set_view(show_draft=self.show_draft, raw=self.raw)

    def _assistant(self, text: str) -> AssistantMessage:
        return AssistantMessage(text, show_draft=self.show_draft, raw=self.raw)

    def update_status(self) -> None:
        self.query_one(StatusBar).update(self.runner.status_text())


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
