"""`localspec tune`: measure this machine's decoding costs and store a profile that
the `auto` policy uses."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from localspec import models
from localspec.bench.calibrate import BATCH_CONTEXTS, band_sizes, calibrate
from localspec.commands.options import load_options, model_options
from localspec.core.drafters.auto import CostModel, best_k
from localspec.core.errors import LocalspecError
from localspec.profile import LONG_CONTEXT, LONG_N_MAX, N_MAX, Profile, save_profile, vcurve_sizes


def _policy_lines(p: Profile) -> list[str]:
    """What the measured costs imply: the best k and its speedup at a few acceptance rates."""
    cost = CostModel(p, N_MAX)
    lines = []
    for label, c in (("n-gram", 0.0), ("draft model", p.c)):
        if c is None:
            continue
        parts = []
        for alpha in (0.5, 0.7, 0.9):
            k, expected, rate = best_k([alpha] * N_MAX, cost, c)
            parts.append(f"a={alpha:.1f}: k={k} ({rate:.2f}x)" if k else f"a={alpha:.1f}: plain")
        lines.append(f"{label:>11} (c={c:.2f}): " + ", ".join(parts))
    n, rate = ceiling(p)
    lines.append(f"{'ceiling':>11}: {rate:.2f}x (a drafter always right, verifying {n} tokens at a time): "
                 "the most speculation can give here")
    for ctx, band in sorted(p.vbands.items(), key=lambda x: int(x[0])):
        n, rate = ceiling(p, band)
        lines.append(f"{'':>11}  {rate:.2f}x after {int(ctx):,} tokens of context (verifying {n} at a time)")
    return lines


def ceiling(p: Profile, curve: list[float] | None = None) -> tuple[int, float]:
    """(n, n / V(n)) at the measured verify size where a drafter that is always right
    gains most: speculation's cap on this machine (long copies approach it; a CPU whose
    V(n) grows nearly linearly keeps it near 2x, a GPU's flat curve puts it far above).
    `curve`: one of the profile's long-context bands instead of the short curve."""
    rates = [n / v for n, v in enumerate(curve or p.vcurve, start=1)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return best + 1, rates[best]


@click.command()
@model_options(default_draft=True)
@click.option("--json", "as_json", is_flag=True, help="print the profile as JSON")
@click.option("--vcurve-max", type=click.IntRange(2, 256), default=N_MAX, show_default=True,
              help="largest verify batch timed after a short context (auto tries larger ones "
              "itself, within a budget)")
@click.option("--vcurve-long-max", type=click.IntRange(0, 512), default=LONG_N_MAX, show_default=True,
              help=f"largest verify batch timed after {LONG_CONTEXT:,} tokens of context, where "
              "edits verify (0: not timed)")
@click.pass_context
def tune(ctx: click.Context, as_json: bool, vcurve_max: int, vcurve_long_max: int, **kw) -> None:
    """Measure decode cost, the verify cost curve V(n) for n = 1..64 (--vcurve-max)
    after a short context and for n = 1..256 (--vcurve-long-max) after 1,024 tokens,
    prefill speed and the draft model's cost ratio on this machine; store them for
    `--spec auto`, which reads the curve measured nearest its prompt's length. With
    -fa auto (the default) it first times flash attention on and off at a 1,024-token
    context and keeps the faster for every later run.

    The profile is keyed by model files, device, threads and GPU layers.
    """
    from localspec.runtime import open_runtime, setup_of  # loads llama.cpp: not for --help

    opts = load_options(kw, ctx.obj["verbose"] if ctx.obj else False)
    if opts.draft is None:
        default = models.load_manifest().default_draft
        try:
            models.resolve(default, role="draft")
            opts = replace(opts, draft=default)
        except LocalspecError:
            pass  # no draft pulled: profile the target alone
    console = Console(stderr=True)
    with open_runtime(opts, want_draft=True) as rt, Progress(
        TextColumn("[bold]tune[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:
        task = progress.add_task("measure", total=len(vcurve_sizes(vcurve_max)) + 2 + len(BATCH_CONTEXTS)
                                 + (opts.flash_attn == "auto")
                                 + (len(band_sizes(vcurve_long_max)) if vcurve_long_max else 0))
        setup = setup_of(rt.target, rt.draft)
        profile = calibrate(rt.target, rt.draft, setup, vcurve_max, tick=lambda: progress.advance(task),
                            long_max=vcurve_long_max)
    path = save_profile(profile)
    if profile.draft is not None:  # V(n) is the target's alone: serve and draftless runs use it too
        save_profile(replace(profile, key=setup.alone().key, draft=None, draft_t_token_s=None))
    if as_json:
        click.echo(json.dumps({**asdict(profile), "path": str(path)}, indent=2))
        return
    v = profile.vcurve
    click.echo(f"target {profile.target}: {1000 * profile.t_token_s:.1f} ms/token "
               f"({1 / profile.t_token_s:.1f} tok/s), prefill {profile.prefill_tok_s:.0f} tok/s, "
               f"{profile.device}, {profile.n_threads} threads")
    if opts.flash_attn != "auto":
        attention = f"{opts.flash_attn} (set by -fa)"
    elif profile.flash_attn:
        attention = f"{profile.flash_attn} (measured faster; runs with -fa auto use it)"
    else:
        attention = "llama.cpp's choice (on and off within 3%)"
    click.echo(f"flash attention: {attention}")
    click.echo("V(n) = verify n tokens / one token: " + ", ".join(
        f"{n}:{v[n - 1]:.2f}" for n in (2, 4, 8, 12, 16, 24, 32, 48, 64) if n <= len(v)))
    for at, band in sorted(profile.vbands.items(), key=lambda x: int(x[0])):
        click.echo(f"V(n) after {int(at):,} tokens: " + ", ".join(
            f"{n}:{band[n - 1]:.2f}" for n in (2, 4, 8, 16, 32, 64, 128, 256) if n <= len(band)))
    if profile.draft:
        click.echo(f"draft {profile.draft}: {1000 * profile.draft_t_token_s:.1f} ms/token, c = {profile.c:.2f}")
    if profile.batch_limits:
        from localspec.bench.calibrate import BATCH_ALPHA, BATCH_K
        from localspec.serve.defaults import spec_threshold

        click.echo(f"serve: speculation {spec_threshold(None, profile).describe()}, timed on batches of "
                   f"{BATCH_K}-token drafts at {BATCH_ALPHA:.0%} acceptance (one sequence alone: auto's own call)")
    click.echo("policy that follows (best k at acceptance a):")
    for line in _policy_lines(profile):
        click.echo("  " + line)
    click.echo(f"saved {path}")
