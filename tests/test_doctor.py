"""`localspec doctor` on this machine, and the offload options (-ngl/-ngld) end to end:
parsed by click, carried in LoadOptions, passed to ModelConfig, applied by the backend."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from localspec.commands.doctor import (
    doctor,
    model_report,
    parse_system_info,
    placement_warnings,
)
from localspec.commands.options import load_options, model_options
from localspec.core.backend import supports_gpu_offload
from localspec.core.backend.ggml import offload_compiled
from localspec.runtime import open_runtime

LOCALSPEC = shutil.which("localspec")
CPU_BUILD = not supports_gpu_offload()


def cli(*args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [LOCALSPEC] if LOCALSPEC else [sys.executable, "-m", "localspec"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


_LOAD = "load_tensors: loading model tensors"
_ASKED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers")
_LAYER = re.compile(r"load_tensors: layer +(\d+) assigned to device (\S+),")


def llama_loads(log: str) -> list[tuple[int | None, int, dict[int, str]]]:
    """llama.cpp's own account of each model load in a `localspec -v` log: (layers it was
    asked to offload, layers in all, {layer: device it put the layer on}). A build with no
    backend to offload to (CPU only, no RPC) does not log the count: None then."""
    loads = []
    for chunk in log.split(_LOAD)[1:]:
        asked = _ASKED.search(chunk)
        layers = {int(i): d for i, d in _LAYER.findall(chunk)}
        if offload_compiled():
            assert asked, "llama.cpp's load log changed: no 'offloaded N/M layers' line"
            loads.append((int(asked[1]), int(asked[2]), layers))
        else:
            assert asked is None, asked[0]
            loads.append((None, len(layers), layers))
    return loads


def off_cpu(layers: dict[int, str]) -> list[int]:
    return sorted(i for i, dev in layers.items() if dev != "CPU")


# ----- doctor through the real console entry point -----------------------------------


def test_doctor_names_cpu_backend_and_amx_state():
    # LOCALSPEC_EXTRA_BUFTS=0 forces the AMX workaround on, whatever this CPU is
    proc = cli("doctor", env={"LOCALSPEC_EXTRA_BUFTS": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(None, 1)[0].lower(): line for line in proc.stdout.splitlines() if line.strip()}
    assert "CPU" in lines["backends"].split(None, 1)[1].split(", ")
    assert "AMX workaround     on (LOCALSPEC_EXTRA_BUFTS=0)" in proc.stdout
    assert ("GPU offload        yes" in proc.stdout) == supports_gpu_offload()
    assert "llama-cpp-python   0.3.36" in proc.stdout
    assert "llama" not in proc.stderr.lower()  # llama.cpp's log stays quiet


def test_doctor_json_parses_and_agrees_with_backend():
    proc = cli("doctor", "--json", env={"LOCALSPEC_EXTRA_BUFTS": "1"})  # workaround forced off
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "CPU" in report["backends"]
    assert any(d["type"] == "cpu" and d["backend"] == "CPU" for d in report["devices"])
    assert report["amx"]["workaround"] is False
    assert report["amx"]["reason"] == "LOCALSPEC_EXTRA_BUFTS=1"
    assert report["gpu_offload"] == supports_gpu_offload()
    assert report["threads"]["default"] >= 1
    assert "CPU" in report["system_info_parsed"]
    if CPU_BUILD:
        assert report["offload_devices"] == [] and report["offload_default"].startswith("none")
    assert "models" not in report  # nothing loaded without --model/--draft


def test_doctor_with_models_reports_placement(smol_path):
    """The placement doctor reports is the one llama.cpp logs (-v) while loading."""
    proc = cli("-v", "doctor", "--json", "-m", smol_path, "--draft", smol_path, "-ngld", "2",
               "-c", "256", "-t", "1", env={"LOCALSPEC_EXTRA_BUFTS": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    target, draft = report["models"]
    assert (target["role"], draft["role"]) == ("target", "draft")
    assert target["layers_total"] == target["n_layer"] + 1 > 1  # the output layer counts too
    assert target["n_threads"] == 1 and target["n_ctx"] == 256
    assert target["amx_workaround"] is True and draft["amx_workaround"] is True  # forced on
    assert "CPU_REPACK" not in proc.stderr  # llama.cpp got no extra buffer types
    assert report["pair"] == {"compatible": True, "error": None}
    loads = llama_loads(proc.stderr)
    assert len(loads) == 2
    for model, (_, total, layers) in zip((target, draft), loads):
        assert total == model["layers_total"] and sorted(layers) == list(range(total))
        assert model["layers_offloaded"] == len(off_cpu(layers))
    assert loads[1][0] == (2 if offload_compiled() else None) and draft["n_gpu_layers_requested"] == 2
    if CPU_BUILD:
        assert target["n_gpu_layers"] == 0 and target["layers_offloaded"] == 0
        assert target["devices"] == ["CPU"] and "on CPU" in target["placement"]
    else:
        assert target["layers_offloaded"] == target["layers_total"]


def test_doctor_reports_incompatible_pair_without_failing(smol_path, gemma_path):
    result = CliRunner().invoke(doctor, ["--json", "-m", smol_path, "--draft", gemma_path, "-c", "256"])
    assert result.exit_code == 0, result.output
    pair = json.loads(result.stdout)["pair"]
    assert pair["compatible"] is False and "cannot draft" in pair["error"]


def test_doctor_missing_model_is_a_usage_error():
    proc = cli("doctor", "-m", "no-such-model.gguf")
    assert proc.returncode == 2 and "no such model file" in proc.stderr


def test_runtime_does_not_depend_on_the_command_line():
    # data flows commands -> runtime: the runtime (LoadOptions included) imports no click
    code = ("import sys, localspec.runtime; "
            "print([m for m in sys.modules if m == 'click' or m.startswith('localspec.commands')])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


# ----- pure parts of the report --------------------------------------------------------


def test_parse_system_info_sections():
    text = "CUDA : ARCHS = 890,900 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 0 | "
    assert parse_system_info(text) == {
        "CUDA": {"ARCHS": "890,900", "USE_GRAPHS": "1"},
        "CPU": {"SSE3": "1", "AVX2": "1", "AMX_INT8": "0"},
    }


def _fake_model(n_gpu_layers: int, n_layer: int = 28) -> SimpleNamespace:
    info = SimpleNamespace(n_gpu_layers=n_gpu_layers, amx_workaround=False, n_threads=2)
    return SimpleNamespace(
        info=info, n_layer=n_layer, name="m.gguf", path="m.gguf", describe=lambda: "qwen2 1.5B",
        size_bytes=1, n_params=1, n_ctx=4096,
    )


@pytest.mark.parametrize("ngl, offloaded, where", [
    (999, 29, "all 29 layers (28 + output) on CUDA0"),
    (10, 10, "10/29 layers on CUDA0, 19 on CPU"),
    (0, 0, "all 29 layers (28 + output) on CPU"),
])
def test_placement_on_a_gpu_build(ngl, offloaded, where):
    report = model_report(_fake_model(ngl), "target", ngl, [{"name": "CUDA0"}])
    assert (report["layers_offloaded"], report["placement"]) == (offloaded, where)


def test_no_offload_device_means_cpu_whatever_ngl():
    report = model_report(_fake_model(999), "target", -1, [])
    assert report["layers_offloaded"] == 0 and report["devices"] == ["CPU"]


def test_warns_when_draft_stays_on_cpu_under_an_offloaded_target():
    gpu = [{"name": "CUDA0"}]
    target = model_report(_fake_model(999), "target", -1, gpu)
    on_cpu = model_report(_fake_model(0, 24), "draft", 0, gpu)
    on_gpu = model_report(_fake_model(999, 24), "draft", -1, gpu)
    assert "-ngld" in placement_warnings([target, on_cpu])[0]
    assert placement_warnings([target, on_gpu]) == []


# ----- -ngl / -ngld: parsed, carried, applied -----------------------------------------


def _parse(args: list[str]):
    """Run the shared model options through click, as every command does."""
    seen = {}

    @click.command()
    @model_options()
    def probe(**kw):
        seen["opts"] = load_options(kw)

    result = CliRunner().invoke(probe, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen["opts"]


def test_offload_defaults_are_all_layers():
    opts = _parse([])
    assert (opts.n_gpu_layers, opts.n_gpu_layers_draft) == (-1, -1)


@pytest.mark.parametrize("args", [
    ["-ngl", "7", "-ngld", "3"],
    ["--n-gpu-layers", "7", "--n-gpu-layers-draft", "3"],
    ["--gpu-layers", "7", "--gpu-layers-draft", "3"],
])
def test_offload_flag_spellings(args):
    opts = _parse(args)
    assert (opts.n_gpu_layers, opts.n_gpu_layers_draft) == (7, 3)


def test_bad_offload_value_is_a_usage_error():
    # llama.cpp's words all and auto are numbers of layers (test_cli_habits); others are not
    result = CliRunner().invoke(click.command()(model_options()(lambda **kw: None)), ["-ngl", "most"])
    assert result.exit_code == 2 and "-ngl" in result.output


def test_offload_reaches_llama_cpp(smol_path):
    """-ngl/-ngld through `run` (click -> LoadOptions -> open_runtime -> Model): llama.cpp's
    own load log says how many layers it was asked to offload and where each layer went.
    An explicit count is handed over as is; llama.cpp offloads the last layers, and a
    CPU-only build keeps every layer on the CPU."""
    proc = cli("-v", "run", "--raw", "-m", smol_path, "--draft", smol_path, "--spec", "model",
               "-ngl", "7", "-ngld", "3", "-c", "256", "-n", "4", "-q", "1, 2, 3, 4,")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()  # both models loaded and generated
    (t_asked, total, target), (d_asked, d_total, draft) = llama_loads(proc.stderr)
    assert (t_asked, d_asked) == ((7, 3) if offload_compiled() else (None, None))
    assert sorted(target) == list(range(total)) and sorted(draft) == list(range(d_total))
    for layers, n, m in ((target, 7, total), (draft, 3, d_total)):
        assert off_cpu(layers) == ([] if CPU_BUILD else list(range(m - n, m)))


def test_default_offload_on_this_build(smol_path):
    opts = _parse(["-m", smol_path, "--draft", smol_path, "-c", "256"])
    with open_runtime(opts, want_draft=True) as rt:
        assert rt.target.cfg.n_gpu_layers == -1 and rt.draft.cfg.n_gpu_layers == -1
        for m in (rt.target, rt.draft):  # -1: all layers when the build can offload, else 0
            if CPU_BUILD:
                assert m.info.n_gpu_layers == 0
            else:
                assert m.info.n_gpu_layers >= m.n_layer + 1
