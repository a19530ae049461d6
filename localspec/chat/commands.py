"""Slash commands: parsing and validation, shared by the textual app and the REPL.

A line is a command when it starts with `/` and a word (`/k 4`); `/usr/bin/env is
broken` is a message, and `//k` sends `/k` literally.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from localspec.core.config import SPEC_MODES, SpecMode

COMMANDS = {
    "help": ("", "show this help"),
    "clear": ("", "forget the conversation (keeps the system message)"),
    "system": ("TEXT", "set the system message; without TEXT, show it; '-' removes it"),
    "k": ("N|auto", "draft N tokens per round, or let k adapt"),
    "spec": ("none|ngram|model|hybrid", "choose the drafter"),
    "temp": ("X", "sampling temperature (0: greedy)"),
    "stats": ("", "this conversation's speed and acceptance per drafter"),
    "save": ("FILE", "save the conversation (.md: markdown, else JSON)"),
    "quit": ("", "leave"),
}
ALIASES = {"exit": "quit", "q": "quit", "h": "help", "?": "help", "temperature": "temp"}
# commands that change nothing a running generation uses
WHILE_GENERATING = ("help", "stats", "quit")

_COMMAND = re.compile(r"^/([A-Za-z?]+)(?:\s+(.*))?$", re.DOTALL)


class CommandError(ValueError):
    """A bad command or argument; the message is the hint shown to the user."""


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""
    value: object = None  # the parsed argument: int | "auto" for k, a SpecMode for spec, float for temp, ...


def unescape(line: str) -> str:
    """`//text` sends `/text`."""
    stripped = line.lstrip()
    return stripped[1:] if stripped.startswith("//") else line


def parse(line: str) -> Command | None:
    """The command on this line, None when the line is a message. Raises CommandError
    (with a hint) for an unknown command or a bad argument."""
    if line.lstrip().startswith("//"):
        return None
    m = _COMMAND.match(line.strip())
    if m is None:
        return None
    name, arg = m.group(1).lower(), (m.group(2) or "").strip()
    name = ALIASES.get(name, name)
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.5)
        hint = f"did you mean /{close[0]}? " if close else ""
        raise CommandError(f"unknown command /{name}: {hint}/help lists the commands")
    return Command(name, arg, _value(name, arg))


def _value(name: str, arg: str) -> object:
    if name == "k":
        if arg.lower() == "auto":
            return "auto"
        try:
            k = int(arg)
        except ValueError:
            raise CommandError("usage: /k N (1-64) or /k auto") from None
        if not 1 <= k <= 64:
            raise CommandError("k must be 1-64 (/spec none turns drafting off)")
        return k
    if name == "spec":
        if arg.lower() not in SPEC_MODES:
            raise CommandError(f"usage: /spec {'|'.join(SPEC_MODES)}")
        return SpecMode(arg.lower())
    if name == "temp":
        try:
            t = float(arg)
        except ValueError:
            raise CommandError("usage: /temp X (0 is greedy)") from None
        if not 0.0 <= t <= 5.0:
            raise CommandError("temperature must be between 0 and 5")
        return t
    if name == "save" and not arg:
        raise CommandError("usage: /save FILE (.md for markdown, else JSON)")
    return arg or None


def help_text() -> str:
    width = max(len(f"/{n} {a}") for n, (a, _) in COMMANDS.items())
    lines = [f"  {f'/{n} {a}'.rstrip():<{width}}  {doc}" for n, (a, doc) in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines) + "\n  //text sends a message that starts with /"
