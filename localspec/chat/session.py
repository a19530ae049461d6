"""Conversation state: messages, the window of them that fits the context, and saving
and resuming a conversation as JSON or markdown. No model, no UI here: the prompt is
built through a `Renderer` (the target's chat template and tokenizer)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from localspec.core.errors import ContextFull, UsageError
from localspec.files import write_atomic

FORMAT = "localspec-chat"
VERSION = 1
ROLES = ("system", "user", "assistant")
MARKDOWN_EXTS = (".md", ".markdown")


class Renderer(Protocol):
    """What building a prompt needs from the target model."""

    n_ctx: int

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


@dataclass
class Message:
    role: str
    content: str
    meta: dict = field(default_factory=dict)  # stop reason, tokens, tok/s: saved, never prompted

    def to_dict(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.meta:
            out["meta"] = self.meta
        return out


@dataclass
class Seen:
    """What the model last saw, as text and as the token ids it was fed and generated.

    Re-tokenizing a reply need not give back the ids the model generated (BPE has many
    spellings of one text), and one differing token costs a re-prefill of everything
    after it. A prompt whose text extends `text` reuses `tokens` as they are, so the KV
    cache matches token for token and only the new text is prefilled."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)

    def tokenize(self, model: Renderer, text: str) -> list[int]:
        if self.tokens and text.startswith(self.text):
            rest = model.tokenize(text[len(self.text) :], add_special=False, parse_special=True)
            return self.tokens + rest
        return model.tokenize(text, add_special=True, parse_special=True)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: list[int]
    dropped: int = 0  # messages that left the context to make room


@dataclass
class Conversation:
    """All messages of a chat. `first` is the index of the oldest message still in the
    model's context: older turns were dropped when the context filled, but stay in the
    transcript (and in saved files)."""

    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    first: int = 0
    seen: Seen = field(default_factory=Seen, repr=False, compare=False)

    def add(self, role: str, content: str, **meta: object) -> Message:
        msg = Message(role, content, dict(meta))
        self.messages.append(msg)
        return msg

    def pop(self) -> Message:
        msg = self.messages.pop()
        self.first = min(self.first, len(self.messages))
        return msg

    def clear(self) -> None:
        self.messages.clear()
        self.first = 0
        self.seen = Seen()

    @property
    def in_context(self) -> list[Message]:
        return self.messages[self.first :]

    def chat_messages(self) -> list[dict]:
        """The messages sent to the chat template: system, then the context window."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m.role, "content": m.content} for m in self.in_context]

    def prompt(self, model: Renderer) -> Prompt:
        """The context window under the chat template, ending with the assistant's turn
        opening; tokens reuse the ids the model last saw where the text allows."""
        text = model.apply_chat_template(self.chat_messages(), add_generation_prompt=True)
        return Prompt(text, self.seen.tokenize(model, text))

    def remember(self, prompt: Prompt, reply_text: str, reply_ids: list[int]) -> None:
        """The model was fed `prompt` and generated `reply_ids`, shown as `reply_text`
        (the caller checks they agree: a stop string cuts the text, not the ids)."""
        self.seen = Seen(prompt.text + reply_text, prompt.tokens + reply_ids)

    def fit(self, model: Renderer, reserve: int) -> Prompt:
        """The prompt, after dropping the oldest turns until it leaves `reserve` tokens
        for the reply. Raises ContextFull when the newest message alone does not fit."""
        dropped = 0
        while True:
            prompt = self.prompt(model)
            n = len(prompt.tokens)
            if n + reserve <= model.n_ctx or (len(self.in_context) <= 1 and n < model.n_ctx):
                # (the newest message alone: a shorter reply than asked, but a reply)
                return Prompt(prompt.text, prompt.tokens, dropped)
            if len(self.in_context) <= 1:
                raise ContextFull(f"the message is {n} tokens; the context holds {model.n_ctx} (raise -c)")
            # drop one exchange: the oldest message, and the reply that followed it
            n = 2 if len(self.in_context) > 2 and self.in_context[1].role == "assistant" else 1
            self.first += n
            dropped += n

    # ----- saving and resuming ----------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "system": self.system, "first": self.first,
            "messages": [m.to_dict() for m in self.messages],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> Conversation:
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise UsageError("not a localspec chat session (no 'messages' list)")
        messages = []
        for raw in data["messages"]:
            role, content = raw.get("role"), raw.get("content")
            if role not in ROLES[1:] or not isinstance(content, str):
                raise UsageError(f"bad message in session: {str(raw)[:80]}")
            messages.append(Message(role, content, dict(raw.get("meta") or {})))
        first = data.get("first", 0)
        first = first if isinstance(first, int) and 0 <= first <= len(messages) else 0
        return cls(system=data.get("system") or None, messages=messages, first=first)

    def to_markdown(self) -> str:
        parts = ["# localspec chat\n\n"]
        if self.system:
            parts.append(_md_section("system", self.system))
        for i, m in enumerate(self.messages):
            if i == self.first and i:
                parts.append("<!-- localspec:context-start -->\n\n")
            parts.append(_md_section(m.role, m.content))
        return "".join(parts)

    @classmethod
    def from_markdown(cls, text: str) -> Conversation:
        conv = cls()
        chunks = _MD_MARK.split(text)
        if len(chunks) < 3:
            raise UsageError("no localspec chat sections in this markdown file")
        # split() alternates: [preamble, role, body, role, body, ...]
        for role, body in zip(chunks[1::2], chunks[2::2]):
            start = body.find(_CONTEXT_START)
            if start >= 0:
                body = body[:start]
            content = re.sub(r"\A### [A-Za-z]+\n\n", "", body)
            content = content[:-2] if content.endswith("\n\n") else content.rstrip("\n")
            if role == "system":
                conv.system = content or None
            else:
                conv.add(role, content)
            if start >= 0:
                conv.first = len(conv.messages)
        return conv

    def save(self, path: str | Path) -> Path:
        """Write JSON, or markdown for .md/.markdown; atomically (temp file + rename)."""
        path = Path(path).expanduser()
        if path.suffix.lower() in MARKDOWN_EXTS:
            data = self.to_markdown()
        else:
            data = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Conversation:
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read session {path}: {exc}") from None
        if path.suffix.lower() in MARKDOWN_EXTS:
            return cls.from_markdown(text)
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise UsageError(f"session {path} is not valid JSON: {exc}") from None


_MD_MARK = re.compile(r"^<!-- localspec:(system|user|assistant) -->\n", re.MULTILINE)
_CONTEXT_START = "<!-- localspec:context-start -->\n"


def _md_section(role: str, content: str) -> str:
    # the HTML comment is invisible when rendered and makes the file parseable again
    return f"<!-- localspec:{role} -->\n### {role.capitalize()}\n\n{content}\n\n"
