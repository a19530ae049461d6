"""Helpers between the engine's token stream and a display, with no UI toolkit in
them: split streamed markdown into complete blocks, and coalesce updates so drawing
happens a few times a second rather than once per token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Piece = tuple[str, bool]  # (text, from_draft)


class BlockSplitter:
    """Feed streamed markdown; get back the text of blocks that are complete.

    A block ends at a blank line outside a code fence, or at the line closing a fence.
    Only whole lines are examined, so a fence marker split across tokens is never
    mistaken for text.
    """

    def __init__(self) -> None:
        self.pending = ""  # text not yet returned as complete
        self._scan = 0  # offset in `pending` of the first line not yet examined
        self._fence: str | None = None  # the open fence's marker (``` or ~~~, maybe longer)

    def feed(self, text: str) -> str:
        """Add streamed text; return the newly completed blocks ("" if none)."""
        self.pending += text
        boundary = 0
        while True:
            end = self.pending.find("\n", self._scan)
            if end < 0:
                break
            line = self.pending[self._scan : end]
            self._scan = end + 1
            if self._closes_block(line):
                boundary = self._scan
        done, self.pending = self.pending[:boundary], self.pending[boundary:]
        self._scan -= boundary
        return done

    def flush(self) -> str:
        """The end of the reply: whatever is left is complete."""
        out, self.pending, self._scan, self._fence = self.pending, "", 0, None
        return out

    def _closes_block(self, line: str) -> bool:
        stripped = line.strip()
        marker = _fence_marker(stripped)
        if self._fence is not None:
            # a closing fence: same character, at least as long, nothing after it
            if marker and marker[0] == self._fence[0] and len(marker) >= len(self._fence) \
                    and stripped == marker:
                self._fence = None
                return True
            return False
        if marker:
            self._fence = marker
            return False
        return stripped == ""


def _fence_marker(stripped: str) -> str:
    for ch in "`~":
        n = len(stripped) - len(stripped.lstrip(ch))
        if n >= 3:
            return ch * n
    return ""


class Coalescer:
    """Collects streamed pieces from the generating thread for the UI thread, and says
    when to ask the UI for a flush: text at most `text_hz` times a second, the status
    line `status_hz`, and never while a flush already asked for is pending, so a slow
    screen gets fewer, bigger updates and the generating thread never waits for it.
    Thread-safe; the clock is injectable for tests."""

    def __init__(self, text_hz: float = 20.0, status_hz: float = 4.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.text_interval = 1.0 / text_hz
        self.status_interval = 1.0 / status_hz
        self.clock = clock
        self.pieces: list[Piece] = []
        self._lock = threading.Lock()
        self._pending = False
        self._last_text = clock()
        self._last_status = float("-inf")  # the first status update goes out at once

    def add(self, text: str = "", from_draft: bool = False) -> bool:
        """Add a piece (or nothing: new numbers only). True when the caller should ask
        the UI to flush now; the UI then calls take()."""
        with self._lock:
            if text:
                if self.pieces and self.pieces[-1][1] == from_draft:
                    self.pieces[-1] = (self.pieces[-1][0] + text, from_draft)  # merge runs
                else:
                    self.pieces.append((text, from_draft))
            if self._pending:
                return False
            now = self.clock()
            text_due = bool(self.pieces) and now - self._last_text >= self.text_interval
            status_due = now - self._last_status >= self.status_interval
            self._pending = text_due or status_due
            return self._pending

    def take(self) -> tuple[list[Piece], bool]:
        """(the pieces collected since the last take, whether the status is due); ends
        the pending flush."""
        with self._lock:
            now = self.clock()
            out, self.pieces = self.pieces, []
            if out:
                self._last_text = now
            status = now - self._last_status >= self.status_interval
            if status:
                self._last_status = now
            self._pending = False
            return out, status
