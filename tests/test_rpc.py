"""Several machines through ggml RPC: `localspec worker` processes on 127.0.0.1, SmolLM2
split across them and the local CPU, greedy output equal to the local-only output (plain
and n-gram speculative), and a worker that is unreachable, silent or killed mid-generation
giving one clear line and exit 1, never a hang.

The tests need a llama-cpp-python built with -DGGML_RPC=on. They skip on a build without
it, unless LOCALSPEC_REQUIRE_RPC=1 (which .ci/run sets): then a missing RPC build fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from contextlib import closing

import click
import pytest
from click.testing import CliRunner
from test_real_models import EDIT_SOURCE, GREEDY, assert_same_greedy, plain_greedy

from localspec.bench.workers import LoopbackWorkers, free_port, localspec_cmd
from localspec.cli import cli
from localspec.commands.options import load_options, model_options
from localspec.core.backend import Model, ggml
from localspec.core.config import GenerationConfig, ModelConfig, SpecConfig
from localspec.core.drafters import NgramDrafter
from localspec.core.engine import collect, generate
from localspec.runtime import model_config

REQUIRED = os.environ.get("LOCALSPEC_REQUIRE_RPC") == "1"
needs_rpc = pytest.mark.skipif(
    not ggml.supports_rpc() and not REQUIRED,
    reason='llama-cpp-python built without RPC (CMAKE_ARGS="-DGGML_RPC=on"); '
           "LOCALSPEC_REQUIRE_RPC=1 fails instead",
)
SPLIT = ["-ngl", "20", "-ts", "1,1", "-t", "1"]  # 20 of SmolLM2's 31 layers on the two workers


_cmd = localspec_cmd
_free_port = free_port


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with LoopbackWorkers(2, threads=1, log_dir=tmp_path_factory.mktemp("workers")) as w:
        yield w


@pytest.fixture()
def own_workers(tmp_path):
    """Workers for a test that kills one."""
    with LoopbackWorkers(2, threads=1, log_dir=tmp_path) as w:
        yield w


# ----- the build --------------------------------------------------------------------


def test_rpc_build_present_when_required():
    if not REQUIRED:
        pytest.skip("LOCALSPEC_REQUIRE_RPC is not set")
    assert ggml.supports_rpc(), 'CI needs llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=on"'


@pytest.mark.parametrize("args", [["run", "--rpc", "127.0.0.1:9", "-n", "1", "hi"], ["worker"]])
def test_build_without_rpc_says_how_to_rebuild(monkeypatch, smol_path, args):
    monkeypatch.setattr(ggml, "supports_rpc", lambda: False)
    extra = ["-m", smol_path] if args[0] == "run" else []
    result = CliRunner().invoke(cli, [args[0], *extra, *args[1:]])
    assert result.exit_code == 2, result.output
    assert 'CMAKE_ARGS="-DGGML_RPC=on"' in result.output and "Traceback" not in result.output


# ----- options ----------------------------------------------------------------------


def _opts(args: list[str]):
    seen = {}

    @click.command()
    @model_options()
    def probe(**kw):
        seen["opts"] = load_options(kw)

    result = CliRunner().invoke(probe, args)
    return result, seen.get("opts")


def test_rpc_and_tensor_split_are_parsed_and_carried():
    result, opts = _opts(["--rpc", "10.0.0.2:50052, gpu-box:6000", "--tensor-split", "3/1", "-ngld", "5"])
    assert result.exit_code == 0, result.output
    assert opts.rpc == ("10.0.0.2:50052", "gpu-box:6000") and opts.tensor_split == (3.0, 1.0)
    target, draft = model_config(opts, "t.gguf", "target"), model_config(opts, "d.gguf", "draft")
    assert target.rpc == opts.rpc and target.tensor_split == (3.0, 1.0)
    assert draft.rpc == opts.rpc and draft.tensor_split == ()  # -ngld > 0: the draft joins


def test_draft_stays_local_by_default():
    _, opts = _opts(["--rpc", "10.0.0.2:50052"])
    assert model_config(opts, "d.gguf", "draft").rpc == ()
    assert model_config(opts, "t.gguf", "target").rpc == ("10.0.0.2:50052",)


@pytest.mark.parametrize("args, words", [
    (["--rpc", "10.0.0.2"], "HOST:PORT"),
    (["--rpc", "10.0.0.2:99999"], "HOST:PORT"),
    (["--rpc", "[::1]:50052"], "IPv4"),
    (["--rpc", "a:1,a:1"], "twice"),
    (["-ts", "1,x"], "numbers"),
    (["-ts", "0,0"], "> 0"),
    (["-ts", "1,-1"], ">= 0"),
])
def test_bad_rpc_options_are_usage_errors(args, words):
    result, _ = _opts(args)
    assert result.exit_code == 2 and words in result.output, result.output


# ----- unreachable and silent workers: bounded, one line, exit 1 --------------------------


def _run_cli(*args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@needs_rpc
def test_unreachable_worker_is_one_line_and_exit_1(smol_path):
    proc = _run_cli("run", "-m", smol_path, "--rpc", f"127.0.0.1:{_free_port()}", "-n", "4", "hi")
    assert proc.returncode == 1, proc.stderr
    assert "unreachable" in proc.stderr and "localspec worker" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@needs_rpc
def test_silent_worker_times_out(smol_path):
    """A port that accepts connections but never answers (a busy worker, a wrong service):
    the connect is bounded by LOCALSPEC_RPC_TIMEOUT, not left to hang."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        ep = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = _run_cli("run", "-m", smol_path, "--rpc", ep, "-n", "4", "hi", timeout=60,
                        env={"LOCALSPEC_RPC_TIMEOUT": "1"})
    assert proc.returncode == 1, proc.stderr
    assert f"RPC worker {ep} did not answer within 1 s" in proc.stderr


@needs_rpc
def test_worker_on_a_busy_port_fails_clearly():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = _run_cli("worker", "--port", str(taken.getsockname()[1]), timeout=60)
    assert proc.returncode == 1 and "cannot listen on 127.0.0.1:" in proc.stderr, proc.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20"])
def test_a_worker_other_machines_can_reach_needs_allow_remote(host, monkeypatch):
    """Before anything listens, with or without an RPC build: the refusal says what
    a reachable worker risks."""
    monkeypatch.setattr(ggml, "rpc_start_server", lambda *a: pytest.fail("the RPC server started"))
    result = CliRunner().invoke(cli, ["worker", "--host", host, "--port", "50999"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "--allow-remote" in out and "read and write this worker's memory" in out
    assert "port 50999" in out and "out-of-bounds" in out and "Traceback" not in out
    help_text = " ".join(CliRunner().invoke(cli, ["worker", "--help"]).output.split())
    assert "--allow-remote" in help_text and "read and write this worker's memory" in help_text


@needs_rpc
def test_allow_remote_serves_on_every_interface_with_a_warning():
    port = _free_port()
    proc = subprocess.Popen(_cmd("worker", "--host", "0.0.0.0", "--allow-remote", "--port", str(port), "-t", "1"),
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                break
        assert any(line.startswith("WARNING: listening on 0.0.0.0") for line in lines), lines
        assert "serving" in lines[-1], lines
    finally:
        # what this test checks is the warning; a worker slow to stop on a loaded machine
        # (its C accept loop sees SIGINT late) is killed instead of failing it
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@needs_rpc  # a build without RPC refuses `worker` first, for that reason
def test_worker_host_must_be_an_ipv4_address():
    result = CliRunner().invoke(cli, ["worker", "--host", "localhost"])
    assert result.exit_code == 2 and "IPv4" in result.output


# ----- two workers + the local CPU: the same greedy output --------------------------------


@needs_rpc
def test_split_model_gives_the_local_greedy_output(workers, smol_path):
    local = Model(ModelConfig(path=smol_path, n_ctx=1024, n_threads=1))
    split = Model(ModelConfig(path=smol_path, n_ctx=1024, n_threads=1, n_gpu_layers=20,
                              rpc=tuple(workers.endpoints), tensor_split=(1.0, 1.0)))
    try:
        assert len(split.info.offload) == 2 and all(d.startswith("RPC") for d in split.info.offload)
        # raw text whose continuation runs past 48 tokens (a chat reply may end sooner)
        prompt = local.tokenize("# prices.py, printed twice\n\n" + EDIT_SOURCE + "\n\n# prices.py again\n\n")
        reference, margins = plain_greedy(local, prompt, 48)
        plain, _ = plain_greedy(split, prompt, 48)
        assert len(reference) == 48
        assert_same_greedy(reference, margins, plain)
        ids, _, stats = collect(generate(
            split, prompt, NgramDrafter(1, 4), sampling=GREEDY, spec=SpecConfig(mode="ngram"),
            gen=GenerationConfig(max_tokens=48)))
        assert_same_greedy(reference, margins, ids)
        assert stats.accepted > 0 and stats.rounds < stats.generated  # several tokens per round
    finally:
        split.close()
        local.close()


@needs_rpc
def test_cli_run_over_workers_matches_local(workers, smol_path):
    args = ["run", "--raw", "-m", smol_path, "-n", "32", "-c", "512", "--spec", "ngram", "-q",
            "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]
    local = _run_cli(*args, "-t", "1")
    remote = _run_cli(*args, "--rpc", workers.rpc, *SPLIT)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert local.stdout.strip() and remote.stdout == local.stdout


@needs_rpc
def test_doctor_reports_workers(workers, smol_path):
    dead = f"127.0.0.1:{_free_port()}"
    proc = _run_cli("doctor", "--json", "--rpc", f"{workers.rpc},{dead}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["rpc"]
    assert report["supported"] is True
    up, down = report["workers"][:2], report["workers"][2]
    assert [w["endpoint"] for w in up] == workers.endpoints and all(w["reachable"] for w in up)
    assert all(d["name"].startswith("RPC") and d["memory_total"] > 0 for w in up for d in w["devices"])
    assert down["reachable"] is False and "unreachable" in down["error"]


@needs_rpc
def test_layers_go_where_ngl_and_tensor_split_say(workers, smol_path):
    """llama.cpp's own log (-v) names the device of every layer: the last 20 of SmolLM2's
    31 (30 + output) shared 3:1 by the two workers, the first 11 on the local CPU."""
    proc = _run_cli("-v", "doctor", "--json", "--rpc", workers.rpc, "-m", smol_path, "-c", "256",
                    "-ngl", "20", "-ts", "3,1", "-t", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    placed = re.findall(r"layer +\d+ assigned to device (\w+)", proc.stderr)
    assert {d: placed.count(d) for d in set(placed)} == {"CPU": 11, "RPC0": 15, "RPC1": 5}
    target = json.loads(proc.stdout)["models"][0]
    assert target["placement"] == "20/31 layers on RPC0 + RPC1, 11 on CPU"
    assert target["devices"] == ["RPC0", "RPC1"]


# ----- a worker killed mid-generation -----------------------------------------------------


def _kill_when(proc: subprocess.Popen, started, victim: subprocess.Popen) -> str:
    """Kill `victim` once `started()` (which blocks, reading the client's output) says the
    generation is under way; the client must then exit on its own within communicate's
    timeout (the no-hang bound). Returns the client's stderr."""
    watchdog = threading.Timer(180, proc.kill)  # a client stuck before it starts
    watchdog.start()
    try:
        ok = started()
    finally:
        watchdog.cancel()
    assert ok and proc.poll() is None, f"ended before the kill: {proc.communicate(timeout=60)[1][-2000:]}"
    victim.send_signal(signal.SIGKILL)
    return proc.communicate(timeout=60)[1]


LOST = "lost the connection to an RPC worker"


@needs_rpc
def test_run_with_a_killed_worker_exits_1(own_workers, smol_path):
    proc = subprocess.Popen(
        _cmd("run", "--raw", "-m", smol_path, "--rpc", own_workers.rpc, *SPLIT, "--spec", "none",
             "-n", "600", "-c", "1024", "1, 2, 3, 4,"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = _kill_when(proc, lambda: bool(proc.stdout.read(8).strip()), own_workers.procs[1])
    assert proc.returncode == 1, err
    assert LOST in err and "Traceback" not in err and "Aborted" not in err


@needs_rpc
def test_edit_with_a_killed_worker_writes_nothing(own_workers, smol_path, tmp_path):
    src = tmp_path / "prices.py"
    src.write_text(EDIT_SOURCE * 4)
    out = tmp_path / "out.py"
    proc = subprocess.Popen(
        _cmd("-v", "edit", str(src), "-i", "Rename total to grand_total.", "-o", str(out), "-y",
             "-m", smol_path, "--rpc", own_workers.rpc, *SPLIT, "-c", "2048"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def loaded() -> bool:  # with -v llama.cpp logs the context it creates; decoding follows
        for line in proc.stderr:
            if "sched_reserve: reserve took" in line:
                time.sleep(0.3)
                return True
        return False

    err = _kill_when(proc, loaded, own_workers.procs[0])
    assert proc.returncode == 1, err[-2000:]
    assert LOST in err
    assert not out.exists() and src.read_text() == EDIT_SOURCE * 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.py")]  # no temp file
