"""What a GGUF file holds, read from its header without loading the weights.

The `gguf` package (llama.cpp's own Python library) names the keys, value types and
quantisation types. Its GGUFReader materialises every vocabulary string as a numpy
array (3-20 s per model on 2 cores), so the walk here reads scalars, steps over big
arrays, and keeps of the vocabulary only a digest per block of tokens: enough to tell
two vocabularies apart before llama.cpp loads anything.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from localspec.models import paths

VOCAB_BLOCK = 1024  # tokens per vocabulary digest
# llama.cpp's split naming: PREFIX-00001-of-00003.gguf (llama_split_path)
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAYS = ("tokenizer.ggml.tokens",)  # digested, not kept


class GGUFError(ValueError):
    """Not a GGUF file, or a header this reader cannot walk."""


@dataclass(frozen=True)
class GGUFInfo:
    """Header facts about one model file (all parts of a split model)."""

    architecture: str = ""
    name: str = ""
    basename: str = ""
    size_label: str = ""
    n_params: int = 0  # elements over all tensors of all parts
    quant: str = ""  # file type (Q4_K_M ...), or the dominant tensor type
    context_length: int = 0
    n_vocab: int = 0
    tokenizer: str = ""  # tokenizer.ggml.model: gpt2 (BPE), llama (SPM), ...
    tokenizer_pre: str = ""
    bos: int | None = None
    eos: int | None = None
    vocab_digest: tuple[str, ...] = ()  # one digest per VOCAB_BLOCK tokens
    split_count: int = 1
    size: int = 0  # bytes over all parts

    @property
    def is_llm(self) -> bool:
        """A language model (not a vision projector or an embedding-only file)."""
        return bool(self.n_vocab) and self.architecture not in ("clip", "")

    def to_dict(self) -> dict:
        return asdict(self) | {"vocab_digest": list(self.vocab_digest)}

    @classmethod
    def from_dict(cls, data: dict) -> GGUFInfo:
        return cls(**(data | {"vocab_digest": tuple(data.get("vocab_digest", ()))}))


def split_parts(path: Path) -> list[Path] | None:
    """All parts of a split model named like llama.cpp names them, or None if `path`
    is not a split part. Missing parts are included (the caller checks they exist)."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_info(path: Path | str) -> GGUFInfo:
    """Header facts of a GGUF file; for the first part of a split model, of all parts.

    Raises GGUFError for a file that is not GGUF or whose header is cut short, and
    OSError when it cannot be read.
    """
    path = Path(path)
    head = _read_header(path, metadata=True)
    kv, n_params, types, size = head.kv, head.n_params, head.tensor_types, path.stat().st_size
    split_count = int(kv.get("split.count", 1) or 1)
    if split_count > 1:
        for part in (split_parts(path) or [])[1:]:
            other = _read_header(part, metadata=False)
            n_params += other.n_params
            size += part.stat().st_size
            for t, n in other.tensor_types.items():
                types[t] = types.get(t, 0) + n
    arch = str(kv.get("general.architecture", ""))
    return GGUFInfo(
        architecture=arch, name=str(kv.get("general.name", "")),
        basename=str(kv.get("general.basename", "")), size_label=str(kv.get("general.size_label", "")),
        n_params=n_params, quant=_quant_name(kv.get("general.file_type"), types),
        context_length=int(kv.get(f"{arch}.context_length", 0) or 0),
        n_vocab=int(kv.get("tokenizer.ggml.tokens", 0) or kv.get(f"{arch}.vocab_size", 0) or 0),
        tokenizer=str(kv.get("tokenizer.ggml.model", "")), tokenizer_pre=str(kv.get("tokenizer.ggml.pre", "")),
        bos=_opt_int(kv.get("tokenizer.ggml.bos_token_id")), eos=_opt_int(kv.get("tokenizer.ggml.eos_token_id")),
        vocab_digest=head.vocab_digest, split_count=split_count, size=size,
    )  # fmt: skip


def cached_info(path: Path | str) -> GGUFInfo:
    """read_info, remembered in the cache dir per file (path, size and mtime of each part)."""
    path = Path(path)
    parts = split_parts(path) if SPLIT_NAME.match(path.name) else [path]
    stamp = [[os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in parts or [path]]
    key, cache = os.path.realpath(path), _load_cache()
    hit = cache.get(key)
    if hit and hit.get("stamp") == stamp:
        try:
            return GGUFInfo.from_dict(hit["info"])
        except TypeError:
            pass  # written by another version
    info = read_info(path)
    cache[key] = {"stamp": stamp, "info": info.to_dict()}
    _save_cache(cache)
    return info


def _cache_file() -> Path:
    return paths.cache_dir() / "gguf-headers.json"


def _load_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    """Atomically, dropping files that are gone; a cache that cannot be written is no error."""
    cache = {k: v for k, v in cache.items() if os.path.exists(k)}
    target = _cache_file()
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        paths.ensure(target.parent)
        tmp.write_text(json.dumps(cache), encoding="utf-8")
        tmp.replace(target)
    except OSError:
        tmp.unlink(missing_ok=True)


def _opt_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _quant_name(file_type: object, tensor_types: dict[int, int]) -> str:
    """general.file_type as llama.cpp names it (Q4_K_M), else the type holding the most
    weights (older files have no file_type)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    if file_type is not None:
        try:
            name = LlamaFileType(int(file_type)).name  # type: ignore[call-overload]
            return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")
        except ValueError:
            return f"type {file_type}"
    if not tensor_types:
        return ""
    dominant = max(tensor_types, key=tensor_types.__getitem__)
    try:
        return GGMLQuantizationType(dominant).name
    except ValueError:
        return f"type {dominant}"


@dataclass
class _Header:
    kv: dict
    n_params: int
    tensor_types: dict[int, int]  # ggml type -> elements
    vocab_digest: tuple[str, ...]


def _read_header(path: Path, *, metadata: bool) -> _Header:
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # empty file
            raise GGUFError(f"{path} is empty") from exc
    with mm:
        try:
            return _Walker(mm, metadata).header()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise GGUFError(f"{path}: GGUF header cut short or corrupt ({exc})") from exc


class _Walker:
    """One pass over magic, version, key/values and tensor infos."""

    def __init__(self, mm: mmap.mmap, metadata: bool) -> None:
        self.mm, self.metadata, self.off, self.order = mm, metadata, 0, "<"
        self.digest: list[str] = []

    def header(self) -> _Header:
        if self.mm[:4] != b"GGUF":
            raise GGUFError("not a GGUF file")
        version = struct.unpack_from("<I", self.mm, 4)[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order, version = ">", struct.unpack_from(">I", self.mm, 4)[0]
        if version < 2:
            raise GGUFError(f"GGUF version {version} is too old for llama.cpp")
        self.off = 8
        n_tensors, n_kv = self.unpack("Q"), self.unpack("Q")
        kv = {}
        for _ in range(n_kv):
            key = self.string()
            kv[key] = self.value(self.unpack("I"), key)
        n_params, types = 0, {}
        for _ in range(n_tensors):
            self.raw_string()
            n_dims = self.unpack("I")
            if n_dims > 8:  # GGML_MAX_DIMS is 4
                raise GGUFError(f"a tensor with {n_dims} dimensions")
            n = 1
            for dim in struct.unpack_from(f"{self.order}{n_dims}Q", self.mm, self.off):
                n *= dim
            self.off += 8 * n_dims
            ggml_type = self.unpack("I")
            self.off += 8  # data offset
            n_params += n
            types[ggml_type] = types.get(ggml_type, 0) + n
        return _Header(kv, n_params, types, tuple(self.digest))

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(self.order + fmt, self.mm, self.off)
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8")

    def raw_string(self) -> bytes:
        n = self.unpack("Q")
        start, self.off = self.off, self.off + n
        if self.off > len(self.mm):
            raise IndexError("string past the end of the file")
        return self.mm[start : self.off]

    def value(self, vtype: int, key: str) -> object:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            if self.metadata:
                return self.string()
            self.raw_string()
            return None
        if vtype != _ARRAY:
            raise GGUFError(f"unknown GGUF value type {vtype} for {key}")
        item_type, count = self.unpack("I"), self.unpack("Q")
        if item_type in _SCALARS:
            self.off += struct.calcsize(_SCALARS[item_type]) * count
        elif item_type == _STRING:
            self.strings(count, digest=self.metadata and key in _KEEP_ARRAYS)
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self.value(item_type, key)
        return count  # an array's value here is its length

    def strings(self, count: int, digest: bool) -> None:
        """Step over `count` strings (the hot loop: 150k+ tokens and merges per model)."""
        mm, off, size = self.mm, self.off, len(self.mm)
        length = struct.Struct(self.order + "Q").unpack_from
        for start in range(0, count, VOCAB_BLOCK):
            h = hashlib.blake2b(digest_size=8) if digest else None
            for _ in range(min(VOCAB_BLOCK, count - start)):
                n = length(mm, off)[0]
                if h is not None:
                    h.update(mm[off : off + 8 + n])  # length prefix and text
                off += 8 + n
            if off > size:
                raise IndexError("string past the end of the file")
            if h is not None:
                self.digest.append(h.hexdigest())
        self.off = off
