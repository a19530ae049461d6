"""Workload tags for the acceptance log: code, json, edit, prose.

Cheap heuristics (a few regexes over at most the first few thousand characters), run
once per generation. The output decides first, since it is what the drafter had to
predict: `git diff | localspec run "write a commit message"` has code in the prompt but
prose in the output, and its acceptance behaves like prose. The prompt is the fallback
when there is no output (a cancelled generation).

Rules, first match wins:
  edit   the `edit` command, or an output that mostly copies lines of the prompt
         (a file piped to `run` and rewritten): n-gram drafting's best case
  json   output (fences stripped) that starts like a JSON object or array
  code   a fenced code block, or enough lines that look like source code
  prose  everything else
"""

from __future__ import annotations

import json
import re

TAGS = ("code", "json", "edit", "prose")
SCAN_CHARS = 8000  # enough to decide; keeps classification O(1) for huge outputs

_FENCE = re.compile(r"^\s*```[\w+-]*\s*$", re.MULTILINE)
_CODE_LINE = re.compile(
    r"""^\s*(
        (def|class|async\s+def|import|from\s+[\w.]+\s+import|return|yield|raise|elif|else:|
         try:|except\b|finally:|with\s|for\s|while\s|if\s.*[:{]\s*$|@\w)
      | (function|const|let|var|public|private|protected|static|fn|pub|impl|struct|enum|
         package|func|\#include|\#define|using|namespace|template)\b
      | [}\])];?\s*$                                  # closing brackets
      | .*[;{]\s*$                                    # C-like statement or block start
      | .*\)\s*(->\s*[\w\[\], .|]+)?:\s*$             # python signature
      | [\w.\[\]"']+\s*(=|\+=|-=|:=|=>)\s*\S          # assignment
      | (//|/\*)                                      # C-like comment
    )""",
    re.VERBOSE,
)
_JSON_START = re.compile(r'^\s*(\{\s*("|\}|$)|\[\s*(\{|\[|"|-?\d|true|false|null|\]|$))')


def classify(prompt_text: str, output_text: str, command: str = "run") -> str:
    """One of TAGS for a generation, from its prompt, output and command name."""
    if command == "edit":
        return "edit"
    prompt = prompt_text[-4 * SCAN_CHARS :]
    output = output_text[:SCAN_CHARS]
    if output.strip() and copies_prompt(prompt, output):
        return "edit"
    text = output if output.strip() else prompt
    if looks_like_json(text):
        return "json"
    if looks_like_code(text):
        return "code"
    return "prose"


def copies_prompt(prompt: str, output: str, *, min_lines: int = 3, share: float = 0.5) -> bool:
    """At least `share` of the output's substantial lines (and `min_lines` of them)
    appear verbatim in the prompt: the output is a rewrite of text it was given."""
    seen = {ln.strip() for ln in prompt.splitlines() if len(ln.strip()) >= 8}
    lines = [ln.strip() for ln in output.splitlines() if len(ln.strip()) >= 8]
    copied = sum(ln in seen for ln in lines)
    return copied >= min_lines and copied >= share * len(lines)


def looks_like_json(text: str) -> bool:
    """A JSON document, possibly fenced or cut off by max_tokens."""
    body = _strip_fence(text).strip()
    if not body or body[0] not in "{[":
        return False
    try:
        json.loads(body)
        return True
    except ValueError:
        pass
    # truncated or slightly off: judge the shape of its start
    return bool(_JSON_START.match(body)) and body.count('"') >= 2


def looks_like_code(text: str, *, share: float = 0.4, min_lines: int = 2) -> bool:
    """A fenced block with content, or a share of code-looking non-empty lines."""
    if len(_FENCE.findall(text)) >= 2:
        return True
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return False
    hits = sum(bool(_CODE_LINE.match(ln)) for ln in lines)
    return hits >= min_lines and hits >= share * len(lines)


def _strip_fence(text: str) -> str:
    s = text.strip()
    if s.startswith("```"):
        s = s.split("\n", 1)[1] if "\n" in s else ""
        end = s.rfind("```")
        s = s[:end] if end >= 0 else s
    return s
