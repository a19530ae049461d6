"""The chat's widgets: messages, notices, the status bar. They hold text and styles
only; the app feeds them coalesced pieces of the reply.

Drawing cost is kept bounded while a reply streams: only a short live tail is redrawn
per update. Complete markdown blocks go to a Markdown widget (and, for the raw view, to
a Run each); lines of a long block still being written (a code fence) are frozen into
Runs of a few lines that are drawn once."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from localspec.chat.streaming import BlockSplitter, Piece

FREEZE_LINES = 8  # the live tail is redrawn on every update: keep it this short


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

    def set(self, text: str) -> None:
        self.update(text, layout=False)  # one line, always: no need to re-layout the screen


class Run(Static):
    """Reply text as generated: (text, from_draft) pieces, draft-sourced ones styled."""

    def __init__(self, pieces: list[Piece], style: Style | None, classes: str) -> None:
        self.pieces = pieces
        super().__init__(styled(pieces, style), markup=False, classes=classes)

    def restyle(self, style: Style | None) -> None:
        self.update(styled(self.pieces, style))


def styled(pieces: list[Piece], style: Style | None) -> Text:
    text = Text()
    for piece, from_draft in pieces:
        text.append(piece, style if from_draft and style else None)
    return text


class AssistantMessage(Vertical):
    """A streamed reply: markdown for complete blocks (or raw Runs, in raw view), then
    frozen Runs of the block being written, then the live Run."""

    COMPONENT_CLASSES = {"assistant--draft"}

    def __init__(self, text: str = "", *, show_draft: bool = True) -> None:
        super().__init__()
        self.pieces: list[Piece] = []  # the whole reply
        self.frozen: list[Piece] = []  # the incomplete block's lines already drawn
        self.live: list[Piece] = []  # the rest: redrawn on each update
        self.splitter = BlockSplitter()
        self.show_draft = show_draft
        self.finished = False
        self._initial = text
        self._live_shape = (0, 0)

    def compose(self) -> ComposeResult:
        yield Markdown(classes="blocks")
        yield Vertical(classes="raw")
        yield Run([], None, classes="live")

    def on_mount(self) -> None:
        if self._initial:  # a resumed reply: complete from the start, no draft marks
            self.add([(self._initial, False)])
            self.finish()

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)

    def draft_style(self) -> Style | None:
        if not self.show_draft:
            return None
        return self.get_component_rich_style("assistant--draft", partial=True)

    def add(self, pieces: list[Piece]) -> None:
        """Append streamed pieces: complete blocks go to markdown, the rest stays live."""
        if not pieces:
            return
        self.pieces.extend(pieces)
        self.live.extend(pieces)
        done = self.splitter.feed("".join(t for t, _ in pieces))
        if done:
            self._complete(done)
        self._freeze()
        self._draw_live()

    def finish(self, note: str = "") -> None:
        """The reply ended: the last block is complete too."""
        rest = self.splitter.flush()
        if rest:
            self._complete(rest)
        self.finished = True
        if note:
            self.border_subtitle = note
        self._draw_live()

    def set_view(self, *, show_draft: bool) -> None:
        self.show_draft = show_draft
        style = self.draft_style()
        for run in self.query(Run):
            run.restyle(style)

    def runs(self) -> list[Run]:
        """What the raw view shows, in order."""
        return list(self.query(Run))

    def _complete(self, done: str) -> None:
        # the complete blocks leave the frozen and live parts for markdown (and a raw Run)
        block = self.frozen + self.live
        taken = _take_front(block, len(done))
        self.frozen, self.live = [], block
        for run in self.query(".frozen"):
            run.remove()
        if done.strip():
            self.query_one(Markdown).append(done)
        self.query_one(".raw", Vertical).mount(Run(taken, self.draft_style(), classes="block"))

    def _freeze(self) -> None:
        text = "".join(t for t, _ in self.live)
        if text.count("\n") < FREEZE_LINES:
            return
        lines = _take_front(self.live, text.rfind("\n") + 1)
        self.frozen.extend(lines)
        self.mount(Run(lines, self.draft_style(), classes="frozen"), before=self.query_one(".live"))

    def _draw_live(self) -> None:
        live = self.query_one(".live", Run)
        live.pieces = self.live
        text = "".join(t for t, _ in self.live)
        # re-layout the screen only when the tail's height may have changed
        width = max(live.content_size.width, 1)
        shape = (text.count("\n"), (len(text) - text.rfind("\n") - 1) // width)
        live.update(styled(self.live, self.draft_style()), layout=shape != self._live_shape)
        self._live_shape = shape
        live.display = bool(self.live) or not (self.finished or self.pieces)


def _take_front(pieces: list[Piece], n: int) -> list[Piece]:
    """Remove the first n characters from a list of pieces; return them as pieces."""
    taken: list[Piece] = []
    while n > 0 and pieces:
        text, from_draft = pieces[0]
        if len(text) <= n:
            taken.append(pieces.pop(0))
            n -= len(text)
        else:
            taken.append((text[:n], from_draft))
            pieces[0] = (text[n:], from_draft)
            n = 0
    return taken
