"""The acceptance log: schema and migrations, what a record holds, concurrent writers,
and failures that must warn once and never raise. No models needed."""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import time

import pytest

from localspec import models
from localspec.acceptance import classify, logdb
from localspec.core.config import SamplingConfig, SpecConfig
from localspec.core.engine import GenerationStats


@pytest.fixture(autouse=True)
def _fresh_module_state(monkeypatch):
    monkeypatch.setattr(logdb, "_warned", set())
    monkeypatch.setattr(logdb, "_identities", {})


def make_stats(drafted: int = 40, accepted: int = 30, generated: int = 60, **kw) -> GenerationStats:
    kw.setdefault("drafter", "ngram")
    return GenerationStats(
        prompt_tokens=kw.pop("prompt_tokens", 120), generated=generated, rounds=25,
        draft_rounds=10 if drafted else 0, drafted=drafted, accepted=accepted, decode_s=2.0,
        drafted_by_pos=[10, 10, 10, 10] if drafted else [],
        accepted_by_pos=[9, 8, 7, 6] if drafted else [], stop_reason="eos", **kw,
    )  # fmt: skip


def log(stats: GenerationStats | None = None, **kw) -> None:
    kw.setdefault("target", "qwen2.5-coder-1.5b")
    kw.setdefault("draft", None)
    kw.setdefault("spec", SpecConfig(mode="ngram", draft_max=12, draft_min=2, adaptive=False))
    kw.setdefault("sampling", SamplingConfig(temperature=0.7, top_k=20, seed=7))
    logdb.log_generation(kw.pop("command", "run"), stats or make_stats(), **kw)


def rows() -> list[dict]:
    with sqlite3.connect(logdb.db_path()) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM generations ORDER BY id")]


def test_db_lives_in_the_state_dir(tmp_path):
    assert logdb.db_path() == tmp_path / "home" / "logs.db"


def test_record_holds_the_generation(tmp_path, capsys):
    model = tmp_path / "tiny-target.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    draft = tmp_path / "tiny-draft.gguf"
    draft.write_bytes(b"GGUF" + b"\x01" * 999)
    log(target=model, draft=str(draft), tag=" Code ", prompt_text="secret prompt")
    (row,) = rows()
    assert row["command"] == "run" and row["version"]
    assert abs(row["ts"] - time.time()) < 60 and row["datetime_utc"].endswith("+00:00")
    assert (row["target_name"], row["target_file"], row["target_size"]) == (
        "tiny-target", "tiny-target.gguf", model.stat().st_size)
    assert len(row["target_sha256"]) == 64 and row["target_identity"] == "quick"
    assert row["draft_name"] == "tiny-draft" and row["draft_size"] == 1003
    assert row["drafter"] == "ngram" and row["spec_mode"] == "ngram"
    assert (row["draft_min"], row["draft_max"], row["adaptive"]) == (2, 12, 0)
    assert (row["temperature"], row["top_k"], row["seed"]) == (0.7, 20, 7)
    assert (row["prompt_tokens"], row["generated"], row["rounds"]) == (120, 60, 25)
    assert (row["drafted"], row["accepted"], row["acceptance"]) == (40, 30, 0.75)
    assert row["mean_accepted"] == 3.0 and row["tokens_per_s"] == 30.0
    assert json.loads(row["acceptance_by_pos"]) == [0.9, 0.8, 0.7, 0.6]
    assert (row["tag"], row["tag_source"]) == ("code", "user")
    assert json.loads(row["stats_json"])["accepted_by_pos"] == [9, 8, 7, 6]
    assert "secret prompt" not in json.dumps(row)  # only numbers and identities
    assert capsys.readouterr().err == ""


def test_tag_is_classified_when_not_given():
    log(prompt_text="list three users", output_text='[{"name": "ann"}, {"name": "bob"}]')
    log(command="edit", prompt_text="x", output_text="y")
    log(prompt_text="why is the sky blue?", output_text="Because of Rayleigh scattering.")
    assert [(r["tag"], r["tag_source"]) for r in rows()] == [
        ("json", "auto"), ("edit", "auto"), ("prose", "auto")]


def test_no_draft_means_no_acceptance():
    log(make_stats(drafted=0, accepted=0, drafter="none"))
    (row,) = rows()
    assert row["acceptance"] is None and row["mean_accepted"] is None
    assert row["draft_name"] is None and row["drafter"] == "none"
    assert logdb.read_records()[0].acceptance is None


def test_identity_is_the_quick_hash_of_a_file_outside_the_manifest(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF1234")
    ident = logdb.model_identity(model)
    assert ident["identity"] == "quick" and ident["sha256"] == models.file_identity(model)["sha256"]
    assert ident["name"] == "m" and ident["size"] == 8


def test_identity_falls_back_to_stat_when_hashing_fails(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF1234")

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(models, "file_identity", unreadable)
    ident = logdb.model_identity(model)
    assert ident["identity"] == "stat" and ident["sha256"] is None
    assert ident["size"] == 8 and ident["mtime"] == model.stat().st_mtime
    assert logdb.model_identity("no/such/model.gguf") == {"name": "model", "file": "model.gguf"}


def test_manifest_model_is_named_by_the_manifest(tmp_path, monkeypatch):
    fake = {"name": "x.gguf", "sha256": "ab" * 32, "sha256_kind": "manifest",
            "manifest_name": "qwen2.5-coder-0.5b"}  # fmt: skip
    monkeypatch.setattr(models, "file_identity", lambda p: fake)
    model = tmp_path / "x.gguf"
    model.write_bytes(b"GGUF")
    ident = logdb.model_identity(model)
    assert (ident["name"], ident["identity"], ident["sha256"]) == ("qwen2.5-coder-0.5b", "manifest", "ab" * 32)


def test_migrations_are_numbered_recorded_and_run_once(monkeypatch):
    log()
    with sqlite3.connect(logdb.db_path()) as db:
        applied = [r[0] for r in db.execute("SELECT name FROM _migrations ORDER BY name")]
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert applied == [name for name, _ in logdb.MIGRATIONS] == ["m001_generations"]

    calls = []

    def m002_note(db):
        calls.append(1)
        db.execute("ALTER TABLE generations ADD COLUMN note TEXT")

    monkeypatch.setattr(logdb, "MIGRATIONS", [*logdb.MIGRATIONS, ("m002_note", m002_note)])
    log()
    log()
    assert calls == [1]  # applied on the next open, exactly once
    assert len(rows()) == 3 and rows()[0]["note"] is None


def test_disabled_writes_nothing(monkeypatch):
    log(enabled=False)
    assert not logdb.db_path().exists()
    for value in ("1", "true", "YES"):
        monkeypatch.setenv("LOCALSPEC_NO_LOG", value)
        log()
        assert not logdb.db_path().exists()
    monkeypatch.setenv("LOCALSPEC_NO_LOG", "0")
    log()
    assert len(rows()) == 1


def _writer(proc: int, n: int, go) -> None:
    go.wait(120)
    for i in range(n):
        stats = GenerationStats(prompt_tokens=proc * 1000 + i, generated=10, drafted=8,
                                accepted=4, draft_rounds=2, rounds=5, drafter="ngram")  # fmt: skip
        logdb.log_generation("run", stats, target="t.gguf", draft=None, spec=SpecConfig(),
                             sampling=SamplingConfig(), tag="code")  # fmt: skip


def test_parallel_writers_lose_no_record(capfd):
    """6 processes x 30 inserts at once into a database none of them has created yet.
    Spawned, not forked: the test process may hold llama.cpp's threads by now."""
    n_proc, n_each = 6, 30
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding llama.cpp threads
    go = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(p, n_each, go)) for p in range(n_proc)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * n_proc
    assert "warning" not in capfd.readouterr().err  # nobody gave up on a lock
    got = sorted(r["prompt_tokens"] for r in rows())
    assert got == sorted(p * 1000 + i for p in range(n_proc) for i in range(n_each))


def _one_warning(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("localspec: warning: acceptance log not written")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_locked_database_warns_once_and_continues(monkeypatch, capsys):
    log()
    capsys.readouterr()
    monkeypatch.setattr(logdb, "BUSY_TIMEOUT_MS", 50)
    holder = sqlite3.connect(logdb.db_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        log()
        log()  # a chat session logging every turn: still one line
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _one_warning(capsys, "locked", str(logdb.db_path()))
    assert len(rows()) == 1


def test_read_only_database_warns_and_continues(monkeypatch, capsys):
    log()
    capsys.readouterr()
    real_connect = sqlite3.connect

    def read_only(path, **kw):  # root ignores file modes, so open it read-only instead
        return real_connect(f"file:{path}?mode=ro", uri=True, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(logdb.sqlite3, "connect", read_only)
        log()
    _one_warning(capsys, "readonly")
    assert len(rows()) == 1


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores file modes")
def test_read_only_file_warns_and_continues(capsys):
    log()
    capsys.readouterr()
    logdb.db_path().chmod(0o444)
    log()
    _one_warning(capsys)


def test_corrupt_database_warns_and_continues(capsys):
    logdb.db_path().parent.mkdir(parents=True)
    logdb.db_path().write_bytes(b"this is not sqlite\n" * 100)
    log()
    _one_warning(capsys, "not a database")


def test_unusable_state_dir_warns_and_continues(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("LOCALSPEC_HOME", str(blocker / "home"))
    log()
    _one_warning(capsys)


def test_read_records_in_time_order_with_since():
    base = 1_700_000_000.0
    for i, ts in enumerate([base + 30, base + 10, base + 20]):
        row = logdb.build_record("run", make_stats(prompt_tokens=i), target="t", draft=None,
                                 spec=SpecConfig(), sampling=SamplingConfig(), tag="code",
                                 now=ts)  # fmt: skip
        logdb.insert(row)
    assert [r.ts for r in logdb.read_records()] == [base + 10, base + 20, base + 30]
    assert [r.ts for r in logdb.read_records(since=base + 15)] == [base + 20, base + 30]
    assert logdb.read_records()[0].key == ("t", None, "ngram", "code")


def test_read_records_of_missing_db_is_empty_and_creates_nothing():
    assert logdb.read_records() == []
    assert not logdb.db_path().exists()


# ----- classify ---------------------------------------------------------------------

FILE = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(6))


@pytest.mark.parametrize(
    "prompt, output, command, tag",
    [
        ("anything", "anything", "edit", "edit"),
        ("add type hints\n\n" + FILE, FILE.replace("(x)", "(x: int)", 2), "run", "edit"),
        ("give me json", '```json\n{"a": 1, "b": [1, 2]}\n```', "run", "json"),
        ("give me json", '{"a": 1, "b": [1, 2', "run", "json"),  # cut off by -n
        ("write fib", "```python\ndef fib(n):\n    return n\n```", "run", "code"),
        ("write fib", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n-1)\n", "run", "code"),
        ("in C", "int main(void) {\n  printf(\"hi\");\n  return 0;\n}\n", "chat", "code"),
        ("diff --git a/x b/x\n+x = 1\n-y = 2\n", "Rename y to x in the config loader.", "run", "prose"),
        ("why is the sky blue?", "Because of Rayleigh scattering. Short waves scatter more.", "chat", "prose"),
        ("# Title\n\nSome words.\n\n## More\n\nOther words here.", "", "run", "prose"),
        ("def f(x):\n    return x\nclass A:\n    pass\n", "", "run", "code"),
    ],
)
def test_classify(prompt, output, command, tag):
    assert classify.classify(prompt, output, command) == tag
    assert tag in classify.TAGS
