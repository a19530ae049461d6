"""llama.cpp's and Ollama's command-line habits: the real console entry point (click's
CliRunner on `localspec.cli.cli`, or the `localspec` script in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import pytest
from click.testing import CliRunner

from localspec import servers
from localspec.bench.workers import free_port
from localspec.cli import cli
from localspec.commands import run as run_module
from localspec.commands.options import spec_mode_of_types
from localspec.core.config import LoadOptions
from localspec.core.errors import UsageError
from localspec.models.gguf_info import read_info


@pytest.fixture
def captured(monkeypatch):
    """`localspec run` up to the generation: what it would load and generate with."""
    seen: dict = {}

    def fake_generation(opts, spec, sampling, gen, text, **kw):
        seen.update(opts=opts, spec=spec, text=text, **kw)

    monkeypatch.setattr(run_module, "run_generation", fake_generation)
    return seen


def invoke(*args: str, stdin: str | None = None):
    return CliRunner().invoke(cli, list(args), input=stdin, catch_exceptions=False)


def test_draft_given_a_number_points_at_draft_max(captured):
    result = invoke("run", "--draft", "16", "hi")
    assert result.exit_code == 2 and "--draft-max 16" in result.output and not captured
    assert invoke("run", "-m", "x.gguf", "--draft-n", "8", "--spec", "ngram", "hi").exit_code == 0
    assert captured["spec"].draft_max == 8  # llama.cpp's older --draft-n is --draft-max


@pytest.mark.parametrize("value, layers", [("all", -1), ("auto", -1), ("7", 7), ("-1", -1)])
def test_gpu_layers_take_all_and_auto(captured, value, layers):
    assert invoke("run", "-m", "x.gguf", "-ngl", value, "-ngld", value, "hi").exit_code == 0
    assert captured["opts"].n_gpu_layers == layers and captured["opts"].n_gpu_layers_draft == layers


def test_gpu_layers_refuse_other_words(captured):
    result = invoke("run", "-ngl", "most", "hi")
    assert result.exit_code == 2 and "'all' or 'auto'" in result.output and not captured


@pytest.mark.parametrize("types, mode", [("ngram-simple", "ngram"), ("ngram-map-k", "ngram"),
                                         ("draft-simple", "model"), ("draft", "model"), ("none", "none"),
                                         ("ngram-simple,draft-simple", "hybrid"),
                                         ("none,ngram-simple", "ngram")])
def test_spec_type_maps_llama_cpp_names(captured, types, mode):
    assert spec_mode_of_types(types) == mode
    args = ("-md", "d.gguf") if mode in ("model", "hybrid") else ()
    result = invoke("run", "-m", "x.gguf", *args, "--spec-type", types, "hi")
    assert result.exit_code == 0, result.output
    assert captured["spec"].mode == mode


@pytest.mark.parametrize("types", ["ngram-mod", "ngram-cache", "ngram-map-k4v", "draft-eagle3", "nonsense"])
def test_spec_type_without_an_equivalent_is_an_error(captured, types):
    with pytest.raises(UsageError):
        spec_mode_of_types(types)
    result = invoke("run", "--spec-type", types, "hi")
    assert result.exit_code == 2 and types in result.output and not captured


def test_spec_type_and_spec_must_agree(captured):
    for order in (("--spec", "model", "--spec-type", "ngram-simple"),
                  ("--spec-type", "ngram-simple", "--spec", "model")):
        result = invoke("run", "-md", "d.gguf", *order, "hi")
        assert result.exit_code == 2 and "disagree" in result.output
    assert invoke("run", "-m", "x.gguf", "--spec", "ngram", "--spec-type", "ngram-simple", "hi").exit_code == 0
    assert captured["spec"].mode == "ngram"


def test_spec_type_overrides_edits_own_default():
    from localspec.commands.edit import configs_for

    assert configs_for(["--spec-type", "ngram-simple"])[1].mode == "ngram"
    assert configs_for([])[1].mode == "auto"


def test_prompt_file_and_system_prompt_flags(captured, tmp_path):
    file = tmp_path / "q.txt"
    file.write_text("what is 2+2?\n")
    assert invoke("run", "-m", "x.gguf", "-f", str(file), "-sys", "be brief").exit_code == 0
    assert captured["text"] == "what is 2+2?" and captured["system"] == "be brief"
    assert invoke("run", "-m", "x.gguf", "--prompt", "hello there", "--system-prompt", "S").exit_code == 0
    assert captured["text"] == "hello there" and captured["system"] == "S"
    assert invoke("run", "-m", "x.gguf", "--file", "-", stdin="from stdin\n").exit_code == 0
    assert captured["text"] == "from stdin"


def test_prompt_given_twice_or_unreadable_is_a_usage_error(captured, tmp_path):
    assert invoke("run", "-p", "a", "b").exit_code == 2
    assert invoke("run", "-p", "a", "-f", str(tmp_path / "q.txt")).exit_code == 2
    result = invoke("run", "-f", str(tmp_path / "missing.txt"))
    assert result.exit_code == 2 and "missing.txt" in result.output and not captured


def test_a_first_word_naming_a_model_is_an_error(smol_path, captured):
    # smol_path: smollm2-135m is on disk, so `localspec models` lists it
    result = invoke("run", "smollm2-135m", "write a haiku")
    assert result.exit_code == 2 and "-m smollm2-135m" in result.output and not captured
    fragment = invoke("run", "smollm2", "hi")  # Ollama's name without the size
    assert fragment.exit_code == 2 and "smollm2-135m" in fragment.output
    assert invoke("run", "ollama:qwen2.5-coder:7b", "hi").exit_code == 2
    alone = invoke("run", "smollm2-135m", stdin="text on stdin")  # Ollama's `run MODEL`
    assert alone.exit_code == 2 and "localspec chat -m smollm2-135m" in alone.output
    # a plain word, a quoted prompt, -p, or an explicit -m: the words are the prompt
    for args in (("explain", "this"), ("smollm2-135m write a haiku",), ("-p", "smollm2-135m hi"),
                 ("-m", "x.gguf", "smollm2-135m", "hi")):
        assert invoke("run", *args).exit_code == 0, args
    assert captured["text"] == "smollm2-135m hi"


def test_ctx_size_zero_is_the_models_own_context(smol_path):
    from localspec.runtime import with_model_context

    trained = read_info(smol_path).context_length
    assert trained >= 2048
    opts = LoadOptions(model=smol_path, draft=None, n_ctx=0, n_threads=1, n_gpu_layers=0, n_gpu_layers_draft=0)
    assert with_model_context(opts, smol_path).n_ctx == trained
    assert with_model_context(replace(opts, n_ctx=512), smol_path).n_ctx == 512
    assert invoke("run", "-c", "10", "hi").exit_code == 2


def test_ls_is_models():
    assert invoke("ls", "--json").output == invoke("models", "--json").output


def _localspec(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_ps_lists_a_running_server_and_forgets_it_on_stop(smol_path, tmp_path):
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path), "LOCALSPEC_NO_LOG": "1"}
    port = free_port()
    # llama.cpp's spellings together: the model's own context split over 2 slots
    proc = subprocess.Popen(
        [sys.executable, "-m", "localspec", "serve", "-m", smol_path, "--port", str(port), "-t", "1",
         "-np", "2", "-c", "0", "-ngl", "all", "--cache-reuse", "256", "--spec-type", "ngram-simple"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        listed: list = []
        while time.monotonic() < deadline and proc.poll() is None:
            listed = json.loads(_localspec("ps", "--json", env=env).stdout)
            if listed and listed[0]["health"] is not None:
                break
            time.sleep(0.3)
        assert len(listed) == 1, proc.stderr.read() if proc.poll() is not None else listed
        row = listed[0]
        trained = read_info(smol_path).context_length
        assert row["pid"] == proc.pid and row["url"] == f"http://127.0.0.1:{port}"
        assert row["slots"] == 2 and row["n_ctx_seq"] == trained // 2  # -c 0: all of it, split
        health = row["health"]
        assert health["status"] == "ok" and health["slots"] == 2 and health["spec_mode"] == "ngram"
        assert health["speed"]["requests"] == 0 and health["speed"]["decode_tokens_per_s"] is None
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", trust_env=False, timeout=60,
                           json={"model": "m", "prompt": "1, 2, 3,", "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        speed = json.loads(_localspec("ps", "--json", env=env).stdout)[0]["health"]["speed"]
        assert speed["requests"] == 1 and speed["generated_tokens"] == reply.json()["usage"]["completion_tokens"]
        assert speed["decode_tokens_per_s"] > 0 and speed["ttft_s"] > 0
        table = _localspec("ps", env={**env, "COLUMNS": "200"})
        assert table.returncode == 0 and f"127.0.0.1:{port}" in table.stdout and "0/2" in table.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not list((tmp_path / "servers").glob("*.json"))  # removed by the server itself
    assert json.loads(_localspec("ps", "--json", env=env).stdout) == []


def test_ps_drops_the_record_of_a_dead_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = servers.ServerRecord(pid=dead.pid, host="127.0.0.1", port=1, model="m", model_path="/m.gguf",
                                  slots=1, n_ctx_seq=512, draft=None, started=time.time())
    path = servers.register(record)
    alive = servers.register(servers.ServerRecord(**{**record.__dict__, "pid": os.getpid(), "port": 2}))
    assert [r.pid for r in servers.running()] == [os.getpid()]
    assert not path.exists() and alive.exists()
    result = invoke("ps", "--json", "--timeout", "0.5")
    rows = json.loads(result.output)
    assert [r["pid"] for r in rows] == [os.getpid()] and rows[0]["health"] is None  # nothing listens
