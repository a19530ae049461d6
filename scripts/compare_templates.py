#!/usr/bin/env python3
"""Compare localspec's chat-template rendering with llama-server's, byte for byte.

Starts llama.cpp's `llama-server --jinja` once per (model, template), posts each
conversation below to its `/apply-template` endpoint, renders the same conversation
with localspec.core.chat_template, and prints which prompts differ.

    python scripts/compare_templates.py --server PATH/llama-server \\
        [--model NAME ...] [--templates DIR] [--record tests/data/chat_templates.json]

--model: GGUFs whose own templates are compared (default: the four test models).
--templates: also every *.jinja in DIR (e.g. llama.cpp's models/templates), each run
  with --template-model's vocabulary (its BOS/EOS texts; default: the first --model).
--record: write the cases, the templates and llama-server's prompts (those localspec
  renders identically) as the expected strings of tests/test_chat_template.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from localspec import models
from localspec.bench.workers import free_port
from localspec.core.backend import Model
from localspec.core.chat_template import (
    CHATML,
    ChatTemplate,
    TemplateError,
    special_tokens,
)
from localspec.core.config import ModelConfig

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }, "required": ["city"]},
}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Local time, ünïcode",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call0a1b2", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call0a1b2", "name": "get_weather",
          "content": '{"temperature": 18, "sky": "clear"}'}
KWARGS = {"date_string": "26 Jul 2024", "datetime": "Jul 26 2024"}  # not today's date

CASES: dict[str, dict] = {
    "user": {"messages": [{"role": "user", "content": "hi"}]},
    "system": {"messages": [{"role": "system", "content": "You answer in one word."},
                            {"role": "user", "content": "Capital of France?"}]},
    "multi_turn": {"messages": [
        {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "Write  `x = 1`\n\nin Python."}]},
    "no_generation_prompt": {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}],
                             "add_generation_prompt": False},
    "tools": {"messages": [ASK], "tools": [WEATHER, CLOCK]},
    "tools_system": {"messages": [{"role": "system", "content": "Be brief."}, ASK], "tools": [WEATHER]},
    "tool_round": {"messages": [ASK, CALL, RESULT], "tools": [WEATHER]},
    "tool_round_answered": {"messages": [ASK, CALL, RESULT, {"role": "assistant", "content": "18 °C, clear."},
                                         {"role": "user", "content": "Thanks"}], "tools": [WEATHER]},
}


class Server:
    """llama-server --jinja on a free port, for one model and template."""

    def __init__(self, binary: str, model: str, template: Path | None) -> None:
        self.port = free_port()
        cmd = [binary, "-m", model, "--jinja", "--port", str(self.port), "-c", "512", "-t", "1",
               "--no-warmup", "-np", "1"]
        if template is not None:
            cmd += ["--chat-template-file", str(template)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._wait()

    def _wait(self) -> None:
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.proc.stderr.read()[-600:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def apply(self, case: dict) -> tuple[str | None, str]:
        body = dict(case) | {"chat_template_kwargs": KWARGS}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/apply-template",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            return json.load(urllib.request.urlopen(req, timeout=60))["prompt"], ""
        except urllib.error.HTTPError as exc:
            return None, exc.read().decode()[:200]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def ours(tmpl: ChatTemplate, case: dict) -> tuple[str | None, str]:
    try:
        return tmpl.render(case["messages"], tools=case.get("tools"),
                           add_generation_prompt=case.get("add_generation_prompt", True), **KWARGS), ""
    except TemplateError as exc:
        return None, str(exc)[:200]


def compare(binary: str, model: Model, template: Path | None, label: str, verbose: bool) -> list[dict]:
    source = template.read_text() if template else (model.chat_template() or CHATML)
    try:
        tmpl = ChatTemplate(source, special_tokens(model))
    except TemplateError as exc:
        print(f"{label}: ours does not compile: {exc}")
        return []
    server = Server(binary, str(model.path), template)
    records = []
    try:
        for name, case in CASES.items():
            theirs, their_err = server.apply(case)
            mine, my_err = ours(tmpl, case)
            status = "both fail" if theirs is None and mine is None else ("same" if theirs == mine else "DIFF")
            records.append({"template": label, "case": name, "status": status, "expected": theirs})
            if status != "same" or verbose:
                print(f"{label:48} {name:22} {status}")
            if status == "DIFF" and verbose:
                print(f"  llama-server: {theirs!r:.600} {their_err}\n  localspec:    {mine!r:.600} {my_err}")
    finally:
        server.close()
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", action="append")
    ap.add_argument("--templates", type=Path)
    ap.add_argument("--template-model")
    ap.add_argument("--record", type=Path)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    names = args.model or ["qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
    loaded = {n: Model(ModelConfig(path=str(models.resolve(n)), n_ctx=256)) for n in names}
    vocab = args.template_model or names[0]
    if vocab not in loaded:
        loaded[vocab] = Model(ModelConfig(path=str(models.resolve(vocab)), n_ctx=256))
    runs = [(f"gguf:{n}", n, None) for n in names]
    runs += [(f"file:{p.stem}", vocab, p) for p in sorted(args.templates.glob("*.jinja"))] if args.templates else []
    records, templates = [], {}
    for label, name, path in runs:
        records += compare(args.server, loaded[name], path, label, args.verbose)
        templates[label] = {"model": name, "source": path.read_text() if path else None}
    n_same = sum(r["status"] == "same" for r in records)
    n_fail = sum(r["status"] == "both fail" for r in records)
    print(f"{n_same} of {len(records)} prompts identical to llama-server's; {n_fail} fail in both; "
          f"{len(records) - n_same - n_fail} differ")
    if args.record:
        prompts = [{k: r[k] for k in ("template", "case", "expected")} for r in records if r["status"] == "same"]
        data = {"cases": CASES, "kwargs": KWARGS, "templates": templates, "prompts": prompts}
        args.record.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return 0 if n_same + n_fail == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
