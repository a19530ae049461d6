"""Sessions, not single prompts: requests that repeat one another the way local work
does, for `localspec bench --sessions` and scripts/compare_sessions_llama_server.py.

Built from standard-library code nobody here wrote:
  tests   "write unittest tests for function F of posixpath", for ten functions
  hints   "add type hints" to a function of each of ten standard-library modules
  agent   an agent loop: each turn reports a tool call's JSON and its result (a module's
          head) and asks for the next call, as one JSON object restating the result
  fresh   unrelated prompts (the built-in ones): no repetition, to show it never costs

Each request runs plain, with `auto` as it was (context only) and with `auto` drafting
from a memory that holds the session's earlier replies; greedy, every output checked
against plain decoding's. Decode speed only (prefill excluded).
"""

from __future__ import annotations

import ast
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig

GREEDY = SamplingConfig(temperature=0.0)
VARIANTS = ("plain", "auto", "memory")

TEST_FUNCS = ("basename", "dirname", "split", "splitext", "join", "isabs", "normpath",
              "relpath", "commonpath", "expanduser")
HINT_FUNCS = (("textwrap", "indent"), ("shlex", "quote"), ("fnmatch", "filter"), ("colorsys", "rgb_to_hsv"),
              ("calendar", "isleap"), ("html", "escape"), ("glob", "has_magic"), ("string", "capwords"),
              ("heapq", "nsmallest"), ("base64", "b64encode"))
AGENT_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "calendar", "html", "glob", "string",
                 "heapq", "base64")
AGENT_SYSTEM = ("You are a coding agent. Tools: read_file(path) returns a file's text; "
                "summarize(path, imports, functions, summary) records what a file holds. Answer "
                "every turn with exactly one JSON object {\"name\": ..., \"arguments\": {...}} and nothing else.")


@dataclass(frozen=True)
class Session:
    name: str
    repeats: bool  # whether its requests repeat one another (the memory's case)
    requests: tuple[str, ...]  # user messages
    system: str | None = None


def _module_text(module: str) -> str:
    """A standard-library module's source, read from its file (inspect cannot see into
    the modules Python freezes at startup, posixpath among them)."""
    return Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")


def _source(module: str, name: str) -> str:
    """The source of a top-level function of `module`."""
    text = _module_text(module)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node, padded=True) + "\n"
    raise LookupError(f"no function {name} in {module}")


def _head(module: str, lines: int = 20) -> str:
    return "".join(_module_text(module).splitlines(True)[:lines])


def builtin_sessions() -> list[Session]:
    """The four sessions, ten requests each (fresh: the built-in prompts)."""
    from localspec.bench import workloads as wl

    tests = tuple(
        f"Write unittest tests for the function `{f}` of Python's `posixpath` module. Its source:\n\n"
        f"```python\n{_source('posixpath', f)}```\n\nReply with only the test module in a python code block."
        for f in TEST_FUNCS)
    hints = tuple(
        f"Add type hints to this function from the standard library's `{m}` module. Reply with only "
        f"the whole function in a python code block.\n\n```python\n{_source(m, f)}```"
        for m, f in HINT_FUNCS)
    agent = tuple(
        "Tool call: " + json.dumps({"name": "read_file", "arguments": {"path": f"Lib/{m}.py"}})
        + f"\nTool result (its first lines):\n```python\n{_head(m)}```\n"
        "Next call: summarize this file, as one JSON object."
        for m in AGENT_MODULES)
    fresh = tuple(w.prompt for w in wl.builtin() if not w.is_edit)
    return [Session("tests", True, tests), Session("hints", True, hints),
            Session("agent", True, agent, AGENT_SYSTEM), Session("fresh", False, fresh)]


@dataclass
class Result:
    """One request of a session under one variant."""

    session: str
    request: int
    variant: str
    tokens: int
    tok_s: float
    same: str  # against plain decoding's greedy output: identical, near-tie @i, MISMATCH @i
    by_source: dict[str, list[int]] = field(default_factory=dict)
    draft_share: float = 0.0  # drafting's share of decode time


def run_sessions(rt, sessions: Sequence[Session], n_requests: int, n_predict: int,
                 draft_max: int = 64, progress: Callable[[str], None] = lambda s: None) -> list[Result]:
    """Every session's first n_requests requests, each under VARIANTS back to back."""
    from localspec.core.drafters import NoDrafter
    from localspec.core.drafters.memory import Memory
    from localspec.core.engine import collect, generate
    from localspec.bench.runner import compare
    from localspec.core.chat_template import chat_prompt
    from localspec.runtime import make_drafter

    target = rt.target
    auto = SpecConfig(mode="auto", draft_max=draft_max, adaptive=False)
    out: list[Result] = []
    for s in sessions:
        memory = Memory()
        for i, user in enumerate(s.requests[:n_requests]):
            prompt = chat_prompt(target, user, s.system)
            plain_ids: list[int] | None = None
            for variant in VARIANTS:
                if variant == "plain":
                    drafter, spec = NoDrafter(), SpecConfig(mode="none")
                else:
                    drafter, spec = make_drafter(auto, GREEDY, None, target=target,
                                                 memory=memory if variant == "memory" else None), auto
                ids, _, st = collect(generate(target, prompt, drafter, sampling=GREEDY, spec=spec,
                                              gen=GenerationConfig(max_tokens=n_predict)))
                verdict = "identical" if plain_ids is None else str(compare(target, prompt, plain_ids, ids))
                plain_ids = ids if plain_ids is None else plain_ids
                share = st.draft_s / st.decode_s if st.decode_s else 0.0
                out.append(Result(s.name, i + 1, variant, st.generated, st.tokens_per_s, verdict,
                                  {k: list(v) for k, v in st.by_source.items()}, share))
                progress(f"{s.name} {i + 1} {variant}: {st.tokens_per_s:.1f} tok/s {dict(st.by_source)}")
    return out


def speedups(results: Sequence[Result]) -> list[dict]:
    """Per request: each variant's decode speedup over plain, accepted tokens per source."""
    rows: dict[tuple[str, int], dict] = {}
    for r in results:
        row = rows.setdefault((r.session, r.request), {"session": r.session, "request": r.request})
        row[r.variant] = r
    out = []
    for row in rows.values():
        plain = row["plain"].tok_s
        line = {"session": row["session"], "request": row["request"], "tokens": row["plain"].tokens}
        for v in VARIANTS[1:]:
            r = row[v]
            line[v] = r.tok_s / plain if plain else None
            line[f"{v}_same"] = r.same
            line[f"{v}_accepted"] = {k: a for k, (_, a) in r.by_source.items()}
            line[f"{v}_draft_share"] = r.draft_share
        out.append(line)
    return out


def session_summary(lines: Sequence[dict], from_request: int = 3) -> dict[str, dict]:
    """Per session: the geometric mean speedup of each variant over all requests and from
    request `from_request` on (a memory has something to recall by then)."""
    import math

    def gm(xs: list[float]) -> float | None:
        xs = [x for x in xs if x]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    out: dict[str, dict] = {}
    for name in dict.fromkeys(l["session"] for l in lines):
        mine = [l for l in lines if l["session"] == name]
        later = [l for l in mine if l["request"] >= from_request]
        out[name] = {f"{v}{suffix}": gm([l[v] for l in group])
                     for v in VARIANTS[1:] for suffix, group in (("", mine), (f"_from_{from_request}", later))}
        out[name]["all_same"] = not any(l[f"{v}_same"].startswith("MISMATCH") for l in mine for v in VARIANTS[1:])
    return out


def format_report(lines: Sequence[dict], summary: dict[str, dict]) -> str:
    """A plain-text table: per request, then per session."""
    head = (f"{'session':8} {'req':>3} {'tokens':>6} {'auto':>6} {'memory':>7}  {'vs plain (auto/memory)':22}  "
            "memory run: accepted by source")
    rows = [head]
    for l in lines:
        same = "/".join(_short(l[f"{v}_same"]) for v in VARIANTS[1:])
        acc = ", ".join(f"{k} {v}" for k, v in l["memory_accepted"].items()) or "-"
        rows.append(f"{l['session']:8} {l['request']:>3} {l['tokens']:>6} {l['auto']:>5.2f}x {l['memory']:>6.2f}x"
                    f"  {same:22}  {acc}")
    rows.append("")
    rows.append(f"{'session':8} {'auto':>6} {'memory':>7} {'auto 3+':>8} {'memory 3+':>10}  lossless")
    for name, s in summary.items():
        rows.append(f"{name:8} {_x(s['auto'])} {_x(s['memory'], 7)} {_x(s['auto_from_3'], 8)} "
                    f"{_x(s['memory_from_3'], 10)}  {'yes' if s['all_same'] else 'NO'}")
    return "\n".join(rows)


def _short(verdict: str) -> str:
    return {"identical": "same"}.get(verdict, verdict.replace("near-tie", "tie").split(" (")[0])


def _x(v: float | None, width: int = 6) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width - 1}.2f}x"
