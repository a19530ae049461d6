#!/usr/bin/env python3
"""Core benchmark: plain decode vs n-gram drafting on an edit-style prompt, side by side
in one process, greedy. Prints ratios (speedup vs plain, acceptance, mean accepted
length, Python overhead) and whether the outputs are identical.

    python scripts/bench_core.py [--model NAME] [--file PATH] [--repeats 1] [-n 1024]
"""

from __future__ import annotations

import argparse
import sys
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
from localspec.core.engine import collect, generate
from localspec.core.chat_template import chat_prompt
from localspec.runtime import make_drafter

HERE = Path(__file__).resolve().parent
DEFAULT_FILE = HERE.parent / "localspec" / "workloads" / "edit" / "inventory.py"
INSTRUCTION = "Rename the class Item to Product everywhere in this file. Output the whole file."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--file", default=str(DEFAULT_FILE))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("-n", type=int, default=1024)
    ap.add_argument("--modes", default="none,ngram:16,ngram:8")
    args = ap.parse_args()

    path = models.resolve(args.model, role="target")
    target = Model(ModelConfig(path=str(path), n_ctx=4096))
    source = Path(args.file).read_text()
    prompt = chat_prompt(target, f"{INSTRUCTION}\n\n```\n{source}```")
    greedy = SamplingConfig(temperature=0.0)
    gen = GenerationConfig(max_tokens=args.n)
    variants = []
    for item in args.modes.split(","):
        mode, _, k = item.partition(":")
        variants.append((item, SpecConfig(mode=mode, draft_max=int(k or 16))))

    results: dict[str, list] = {name: [] for name, _ in variants}
    outputs: dict[str, list[int]] = {}
    for r in range(args.repeats):  # interleaved so machine noise hits every variant alike
        for name, spec in variants:
            drafter = make_drafter(spec, greedy, None)
            ids, _, stats = collect(generate(target, prompt, drafter, sampling=greedy, spec=spec, gen=gen))
            results[name].append(stats)
            outputs.setdefault(name, ids)
            print(f"[{r + 1}/{args.repeats}] {name}: {stats.tokens_per_s:.2f} tok/s", file=sys.stderr)

    base = sum(s.tokens_per_s for s in results["none"]) / len(results["none"])
    table = Table(title=f"{path.name}, {len(prompt)}-token edit prompt, greedy")
    for col in ("mode", "tokens", "tok/s", "speedup", "acceptance", "mean acc", "tok/round",
                "overhead", "identical"):
        table.add_column(col, justify="right")
    for name, runs in results.items():
        tps = sum(s.tokens_per_s for s in runs) / len(runs)
        s = runs[-1]
        table.add_row(
            name, str(s.generated), f"{tps:.2f}", f"{tps / base:.2f}x", f"{s.acceptance:.1%}",
            f"{s.mean_accepted:.2f}", f"{s.tokens_per_round:.2f}", f"{s.overhead:.1%}",
            "yes" if outputs[name] == outputs["none"] else "NO",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
