"""Shared fixtures: user state in a temp dir; real GGUF models, pulled once if missing."""

from __future__ import annotations

import os

import pytest

# the CLI tests start ~150 `localspec` processes: let them keep the package's bytecode
# (an environment that forbids writing it makes every one recompile, ~0.1-0.2 s each)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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
