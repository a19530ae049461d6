"""`localspec doctor`: what the installed llama.cpp build can do, and where models go.

Without models it reports the build: llama-cpp-python and ggml versions, whether GPU
offload is compiled in, the ggml backends and devices, CPU features, whether the AMX
workaround is in effect, threads, the offload defaults and RPC support (with --rpc,
whether each worker answers and its devices' memory). With --model/--draft it
loads them as `run` would (same -ngl/-ngld/-t/-c) and reports how many layers
llama.cpp puts on which device, and whether the pair can speculate together.
"""

from __future__ import annotations

import json
import os
import platform
import sys

import click

from localspec import __version__
from localspec.commands.options import load_options, model_options
from localspec.commands.ui import human_size
from localspec.core import rpc
from localspec.core.config import LoadOptions
from localspec.core.errors import BackendError, LocalspecError, UsageError

try:  # a missing or broken llama-cpp-python is what doctor is asked about, not a crash
    from localspec.core.backend import (
        Model,
        backends,
        default_threads,
        device_info,
        devices,
        ggml_build,
        has_amx,
        llama_cpp_version,
        supports_gpu_offload,
        supports_rpc,
        system_info,
    )
    from localspec.core.compat import check_pair
    from localspec.runtime import load_model

    BACKEND_ERROR: BackendError | None = None
except BackendError as exc:
    BACKEND_ERROR = exc

_GIB = 1024**3


# ----- the report -------------------------------------------------------------------


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """'CPU : AVX = 1 | AVX2 = 1 | CUDA : ARCHS = 900 | ' -> {backend: {feature: value}}."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for part in text.split("|"):
        part = part.strip()
        if " : " in part:
            section, part = (s.strip() for s in part.split(" : ", 1))
        key, eq, value = part.partition(" = ")
        if eq:
            out.setdefault(section, {})[key.strip()] = value.strip()
    return out


def offload_devices(devs: list[dict]) -> list[dict]:
    """The devices llama.cpp spreads offloaded layers over: GPUs, else integrated GPUs."""
    gpus = [d for d in devs if d["type"] == "gpu"]
    return gpus or [d for d in devs if d["type"] == "igpu"]


def system_report(n_threads: int | None) -> dict:
    info = system_info()
    features = parse_system_info(info)
    devs = devices()
    forced = os.environ.get("LOCALSPEC_EXTRA_BUFTS")
    amx_build = features.get("CPU", {}).get("AMX_INT8") == "1"
    amx = has_amx()
    if forced in ("0", "1"):
        amx_reason = f"LOCALSPEC_EXTRA_BUFTS={forced}"
    elif amx:
        amx_reason = "llama.cpp reports AMX_INT8" if amx_build else "the CPU advertises AMX"
    else:
        amx_reason = "no AMX on this CPU"
    gpu = supports_gpu_offload()
    cpu_dev = next((d for d in devs if d["type"] == "cpu"), None)
    return {
        "localspec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "llama_cpp_python": llama_cpp_version(),
        "ggml": ggml_build(),
        "gpu_offload": gpu,
        "backends": backends(),
        "devices": devs,
        "offload_devices": [d["name"] for d in offload_devices(devs)],
        "cpu": {
            "description": cpu_dev["description"] if cpu_dev else platform.processor(),
            "features": [k for k, v in features.get("CPU", {}).items() if v == "1"],
        },
        "amx": {"in_build": amx_build, "workaround": amx, "reason": amx_reason},
        "threads": {"default": default_threads(), "requested": n_threads},
        "offload_default": "all layers" if gpu else "none (CPU-only build)",
        "system_info": info.strip(),
        "system_info_parsed": features,
    }


def model_report(model: Model, role: str, requested: int, offload_to: list[dict]) -> dict:
    """How llama.cpp placed one loaded model: it counts the output layer as one more
    layer, so 'all' is n_layer + 1, offloaded from the last layer backwards."""
    total = model.n_layer + 1
    offloaded = min(max(model.info.n_gpu_layers, 0), total) if offload_to else 0
    names = [d["name"] for d in offload_to]
    if offloaded == total:
        placement = f"all {total} layers ({total - 1} + output) on {' + '.join(names)}"
    elif offloaded == 0:
        placement = f"all {total} layers ({total - 1} + output) on CPU"
    else:
        placement = f"{offloaded}/{total} layers on {' + '.join(names)}, {total - offloaded} on CPU"
    return {
        "role": role, "name": model.name, "path": str(model.path), "description": model.describe(),
        "size_bytes": model.size_bytes, "n_params": model.n_params, "n_layer": total - 1,
        "n_gpu_layers_requested": requested, "n_gpu_layers": model.info.n_gpu_layers,
        "layers_total": total, "layers_offloaded": offloaded, "devices": names if offloaded else ["CPU"],
        "placement": placement, "amx_workaround": model.info.amx_workaround,
        "n_threads": model.info.n_threads, "n_ctx": model.n_ctx,
    }


def load_models(opts: LoadOptions, offload_to: list[dict]) -> tuple[list[dict], dict | None, list[str]]:
    """Load what --model/--draft name; (model reports, pair check, warnings)."""
    wanted = [(role, spec, ngl) for role, spec, ngl in (
        ("target", opts.model, opts.n_gpu_layers), ("draft", opts.draft, opts.n_gpu_layers_draft)
    ) if spec and spec.lower() != "none"]
    loaded: dict[str, Model] = {}
    reports: list[dict] = []
    pair = None
    try:
        for role, _, ngl in wanted:
            loaded[role] = load_model(opts, role)
            reports.append(model_report(loaded[role], role, ngl, _offload_of(loaded[role], offload_to)))
        if len(loaded) == 2:
            try:
                check_pair(loaded["target"], loaded["draft"])
                pair = {"compatible": True, "error": None}
            except LocalspecError as exc:
                pair = {"compatible": False, "error": str(exc)}
    finally:
        for m in loaded.values():
            m.close()
    return reports, pair, placement_warnings(reports)


def _offload_of(model: Model, local: list[dict]) -> list[dict]:
    """The devices a model's offloaded layers went to: with --rpc, the workers' first."""
    return [{"name": n} for n in model.info.offload] if model.info.rpc else local


def rpc_report(endpoints: tuple[str, ...]) -> dict:
    """RPC support in this build and, for each --rpc worker, whether it answers and what
    it offers (ggml names a worker's devices RPC0, RPC1, ... in the order attached)."""
    supported = supports_rpc()
    if endpoints and not supported:
        raise UsageError(rpc.REBUILD)
    workers = []
    for ep in endpoints:
        try:
            version = rpc.probe(ep)
            devs = [device_info(d) for d in rpc.attach([ep])]
            workers.append({"endpoint": ep, "reachable": True, "protocol": version, "devices": devs})
        except LocalspecError as exc:
            workers.append({"endpoint": ep, "reachable": False, "error": str(exc)})
    return {"supported": supported, "workers": workers}


def placement_warnings(reports: list[dict]) -> list[str]:
    """Placements that make speculation slow: a draft left (partly) on the CPU while the
    target is offloaded costs more per drafted token than it saves."""
    by_role = {r["role"]: r for r in reports}
    t, d = by_role.get("target"), by_role.get("draft")
    if t and d and t["layers_offloaded"] and d["layers_offloaded"] < d["layers_total"]:
        return [("the draft model is not fully on the GPU: a draft left on the CPU makes "
                 "speculation slower (use -ngld -1)")]
    return []


@click.command()
@model_options()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, **kw) -> None:
    """Show what this llama.cpp build supports (GPU offload, backends, devices, CPU
    features, the AMX workaround, RPC) and, with --model/--draft, where each model's
    layers go; with --rpc, whether each worker answers.

    \b
      localspec doctor
      localspec doctor --rpc 192.168.1.20:50052 -m qwen2.5-coder-1.5b -ngl 99
      localspec doctor -m qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --json
    """
    opts = load_options(kw, bool((ctx.obj or {}).get("verbose")))
    if BACKEND_ERROR is not None:
        _no_backend(BACKEND_ERROR, as_json)
    report = system_report(opts.n_threads)
    report["rpc"] = rpc_report(opts.rpc)
    unreachable = [w["endpoint"] for w in report["rpc"]["workers"] if not w["reachable"]]
    if unreachable and (opts.model or opts.draft):
        report["warnings"] = [f"models not loaded: RPC worker {', '.join(unreachable)} unreachable"]
    elif opts.model or opts.draft:
        offload_to = [d for d in report["devices"] if d["name"] in report["offload_devices"]]
        report["models"], report["pair"], report["warnings"] = load_models(opts, offload_to)
        report["devices"] = devices()  # free memory now that the models are loaded
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)


def _no_backend(exc: BackendError, as_json: bool) -> None:
    """What can be said without llama.cpp; exit 1."""
    if as_json:
        click.echo(json.dumps({"localspec": __version__, "python": platform.python_version(),
                               "platform": f"{platform.system()} {platform.machine()}",
                               "llama_cpp_python": None, "error": str(exc)}, indent=2))
    else:
        _row("localspec", f"{__version__} (Python {platform.python_version()}, "
                          f"{platform.system()} {platform.machine()})")
        _row("llama-cpp-python", f"UNUSABLE: {exc}")
    raise SystemExit(1)


# ----- text output ------------------------------------------------------------------


def _row(key: str, value: object) -> None:
    click.echo(f"{key:<18} {value}")


def _mem(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


def print_report(r: dict) -> None:
    _row("localspec", f"{r['localspec']} (Python {r['python']}, {r['platform']})")
    _row("llama-cpp-python", f"{r['llama_cpp_python']} (ggml {r['ggml']['version']}, "
                             f"llama.cpp commit {r['ggml']['commit']})")
    if r["gpu_offload"]:
        _row("GPU offload", f"yes: layers go to {', '.join(r['offload_devices'])}")
    else:
        _row("GPU offload", "no (CPU-only build; for CUDA or Metal see docs/gpu.md)")
    _row("backends", ", ".join(r["backends"]))
    for i, d in enumerate(r["devices"]):
        mem = f", {_mem(d['memory_free'])} free of {_mem(d['memory_total'])}" if d["memory_total"] else ""
        _row("devices" if i == 0 else "",
             f"{d['name']}: {d['description']} ({d['type']}, {d['backend']} backend{mem})")
    _row("CPU", r["cpu"]["description"])
    _row("CPU features", " ".join(r["cpu"]["features"]) or "(none reported)")
    amx = r["amx"]
    _row("AMX workaround", f"{'on' if amx['workaround'] else 'off'} ({amx['reason']})")
    threads = r["threads"]
    _row("threads", f"{threads['requested'] or threads['default']}"
                    f"{'' if threads['requested'] else ' (all cores available; -t to change)'}")
    _row("offload default", f"-ngl/-ngld -1 = {r['offload_default']}")
    print_rpc(r["rpc"])
    _row("system info", r["system_info"])
    for m in r.get("models", []):
        click.echo()
        _row(f"{m['role']} model", f"{m['name']} ({m['description']})")
        _row("  size", f"{human_size(m['size_bytes'])}, {m['n_params'] / 1e6:,.0f}M parameters")
        _row("  layers", m["placement"])
        flag = "-ngl" if m["role"] == "target" else "-ngld"
        _row(f"  {flag}", f"{m['n_gpu_layers_requested']} (passed to llama.cpp as {m['n_gpu_layers']})")
        _row("  threads", m["n_threads"])
        _row("  context", f"{m['n_ctx']} tokens")
        _row("  AMX workaround", "on" if m["amx_workaround"] else "off")
    if r.get("pair"):
        click.echo()
        p = r["pair"]
        _row("pair", "compatible" if p["compatible"] else f"INCOMPATIBLE: {p['error']}")
    for w in r.get("warnings", []):
        click.echo(f"warning: {w}", err=True)


def print_rpc(r: dict) -> None:
    if r["supported"]:
        _row("RPC", "yes: `localspec worker` serves this machine, --rpc HOST:PORT uses workers")
    else:
        _row("RPC", f"no ({rpc.REBUILD})")
    for i, w in enumerate(r["workers"]):
        if w["reachable"]:
            devs = "; ".join(f"{d['name']}, {_mem(d['memory_free'])} free of {_mem(d['memory_total'])}"
                             for d in w["devices"])
            line = f"{w['endpoint']}: {devs} (protocol {w['protocol']})"
        else:
            line = f"{w['endpoint']}: UNREACHABLE: {w['error']}"
        _row("RPC workers" if i == 0 else "", line)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(doctor())
