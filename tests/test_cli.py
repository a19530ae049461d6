"""The real console entry point: subprocesses, real pipes, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

LOCALSPEC = shutil.which("localspec") or ""


def cli(*args: str, stdin: str | None = None, timeout: int = 300, env: dict | None = None):
    cmd = [LOCALSPEC] if LOCALSPEC else [sys.executable, "-m", "localspec"]
    return subprocess.run(
        [*cmd, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_version_and_python_m():
    proc = subprocess.run([sys.executable, "-m", "localspec", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "localspec" in proc.stdout


@pytest.mark.parametrize("command", ["run", "models", "pull"])
def test_help_on_every_command(command):
    proc = cli(command, "--help", timeout=60)
    assert proc.returncode == 0 and "Usage:" in proc.stdout


def test_top_level_help_lists_commands():
    proc = cli("--help", timeout=60)
    assert proc.returncode == 0
    for name in ("run", "models", "pull"):
        assert name in proc.stdout


def test_run_through_a_real_pipe(smol_path):
    # echo ... | localspec run: stdin is the prompt (appended after arguments)
    proc = subprocess.run(
        f"echo 'def add(a, b):' | {LOCALSPEC or sys.executable + ' -m localspec'} run --raw "
        f"-m {smol_path} -n 12 --stats json",
        shell=True, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["generated"] == 12 and stats["stop_reason"] == "length"
    assert "llama" not in proc.stderr.split("{")[0].lower()  # llama.cpp's log stays quiet


def test_run_into_head_has_no_traceback(smol_path):
    proc = subprocess.run(
        f"{LOCALSPEC or sys.executable + ' -m localspec'} run -m {smol_path} -n 200 -q "
        f"'Count from one to one hundred in words, one per line.' | head -n 2",
        shell=True, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    assert len(proc.stdout.splitlines()) <= 2


def test_missing_model_is_one_line_exit_2(tmp_path):
    proc = cli("run", "-m", "no-such-model-name", "hello", timeout=60,
               env={"LOCALSPEC_MODELS": str(tmp_path)})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_manifest_model_says_how_to_pull(tmp_path, monkeypatch):
    from localspec import models
    from localspec.core.errors import ModelNotFound
    from localspec.models import paths

    monkeypatch.setattr(paths, "models_dirs", lambda: [tmp_path])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound) as err:
        models.resolve("gemma3-270m")
    assert "localspec pull gemma3-270m" in str(err.value)


def test_missing_path_exit_2(tmp_path):
    proc = cli("run", "-m", str(tmp_path / "nope.gguf"), "hi", timeout=60)
    assert proc.returncode == 2 and "nope.gguf" in proc.stderr and "Traceback" not in proc.stderr


def test_incompatible_pair_exit_2(draft_path, gemma_path):
    proc = cli("run", "-m", draft_path, "--draft", gemma_path, "-n", "4", "hi")
    assert proc.returncode == 2, proc.stderr
    assert "gemma" in proc.stderr and "qwen2.5-coder-0.5b" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prompt_longer_than_context_exit_2(smol_path):
    proc = cli("run", "-m", smol_path, "-c", "64", "-n", "4", "word " * 1200)
    assert proc.returncode == 2 and "context" in proc.stderr and "Traceback" not in proc.stderr


def test_no_prompt_exit_2(smol_path):
    proc = cli("run", "-m", smol_path, stdin="")
    assert proc.returncode == 2 and "no prompt" in proc.stderr


def test_bad_option_value_exit_2():
    proc = cli("run", "--temp", "-1", "hi", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_spec_model_without_draft_exit_2(smol_path):
    proc = cli("run", "-m", smol_path, "--spec", "model", "--draft", "none", "hi", timeout=60)
    assert proc.returncode == 2 and "--draft" in proc.stderr


def test_stop_string_not_printed(smol_path):
    proc = cli("run", "--raw", "-m", smol_path, "-n", "60", "-q", "--stop", "3",
               "Count: 1, 2,")
    assert proc.returncode == 0, proc.stderr
    assert "3" not in proc.stdout


def test_llama_cpp_flag_aliases(smol_path):
    proc = cli("run", "--raw", "-m", smol_path, "-n", "8", "--spec-draft-n-max", "4",
               "--draft-min", "1", "--stats", "json", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert len(stats["drafted_by_pos"]) <= 4
