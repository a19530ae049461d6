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


# every command, with text only its own help has (an option, else its docstring)
COMMAND_HELP = {
    "run": "--raw", "edit": "--instruction", "chat": "--session", "serve": "--parallel",
    "bench": "--vcurve", "tune": "Measure decode cost", "stats": "--since",
    "models": "List known models", "ls": "List known models", "pull": "--force",
    "doctor": "what this llama.cpp build", "worker": "--cache", "ps": "--timeout",
}


@pytest.mark.parametrize("command", sorted(COMMAND_HELP))
def test_help_on_every_command(command):
    proc = cli(command, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"Usage: localspec {command} [OPTIONS]")
    assert COMMAND_HELP[command] in proc.stdout


def test_top_level_help_lists_commands():
    proc = cli("--help", timeout=60)
    assert proc.returncode == 0
    listed = proc.stdout.split("\nCommands:\n", 1)[1].splitlines()
    assert sorted(line.split()[0] for line in listed if line.strip()) == sorted(COMMAND_HELP)


BROKEN_IMPORTS = {  # llama-cpp-python missing, and installed with a library that does not load
    "missing": 'raise ImportError("llama_cpp made unimportable by the test", name="llama_cpp")\n',
    "broken": 'raise RuntimeError("Failed to load shared library \'/x/libllama.so\': undefined symbol")\n',
}


@pytest.fixture(params=sorted(BROKEN_IMPORTS))
def no_llama_cpp(tmp_path, request):
    """An environment in which `import llama_cpp` fails, as on a machine where
    llama-cpp-python is missing or its build is broken."""
    fake = tmp_path / "no_llama" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(BROKEN_IMPORTS[request.param])
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_help_and_completion_without_llama_cpp(no_llama_cpp):
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True,
                           env={**os.environ, **no_llama_cpp})
    assert probe.returncode != 0  # the fixture does hide it
    top = cli("--help", timeout=60, env=no_llama_cpp)
    assert top.returncode == 0, top.stderr
    assert "run " in top.stdout and "serve " in top.stdout
    for command in ("run", "chat", "edit", "serve", "models", "ls", "ps", "stats", "pull", "tune",
                    "bench", "worker", "doctor"):
        proc = cli(command, "--help", timeout=60, env=no_llama_cpp)
        assert proc.returncode == 0, (command, proc.stderr)
        assert proc.stdout.startswith(f"Usage: localspec {command} [OPTIONS]")
    comp = cli(timeout=60, env={**no_llama_cpp, "_LOCALSPEC_COMPLETE": "bash_complete",
                                "COMP_WORDS": "localspec se", "COMP_CWORD": "1"})
    assert comp.returncode == 0 and comp.stdout.split() == ["plain,serve"], comp.stderr
    models = cli(timeout=60, env={**no_llama_cpp, "_LOCALSPEC_COMPLETE": "bash_complete",
                                  "COMP_WORDS": "localspec run -m qwen2.5-coder-1", "COMP_CWORD": "3"})
    assert models.returncode == 0 and "plain,qwen2.5-coder-1.5b" in models.stdout.split(), models.stderr


def test_commands_needing_llama_cpp_fail_in_one_line_without_it(no_llama_cpp):
    for args in (("run", "-m", "smollm2-135m", "hi"), ("serve", "-m", "smollm2-135m")):
        proc = cli(*args, timeout=60, env=no_llama_cpp)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert "llama-cpp-python" in proc.stderr
    doctor = cli("doctor", timeout=60, env=no_llama_cpp)  # says what is wrong, as its report
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr
    assert "llama-cpp-python   UNUSABLE: llama-cpp-python is" in doctor.stdout


def test_model_completion_lists_what_models_lists(smol_path):
    # smol_path: the file is on disk, so `localspec models` lists it by its manifest name
    listed = json.loads(cli("models", "--json", timeout=60).stdout)
    names = {row["name"] for row in listed}
    assert "smollm2-135m" in names
    env = {"_LOCALSPEC_COMPLETE": "bash_complete", "COMP_CWORD": "3"}
    proc = cli(timeout=60, env={**env, "COMP_WORDS": "localspec run -m smol"})
    assert proc.returncode == 0, proc.stderr
    got = [line.split(",", 1)[1] for line in proc.stdout.split()]
    assert "smollm2-135m" in got and all(g.startswith("smol") and g in names for g in got)
    drafts = cli(timeout=60, env={**env, "COMP_WORDS": "localspec chat --draft "}).stdout.split()
    values = [line.split(",", 1)[1] for line in drafts]
    assert values[:2] == ["auto", "none"] and names <= set(values)


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
    args = ("run", "--raw", "-m", smol_path, "-n", "12", "-t", "1", "-q")
    plain = cli(*args, "Count: 1, 2,")
    assert plain.returncode == 0, plain.stderr
    cut = plain.stdout.find("5, 6")  # a stop string of several tokens, inside the reply
    assert cut > 0, plain.stdout
    proc = cli(*args, "--stop", "5, 6", "Count: 1, 2,")
    assert proc.returncode == 0, proc.stderr
    # everything before the stop string, none of it or what follows
    assert proc.stdout.rstrip("\n") == plain.stdout[:cut] and "4" in proc.stdout


def test_llama_cpp_flag_aliases(smol_path):
    # n-gram drafts of a repeating list: up to 16 tokens long without --spec-draft-n-max,
    # and the short draft at the end (3 tokens left) is verified without --spec-draft-n-min
    proc = cli("run", "--raw", "-m", smol_path, "-n", "15", "-t", "1", "--spec", "ngram", "--fixed-k",
               "--spec-draft-n-max", "4", "--spec-draft-n-min", "4", "--stats", "json",
               "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    drafted = stats["drafted_by_pos"]
    assert len(drafted) == 4 and drafted[0] > 0  # at most 4 drafted, and 4 were
    assert drafted[-1] == drafted[0]  # every verified draft was 4 long: none shorter
