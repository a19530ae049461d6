"""Rewrite a file (or a range of its lines) with the target model, safely.

The model sees the text in one fenced block and answers with the whole edited text in
one fenced block; the reply is primed with the opening fence, so the generation is the
new text followed by the closing fence. The file's own tokens feed the n-gram drafter:
an edit is mostly a copy, which is what prompt lookup drafts for free.

Safety: binary and non-UTF-8 input is refused; nothing is written unless the closing
fence arrived; the write is atomic (temp file in the same directory, fsync, rename)
and keeps the mode bits, the line endings and the final newline of the original.
"""

from __future__ import annotations

import difflib
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.core.chat_template import render_chat
from localspec.core.errors import UsageError
from localspec.core.events import Done, Event, GenerationStats, Token, Transcript
from localspec.files import write_atomic  # noqa: F401 - the edit command writes with it

if TYPE_CHECKING:  # the text helpers stay importable without loading llama.cpp
    from localspec.core.backend import Model
    from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
    from localspec.core.drafters import Drafter

BOM = "\ufeff"

# Defaults of the shared spec flags for edits, where drafts are long copies of the file
# (chosen with scripts/replay_policy.py; a flag or an environment variable always wins):
# auto, which drafts a copied run whole once it has held long enough to pay on this
# machine's verify costs (up to 256 tokens: verify throughput still rises at 128 on a
# CPU), and short matches only where they have been right. It takes the draft model
# into account when one is given (--draft). In click's names (`localspec edit` applies
# them; the benchmark's edit tasks match n-grams the same way).
EDIT_SPEC_DEFAULTS = {"spec": "auto", "draft_max": 256, "ngram_min": 3, "ngram_max": 12}

SYSTEM_PROMPT = (
    "You are a precise code editor. You receive a text in a fenced block and an "
    "instruction. Reply with the complete edited text in one fenced block and nothing "
    "else: no explanations. Apply exactly what the instruction asks; keep every other "
    "line exactly as it is, with the same indentation, comments, blank lines and order."
)

LANGS = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx", ".json": "json", ".toml": "toml",
    ".yaml": "yaml", ".yml": "yaml", ".md": "markdown", ".rs": "rust", ".go": "go",
    ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".java": "java",
    ".kt": "kotlin", ".rb": "ruby", ".sh": "bash", ".bash": "bash", ".zsh": "zsh",
    ".html": "html", ".css": "css", ".sql": "sql", ".xml": "xml", ".ini": "ini",
    ".cfg": "ini", ".lua": "lua", ".php": "php", ".swift": "swift", ".cs": "csharp",
}


# ----- reading ------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A text file as read: `text` keeps the file's own line endings (BOM removed)."""

    name: str  # for messages and diff headers ("<stdin>" for -)
    data: bytes  # the exact bytes, to check nothing changed before replacing
    text: str
    bom: bool
    mode: int | None  # permission bits; None for stdin

    def encode(self, text: str) -> bytes:
        return ((BOM if self.bom else "") + text).encode("utf-8")


def decode_text(data: bytes, name: str) -> tuple[str, bool]:
    """(text, had_bom). Binary or non-UTF-8 input is a UsageError, never a guess."""
    if b"\0" in data:
        raise UsageError(f"{name}: looks binary (contains NUL bytes); refusing to edit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{name}: not UTF-8 text (invalid byte at offset {exc.start}); refusing to edit"
        ) from None
    if text.startswith(BOM):
        return text[1:], True
    return text, False


def read_source(path: str | Path) -> Source:
    """Read a regular file to edit; a missing, unreadable or binary file is a UsageError."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: not a regular file")
        data = p.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    text, bom = decode_text(data, str(path))
    return Source(str(path), data, text, bom, stat.S_IMODE(st.st_mode))


def source_from_bytes(data: bytes, name: str = "<stdin>") -> Source:
    text, bom = decode_text(data, name)
    return Source(name, data, text, bom, None)


# ----- line endings and ranges ----------------------------------------------------------


def detect_newline(text: str) -> str:
    """The file's dominant line ending: CRLF when most line breaks are CRLF."""
    crlf = text.count("\r\n")
    return "\r\n" if crlf and crlf * 2 >= text.count("\n") else "\n"


def to_lf(text: str) -> str:
    return text.replace("\r\n", "\n")


def from_lf(text: str, newline: str) -> str:
    return text if newline == "\n" else text.replace("\n", newline)


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split at "\n" only (str.splitlines also splits at form
    feeds and other separators, which editors and --lines do not count)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def parse_lines(spec: str) -> tuple[int | None, int | None]:
    """`A:B` (1-based, inclusive), `A:` (to the end) or `:B`; also `A-B`."""
    m = re.fullmatch(r"\s*(\d*)\s*[:-]\s*(\d*)\s*", spec)
    if not m or not (m.group(1) or m.group(2)):
        raise UsageError(f"--lines {spec!r}: expected A:B (1-based, inclusive), A: or :B")
    a = int(m.group(1)) if m.group(1) else None
    b = int(m.group(2)) if m.group(2) else None
    if (a is not None and a < 1) or (a is not None and b is not None and b < a):
        raise UsageError(f"--lines {spec}: need 1 <= A <= B")
    return a, b


@dataclass(frozen=True)
class Region:
    """The text to rewrite and what surrounds it. `head` and `tail` are kept byte for
    byte; `body` is LF-only without its final line breaks (`newlines` counts them, so
    the presence or absence of a final newline survives the round trip)."""

    head: str
    raw: str  # the region exactly as in the file
    tail: str
    body: str
    newlines: int  # line breaks at the end of the region (0: no final newline)
    newline: str  # the line ending to write the new body with
    first: int  # 1-based line numbers of the region
    last: int

    def join(self, new_body: str) -> str:
        """Splice an edited body back in: LF -> the file's line ending; trailing line
        breaks as in the original (models often add or drop one at the end)."""
        if self.unchanged(new_body):
            return self.head + self.raw + self.tail
        body = to_lf(new_body).rstrip("\n")
        if not body:  # the lines were deleted, with their line breaks
            return self.head + self.tail
        return self.head + from_lf(body + "\n" * self.newlines, self.newline) + self.tail

    def unchanged(self, new_body: str) -> bool:
        return to_lf(new_body).rstrip("\n") == self.body


def split_region(text: str, first: int | None = None, last: int | None = None) -> Region:
    """Split `text` into head / region (lines first..last, 1-based inclusive) / tail."""
    lines = split_lines(text)
    n = len(lines)
    a = first or 1
    b = n if last is None else last
    if first is not None or last is not None:
        if a > n:
            raise UsageError(f"--lines {a}:{b}: the text has only {n} lines")
        if b > n:
            raise UsageError(f"--lines {a}:{b}: the text has only {n} lines (use {a}: for the rest)")
    head, raw, tail = "".join(lines[: a - 1]), "".join(lines[a - 1 : b]), "".join(lines[b:])
    lf = to_lf(raw)
    body = lf.rstrip("\n")
    return Region(head, raw, tail, body, len(lf) - len(body), detect_newline(text), a, b)


# ----- prompt and reply ---------------------------------------------------------------


def choose_fence(text: str) -> str:
    """Three backticks, or more than the longest run at a line start in the text, so a
    Markdown file's own fences cannot close ours."""
    runs = [len(m.group(1)) for m in re.finditer(r"^[ \t]*(`{3,})", text, re.M)]
    return "`" * max(3, max(runs, default=0) + 1)


def lang_for(name: str) -> str:
    return LANGS.get(Path(name).suffix.lower(), "")


BODY_MARK = "\ue000BODY\ue000"
INSTRUCTION_MARK = "\ue000INSTRUCTION\ue000"


def build_messages(region: Region, name: str, n_lines: int,
                   instruction: str = INSTRUCTION_MARK, body: str = BODY_MARK) -> list[dict]:
    """Chat messages: the text in a fenced block, then the instruction."""
    fence = choose_fence(region.body)
    where = Path(name).name
    if region.first != 1 or region.last != n_lines:
        where += f", lines {region.first}-{region.last} of {n_lines}"
    user = (
        f"File: {where}\n{fence}{lang_for(name)}\n{body}\n{fence}\n\n"
        f"Instruction: {instruction}\n\n"
        "Reply with the complete edited text in one fenced block."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def reply_prefix(region: Region, name: str) -> str:
    """The start of the assistant's reply that we write ourselves: the opening fence."""
    return f"{choose_fence(region.body)}{lang_for(name)}\n"


def build_prompt(target: Model, region: Region, name: str, n_lines: int,
                 instruction: str) -> list[int]:
    """Prompt tokens: chat template, then our opening fence as the reply's start."""
    return build_prompt_parts(target, region, name, n_lines, instruction)[0]


def build_prompt_parts(target: Model, region: Region, name: str, n_lines: int,
                       instruction: str) -> tuple[list[int], int]:
    """(prompt tokens, length of the prefix that does not depend on the instruction).

    The prefix (system prompt, file name, the text) comes before the instruction, so its
    KV state can be kept and a second edit of the same text prefills only the rest; each
    part is tokenized on its own, so the prefix's tokens never depend on what follows.
    The text and the instruction are tokenized as plain text: a literal "<|im_end|>" in
    a file must not become a control token."""
    text = render_chat(target, build_messages(region, name, n_lines)) + reply_prefix(region, name)
    before, rest = text.split(BODY_MARK)
    middle, after = rest.split(INSTRUCTION_MARK)
    prefix = [
        *target.tokenize(before, add_special=True, parse_special=True),
        *target.tokenize(region.body, add_special=False, parse_special=False),
        *target.tokenize(middle, add_special=False, parse_special=True),
    ]
    return [
        *prefix,
        *target.tokenize(instruction.strip(), add_special=False, parse_special=False),
        *target.tokenize(after, add_special=False, parse_special=True),
    ], len(prefix)


class FenceReader:
    """Follows a reply as it streams: the body is what lies between the first fence
    line (```lang) and the next line that is only the fence. `done` once that closing
    line is complete, so the caller can stop generating."""

    def __init__(self, fence: str = "```") -> None:
        f = re.escape(fence)
        self.text = ""
        self.body: str | None = None
        self._open = re.compile(rf"(?:^|\n){f}[^\n`]*\n")
        self._close = re.compile(rf"\r?\n{f}`*[ \t]*(\r?\n|$)")
        self._start: int | None = None  # where the body begins
        self._from = 0  # complete lines before this were checked already

    def feed(self, piece: str) -> bool:
        if self.body is None and piece:
            self.text += piece
            self._scan(final=False)
        return self.body is not None

    def finish(self) -> str | None:
        """The body, or None when the block never closed (an incomplete answer)."""
        if self.body is None:
            self._scan(final=True)
        return self.body

    @property
    def done(self) -> bool:
        return self.body is not None

    def _scan(self, final: bool) -> None:
        if self._start is None:
            opening = self._open.search(self.text)
            if opening is None:
                return
            # the opening line's own line break may begin the closing match: empty body
            self._start = opening.end()
            self._from = self._start - 1
        for m in self._close.finditer(self.text, self._from):
            if m.group(1) or final:
                end = m.start()
                self.body = to_lf(self.text[self._start : end]) if end >= self._start else ""
                return
        # only the last, unfinished line can still become the closing fence
        self._from = max(self._from, self.text.rfind("\n") - 1)


def extract_fenced(reply: str, fence: str = "```") -> str | None:
    """The body of the first fenced block of a complete reply; None if it never closed."""
    reader = FenceReader(fence)
    reader.feed(reply)
    return reader.finish()


class FenceStop:
    """Edit's stop rule, fed a generation's events: the reply is primed with the opening
    fence, so the answer is complete once the closing fence line is (`done`: stop
    generating). `cut` is how many tokens had come then: those accepted after it in the
    same round are not part of the answer."""

    def __init__(self, fence: str) -> None:
        self.fence = fence
        self.reader = FenceReader(fence)
        self.reader.feed(fence + "\n")  # the opening fence is in the prompt, not in the reply
        self.n_tokens = 0
        self.cut: int | None = None

    @property
    def done(self) -> bool:
        return self.reader.done

    def add(self, ev: Event) -> None:
        """One event of the generation (Round events carry no text)."""
        if isinstance(ev, Token):
            self.n_tokens += 1
            if self.feed(ev.text) and self.cut is None:
                self.cut = self.n_tokens
        elif isinstance(ev, Done):
            self.feed(ev.text)

    def feed(self, text: str) -> bool:
        """More of the reply's text (for a generation that is not ours: the peer's)."""
        return self.reader.feed(text)

    def body(self) -> str | None:
        """The edited text, or None when the block never closed (an incomplete answer)."""
        return _drop_repeated_fence(self.reader.finish(), self.fence)

    @property
    def reply(self) -> str:
        """The reply after our opening fence, up to the closing one, for diagnostics."""
        return self.reader.text[len(self.fence) + 1 :]


@dataclass
class Outcome:
    """What a rewrite produced: `body` is None unless the answer was complete."""

    body: str | None
    stats: GenerationStats | None
    reply: str  # the raw reply after our opening fence, for diagnostics


def rewrite(target: Model, drafter: Drafter, prompt: list[int], fence: str, *,
            sampling: SamplingConfig, spec: SpecConfig, gen: GenerationConfig,
            draft_model: Model | None = None,
            on_event: Callable[[Event], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Outcome:
    """Generate the edited text; stop as soon as the closing fence line is complete (or
    `should_stop` says so). KeyboardInterrupt propagates (the engine leaves the KV cache
    consistent)."""
    from localspec.core.engine import generate

    stop = FenceStop(fence)
    user_stop = should_stop or (lambda: False)
    with Transcript(generate(target, prompt, drafter, sampling=sampling, spec=spec, gen=gen,
                             should_stop=lambda: stop.done or user_stop(),
                             draft_model=draft_model)) as run:
        for ev in run:
            if on_event is not None:
                on_event(ev)
            stop.add(ev)
    return Outcome(stop.body(), run.stats, stop.reply)


def _drop_repeated_fence(body: str | None, fence: str) -> str | None:
    # primed with our opening fence, a model may still write its own "```python" line
    if body is not None and re.match(rf"{re.escape(fence)}[\w+#.-]*\n", body):
        return body.partition("\n")[2]
    return body


# ----- diff and writing -----------------------------------------------------------------


def unified_diff(old: str, new: str, name: str, context: int = 3) -> str:
    """A unified diff of two texts (line endings normalised), with a/ b/ headers."""
    a = split_lines(to_lf(old))
    b = split_lines(to_lf(new))
    lines = []
    for line in difflib.unified_diff(a, b, f"a/{name}", f"b/{name}", n=context):
        if not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        lines.append(line)
    return "".join(lines)
