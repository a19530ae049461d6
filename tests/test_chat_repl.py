"""`localspec chat` without a terminal: a line REPL through real pipes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest

LOCALSPEC = shutil.which("localspec")
CMD = [LOCALSPEC] if LOCALSPEC else [sys.executable, "-m", "localspec"]


def chat(*args: str, stdin: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, "chat", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_echo_into_chat_through_a_real_pipe(smol_path):
    proc = subprocess.run(f"echo hi | {' '.join(CMD)} chat -m {smol_path} -n 16",
                          shell=True, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and proc.stdout.endswith("\n")
    assert "llama" not in proc.stderr.lower()  # llama.cpp's loading log stays quiet


def test_replies_on_stdout_commands_on_stderr(smol_path):
    lines = "What is 2+2?\n/k 2\n/spec model\n/nope\n\nAnd 3+3?\n/stats\n/quit\nnever sent\n"
    proc = chat("-m", smol_path, "-n", "12", "--spec", "ngram", stdin=lines)
    assert proc.returncode == 0, proc.stderr
    assert "k fixed at 2" in proc.stderr
    assert "needs a draft model" in proc.stderr
    assert "unknown command /nope" in proc.stderr
    assert "2 replies" in proc.stderr  # /stats saw both turns; the line after /quit never ran
    for noise in ("k fixed", "unknown command", "replies"):
        assert noise not in proc.stdout
    assert proc.stdout.strip()


def test_session_saves_and_resumes(smol_path, tmp_path):
    for name in ("chat.json", "chat.md"):
        path = tmp_path / name
        args = ("-m", smol_path, "-n", "8", "--draft", "none", "--session", str(path))  # no draft: not the point
        assert chat(*args, stdin="Hello\n").returncode == 0
        proc = chat(*args, "--system", "Be brief.", stdin="Say it again\n")
        assert proc.returncode == 0, proc.stderr
        from localspec.chat.session import Conversation

        conv = Conversation.load(path)
        assert [m.role for m in conv.messages] == ["user", "assistant"] * 2
        assert conv.messages[0].content == "Hello" and conv.system == "Be brief."
    assert json.loads((tmp_path / "chat.json").read_text())["messages"][1]["meta"]["tokens"] > 0


def test_bad_input_is_one_line_and_exit_2(smol_path, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = chat("-m", smol_path, "--session", str(bad), stdin="hi\n", timeout=60)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = chat("-m", smol_path, "--spec", "model", "--draft", "none", stdin="hi\n", timeout=60)
    assert proc.returncode == 2 and "needs a draft model" in proc.stderr


def test_ctrl_c_stops_the_reply_and_the_repl_goes_on(smol_path):
    proc = subprocess.Popen(
        [*CMD, "chat", "-m", smol_path, "-n", "300", "--spec", "ngram"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        proc.stdin.write("List the numbers from 1 to 200, one per line.\n")
        proc.stdin.flush()
        first = proc.stdout.read(1)  # the reply has started
        assert first
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/stats\n/quit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "(stopped)" in err and "1 replies" in err
    assert "Traceback" not in err
    assert (first + out).strip()


def test_chat_drafts_with_auto_by_default(smol_path):
    """No --draft: the best compatible model on disk (for SmolLM2, itself), said on stderr;
    --draft none loads no draft model."""
    proc = chat("-m", smol_path, "-n", "8", "--no-log", stdin="hi\n")
    assert proc.returncode == 0, proc.stderr
    assert "draft: smollm2-135m (auto:" in proc.stderr and proc.stdout.strip()
    proc = chat("-m", smol_path, "-n", "8", "--no-log", "--draft", "none", stdin="hi\n")
    assert proc.returncode == 0 and "draft:" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [["--help"]])
def test_chat_help(args):
    proc = subprocess.run([*CMD, "chat", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--session" in proc.stdout and "/help" in proc.stdout
