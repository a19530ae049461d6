"""GGUFs other tools downloaded: headers, discovery, names, and --draft auto.

Every store lives in a temp dir laid out as its tool lays it out, holding hard links (or
copies) of the real test GGUFs; every store variable points there, so the user's own
stores are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from localspec import models
from localspec.core.errors import UsageError
from localspec.models import drafts, paths, stores
from localspec.models.gguf_info import GGUFError, cached_info, read_info

REAL_MANIFEST = Path(__file__).resolve().parents[1] / "models" / "manifest.json"
SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
SMOL_HUB_FILE = "smollm2-135m-instruct-q4_1.gguf"
CMD = [sys.executable, "-m", "localspec"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Every store variable in tmp; a checkout and models dir without weights."""
    user = tmp_path / "user"
    checkout = tmp_path / "checkout"
    (checkout / "models").mkdir(parents=True)
    shutil.copy(REAL_MANIFEST, checkout / "models" / "manifest.json")
    monkeypatch.setattr(paths, "CHECKOUT_DIR", checkout)
    monkeypatch.setattr(paths, "PACKAGE_DIR", checkout / "localspec")
    monkeypatch.setattr(stores, "_warned", set())
    values = {
        "HOME": user, "XDG_CACHE_HOME": user / ".cache", "HF_HOME": user / ".cache" / "huggingface",
        "HF_HUB_CACHE": user / ".cache" / "huggingface" / "hub", "LLAMA_CACHE": user / ".cache" / "llama.cpp",
        "OLLAMA_MODELS": user / ".ollama" / "models", "LOCALSPEC_MODELS": tmp_path / "models",
        "LOCALSPEC_HOME": tmp_path / "localspec",
    }  # fmt: skip
    for var, value in values.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return SimpleNamespace(
        tmp=tmp_path, user=user, models=tmp_path / "models", hub=values["HF_HUB_CACHE"],
        ollama=values["OLLAMA_MODELS"], llamacpp=values["LLAMA_CACHE"], lmstudio=user / ".lmstudio" / "models",
    )  # fmt: skip


def place(src: str | Path, dst: Path) -> Path:
    """A hard link of a real model (a copy across file systems): its own path, no disk.

    The link is to the file itself, never to a symlink standing at `src` (os.link does
    not follow one on Linux): a test deleting its blob must not reach the real model."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(os.path.realpath(src), dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def add_hub(root: Path, repo: str, file: str, src: str | Path, commit: str = "c" * 40) -> Path:
    """models--org--repo/{blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag>, refs/main}."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blob = place(src, repo_dir / "blobs" / hashlib.sha256(file.encode()).hexdigest())
    link = repo_dir / "snapshots" / commit / file
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("..", "..", "blobs", blob.name))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return link


_DIGESTS: dict[str, str] = {}


def _sha256(path: str | Path) -> str:
    if str(path) not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _DIGESTS[str(path)] = digest.hexdigest()
    return _DIGESTS[str(path)]


def add_ollama(root: Path, name: str, tag: str, src: str | Path, namespace: str = "library") -> Path:
    """manifests/registry.ollama.ai/<namespace>/<name>/<tag> naming blobs/sha256-<hex> layers."""
    model = root / "blobs" / f"sha256-{_sha256(src)}"
    if not model.exists():
        place(src, model)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{_sha256(src)}",
               "size": model.stat().st_size}]  # fmt: skip
    template, config = b"{{ .Prompt }}", json.dumps({"model_format": "gguf", "model_family": name}).encode()
    for data in (template, config):
        (root / "blobs" / f"sha256-{hashlib.sha256(data).hexdigest()}").write_bytes(data)
    layers.append({"mediaType": "application/vnd.ollama.image.template",
                   "digest": f"sha256:{hashlib.sha256(template).hexdigest()}", "size": len(template)})  # fmt: skip
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{hashlib.sha256(config).hexdigest()}", "size": len(config)},
                "layers": layers}  # fmt: skip
    path = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return model


def file_states(root: Path) -> dict[str, tuple]:
    """Every file and link under root with size and mtime: what a read-only tool keeps."""
    return {str(p): (p.is_symlink(), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


# --- the GGUF header -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_gguf(smol_path):
    """gguf's own reader of SmolLM2 (pure Python, seconds to open): one for the module."""
    import gguf

    return gguf.GGUFReader(smol_path)


def test_header_agrees_with_the_gguf_reader(smol_path, smol_gguf):
    from gguf import LlamaFileType

    ref = smol_gguf
    info = read_info(smol_path)

    def field(key: str):
        return ref.fields[key].contents()

    assert info.architecture == field("general.architecture") == "llama"
    assert info.context_length == field("llama.context_length") == 8192
    assert info.n_vocab == len(ref.fields["tokenizer.ggml.tokens"].data) == 49152
    assert info.quant == LlamaFileType(field("general.file_type")).name.removeprefix("MOSTLY_") == "Q4_1"
    assert info.n_params == sum(int(t.n_elements) for t in ref.tensors) == 134_515_008
    assert (info.bos, info.eos, info.tokenizer) == (field("tokenizer.ggml.bos_token_id"),
                                                    field("tokenizer.ggml.eos_token_id"), "gpt2")  # fmt: skip
    assert info.size == os.path.getsize(smol_path) and info.split_count == 1


def test_header_facts_vocabularies_and_bad_files(smol_path, gemma_path, tmp_path):
    smol, gemma = read_info(smol_path), read_info(gemma_path)
    assert (gemma.architecture, gemma.quant, gemma.n_vocab, gemma.tokenizer) == ("gemma3", "Q4_K_M", 262144, "llama")
    assert len(smol.vocab_digest) == 48 and drafts.vocab_mismatch(smol, smol) is None
    assert "other tokenizer" in drafts.vocab_mismatch(smol, gemma)
    renamed = smol.__class__(**(smol.to_dict() | {"vocab_digest": (*smol.vocab_digest[:5], "0" * 16,
                                                                    *smol.vocab_digest[6:])}))  # fmt: skip
    assert "other token texts (ids 5120-6143)" in drafts.vocab_mismatch(smol, renamed)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(smol_path).read_bytes()[:100_000])  # ends inside the vocabulary
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    for bad in (cut, text):
        with pytest.raises(GGUFError):
            read_info(bad)


def test_header_cache_rereads_a_changed_file(env, smol_path, monkeypatch):
    from localspec.models import gguf_info

    real = read_info(smol_path)
    calls = []
    monkeypatch.setattr(gguf_info, "read_info", lambda p: calls.append(p) or real)
    path = env.tmp / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    assert cached_info(path) == cached_info(path) == real and len(calls) == 1  # then from the cache
    os.utime(path, ns=(1, 1))
    assert cached_info(path) == real and len(calls) == 2  # changed: read again


# --- discovery and names -----------------------------------------------------------------


def test_each_store_is_discovered_listed_and_resolved(env, smol_path, gemma_path):
    hub = add_hub(env.hub, SMOL_REPO, SMOL_HUB_FILE, smol_path)
    gemma_blob = add_ollama(env.ollama, "gemma3", "270m", gemma_path)
    user_blob = add_ollama(env.ollama, "smol", "q4", smol_path, namespace="someone")
    entry = models.load_manifest().models["smollm2-135m"]
    lms = place(smol_path, env.lmstudio / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF" / entry.filename)
    flat = place(gemma_path, env.llamacpp / "ggml-org_gemma-3-270m-GGUF_gemma-3-270m-q4_k_m.gguf")
    before = file_states(env.user)

    found = {f.name: f for f in stores.discover()}
    assert {n: (f.path, f.source) for n, f in found.items()} == {
        f"{SMOL_REPO}:{SMOL_HUB_FILE}": (hub, "hub"),
        f"llama.cpp:{flat.name}": (flat, "llama.cpp"),
        f"lmstudio:lmstudio-community/SmolLM2-135M-Instruct-GGUF/{entry.filename}": (lms, "lmstudio"),
        "ollama:gemma3:270m": (gemma_blob, "ollama"),
        "ollama:someone/smol:q4": (user_blob, "ollama"),
    }
    for name, item in found.items():
        assert models.resolve(name) == item.path
    assert models.resolve("ollama:gemma3") == gemma_blob  # no :latest tag: a unique fragment
    assert models.resolve("ollama:registry.ollama.ai/library/gemma3:270m") == gemma_blob
    assert models.resolve("hf:" + f"{SMOL_REPO}:{SMOL_HUB_FILE}") == hub
    assert models.resolve("gemma-3-270m-GGUF") == flat  # a unique fragment of any name
    assert models.resolve("smollm2-135m") == lms  # the manifest model, found in LM Studio
    with pytest.raises(UsageError, match="matches 3 models"):
        models.resolve("smol")

    rows = {r.name: r for r in models.list_models()}
    assert rows["smollm2-135m"].path == lms and rows["smollm2-135m"].info.architecture == "llama"
    assert rows["ollama:gemma3:270m"].info.quant == "Q4_K_M" and rows["ollama:gemma3:270m"].source == "ollama"
    assert sum(r.path == lms for r in rows.values()) == 1  # listed once, under the manifest name
    assert rows[f"llama.cpp:{flat.name}"].to_dict()["n_params"] == 268_098_176
    assert file_states(env.user) == before  # read-only: nothing written, moved or touched


def test_broken_entries_are_skipped_with_a_warning(env, smol_path, capfd):
    good = add_hub(env.hub, SMOL_REPO, SMOL_HUB_FILE, smol_path)
    gone = add_hub(env.hub, "someone/Gone-GGUF", "gone-q4_k_m.gguf", smol_path)
    gone.resolve().unlink()  # the blob was deleted: a dangling snapshot link
    add_ollama(env.ollama, "smol", "latest", smol_path)
    bad = env.ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"layers": [')
    orphan = env.ollama / "manifests" / "registry.ollama.ai" / "library" / "orphan" / "latest"
    orphan.parent.mkdir(parents=True)
    orphan.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                              "digest": "sha256:" + "ab" * 32}]}))  # fmt: skip
    place(smol_path, env.lmstudio / "pub" / "Half-GGUF" / "half-00001-of-00002.gguf")  # part 2 missing

    names = [f.name for f in stores.discover()]
    assert names == [f"{SMOL_REPO}:{SMOL_HUB_FILE}", "ollama:smol:latest"]
    err = capfd.readouterr().err
    assert "dangling link" in err and str(gone) in err
    assert "broken/latest: unreadable" in err and "orphan/latest: its blob" in err
    assert "half-00002-of-00002.gguf" in err
    assert models.resolve("ollama:smol") == env.ollama / "blobs" / f"sha256-{_sha256(smol_path)}"
    assert models.resolve(f"{SMOL_REPO}:{SMOL_HUB_FILE}") == good
    assert cli("models").exit_code == 0
    result = cli("models", "--json")
    assert result.exit_code == 0
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["ollama:smol:latest"]["architecture"] == "llama" and "ollama:broken:latest" not in rows


def test_split_model_is_listed_once_and_loads_from_its_first_part(env, smol_path, smol_gguf):
    import gguf

    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    folder = env.lmstudio / "pub" / "SmolLM2-split-GGUF"
    folder.mkdir(parents=True)
    reader = smol_gguf
    writer = gguf.GGUFWriter(folder / "smol.gguf", arch="llama", split_max_tensors=150)
    for field in reader.fields.values():
        if field.name != "general.architecture" and not field.name.startswith("GGUF."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    first, second = folder / "smol-00001-of-00002.gguf", folder / "smol-00002-of-00002.gguf"
    assert first.exists() and second.exists()

    [found] = stores.discover()
    assert (found.path, found.parts) == (first, 2)
    assert found.size == first.stat().st_size + second.stat().st_size
    assert models.resolve(str(second)) == first and models.resolve("SmolLM2-split") == first
    info = read_info(first)
    assert (info.split_count, info.n_params, info.n_vocab) == (2, 134_515_008, 49152)
    model = Model(ModelConfig(path=str(first), n_ctx=128))
    try:
        assert model.n_params == info.n_params  # llama.cpp found the second part itself
    finally:
        model.close()


# --- --draft auto -------------------------------------------------------------------------


def cli(*args: str):
    from localspec.cli import cli as group

    return CliRunner().invoke(group, list(args), catch_exceptions=False)


def test_draft_auto_pairs_smollm2_with_itself_and_refuses_gemma(env, smol_path, gemma_path):
    hub = add_hub(env.hub, SMOL_REPO, SMOL_HUB_FILE, smol_path)
    add_ollama(env.ollama, "gemma3", "270m", gemma_path)
    candidates = drafts.draft_candidates(hub)
    smol, gemma = candidates
    assert smol.name == f"{SMOL_REPO}:{SMOL_HUB_FILE}" and smol.kept and "the target itself" in smol.reason
    assert gemma.name == "ollama:gemma3:270m" and not gemma.kept
    assert "other tokenizer" in gemma.reason  # refused for its vocabulary

    result = cli("run", "-m", SMOL_HUB_FILE, "hi", "-n", "4", "--no-log", "--spec", "model")
    assert result.exit_code == 0 and result.stdout.strip()
    assert f"draft: {SMOL_REPO}:{SMOL_HUB_FILE} (auto: the target itself" in result.stderr
    assert "drafter model" in result.stderr  # the draft model drafted
    gemma_target = drafts.draft_candidates(gemma.path)  # and the other way round
    assert [(c.name, c.kept) for c in gemma_target] == [(gemma.name, True), (smol.name, False)]


def test_draft_auto_falls_back_to_ngrams(env, smol_path, monkeypatch):
    place(smol_path, env.models / "smol.gguf")
    result = cli("run", "-m", "smol.gguf", "hi", "-n", "4", "--no-log", "--draft", "none")
    assert result.exit_code == 0 and "draft:" not in result.stderr  # none: no draft model
    monkeypatch.setattr(drafts, "SAME_SIZE_MAX_PARAMS", 0)  # as if SmolLM2 were a 7B
    [only] = drafts.draft_candidates(env.models / "smol.gguf")
    assert not only.kept and "not much smaller" in only.reason  # no second copy of a big target
    result = cli("run", "-m", "smol.gguf", "hi", "-n", "4", "--no-log")
    assert result.exit_code == 0 and result.stdout.strip()
    assert "draft: none (auto: no compatible smaller model on disk" in result.stderr


def test_draft_auto_picks_the_half_b_for_the_qwen_target(env, target_path, draft_path, smol_path, gemma_path):
    for src in (target_path, draft_path, smol_path, gemma_path):
        place(src, env.models / Path(src).name)
    candidates = drafts.draft_candidates(env.models / Path(target_path).name)
    kept = [c for c in candidates if c.kept]
    assert [c.name for c in kept] == ["qwen2.5-coder-0.5b"] and "same family" in kept[0].reason
    refused = {c.name: c.reason for c in candidates if not c.kept}
    assert "not much smaller" in refused["qwen2.5-coder-1.5b"]
    assert "other vocabulary" in refused["smollm2-135m"] and "other tokenizer" in refused["gemma3-270m"]
    result = cli("models", "--drafts-for", "qwen2.5-coder-1.5b", "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)["candidates"]
    assert [c["name"] for c in listed if c["kept"]] == ["qwen2.5-coder-0.5b"] and len(listed) == 4


@pytest.mark.slow
def test_run_uses_the_default_pair(target_path, draft_path):
    """On this machine's real models: `localspec run` drafts the 1.5B with the 0.5B."""
    proc = subprocess.run([*CMD, "run", "hi", "-n", "1", "--no-log"], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "draft: qwen2.5-coder-0.5b (auto:" in proc.stderr
