#!/usr/bin/env python3
"""Edit benchmark: each task of localspec/workloads/edit/tasks.jsonl rewritten greedily
with n-gram drafting (the `localspec edit` defaults) and with --spec none, side by side
in one process, through the same code path as the command. Prints per task: plain and
drafted tok/s, speedup, acceptance, mean accepted length, tokens per round, whether
the edited texts are identical; then the round time per batch size measured in the
run (V(n), relative to n=1), which decides what a round of k drafted tokens costs.

--replay VARIANT replays the plain run's greedy tokens through another drafter and k
policy (no model: the target's choices are known) and costs each round with V(n), as
measured in this run or as in a reference curve (--v-table reference): a way to compare drafters
on a busy machine, where only ratios of measured runs are trustworthy.

    python scripts/bench_edit.py [--model NAME] [--repeats 1] [--tasks 0,1,2]
        [--variant "draft_max=15,ngram_max=6" ...] [--replay "mode=copy,adaptive=0" ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from localspec import models
from localspec.core.backend import Model
from localspec.core.config import (
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.core.drafters.base import DrafterBase
from localspec.core.drafters.ngram import NgramDraft
from localspec.core.engine import AdaptiveK, Round, Token
from localspec.runtime import make_drafter
from localspec.edit import (
    EDIT_SPEC_DEFAULTS,
    build_prompt,
    choose_fence,
    read_source,
    rewrite,
    split_lines,
    split_region,
)

WORKLOADS = Path(__file__).resolve().parent.parent / "localspec" / "workloads"
GREEDY = SamplingConfig(temperature=0.0)


# the curve the project started from: 1.5B, 2 threads (docs/measurements.md)
REFERENCE_V_MS = {1: 102, 2: 145, 4: 202, 5: 234, 8: 320, 16: 323}
# measured on a 2-core AMD EPYC (Zen 3, no AMX) host with scripts' decode loop, quiet machine
EPYC_V_MS = {1: 93, 2: 137, 3: 173, 4: 210, 5: 251, 6: 275, 8: 458, 10: 531, 12: 592, 15: 576,
             16: 657, 17: 765, 20: 912, 24: 895, 32: 1079}


class RoundTimer:
    """Wall time of each round by batch size (1 + drafted tokens), from the events;
    also the token ids of the current run (for --replay)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.by_n: dict[int, list[float]] = defaultdict(list)
        self.ids: list[int] = []

    def start(self) -> None:
        self.last, self.ids = None, []

    def __call__(self, ev) -> None:
        now = time.perf_counter()
        if isinstance(ev, Token):
            self.ids.append(ev.id)
            if self.last is None:
                self.last = now  # the first token comes from prefill
        elif isinstance(ev, Round):
            if self.last is not None:
                self.by_n[1 + ev.n_draft].append(now - self.last)
            self.last = now


class CopyDrafter(DrafterBase):
    """PROTOTYPE for localspec/drafters/copy.py (proposed; drafters/ is not edit's to
    change): edit-aware prompt lookup. Selected here with --variant mode=copy.

    Candidates are all earlier positions in the context (the prompt holds the file,
    then the text generated so far) whose preceding 2-gram (else 1-gram) equals the
    context's suffix. Rank: longest backward match L (up to 64 tokens), then closeness
    to the copy cursor (where the last accepted copy ended, at or after it preferred),
    then recency. The cursor keeps a rewrite aligned with the original, so after
    `def sell(` the draft continues sell's body, not the most recent `(self, amount)`.
    When the only matches are weak (L < 2) right after a rejection at the cursor, the
    new token is taken to replace the old one (a rename): copy from cursor + 1.
    """

    name = "copy"

    def __init__(self, max_match: int = 64, min_match: int = 1, substitute: bool = True) -> None:
        self.max_match = max_match
        self.min_match = min_match  # draft nothing on a shorter match: a plain round is cheaper
        self.substitute = substitute

    def begin(self, prompt) -> None:
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple, list[int]]] = {1: defaultdict(list), 2: defaultdict(list)}
        self.cursor: int | None = None  # position in tokens where the aligned copy continues
        self.last: int | None = None  # start of the last draft
        self.substituted_at: int | None = None
        self._extend(prompt)

    def _extend(self, new) -> None:
        for tok in new:
            end = len(self.tokens)  # n-grams ending just before `tok` map to its position
            for n, idx in self.index.items():
                if end >= n:
                    idx[tuple(self.tokens[end - n : end])].append(end)
            self.tokens.append(tok)

    def observe(self, n_draft: int, n_accept: int, verify_s: float, draft_s: float) -> None:
        if self.last is not None and n_accept > 0:
            self.cursor = self.last + n_accept
            self.substituted_at = None
        self.last = None

    def _best(self) -> tuple[int, int | None]:
        t, end = self.tokens, len(self.tokens)
        for n in (2, 1):
            cands = self.index[n].get(tuple(t[end - n :])) if end >= n else None
            if not cands:
                continue
            best_key, best_p = None, None
            for p in cands:
                length = n
                while length < self.max_match and p > length and t[p - length - 1] == t[end - length - 1]:
                    length += 1
                if self.cursor is None:
                    near = p
                else:
                    d = p - self.cursor
                    near = -d if d >= 0 else -(1 << 30) + d  # at/after the cursor first
                key = (length, near)
                if best_key is None or key > best_key:
                    best_key, best_p = key, p
            return best_key[0], best_p
        return 0, None

    def draft(self, context, k: int) -> NgramDraft:
        n = len(self.tokens)
        if n > len(context) or (n and context[n - 1] != self.tokens[n - 1]):
            self.begin(context)
        else:
            self._extend(context[n:])
        if k <= 0:
            return NgramDraft(source=self.name)
        length, p = self._best()
        if length < 2 and self.substitute and self.cursor is not None and self.substituted_at != self.cursor:
            p, self.substituted_at = self.cursor + 1, self.cursor
        elif length < self.min_match:
            p = None
        if p is None or p >= len(self.tokens):
            return NgramDraft(source=self.name)
        self.last = p
        return NgramDraft(tokens=self.tokens[p : p + k], source=self.name, match_len=length)


def edit_spec(overrides: str = "") -> SpecConfig:
    """The spec `localspec edit` uses by default, with key=value overrides."""
    d = EDIT_SPEC_DEFAULTS  # in click's names: spec, fixed_k
    values = {"mode": d["spec"], "adaptive": not d.get("fixed_k", False),
              **{k: v for k, v in d.items() if k not in ("spec", "fixed_k")}}
    for item in filter(None, (s.strip() for s in overrides.split(","))):
        key, _, val = item.partition("=")
        values[key] = (val if key == "mode" else val == "1" if key == "adaptive"
                       else float(val) if key == "draft_p_min" else int(val))
    if values["mode"] == "copy":
        return CopySpec(**{**values, "mode": "ngram"})
    return SpecConfig(**values)


@dataclass(frozen=True)
class CopySpec(SpecConfig):
    """--variant mode=copy: the prototype CopyDrafter, which the engine runs as it runs
    an n-gram drafter (it drafts whenever the mode is not none)."""


def task_prompt(target: Model, task: dict) -> tuple[list[int], list[int], str]:
    """(prompt, file tokens, fence) exactly as `localspec edit FILE -i INSTRUCTION`."""
    src = read_source(WORKLOADS / task["file"])
    region = split_region(src.text)
    prompt = build_prompt(target, region, task["file"], len(split_lines(src.text)), task["instruction"])
    file_tokens = target.tokenize(region.body, add_special=False, parse_special=False)
    return prompt, file_tokens, choose_fence(region.body)


def drafter_for(spec: SpecConfig, file_tokens: list[int], target: Model | None, task: dict):
    if isinstance(spec, CopySpec):
        return CopyDrafter(min_match=spec.ngram_min, substitute=spec.draft_p_min > 0), spec
    return make_drafter(spec, GREEDY, None, file_tokens, target=target, instruction=task["instruction"],
                        filename=task["file"]), spec


def run_one(target: Model, task: dict, spec: SpecConfig, timer: RoundTimer):
    prompt, file_tokens, fence = task_prompt(target, task)
    drafter, spec = drafter_for(spec, file_tokens, target, task)
    gen = GenerationConfig(max_tokens=2 * len(file_tokens) + 256)
    timer.start()
    return rewrite(target, drafter, prompt, fence, sampling=GREEDY, spec=spec, gen=gen, on_event=timer)


def v_curve(points: dict[int, float]):
    """V(n) in ms through the known points: linear between them, the last slope beyond."""
    xs = sorted(points)

    def v(n: int) -> float:
        if n in points:
            return points[n]
        lo = max([x for x in xs if x < n], default=xs[0])
        hi = min([x for x in xs if x > n], default=None)
        if hi is None:  # beyond the table: continue the last segment
            a, b = xs[-2], xs[-1]
            return points[b] + (n - b) * (points[b] - points[a]) / (b - a)
        return points[lo] + (n - lo) * (points[hi] - points[lo]) / (hi - lo)

    return v


def replay(prompt: list[int], ref: list[int], drafter, spec: SpecConfig, v) -> dict:
    """Greedy speculation replayed on a known greedy output `ref`: the same drafter calls,
    k policy and accept rule as the engine, each round costed v(1 + n_draft) ms."""
    eos = -1
    out = [*ref, eos]
    context = [*prompt, out[0]]
    drafter.begin(prompt)
    policy = AdaptiveK(spec)
    i, cost, rounds, drafted, accepted, draft_rounds = 1, 0.0, 0, 0, 0, 0
    while i < len(out):
        k = min(policy.k, len(out) - i)
        draft = drafter.draft(context, k).tokens[:k] if k > 0 else []
        n = 0
        while n < len(draft) and draft[n] == out[i + n]:
            n += 1
        cost += v(1 + len(draft))
        rounds += 1
        drafted, accepted, draft_rounds = drafted + len(draft), accepted + n, draft_rounds + bool(draft)
        policy.update(len(draft), n)
        drafter.observe(len(draft), n, v(1 + len(draft)) / 1000, 0.0)  # auto learns V from this
        context += [t for t in out[i : i + n + 1] if t != eos]
        i += n + 1
    return {"speedup": len(ref) * v(1) / cost, "acceptance": accepted / max(1, drafted),
            "mean_accepted": accepted / max(1, draft_rounds), "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target [default: qwen2.5-coder-1.5b]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tasks", default=None, help="comma-separated task indices [default: all]")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra drafted variant: SpecConfig overrides, e.g. draft_max=15,ngram_max=6")
    ap.add_argument("--replay", action="append", default=[],
                    help="variant to replay on the plain runs' tokens (no model), e.g. mode=copy,adaptive=0")
    ap.add_argument("--v-table", choices=["measured", "reference", "epyc"], default="measured",
                    help="round cost for --replay: this run's round times, the reference V(n), or "
                         "the one measured on a 2-core AMD EPYC")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    tasks = [json.loads(ln) for ln in (WORKLOADS / "edit" / "tasks.jsonl").read_text().splitlines() if ln.strip()]
    chosen = [int(i) for i in args.tasks.split(",")] if args.tasks else list(range(len(tasks)))
    path = models.resolve(args.model, role="target")
    target = Model(ModelConfig(path=str(path), n_ctx=4096, n_threads=args.threads))
    variants = [("none", replace(edit_spec(), mode="none")), ("edit", edit_spec())]
    variants += [(v, edit_spec(v)) for v in args.variant]

    results: dict[tuple[int, str], list] = defaultdict(list)
    bodies: dict[tuple[int, str], str | None] = {}
    timers = {name: RoundTimer() for name, _ in variants}
    plain_ids: dict[int, list[int]] = {}
    for r in range(args.repeats):  # interleaved, so machine noise hits every variant alike
        for ti in chosen:
            for name, spec in variants:
                out = run_one(target, tasks[ti], spec, timers[name])
                results[ti, name].append(out.stats)
                bodies.setdefault((ti, name), out.body)
                if name == "none":
                    plain_ids[ti] = timers[name].ids
                s = out.stats
                print(f"[{r + 1}/{args.repeats}] task {ti} {name}: {s.generated} tok, "
                      f"{s.tokens_per_s:.2f} tok/s, {s.rounds} rounds"
                      + ("" if out.body is not None else " INCOMPLETE"), file=sys.stderr, flush=True)

    rows = report(tasks, chosen, variants, results, bodies, path.name)
    measured = print_v_table(timers)
    if args.replay:
        tables = {"reference": REFERENCE_V_MS, "epyc": EPYC_V_MS, "measured": measured or REFERENCE_V_MS}
        v = v_curve(tables[args.v_table])
        names = [name for name, _ in variants[1:]] + args.replay
        print_replays(target, tasks, chosen, plain_ids, names, v, args.v_table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    ok = all(r["identical"] and r["complete"] for r in rows)
    return 0 if ok else 1


def report(tasks, chosen, variants, results, bodies, model_name) -> list[dict]:
    table = Table(title=f"localspec edit, {model_name}, greedy: drafted vs --spec none")
    for col in ("task", "variant", "tokens", "plain tok/s", "tok/s", "speedup", "acceptance",
                "mean acc", "tok/round", "identical"):
        table.add_column(col, justify="right")
    rows = []
    for ti in chosen:
        plain = statistics.mean(s.tokens_per_s for s in results[ti, "none"])
        label = f"{ti}: {Path(tasks[ti]['file']).name} {tasks[ti]['instruction'][:28]}…"
        for name, _ in variants[1:]:
            runs = results[ti, name]
            tps = statistics.mean(s.tokens_per_s for s in runs)
            s = runs[-1]
            same = bodies[ti, name] == bodies[ti, "none"]
            complete = bodies[ti, name] is not None and bodies[ti, "none"] is not None
            rows.append({"task": ti, "variant": name, "tokens": s.generated, "plain_tps": plain,
                         "tps": tps, "speedup": tps / plain, "acceptance": s.acceptance,
                         "mean_accepted": s.mean_accepted, "tokens_per_round": s.tokens_per_round,
                         "identical": same, "complete": complete})
            table.add_row(label, name, str(s.generated), f"{plain:.2f}", f"{tps:.2f}",
                          f"{tps / plain:.2f}x", f"{s.acceptance:.1%}", f"{s.mean_accepted:.2f}",
                          f"{s.tokens_per_round:.2f}",
                          "yes" if same else ("NO" if complete else "incomplete"))
    Console().print(table)
    return rows


def print_replays(target, tasks, chosen, plain_ids, names, v, table_name) -> None:
    table = Table(title=f"replayed on the plain runs' tokens, V(n) {table_name}")
    for col in ("variant", *[f"task {ti}" for ti in chosen]):
        table.add_column(col, justify="right")
    for name in names:
        cells = []
        for ti in chosen:
            prompt, file_tokens, _ = task_prompt(target, tasks[ti])
            spec = edit_spec("" if name == "edit" else name)
            drafter, spec = drafter_for(spec, file_tokens, None if spec.mode != "auto" else target, tasks[ti])
            r = replay(prompt, plain_ids[ti], drafter, spec, v)
            cells.append(f"{r['speedup']:.2f}x acc {r['acceptance']:.0%} mean {r['mean_accepted']:.1f}")
        table.add_row(name, *cells)
    Console().print(table)


def print_v_table(timers: dict[str, RoundTimer]) -> dict[int, float]:
    """Round time by batch size over all runs (drafting and Python included); returns the
    median ms by batch size where at least 3 rounds were seen."""
    by_n: dict[int, list[float]] = defaultdict(list)
    for timer in timers.values():
        for n, xs in timer.by_n.items():
            by_n[n].extend(xs)
    if 1 not in by_n:
        return {}
    base = statistics.median(by_n[1])
    table = Table(title="round time by batch size (median; V(n) relative to n=1)")
    for col in ("n", "rounds", "ms", "V(n)", "ms/token if all accepted"):
        table.add_column(col, justify="right")
    for n in sorted(by_n):
        med = statistics.median(by_n[n])
        table.add_row(str(n), str(len(by_n[n])), f"{med * 1000:.0f}", f"{med / base:.2f}",
                      f"{med * 1000 / n:.0f}")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
