"""Benchmark workloads: the prompts and edit tasks shipped in `localspec/workloads/`,
or the user's own JSONL file (`--prompts`).

One JSON object a line, either a prompt or an edit task:

    {"prompt": "Write a function ...", "tag": "code"}
    {"file": "edit/inventory.py", "instruction": "Add type hints.", "tag": "edit"}

`file` is relative to the JSONL file. `tag` is optional: edit tasks default to
"edit", prompts are classified from their text (code, json or prose). An edit task
becomes the prompt `localspec edit` sends: the file in a fenced block, the
instruction, and the reply primed with the opening fence; generation stops once the
closing fence line is complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.core.errors import UsageError
from localspec.models.paths import PACKAGE_DIR

if TYPE_CHECKING:
    from localspec.core.backend import Model

WORKLOADS_DIR = PACKAGE_DIR / "workloads"
BUILTIN_FILES = (WORKLOADS_DIR / "prompts.jsonl", WORKLOADS_DIR / "edit" / "tasks.jsonl")
TAG_ORDER = ("code", "json", "prose", "edit")


@dataclass(frozen=True)
class Workload:
    """One prompt or edit task. `name` is unique in a run ("code-1", "edit-2")."""

    name: str
    tag: str
    prompt: str = ""  # prompt workloads: the user message
    file: str = ""  # edit tasks: the file's name (for the fence language) ...
    text: str = ""  # ... its contents
    instruction: str = ""

    @property
    def is_edit(self) -> bool:
        return bool(self.file)


@dataclass
class Prepared:
    """A workload turned into tokens for one target model."""

    tokens: list[int]
    max_tokens: int
    fence: str | None = None  # edit tasks: stop once this closing fence line is complete
    extra: list[int] = field(default_factory=list)  # a second n-gram source: the file
    n_prefix: int = 0  # edit tasks: the instruction-free prefix (what the prefix cache keeps)


def builtin() -> list[Workload]:
    """The workloads shipped with the package: code, json and prose prompts, edit tasks."""
    out: list[Workload] = []
    for path in BUILTIN_FILES:
        out.extend(load_jsonl(path, base=WORKLOADS_DIR))
    return name_workloads(out)


def load_jsonl(path: str | Path, base: Path | None = None) -> list[Workload]:
    """Read a workload file; any problem is a one-line UsageError naming file and line.
    Edit tasks' files are relative to `base` (default: the JSONL file's directory)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"--prompts {path}: cannot read it ({reason})") from None
    out = [_parse(path, base or path.parent, i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if not out:
        raise UsageError(f"--prompts {path}: no workloads in it (one JSON object a line)")
    return out


def _parse(path: Path, base: Path, lineno: int, line: str) -> Workload:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object with \"prompt\" or \"file\"")
    tag = obj.get("tag")
    if tag is not None and (not isinstance(tag, str) or not tag.strip()):
        raise UsageError(f"{where}: \"tag\" must be a non-empty string")
    if "file" in obj:
        return _edit_task(base, where, obj, tag)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where}: needs a non-empty \"prompt\" string (or \"file\" and \"instruction\")")
    return Workload(name="", tag=_tag(tag) or _classify(prompt), prompt=prompt)


def _edit_task(base: Path, where: str, obj: dict, tag: str | None) -> Workload:
    file, instruction = obj.get("file"), obj.get("instruction")
    if not isinstance(file, str) or not file:
        raise UsageError(f"{where}: \"file\" must be a path relative to {base}")
    if not isinstance(instruction, str) or not instruction.strip():
        raise UsageError(f"{where}: an edit task needs a non-empty \"instruction\"")
    from localspec.edit import read_source

    try:
        source = read_source(base / file)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return Workload(name="", tag=_tag(tag) or "edit", file=file, text=source.text,
                    instruction=instruction)


def _tag(tag: str | None) -> str | None:
    return tag.strip().lower() if tag else None


def _classify(prompt: str) -> str:
    from localspec.acceptance.classify import classify

    return classify(prompt, "", "bench")


def name_workloads(items: Iterable[Workload]) -> list[Workload]:
    """Name each workload after its tag and rank within the tag: code-1, code-2, edit-1."""
    seen: dict[str, int] = {}
    out = []
    for w in items:
        seen[w.tag] = seen.get(w.tag, 0) + 1
        out.append(Workload(f"{w.tag}-{seen[w.tag]}", w.tag, w.prompt, w.file, w.text, w.instruction))
    return out


def select(workloads: Sequence[Workload], tags: Sequence[str] = (), per_tag: int = 0) -> list[Workload]:
    """Keep the given tags (all when empty), at most `per_tag` of each (0: all); ordered
    code, json, prose, edit, then other tags."""
    wanted = [t.lower() for t in tags]
    unknown = [t for t in wanted if t not in {w.tag for w in workloads}]
    if unknown:
        have = ", ".join(sorted({w.tag for w in workloads}))
        raise UsageError(f"--tags: no workload tagged {', '.join(unknown)} (have: {have})")
    count: dict[str, int] = {}
    out = []
    for w in workloads:
        if wanted and w.tag not in wanted:
            continue
        count[w.tag] = count.get(w.tag, 0) + 1
        if per_tag <= 0 or count[w.tag] <= per_tag:
            out.append(w)
    return sorted(out, key=lambda w: tag_rank(w.tag))


def tag_rank(tag: str) -> int:
    return TAG_ORDER.index(tag) if tag in TAG_ORDER else len(TAG_ORDER)


def prepare(w: Workload, target: Model, n_predict: int, edit_n: int = 0) -> Prepared:
    """Tokens and a token limit for `target`. Edit tasks get `edit_n` tokens, or when
    that is 0 enough for the whole file: 1.5x its tokens + 64."""
    from localspec import edit
    from localspec.core.chat_template import chat_prompt

    if not w.is_edit:
        return Prepared(chat_prompt(target, w.prompt), n_predict)

    region = edit.split_region(w.text)
    n_lines = len(w.text.splitlines())
    tokens, n_prefix = edit.build_prompt_parts(target, region, w.file, n_lines, w.instruction)
    body = target.tokenize(region.body, add_special=False, parse_special=False)
    limit = edit_n if edit_n > 0 else len(body) * 3 // 2 + 64
    return Prepared(tokens, limit, fence=edit.choose_fence(region.body), extra=body,
                    n_prefix=n_prefix)
