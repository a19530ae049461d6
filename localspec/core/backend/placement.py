"""Where a model's layers go: -ngl of them on the offload devices (the --rpc workers'
first, then local GPUs), shared out by --tensor-split; and what the load ended up as."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from localspec.core import rpc
from localspec.core.backend.ggml import device_name, max_devices, offload_handles
from localspec.core.config import ModelConfig
from localspec.core.errors import UsageError
from localspec.core.tuning import ALL_LAYERS


@dataclass(frozen=True)
class LoadInfo:
    """What a loaded model ended up as, for `doctor` and the logs."""

    n_gpu_layers: int
    amx_workaround: bool
    n_threads: int
    offload: tuple[str, ...] = ()  # devices offloaded layers go to, in order (RPC0, CUDA0, ...)
    rpc: tuple[str, ...] = ()  # the --rpc workers (HOST:PORT) among them


def placement(cfg: ModelConfig, mparams: object) -> tuple[int, tuple[str, ...], list]:
    """Where the layers go: -ngl of them on the offload devices (the --rpc workers'
    first, as llama.cpp orders them, then local GPUs), shared out by --tensor-split; the
    rest on the CPU. Sets mparams; returns (n_gpu_layers, device names, the ctypes arrays
    to keep alive through the load)."""
    remote = rpc.attach(cfg.rpc) if cfg.rpc else []
    devs = [*remote, *offload_handles()]
    names = tuple(device_name(d) for d in devs)
    if len(cfg.tensor_split) > len(devs):
        raise UsageError(
            f"--tensor-split has {len(cfg.tensor_split)} entries, but {len(devs)} devices take "
            f"offloaded layers here ({', '.join(names) or 'none: no GPU and no --rpc'})")
    n_gpu = cfg.n_gpu_layers if cfg.n_gpu_layers >= 0 else (ALL_LAYERS if devs else 0)
    mparams.n_gpu_layers = n_gpu
    keep: list = []
    if remote:  # workers are not registered ggml devices: llama.cpp gets the list itself
        arr = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
        mparams.devices = ctypes.cast(arr, ctypes.c_void_p)
        keep.append(arr)
    if cfg.tensor_split:
        split = (ctypes.c_float * max_devices())(*cfg.tensor_split)
        mparams.tensor_split = split
        keep.append(split)
    return n_gpu, names if n_gpu else (), keep
