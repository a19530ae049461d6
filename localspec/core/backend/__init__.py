"""llama.cpp, through llama-cpp-python: the one package that imports llama_cpp
(bench/peer.py is the deliberate exception outside it). Everything else uses the names
re-exported here.

    ggml.py       the library handle and its log (captured()), system and CPU facts (AMX),
                  ggml devices and the RPC backend through ctypes (llama-cpp-python binds
                  no ggml_backend_* function); Owned, the close()/with/collect base
    placement.py  where a model's layers go (-ngl, --rpc workers, --tensor-split); LoadInfo
    prefix.py     PrefixReuse: prefix reuse over a KV record (Model's and the fake model's)
    ubatch.py     how llama.cpp splits a multi-sequence decode into ubatches (a step's price)
    llama_model.py  Model: load a GGUF, tokenize, chat template, decode batches, rewind, KV
                  sequences, sequence state as bytes; Detokenizer
    grammar.py    llama.cpp's grammar sampler as a Grammar (allows/allowed/mask/accept/clone)
                  and JSON schema -> GBNF (jsonschema checks, llama-cpp-python's converter)
"""

from localspec.core.backend.ggml import (
    backends,
    captured,
    default_threads,
    device_info,
    device_name,
    devices,
    ggml_build,
    has_amx,
    init_backend,
    is_verbose,
    llama_cpp_version,
    max_devices,
    offload_handles,
    set_verbose,
    supports_gpu_offload,
    supports_rpc,
    system_info,
)
from localspec.core.backend.grammar import (
    JSON_GBNF,
    Grammar,
    check_grammar,
    json_schema_grammar,
)
from localspec.core.backend.llama_model import Detokenizer, Model
from localspec.core.backend.placement import LoadInfo
from localspec.core.backend.prefix import PrefixReuse, shared_prefix
from localspec.core.backend.ubatch import ubatches

__all__ = [
    "JSON_GBNF", "Detokenizer", "Grammar", "LoadInfo", "Model", "PrefixReuse", "shared_prefix", "backends",
    "captured", "check_grammar", "default_threads", "device_info", "device_name", "devices",
    "ggml_build", "has_amx", "init_backend", "is_verbose", "json_schema_grammar",
    "llama_cpp_version", "max_devices", "offload_handles", "set_verbose",
    "supports_gpu_offload", "supports_rpc", "system_info", "ubatches",
]
