"""`localspec chat` without a terminal: one prompt per line in, one reply out.

Replies go to stdout (each ends with a newline); command output, notices and errors
go to stderr, so `localspec chat < questions.txt > answers.txt` keeps answers clean.
Ctrl-C stops the reply being generated (a second one leaves); at the prompt it leaves.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from localspec.chat.commands import CommandError, parse, unescape
from localspec.chat.runner import ChatRunner, Trimmed
from localspec.core.engine import Done, Token
from localspec.core.errors import LocalspecError


def run_repl(runner: ChatRunner, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Read lines until EOF or /quit; returns the exit code."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            stderr.write("> ")
            stderr.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stderr.write("\n")
            return 130
        if not line:
            return 0
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        try:
            cmd = parse(line)
            if cmd is not None and cmd.name == "quit":
                return 0
            if cmd is not None:
                stderr.write(runner.apply(cmd) + "\n")
                continue
            reply(runner, unescape(line), stdout, stderr)
        except CommandError as exc:
            stderr.write(f"{exc}\n")
        except (LocalspecError, OSError) as exc:
            stderr.write(f"error: {exc}\n")
        except KeyboardInterrupt:
            stderr.write("\n")
            return 130
        stderr.flush()


def reply(runner: ChatRunner, text: str, stdout: TextIO, stderr: TextIO) -> None:
    """Stream one reply to stdout, ending it with a newline."""
    last = ""
    with _sigint_cancels() as cancel:
        stream = runner.reply(text, cancel.is_set)
        try:
            for ev in stream:
                piece = ev.text if isinstance(ev, (Token, Done)) else ""
                if piece:
                    stdout.write(piece)
                    stdout.flush()
                    last = piece
                elif isinstance(ev, Trimmed):
                    stderr.write(f"context full: dropped the {ev.dropped} oldest messages\n")
        finally:
            stream.close()
    if not last.endswith("\n"):
        stdout.write("\n")
    stdout.flush()
    if cancel.is_set():
        stderr.write("(stopped)\n")


@contextmanager
def _sigint_cancels() -> Iterator[threading.Event]:
    """While a reply streams, the first Ctrl-C asks the engine to stop after the round
    in flight (the KV cache stays consistent); the second raises KeyboardInterrupt."""
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return

    def handler(signum: int, frame: object) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)
