#!/usr/bin/env python3
"""JSON-schema generation, side by side in one process: constrained plain decoding vs
constrained decoding with n-gram and with draft-model speculation (greedy, so every
mode must give the same tokens; the script checks that, and that each reply validates).

Tasks: extraction from a passage in the prompt (values are copied: n-gram friendly),
tool-call arguments, and free generation of a small list. Modes run interleaved, task
by task, so drift in machine load hits them alike. Prints tok/s per mode, the ratio to
plain constrained decoding, acceptance, and what the grammar itself costs per token
(time inside the Grammar calls, from wrapped methods).

    python scripts/bench_json.py [--model qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
                                 [-n 192] [--repeats 1] [--modes none,ngram,model,auto]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import jsonschema

from localspec import models
from localspec.core.backend import Grammar, Model, json_schema_grammar
from localspec.core.config import (
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.drafters import NgramDrafter, NoDrafter
from localspec.core.drafters.draft_model import ModelDrafter
from localspec.core.engine import collect, generate
from localspec.core.chat_template import chat_prompt
from localspec.runtime import make_drafter

ORDER = {"type": "object", "required": ["order_id", "customer", "items", "total", "paid"], "properties": {
    "order_id": {"type": "string"}, "customer": {"type": "object", "required": ["name", "email"],
                                                 "properties": {"name": {"type": "string"}, "email": {"type": "string"}}},
    "items": {"type": "array", "items": {"type": "object", "required": ["sku", "qty", "price"], "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}}}},
    "total": {"type": "number"}, "paid": {"type": "boolean"}}}
PASSAGE = ("Order A-20931 was placed by Maria Lopez (maria.lopez@example.com). She bought 2 x "
           "SKU KB-101 mechanical keyboard at 89.50 each, 1 x SKU MS-220 wireless mouse at 24.99 "
           "and 3 x SKU CB-007 USB-C cable at 7.25 each. The total is 225.74 and it has been paid.")
WEATHER = {"type": "object", "required": ["city", "unit", "days"], "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
USERS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "required": ["name", "age", "city", "languages"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}}}}}
TASKS = {
    "extract": (ORDER, f"Extract the order as JSON.\n\n{PASSAGE}"),
    "tool-args": (WEATHER, ("Arguments for get_weather as JSON: what will the weather be in "
                            "Lyon over the next five days, in celsius?")),
    "generate": (USERS, "Invent three programmers as JSON: name, age, city and the languages they use."),
}


class GrammarClock:
    """Wraps Grammar's methods to add up the time spent in them (the grammar's cost)."""

    def __init__(self) -> None:
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.depth = 0
        for name in ("allows", "allowed", "allowed_all", "accept", "clone"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(Grammar, name)

        def timed(*args, **kw):
            if self.depth:  # inside another timed call (accept() asks allows() first)
                return inner(*args, **kw)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.depth -= 1
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(Grammar, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def drafter_for(mode: str, draft: Model | None, target: Model, spec: SpecConfig):
    if mode == "none":
        return NoDrafter()
    if mode == "ngram":
        return NgramDrafter(1, 4)
    if mode == "auto":  # as `localspec run` builds it: this machine's profile, stored on-line costs
        return make_drafter(spec, SamplingConfig(temperature=0.0), draft, target=target)
    if mode == "model":
        return ModelDrafter(draft, SamplingConfig(temperature=0.0), p_min=0.5)
    raise SystemExit(f"unknown mode {mode!r}: none, ngram, model or auto")


def run_one(target: Model, draft: Model | None, mode: str, prompt: list[int], gbnf: str, n: int):
    for m in (target, draft):
        if m is not None:
            m.rewind(0)  # every mode prefills from an empty cache
    spec = SpecConfig(mode=mode, draft_max=16)
    uses_draft = mode in ("model", "auto")
    return collect(generate(target, prompt, drafter_for(mode, draft if uses_draft else None, target, spec),
                            spec=spec, gen=GenerationConfig(max_tokens=n, grammar=gbnf),
                            draft_model=draft if uses_draft else None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", default="none,ngram,model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    load = lambda name: Model(ModelConfig(path=str(models.resolve(name)), n_ctx=4096, n_threads=args.threads))
    target = load(args.model)
    draft = load(args.draft) if {"model", "auto"} & set(modes) else None
    clock = GrammarClock()
    totals = {m: defaultdict(float) for m in modes}
    for rep in range(args.repeats):
        for task, (schema, question) in TASKS.items():
            gbnf = json_schema_grammar(schema)
            prompt = chat_prompt(target, question)
            outputs = {}
            for mode in modes:
                clock.reset()
                ids, text, st = run_one(target, draft, mode, prompt, gbnf, args.n)
                outputs[mode] = ids
                valid = st.stop_reason == "eos"
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError):
                    valid = False
                t = totals[mode]
                t["tokens"] += st.generated
                t["decode_s"] += st.decode_s
                t["drafted"] += st.drafted
                t["accepted"] += st.accepted
                t["grammar_s"] += sum(clock.seconds.values())
                t["full_vocab"] += clock.calls["allowed_all"]
                t["invalid"] += not valid
                print(f"[{rep}] {task:9s} {mode:5s} {st.generated:4d} tok {st.tokens_per_s:6.2f} tok/s "
                      f"accept {st.accepted}/{st.drafted} grammar {sum(clock.seconds.values()) * 1e3:6.1f} ms "
                      f"({clock.calls['allowed_all']} full-vocabulary asks) valid={valid}", flush=True)
            for m in modes[1:]:  # greedy: equal, or apart from a near-tie (batched kernels)
                a, b = outputs[modes[0]], outputs[m]
                i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                print(f"      {m} vs {modes[0]}: " + ("same tokens" if a == b else
                      f"first different token: {i if i is not None else min(len(a), len(b))}"))
    base = totals[modes[0]]["tokens"] / totals[modes[0]]["decode_s"]
    print("\nmode   tok/s   ratio  acceptance  grammar ms/token  grammar share  invalid")
    for mode in modes:
        t = totals[mode]
        rate = t["tokens"] / t["decode_s"]
        acc = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        print(f"{mode:5s} {rate:7.2f} {rate / base:6.2f}x {acc:10.0%} {t['grammar_s'] / t['tokens'] * 1e3:12.3f}"
              f" {t['grammar_s'] / t['decode_s']:13.1%} {int(t['invalid']):8d}")


if __name__ == "__main__":
    main()
