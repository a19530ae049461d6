"""The on-disk prefix cache with the real SmolLM2: a second edit of an unchanged file
restores the file's KV state and prefills only the instruction, with output identical
to the cold run; a corrupt, truncated, stale or foreign entry is never trusted; the
size cap evicts the least recently used entries."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from localspec.core.config import GenerationConfig, SamplingConfig, SpecConfig
from localspec.core.drafters import NoDrafter
from localspec.core.engine import collect, generate
from localspec.edit import build_prompt_parts, split_lines, split_region
from localspec.prefix_store import MAGIC, PrefixStore, warm_prefix

WORKLOADS = Path(__file__).resolve().parent.parent / "localspec" / "workloads" / "edit"
TEXT = "".join(split_lines((WORKLOADS / "inventory.py").read_text())[:12])  # ~160 tokens with the prompt
GREEDY = SamplingConfig(temperature=0.0)


def prompt_for(model, text: str = TEXT, instruction: str = "Rename Item to Product.") -> tuple[list[int], int]:
    region = split_region(text)
    return build_prompt_parts(model, region, "inventory.py", len(split_lines(text)), instruction)


def forget(model) -> None:
    """An empty KV cache, as in a new process: only the disk can supply the prefix."""
    model.rewind(0, force=True)


def edit_run(model, prompt: list[int], n_prefix: int, cache: PrefixStore, n: int = 24):
    """One edit's generation, the way `localspec edit` runs it: the prefix from the cache
    (or prefilled and stored), then generate(); returns (use, first logits, ids, stats)."""
    use = warm_prefix(model, prompt[:n_prefix], cache)
    first = model.prefill(prompt)[0].copy()  # what generate() computes first
    model.rewind(n_prefix)
    ids, _, stats = collect(generate(model, prompt, NoDrafter(), sampling=GREEDY,
                                     spec=SpecConfig(mode="none"), gen=GenerationConfig(max_tokens=n)))
    use.add_to(stats)
    return use, first, ids, stats


@pytest.fixture(scope="module")
def smol(smol_path):
    """One thread: with more threads than idle cores, llama.cpp's spinning barrier makes
    a small model several times slower on a busy machine."""
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    with Model(ModelConfig(path=smol_path, n_ctx=2048, n_threads=1)) as m:
        yield m


@pytest.fixture
def cache(tmp_path) -> PrefixStore:
    return PrefixStore(tmp_path / "prefix", cap=1 << 30, min_tokens=16)


@pytest.fixture(scope="module")
def stored(smol, tmp_path_factory) -> tuple[bytes, np.ndarray]:
    """A cold edit's entry (its bytes) and first logits, made once for the tests that
    damage a copy of it or need an entry's size."""
    cache = PrefixStore(tmp_path_factory.mktemp("stored") / "prefix", cap=1 << 30, min_tokens=16)
    prompt, n_prefix = prompt_for(smol)
    forget(smol)
    _, logits, _, _ = edit_run(smol, prompt, n_prefix, cache, n=1)
    [entry] = cache.entries()
    return entry.read_bytes(), logits


def test_prompt_prefix_is_everything_before_the_instruction(smol):
    a, na = prompt_for(smol, instruction="Rename Item to Product.")
    b, nb = prompt_for(smol, instruction="Add type hints.")
    assert na == nb and a[:na] == b[:nb] and a[na:] != b[nb:]
    assert "class Item" in smol.detokenize(a[:na])
    assert smol.detokenize(a[na:]).startswith("Rename Item to Product.")


def test_second_edit_restores_the_prefix_and_matches_the_cold_run(smol, cache):
    prompt, n_prefix = prompt_for(smol)
    forget(smol)
    cold, cold_logits, cold_ids, cold_stats = edit_run(smol, prompt, n_prefix, cache)
    assert cold.decoded == n_prefix and cold.stored and not cold.restored
    assert cold_stats.prefill_tokens == len(prompt)  # the whole prompt, counted once
    assert len(cache.entries()) == 1

    forget(smol)
    warm, warm_logits, warm_ids, warm_stats = edit_run(smol, prompt, n_prefix, cache)
    assert warm.restored == n_prefix and warm.decoded == 0
    assert warm_stats.restored_tokens == n_prefix
    assert warm_stats.prefill_tokens == len(prompt) - n_prefix  # the instruction and the tail
    assert warm_stats.prefill_tokens < 40 < n_prefix
    assert warm.saved_s is not None and warm.saved_s > 0  # the cold prefill, recorded
    assert np.array_equal(warm_logits, cold_logits)  # bit for bit: the same KV values
    assert warm_ids == cold_ids and len(cold_ids) == 24


def test_a_second_instruction_on_the_same_file_hits(smol, cache):
    first, n1 = prompt_for(smol, instruction="Rename Item to Product.")
    forget(smol)
    assert warm_prefix(smol, first[:n1], cache).stored
    second, n2 = prompt_for(smol, instruction="Add type hints to every function.")
    forget(smol)
    assert warm_prefix(smol, second[:n2], cache).restored == n2


def _flip(path: Path, where: str) -> None:
    data = bytearray(path.read_bytes())
    (n_header,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    body = len(MAGIC) + 4 + n_header
    if where == "truncated":
        data = data[: len(data) - 1000]
    elif where == "empty":
        data = bytearray()
    elif where == "magic":
        data[0] ^= 0xFF
    elif where == "header":
        data[len(MAGIC) + 4] = ord("[")
    elif where == "tokens":
        data[body + 4] ^= 0x01
    elif where == "state":
        data[-4096] ^= 0x01  # a bit of a V value deep in the state: only the checksum sees it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["truncated", "empty", "magic", "header", "tokens", "state"])
def test_a_corrupt_entry_is_ignored_then_replaced(smol, cache, stored, where):
    good, cold_logits = stored
    prompt, n_prefix = prompt_for(smol)
    entry = cache.path_for(smol, prompt[:n_prefix])
    entry.parent.mkdir(parents=True)
    entry.write_bytes(good)
    forget(smol)
    assert cache.restore(smol, prompt[:n_prefix]) is not None  # the copy is a good entry
    _flip(entry, where)
    forget(smol)
    assert cache.restore(smol, prompt[:n_prefix]) is None
    again, logits, _, _ = edit_run(smol, prompt, n_prefix, cache, n=1)
    assert again.restored == 0 and again.decoded == n_prefix and again.stored
    assert np.array_equal(logits, cold_logits)
    forget(smol)
    assert cache.restore(smol, prompt[:n_prefix]) is not None  # the good entry is back


def test_a_state_llama_cpp_refuses_leaves_an_empty_sequence(smol, cache):
    # consistent header and checksum, but the state of fewer cells than the header's tokens
    prompt, n_prefix = prompt_for(smol)
    forget(smol)
    smol.decode(prompt[: n_prefix - 5], logits=())
    short_state = smol.state_bytes()
    assert smol.load_state(short_state, prompt[:n_prefix]) == 0  # positions do not match
    assert smol.cached == [] and smol.n_past == 0
    assert smol.load_state(bytearray(short_state[:100]), prompt[: n_prefix - 5]) == 0
    assert smol.cached == []
    assert smol.load_state(short_state, prompt[: n_prefix - 5]) == n_prefix - 5
    assert smol.cached == prompt[: n_prefix - 5]


def test_the_cap_evicts_the_least_recently_used(smol, stored, tmp_path):
    texts = [TEXT.replace("Item", name) for name in ("Alpha", "Beta", "Gamma")]
    size = len(stored[0])  # TEXT's entry: these texts' are the same to a few tokens
    cache = PrefixStore(tmp_path / "prefix", cap=int(size * 2.5), min_tokens=16)
    prefixes = []
    for i, text in enumerate(texts[:2]):
        prompt, n = prompt_for(smol, text)
        prefixes.append(prompt[:n])
        forget(smol)
        assert warm_prefix(smol, prompt[:n], cache).stored
        os.utime(cache.path_for(smol, prompt[:n]), (1000 + i, 1000 + i))
    forget(smol)
    assert cache.restore(smol, prefixes[0]) is not None  # a hit makes Alpha the most recent
    prompt, n = prompt_for(smol, texts[2])
    forget(smol)
    assert warm_prefix(smol, prompt[:n], cache).stored
    kept = {p.name for p in cache.entries()}
    assert kept == {cache.path_for(smol, prefixes[0]).name, cache.path_for(smol, prompt[:n]).name}
    assert sum(p.stat().st_size for p in cache.entries()) <= cache.cap
    tiny = PrefixStore(tmp_path / "tiny", cap=size // 2, min_tokens=16)
    forget(smol)
    assert not warm_prefix(smol, prefixes[1], tiny).stored and tiny.entries() == []


def test_a_changed_file_misses(smol, cache):
    prompt, n = prompt_for(smol)
    forget(smol)
    warm_prefix(smol, prompt[:n], cache)
    changed, m = prompt_for(smol, TEXT.replace("quantity", "amount", 1))
    forget(smol)
    use = warm_prefix(smol, changed[:m], cache)
    assert use.restored == 0 and use.decoded == m and len(cache.entries()) == 2


def test_another_model_of_the_same_shape_misses(smol, smol_path, cache, tmp_path):
    # other weights, same architecture: llama.cpp would accept the state, the key must not
    from localspec.core.backend import Model
    from localspec.core.config import ModelConfig

    data = bytearray(Path(smol_path).read_bytes())
    data[-100] ^= 0x01  # a bit of the last tensor's weights
    other_path = tmp_path / "other-smollm2.gguf"
    other_path.write_bytes(bytes(data))
    del data
    prompt, n = prompt_for(smol)
    forget(smol)
    warm_prefix(smol, prompt[:n], cache)
    [entry] = cache.entries()
    with Model(ModelConfig(path=str(other_path), n_ctx=2048, n_threads=1)) as other:
        tokens = prompt[:n]
        assert cache.path_for(other, tokens) != entry
        entry.rename(cache.path_for(other, tokens))  # even a file at the other model's own path
        assert cache.restore(other, tokens) is None
        assert other.n_past == 0
        forget(smol)
        smol.decode(tokens, logits=())
        assert other.load_state(smol.state_bytes(), tokens) == n  # llama.cpp alone would take it


def test_header_names_model_and_tokens(smol, cache):
    prompt, n = prompt_for(smol)
    forget(smol)
    warm_prefix(smol, prompt[:n], cache)
    raw = cache.entries()[0].read_bytes()
    (n_header,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    header = json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n_header])
    assert header["n_tokens"] == n and header["model_file"] == smol.name
    assert len(raw) == len(MAGIC) + 4 + n_header + 4 * n + header["state_bytes"]


def test_stale_temp_files_are_swept(smol, cache):
    prompt, n = prompt_for(smol)
    cache.root.mkdir(parents=True)
    old = cache.root / ".x.tmp"
    old.write_bytes(b"half an entry")
    os.utime(old, (1000, 1000))
    fresh = cache.root / ".y.tmp"
    fresh.write_bytes(b"being written")
    forget(smol)
    warm_prefix(smol, prompt[:n], cache)
    assert not old.exists() and fresh.exists()


def test_zero_cap_turns_it_off(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_PREFIX_CACHE_MB", "0")
    cache = PrefixStore(tmp_path / "off", min_tokens=16)
    prompt, n = prompt_for(smol)
    forget(smol)
    use = warm_prefix(smol, prompt[:n], cache)
    assert not use.stored and use.decoded == n and not (tmp_path / "off").exists()


@pytest.mark.parametrize(("a", "b", "n"), [
    ([], [1, 2], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2], [1, 2, 3], 2),
    ([5, 2], [1, 2], 0), ([1, 2, 4, 9], [1, 2, 3, 9], 2), (np.arange(3000), list(range(2999)) + [7], 2999),
])
def test_shared_prefix_counts_the_common_start(a, b, n):
    from localspec.core.backend import shared_prefix

    assert shared_prefix(a, b) == n
