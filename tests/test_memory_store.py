"""The on-disk memory (memory_store.py): bounded with the oldest dropped first, whole
after a SIGKILL mid-write, shared by two processes; and the commands' flags."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from localspec import memory_store
from localspec.memory_store import StoredMemory, append, connect, load

WRITER = textwrap.dedent("""
    import sys
    from localspec.memory_store import append, connect
    db = connect(sys.argv[1])
    who, n = int(sys.argv[2]), int(sys.argv[3])
    for i in range(n):
        append(db, "v", [who * 1_000_000 + i] * (1000 + i % 7 * 5000), 1 << 30)
        print(i, flush=True)
""")


def _rows(path) -> list[tuple[int, bytes]]:
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return db.execute("SELECT n, tokens FROM texts ORDER BY id").fetchall()


def test_the_store_keeps_the_newest_texts_within_its_bound(tmp_path):
    db = connect(tmp_path / "m.db")
    for i in range(50):
        append(db, "v", [i] * 99, 1000)  # 100 tokens each with its separator
        total = db.execute("SELECT SUM(n + 1) FROM texts WHERE vocab = 'v'").fetchone()[0]
        assert total <= 1000
    append(db, "w", [7] * 10, 1000)  # another vocabulary is kept apart
    texts = load(db, "v", 1000)
    assert [int(t[0]) for t in texts] == list(range(40, 50))  # the newest ten, oldest first
    assert [t.tolist() for t in load(db, "w", 1000)] == [[7] * 10]


def test_a_writer_killed_mid_write_leaves_whole_texts(tmp_path):
    path = tmp_path / "m.db"
    connect(path).close()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(round_), "10000"],
                                stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(3 + round_ * 7):  # let it commit a few, then kill it somewhere
            proc.stdout.readline()
        time.sleep(0.003 * round_)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rows = _rows(path)
    assert len(rows) > 40
    for n, blob in rows:  # every text whole and as written
        tokens = np.frombuffer(blob, dtype="<i4")
        assert len(tokens) == n and (tokens == tokens[0]).all()


def test_two_processes_share_the_store(tmp_path):
    path = tmp_path / "m.db"
    connect(path).close()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(who), "60"],
                              stdout=subprocess.DEVNULL, env=env) for who in (1, 2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    rows = _rows(path)
    firsts = sorted(int(np.frombuffer(blob, dtype="<i4")[0]) for _, blob in rows)
    assert firsts == sorted([1_000_000 + i for i in range(60)] + [2_000_000 + i for i in range(60)])
    memory = StoredMemory("v", max_tokens=1 << 30, path=path)  # a third reads what both wrote
    assert len(memory.texts) == sum(n + 1 for n, _ in rows)


def test_a_stored_memory_remembers_across_processes(tmp_path):
    path = tmp_path / "m.db"
    StoredMemory("v", path=path).add([5, 6, 7, 8, 9])
    again = StoredMemory("v", path=path)
    assert again.texts.tokens.tolist() == [5, 6, 7, 8, 9, -1]


def test_an_unreadable_store_means_no_memory_not_a_failure(tmp_path, capsys):
    path = tmp_path / "m.db"
    path.write_bytes(b"this is not a database" * 100)
    memory = StoredMemory("v", path=path)
    memory.add([1, 2, 3])  # and not remembering either
    assert len(memory.texts) == 4
    assert "memory: cannot" in capsys.readouterr().err


def test_lookup_reads_text_files_and_skips_binaries_and_hidden_dirs(tmp_path):
    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / "b.bin").write_bytes(b"\0\1\2")
    texts = memory_store.read_corpus([str(tmp_path)], lambda s: [ord(c) for c in s])
    assert texts == [[ord(c) for c in "print(1)\n"]]


def _run(home, *args):
    env = {**os.environ, "LOCALSPEC_HOME": str(home), "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-m", "localspec", "run", *args, "--stats", "json", "-t", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    return r


PROMPT = "Write a Python function that returns the squares of a list."


@pytest.mark.parametrize("flags", [(), ("--no-memory",)])
def test_run_remembers_unless_told_not_to(smol_path, tmp_path, flags):
    base = ("-m", smol_path, "--draft", "none", "-n", "48", *flags, PROMPT)
    first = _run(tmp_path, *base)
    again = _run(tmp_path, *base)
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    assert first.stdout == again.stdout  # greedy: the same reply either way
    recalled = json.loads(again.stderr.strip().splitlines()[-1])["by_source"].get("memory", [0, 0])[1]
    if flags:
        assert recalled == 0
        assert not (tmp_path / "memory.db").exists()
    else:
        assert recalled > 8
        env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path), "PYTHONPATH": os.getcwd()}
        shown = subprocess.run([sys.executable, "-m", "localspec", "stats", "--json"], capture_output=True,
                               text=True, env=env, timeout=60)
        assert json.loads(shown.stdout)["by_source"]["memory"]["accepted"] == recalled  # `stats` sums it


def test_lookup_drafts_from_a_corpus(smol_path, tmp_path):
    base = ("-m", smol_path, "--draft", "none", "-n", "48", "--no-memory", PROMPT)
    plain = _run(tmp_path, *base)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "squares.py").write_text(plain.stdout)
    looked = _run(tmp_path, *base, "--lookup", str(tmp_path / "corpus"))
    assert looked.returncode == 0 and looked.stdout == plain.stdout
    assert json.loads(looked.stderr.strip().splitlines()[-1])["by_source"].get("memory", [0, 0])[1] > 8
    bad = _run(tmp_path, *base, "--lookup", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
