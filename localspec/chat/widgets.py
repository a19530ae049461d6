"""The chat's widgets: messages, notices, the status bar. They hold text and styles
only; the app feeds them coalesced pieces of the reply."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from localspec.chat.streaming import BlockSplitter, Piece


class UserMessage(Static):
    """What the user typed, shown as typed (no markup)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), markup=False)


class Notice(Static):
    """A line from the chat itself: command output, a dropped-turns notice, an error."""

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(Text(text), markup=False, classes=f"-{kind}")


class StatusBar(Static):
    """One line of numbers, set a few times a second while generating."""


class AssistantMessage(Vertical):
    """A streamed reply. Complete markdown blocks are rendered by a Markdown widget;
    the block still being written is a plain-text tail in which draft-sourced tokens
    carry the `assistant--draft` style. In raw view the whole reply is that text."""

    COMPONENT_CLASSES = {"assistant--draft"}

    def __init__(self, text: str = "", *, show_draft: bool = True, raw: bool = False) -> None:
        super().__init__()
        self.pieces: list[Piece] = []  # the whole reply, (text, from_draft) runs
        self.tail: list[Piece] = []  # the part not yet handed to the Markdown widget
        self.splitter = BlockSplitter()
        self.show_draft = show_draft
        self.raw = raw
        self.finished = False
        self._initial = text

    def compose(self) -> ComposeResult:
        yield Markdown(classes="blocks")
        yield Static("", classes="tail", markup=False)

    def on_mount(self) -> None:
        if self._initial:  # a resumed reply: complete from the start, no draft marks
            self.add([(self._initial, False)])
            self.finish()

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)

    def add(self, pieces: list[Piece]) -> None:
        """Append streamed pieces: complete blocks go to markdown, the rest stays tail."""
        if not pieces:
            return
        self.pieces.extend(pieces)
        self.tail.extend(pieces)
        done = self.splitter.feed("".join(t for t, _ in pieces))
        if done:
            self.query_one(Markdown).append(done)
            _drop_front(self.tail, len(done))
        self._draw_tail()

    def finish(self, note: str = "") -> None:
        """The reply ended: the last block is complete too."""
        rest = self.splitter.flush()
        if rest.strip():
            self.query_one(Markdown).append(rest)
        self.tail.clear()
        self.finished = True
        if note:
            self.border_subtitle = note
        self._draw_tail()

    def set_view(self, *, show_draft: bool, raw: bool) -> None:
        self.show_draft, self.raw = show_draft, raw
        self._draw_tail()

    def tail_text(self) -> Text:
        """The plain-text part as displayed: draft-sourced runs styled when enabled."""
        style = self.get_component_rich_style("assistant--draft", partial=True) if self.show_draft else None
        text = Text()
        for piece, from_draft in self.pieces if self.raw else self.tail:
            text.append(piece, style if from_draft and style else None)
        return text

    def _draw_tail(self) -> None:
        tail = self.query_one(".tail", Static)
        tail.update(self.tail_text())
        tail.display = self.raw or bool(self.tail) or (not self.finished and not self.pieces)
        self.query_one(Markdown).display = not self.raw


def _drop_front(pieces: list[Piece], n: int) -> None:
    """Remove the first n characters from a list of pieces."""
    while n > 0 and pieces:
        text, from_draft = pieces[0]
        if len(text) <= n:
            pieces.pop(0)
            n -= len(text)
        else:
            pieces[0] = (text[n:], from_draft)
            n = 0
