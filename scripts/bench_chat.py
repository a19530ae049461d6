#!/usr/bin/env python3
"""Chat measurements, each side by side in one process:

render  what drawing costs generation: the same greedy reply generated without a UI
        (the runner's event stream drained in a thread) and inside the textual chat app
        (headless `run_test`, a 120x40 screen, markdown and draft styling on),
        alternating. Prints decode tok/s each way, their ratio, and the UI thread's CPU
        time over the reply's wall time (the app's /stats figure). A small, fast model
        is the hard case: more tokens per second to draw.
ttft    time to first token of turn 2 with the KV cache kept between turns (only the new
        tokens are prefilled) vs re-prefilling the whole history (--no-prompt-cache),
        on a turn 1 that carries a source file.

    python scripts/bench_chat.py render [--model smollm2-135m] [--repeats 3] [-n 256]
    python scripts/bench_chat.py ttft [--model qwen2.5-coder-1.5b] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
from pathlib import Path

from localspec import models
from localspec.chat.app import ChatApp
from localspec.chat.runner import ChatRunner
from localspec.core.backend import Model
from localspec.core.config import (
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    SpecConfig,
)
from localspec.runtime import Runtime

PROMPT = "Write a Python module with five small functions for string utilities, with docstrings."


SOURCE = Path(__file__).resolve().parent.parent / "localspec" / "workloads" / "edit" / "inventory.py"


def runner_for(model: Model, n: int, reuse_prefix: bool = True) -> ChatRunner:
    model.rewind(0)
    return ChatRunner(Runtime(model, None), spec=SpecConfig(mode="ngram", draft_max=8),
                      sampling=SamplingConfig(temperature=0.0), gen=GenerationConfig(max_tokens=n),
                      log=False, reuse_prefix=reuse_prefix)


def drain(runner: ChatRunner, prompt: str) -> None:
    stream = runner.reply(prompt)
    try:
        for _ in stream:
            pass
    finally:
        stream.close()


def without_ui(model: Model, n: int) -> float:
    runner = runner_for(model, n)
    t = threading.Thread(target=drain, args=(runner, PROMPT))  # the app's worker is a thread too
    t.start()
    t.join()
    return runner.turns[-1].tokens_per_s


def turn_two(model: Model, reuse_prefix: bool) -> tuple[float, int, int]:
    """(turn-2 time to first token, tokens prefilled for turn 2, history tokens)."""
    runner = runner_for(model, 48, reuse_prefix)
    drain(runner, f"Review this file briefly:\n```python\n{SOURCE.read_text()}```")
    drain(runner, "Which method would you rename first, and why?")
    turn = runner.turns[-1]
    return turn.ttft_s or 0.0, turn.prefill_tokens, turn.prompt_tokens


def with_ui(model: Model, n: int, hz: tuple[float, float] = (4.0, 2.0)) -> tuple[float, float, int]:
    from textual.widgets import Input

    runner = runner_for(model, n)

    async def go() -> tuple[float, float, int]:
        app = ChatApp(runner, text_hz=hz[0], status_hz=hz[1])
        async with app.run_test(size=(120, 40)) as pilot:
            app.query_one("#prompt", Input).value = PROMPT
            await pilot.press("enter")
            await pilot.pause()
            while app.generating:  # not pilot.pause(): its wait-for-idle costs the UI ~6% CPU
                await asyncio.sleep(0.2)
            rs = app.render_stats
            return runner.turns[-1].tokens_per_s, rs.ui_cpu_s / rs.generating_s, rs.updates

    return asyncio.run(go())


def render(args: argparse.Namespace) -> None:
    path = models.resolve(args.model or "smollm2-135m", role="target")
    model = Model(ModelConfig(path=str(path), n_ctx=2048, n_threads=args.threads))
    without_ui(model, 16)  # warm-up
    plain, ui, shares, updates = [], [], [], []
    for i in range(args.repeats):
        order = ("plain", "ui") if i % 2 == 0 else ("ui", "plain")
        for which in order:
            if which == "plain":
                plain.append(without_ui(model, args.n))
            else:
                tok_s, share, n_updates = with_ui(model, args.n, (args.text_hz, args.status_hz))
                ui.append(tok_s)
                shares.append(share)
                updates.append(n_updates)
        print(f"[{i + 1}/{args.repeats}] no UI {plain[-1]:.1f} tok/s, chat app {ui[-1]:.1f} tok/s, "
              f"UI thread CPU {shares[-1]:.1%} of the reply, {updates[-1]} screen updates")
    p, u = statistics.median(plain), statistics.median(ui)
    print(f"{path.name}, -n {args.n}: median no UI {p:.1f} tok/s, chat app {u:.1f} tok/s, "
          f"ratio {u / p:.3f} (overhead {1 - u / p:+.1%}); UI thread CPU median "
          f"{statistics.median(shares):.1%} of generation time")
    model.close()


def ttft(args: argparse.Namespace) -> None:
    path = models.resolve(args.model, role="target")
    model = Model(ModelConfig(path=str(path), n_ctx=4096, n_threads=args.threads))
    cached, full = [], []
    for i in range(args.repeats):
        for reuse in ((True, False) if i % 2 == 0 else (False, True)):
            t, prefilled, history = turn_two(model, reuse)
            (cached if reuse else full).append(t)
            print(f"[{i + 1}/{args.repeats}] {'kept KV' if reuse else 're-prefill'}: turn-2 TTFT "
                  f"{t:.2f}s, prefilled {prefilled} of {history} history tokens")
    c, f = statistics.median(cached), statistics.median(full)
    print(f"{path.name}: turn-2 TTFT median {c:.2f}s with the KV cache kept vs {f:.2f}s re-prefilling "
          f"the history: {f / c:.1f}x faster")
    model.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["render", "ttft"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--text-hz", type=float, default=4.0, help="render: the app's text updates per second")
    ap.add_argument("--status-hz", type=float, default=2.0, help="render: status bar updates per second")
    args = ap.parse_args()
    (render if args.what == "render" else ttft)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
