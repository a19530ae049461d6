"""Shared fixtures: user state in a temp dir; real GGUF models, pulled once if missing."""

from __future__ import annotations

import os

import pytest

# the CLI tests start ~150 `localspec` processes: let them keep the package's bytecode
# (an environment that forbids writing it makes every one recompile, ~0.1-0.2 s each)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n N`), give each worker its own share of the cores: llama.cpp
    sizes its thread pool from the CPU affinity (core/backend/ggml.default_threads), and
    two workers each spinning a pool over both cores of a 2-core machine stall each other.
    Processes a test starts (servers, `localspec` commands) inherit the affinity."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    i = int(worker[2:])
    share = cores[i % len(cores)::count] or [cores[i % len(cores)]]
    os.sched_setaffinity(0, share)


_pin_xdist_worker()


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most four. Each worker
    loads the session's models and starts each module's servers once (`--dist loadfile`),
    so more workers mostly repeat that work."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4))

@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched) -> None:
    """A test that crashed its worker (a segfault in llama.cpp, or pytest-timeout ending a
    hung test) is reported failed once and not run again; the run goes on and fails.

    Under `--dist loadfile`, xdist puts every work unit the dead worker held back in the
    queue, the crashed test still pending (so each replacement worker crashes on it
    again) and the units it had finished too: a replacement worker handed a finished
    unit is sent no tests, never reports one, and is never given more work, so the run
    hangs with every worker idle. Here the crashed test counts as done and finished
    units leave the queue."""
    queue = getattr(sched, "workqueue", None)
    if not isinstance(queue, dict):  # another scheduler (-n 0 has none)
        return
    for scope, unit in list(queue.items()):
        if crashitem in unit:
            unit[crashitem] = True
        if all(unit.values()):
            del queue[scope]


TEST_MODEL = "smollm2-135m"
TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
OTHER_VOCAB = "gemma3-270m"


@pytest.fixture(autouse=True)
def _user_home(tmp_path, monkeypatch):
    """Logs, profiles and caches of the tool go to a temp dir in every test, and other
    tools' model stores (hub cache, llama.cpp cache, Ollama, LM Studio under HOME) are
    empty ones: a developer's own models must not change what `--draft auto` picks."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    stores = tmp_path / "stores"
    monkeypatch.setenv("HOME", str(stores / "user"))
    monkeypatch.setenv("HF_HUB_CACHE", str(stores / "hf"))
    monkeypatch.setenv("LLAMA_CACHE", str(stores / "llama.cpp"))
    monkeypatch.setenv("OLLAMA_MODELS", str(stores / "ollama"))
    monkeypatch.setenv("LOCALSPEC_NO_LOG", "0")


def _path(name: str) -> str:
    from localspec import models

    return str(models.resolve(name, pull_if_missing=True, progress=False))


@pytest.fixture(scope="session")
def smol_path() -> str:
    return _path(TEST_MODEL)


@pytest.fixture(scope="session")
def target_path() -> str:
    return _path(TARGET)


@pytest.fixture(scope="session")
def draft_path() -> str:
    return _path(DRAFT)


@pytest.fixture(scope="session")
def gemma_path() -> str:
    return _path(OTHER_VOCAB)


def _load(path: str, n_ctx: int = 2048):
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    return Model(ModelConfig(path=path, n_ctx=n_ctx))


@pytest.fixture(scope="session")
def smol(smol_path):
    m = _load(smol_path)
    yield m
    m.close()


@pytest.fixture(scope="session")
def smol_draft(smol_path):
    """A second instance of SmolLM2 (its own KV cache) to draft for `smol`."""
    m = _load(smol_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def model(request, smol_path):
    """SmolLM2 opened for a serve test module: its SLOTS sequences (2 unless the module
    sets SLOTS) of SLOT_CTX cells each (1,024 unless it sets SLOT_CTX), one thread. A
    module that defines its own `model` fixture gets that one instead."""
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    slots = getattr(request.module, "SLOTS", 2)
    slot_ctx = getattr(request.module, "SLOT_CTX", 1024)
    m = Model(ModelConfig(path=smol_path, n_ctx=slots * slot_ctx, n_seq_max=slots, n_threads=1))
    yield m
    m.close()


@pytest.fixture(scope="session")
def qwen_target(target_path):
    m = _load(target_path)
    yield m
    m.close()


@pytest.fixture(scope="session")
def qwen_draft(draft_path):
    m = _load(draft_path)
    yield m
    m.close()
