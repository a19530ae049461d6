"""`localspec bench`: speculation against plain decoding on this machine, per workload
and per tag, with the verify cost curve and (optionally) llama-cpp-python's own
prompt lookup as a peer."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from localspec.bench import serve_bench
from localspec.bench.peer import PEERS
from localspec.commands.options import load_options, model_options, spec_config
from localspec.core.config import SPEC_MODES, SpecMode
from localspec.core.errors import UsageError
from localspec.core.tuning import DRAFT_P_MIN

DEFAULT_MODES = "none,ngram,model,hybrid"
QUICK = {"per_tag": 1, "n_predict": 48, "edit_n": 160, "vcurve_max": 8}


@click.command()
@model_options(default_draft=True)
@click.option("--modes", default=DEFAULT_MODES, show_default=True,
              help=f"comma-separated drafting modes to compare ({', '.join(SPEC_MODES)}); "
                   "none is always run, as the baseline")
@click.option("--k", "ks", default="16", show_default=True,
              help="draft lengths to sweep (the --draft-max of each variant), e.g. 4,8,16")
@click.option("--fixed-k", is_flag=True, help="always draft k tokens (no adaptive k)")
@click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min", type=click.FloatRange(0, 1),
              default=DRAFT_P_MIN, show_default=True,
              help="the model drafter stops when its top probability falls below this")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=1), default=256,
              show_default=True, help="most tokens per generation for prompt workloads")
@click.option("--edit-n", type=click.IntRange(min=0), default=0,
              help="most tokens per edit task [default: enough for the file: 1.5x its tokens + 64]")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE.jsonl",
              help='your own workloads, one JSON object a line: {"prompt": ..., "tag": ...} or '
                   '{"file": ..., "instruction": ...}')
@click.option("--tags", default=None, help="only these tags, e.g. code,edit")
@click.option("--per-tag", type=click.IntRange(min=0), default=0,
              help="at most this many workloads per tag (0: all)")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="runs of every variant, in alternating order")
@click.option("--quick", is_flag=True,
              help="a short run: one workload per tag, -n 48, --edit-n 160 (edits stay unfinished)")
@click.option("--vcurve", is_flag=True, help="measure the verify cost curve V(n) and draft cost c")
@click.option("--vcurve-max", type=click.IntRange(1, 64), default=32, show_default=True,
              help="largest verify batch for --vcurve")
@click.option("--peer", type=click.Choice(PEERS), default=None,
              help="also run a peer implementation on the same prompts, in the same process")
@click.option("--serve", "serve", is_flag=True,
              help="then benchmark serving (serve's default drafting, auto): concurrent requests by "
                   "context band, speculation off / on / by rule; prints the crossover and why, and "
                   "keeps it in the profile for `localspec serve`")
@click.option("--concurrency", default=None, metavar="C1,C2,...",
              help="with --serve: concurrent request counts [default: the serve bench's]")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON on stdout")
@click.option("--save", "save_path", default=None, metavar="FILE.json",
              help="also write the JSON results to this file")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="save a plot: speedup by mode and tag, V(n) (needs matplotlib)")
@click.option("--no-log", is_flag=True, help="do not append the generations to the acceptance log")
@click.option("--prefix-cache", is_flag=True,
              help="edit tasks restore their file's KV state from the prefix cache (stored "
                   "first when absent), as a second `localspec edit` of the file does")
@click.option("--sessions", "sessions", default=None, metavar="NAME,...",
              help="benchmark sessions instead: requests that repeat one another (tests, hints, "
                   "agent) and ones that do not (fresh), each plain, auto and auto with a memory; "
                   "'all' for every session")
@click.option("--session-requests", type=click.IntRange(1, 10), default=10, show_default=True,
              help="with --sessions: requests per session")
@click.pass_context
def bench(ctx: click.Context, modes: str, ks: str, fixed_k: bool, draft_p_min: float,
          n_predict: int, edit_n: int, prompts_file: str | None, tags: str | None, per_tag: int,
          repeats: int, quick: bool, vcurve: bool, vcurve_max: int, peer: str | None,
          serve: bool, concurrency: str | None, as_json: bool, save_path: str | None,
          plot_path: str | None, no_log: bool, prefix_cache: bool, sessions: str | None,
          session_requests: int, **kw: Any) -> None:
    """Benchmark speculative decoding on this machine: tok/s, speedup over plain
    decoding, acceptance and mean accepted length against theory, per workload tag.

    \b
      localspec bench --quick                        a few minutes
      localspec bench --k 4,8,16 --vcurve --plot bench.png
      localspec bench --prompts mine.jsonl --modes none,ngram --json
      localspec bench --tags edit --peer llama-cpp-python

    Every variant of a workload runs in this one process, interleaved, greedy; each
    speculative output is checked token by token against plain decoding. Edit tasks
    draft with `localspec edit`'s n-gram matching (3 to 12 tokens).
    """
    from localspec.bench import report
    from localspec.bench import workloads as wl
    from localspec.bench.runner import Settings

    if sessions:
        _sessions(ctx, sessions, session_requests, n_predict, as_json, save_path, kw)
        return

    if quick:  # only where the user did not choose
        per_tag, n_predict, edit_n, vcurve_max = (
            QUICK[name] if not _given(ctx, name) else value
            for name, value in (("per_tag", per_tag), ("n_predict", n_predict),
                                ("edit_n", edit_n), ("vcurve_max", vcurve_max)))
    # everything that can fail on user input fails here, before a model loads
    if plot_path:
        report.check_plot()
    serve_cs = _parse_ks(concurrency, "--concurrency", 1, 256) if concurrency else None
    items = wl.name_workloads(wl.load_jsonl(prompts_file)) if prompts_file else wl.builtin()
    items = wl.select(items, _words(tags), per_tag)
    opts = load_options(kw, ctx.obj["verbose"] if ctx.obj else False)
    mode_list = _parse_modes(modes, explicit=_given(ctx, "modes"), draft=opts.draft)
    k_list = _parse_ks(ks)
    if opts.draft is None and any(m.uses_draft_model for m in mode_list):
        from localspec.models import load_manifest

        opts = replace(opts, draft=load_manifest().default_draft)
    variants = _variants(mode_list, k_list, draft_p_min, fixed_k, opts.draft, peer)
    settings = Settings(n_predict, edit_n, repeats, log=not no_log, prefix_cache=prefix_cache)

    results, vc, meta, title = _run(opts, items, variants, settings,
                                    vcurve_max if vcurve else 0, peer, k_list)
    # after our models are freed: the serve bench loads its own target
    serve_out = _serve_bench(opts, n_predict, _words(tags), per_tag, serve_cs) if serve else None
    out = report.to_json(results, vc, meta) | {"serve": serve_out}
    if save_path:
        _write(save_path, json.dumps(out, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        report.print_report(results, vc, title)
        if serve_out is not None:
            click.echo(serve_bench.format_report(serve_out))
    if plot_path:
        _plots(plot_path, results, vc, title, serve_out)
    _fail_on_mismatch(results)


def _sessions(ctx: click.Context, names: str, n_requests: int, n_predict: int, as_json: bool,
              save_path: str | None, kw: dict) -> None:
    """`bench --sessions`: the session benchmark (bench/sessions.py), no draft model."""
    from localspec.bench import sessions as sb
    from localspec.commands.doctor import system_report
    from localspec.runtime import open_runtime

    known = {s.name: s for s in sb.builtin_sessions()}
    wanted = list(known) if names.strip() == "all" else _words(names)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise click.UsageError(f"--sessions: unknown {', '.join(unknown)} (known: {', '.join(known)}, all)")
    opts = replace(load_options(kw, ctx.obj["verbose"] if ctx.obj else False), draft="none")
    with open_runtime(opts, want_draft=False) as rt:
        results = sb.run_sessions(rt, [known[n] for n in wanted], n_requests, n_predict,
                                  progress=lambda line: click.echo(line, err=True))
        model = rt.target.name
    lines = sb.speedups(results)
    summary = sb.session_summary(lines)
    cpu = system_report(None)["cpu"]
    out = {"model": model, "cpu": f"{cpu['description']} ({', '.join(cpu['features'][:6])})", "n_predict": n_predict, "requests": lines, "sessions": summary}
    if save_path:
        _write(save_path, json.dumps(out, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(f"{model} on {out['cpu']}, greedy, {n_predict} tokens a request")
        click.echo(sb.format_report(lines, summary))
    if not all(s["all_same"] for s in summary.values()):
        raise SystemExit(1)


def _serve_bench(opts: Any, n_predict: int, tags: list[str], per_tag: int,
                 concurrency: list[int] | None) -> dict[str, Any]:
    return serve_bench.run_serve_bench(
        opts=opts, n_predict=n_predict, tags=tags or ("code", "json", "prose", "edit"),
        per_tag=per_tag or 1, progress=lambda line: click.echo(line, err=True),
        **({"concurrency": concurrency} if concurrency else {}))


def _fail_on_mismatch(results: list) -> None:
    bad = [r for r in results if r.verdict.status == "MISMATCH"]
    if bad:
        names = ", ".join(f"{r.workload} {r.variant.label}" for r in bad)
        raise click.ClickException(f"output differs from plain decoding at a confident token: {names}")


def _variants(modes: list[str], ks: list[int], draft_p_min: float, fixed_k: bool,
              draft: str | None, peer: str | None) -> list:
    """`none`, then every mode at every k (the engine's SpecConfig built the way `run`
    builds it, so `auto` resolves as it does there), then the peer at every k."""
    from localspec.bench.runner import Variant

    has_draft = bool(draft and draft.lower() != "none")
    variants = [Variant("none")]
    for mode in modes[1:]:
        for k in ks:
            spec = spec_config({"spec": mode, "draft_max": k, "draft_min": 0, "draft_p_min": draft_p_min,
                                "ngram_min": 1, "ngram_max": 4, "fixed_k": fixed_k}, has_draft)
            variants.append(Variant(mode, k, spec))
    return variants + ([Variant("peer", k) for k in ks] if peer else [])


def _run(opts: Any, items: list, variants: list, settings: Any, vcurve_max: int,
         peer: str | None, ks: list[int]) -> tuple[list, Any, dict[str, Any], str]:
    """Load the models, measure V(n) when asked, run every workload: (results, V curve,
    metadata, title)."""
    from localspec.bench.report import BenchProgress
    from localspec.bench.runner import run_workload
    from localspec.bench.vcurve import measure_vcurve
    from localspec.runtime import open_runtime

    with open_runtime(opts, want_draft=any(v.uses_draft for v in variants)) as rt:
        meta = _meta(rt, settings, variants, peer)
        title = (f"{rt.target.name}" + (f" + draft {rt.draft.name}" if rt.draft else "")
                 + f", greedy, threads={rt.target.info.n_threads}")
        _warn_if_busy()
        peer_impl = _open_peer(peer, rt, items, settings, ks) if peer else None
        steps = len(items) * len(variants) * settings.repeats + (1 if vcurve_max else 0)
        results: list = []
        vc = None
        try:
            with BenchProgress(steps) as progress:
                if vcurve_max:
                    progress.step("V(n) and c", vcurve_max)
                    vc = measure_vcurve(rt.target, vcurve_max, draft=rt.draft,
                                        on_step=lambda n: progress.advance())
                for w in items:
                    results += run_workload(rt, w, variants, settings, progress, peer_impl, vc)
        finally:
            if peer_impl is not None:
                peer_impl.close()
        meta["machine"]["load_avg_end"] = _load()
    return results, vc, meta, title


def _plots(path: str, results: list, vc: Any, title: str, serve_out: dict | None) -> None:
    from localspec.bench import report

    report.plot(path, results, vc, title)
    click.echo(f"plot written to {path}", err=True)
    if serve_out is not None:
        serve_plot = str(Path(path).with_name(Path(path).stem + "-serve.png"))
        serve_bench.plot(serve_out, serve_plot)
        click.echo(f"serve plot written to {serve_plot}", err=True)


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--save {path}: {exc.strerror or exc}") from None
    click.echo(f"results written to {path}", err=True)


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def _warn_if_busy() -> None:
    """Timings mean little when other processes hold the cores: say so up front."""
    load, cores = _load(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cores + 0.5:
        click.echo(f"warning: load average {load:.1f} on {cores} cores before the run: other "
                   "processes compete for the CPU, timings will be noisy", err=True)


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


def _words(text: str | None) -> list[str]:
    return [w.strip() for w in (text or "").split(",") if w.strip()]


def _parse_modes(text: str, *, explicit: bool, draft: str | None) -> list[SpecMode]:
    """`none` first, then the others in the order given; no draft model: the default
    list drops the modes that need one, an explicit list is an error."""
    modes = [m.lower() for m in _words(text)]
    unknown = [m for m in modes if m not in SPEC_MODES]
    if unknown:
        raise UsageError(f"--modes: unknown mode {', '.join(unknown)} (choose from {', '.join(SPEC_MODES)})")
    no_draft = bool(draft) and draft.lower() == "none"
    if no_draft:
        needing = [m for m in modes if SpecMode(m).needs_draft_model]
        if needing and explicit:
            raise UsageError(f"--modes {','.join(needing)} needs a draft model (not --draft none)")
        modes = [m for m in modes if not SpecMode(m).needs_draft_model]
    return [SpecMode.NONE, *dict.fromkeys(SpecMode(m) for m in modes if m != SpecMode.NONE)]


def _parse_ks(text: str, flag: str = "--k", lo: int = 1, hi: int = 256) -> list[int]:
    try:
        ks = [int(w) for w in _words(text)]
    except ValueError:
        raise UsageError(f"{flag} {text}: expected comma-separated integers, e.g. 4,8,16") from None
    if not ks or any(not lo <= k <= hi for k in ks):
        raise UsageError(f"{flag} {text}: each value must be between {lo} and {hi}")
    return list(dict.fromkeys(ks))


def _open_peer(name: str, rt: Any, items: list, settings: Any, ks: list[int]) -> Any:
    """The peer on the same target file, with a context just large enough (it keeps
    logits for every position: n_ctx x n_vocab floats)."""
    from localspec.bench.peer import open_peer
    from localspec.bench.workloads import prepare
    from localspec.core.backend import has_amx

    need = max(len(p.tokens) + p.max_tokens for p in
               (prepare(w, rt.target, settings.n_predict, settings.edit_n) for w in items))
    n_ctx = min(rt.target.n_ctx, need + max(ks) + 64)
    return open_peer(name, str(rt.target.path), n_ctx=n_ctx, n_threads=rt.target.info.n_threads,
                     n_gpu_layers=rt.target.info.n_gpu_layers, num_pred_tokens=ks[0],
                     amx_workaround=has_amx())


def _meta(rt: Any, settings: Any, variants: list, peer: str | None) -> dict[str, Any]:
    from localspec import __version__
    from localspec.core.backend import llama_cpp_version

    def model(m: Any) -> dict[str, Any] | None:
        return None if m is None else {"name": m.name, "path": str(m.path), "size": m.size_bytes,
                                       "n_gpu_layers": m.info.n_gpu_layers}

    return {
        "version": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"threads": rt.target.info.n_threads, "llama_cpp_python": llama_cpp_version(),
                    "amx_workaround": rt.target.info.amx_workaround, "platform": sys.platform,
                    "cpu_count": os.cpu_count(), "load_avg_start": _load()},
        "target": model(rt.target), "draft": model(rt.draft),
        "settings": {"n_predict": settings.n_predict, "edit_n": settings.edit_n,
                     "repeats": settings.repeats, "sampling": "greedy", "peer": peer,
                     "variants": [{"mode": v.mode, "k": v.k,
                                   "adaptive": v.spec.adapts_k if v.spec else None,
                                   "resolved_mode": v.spec.mode if v.spec else None}
                                  for v in variants]},
    }
