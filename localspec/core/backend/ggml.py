"""llama.cpp's runtime below the model: the library handle and its log, system and CPU
facts (AMX), ggml devices, and the ggml RPC backend (what llama-cpp-python does not bind;
llama_model.py loads and runs models).

llama-cpp-python 0.3.36 binds no ggml_backend_* function: they are read through
libllama's handle (dlsym on it also finds the ggml libraries it links). The RPC entry
points are reached as llama.cpp's own common/arg.cpp does: the "RPC" backend reg, then
its proc addresses, so a build that loads backends at run time works too.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TypeVar

from localspec.core.errors import BackendError

try:
    import llama_cpp as _ll
except ImportError as exc:  # pragma: no cover - install problem, reported once
    raise BackendError(
        "llama-cpp-python is not installed; run: pip install 'llama-cpp-python>=0.3.36,<0.3.37'"
    ) from exc
except (OSError, RuntimeError) as exc:  # installed, but its shared library does not load
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    raise BackendError(f"llama-cpp-python is installed but does not load: {reason}; reinstall it: "
                       "pip install --force-reinstall 'llama-cpp-python>=0.3.36,<0.3.37'") from exc

_log_verbose = False
_log_lock = threading.Lock()
_log_capture: list[str] | None = None  # llama.cpp's messages while captured()


@_ll.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs hundreds of lines while loading: silent unless -v
    if _log_capture is not None and text:
        _log_capture.append(text.decode("utf-8", errors="replace"))
    if _log_verbose and text:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


@contextmanager
def captured() -> Iterator[list[str]]:
    """What llama.cpp says during a call, through its log or straight to stderr (its
    grammar parser fprintf()s): collected into the yielded list instead of the terminal,
    to become one line of an error. One caller at a time; fd 2 is borrowed meanwhile."""
    global _log_capture
    with _log_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        out: list[str] = []
        _log_capture = out
        try:
            yield out
        finally:
            _log_capture = None
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.insert(0, tmp.read().decode("utf-8", errors="replace"))


_O = TypeVar("_O", bound="Owned")


class Owned:
    """Something llama.cpp allocated for this process: close() frees it (once), and so do
    leaving a `with` block and garbage collection."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: llama_cpp may be gone
            pass


def set_verbose(verbose: bool) -> None:
    global _log_verbose
    _log_verbose = verbose


def is_verbose() -> bool:
    return _log_verbose


@cache
def init_backend() -> None:
    _ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
    _ll.llama_backend_init()


def llama_cpp_version() -> str:
    return getattr(_ll, "__version__", "unknown")


@cache
def system_info() -> str:
    """llama.cpp's own feature string (CPU features, backends)."""
    init_backend()
    return _ll.llama_print_system_info().decode("utf-8", errors="replace")


@cache
def has_amx() -> bool:
    """AMX present: llama.cpp's AMX matmul segfaults on multi-token batches (issue #20824).

    Either llama.cpp reports it (built in) or the CPU advertises it (a build that loads
    CPU variants at run time). LOCALSPEC_EXTRA_BUFTS=1 or 0 overrides the decision.
    """
    forced = os.environ.get("LOCALSPEC_EXTRA_BUFTS")
    if forced in ("0", "1"):
        return forced == "0"
    return "AMX_INT8 = 1" in system_info() or _cpu_flag("amx_int8")


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 4


# ----- ggml through libllama's handle --------------------------------------------

_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
_vp, _sz = ctypes.c_void_p, ctypes.c_size_t


def _ggml_fn(name: str, restype: object, *argtypes: object):
    init_backend()
    f = getattr(_ll.llama_cpp._lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


def ggml_build() -> dict:
    """ggml's version and the llama.cpp commit it was built from."""
    out = {}
    for key in ("version", "commit"):
        try:
            out[key] = _ggml_fn(f"ggml_{key}", ctypes.c_char_p)().decode()
        except (AttributeError, OSError):
            out[key] = "unknown"
    return out


def device_handles() -> list[int]:
    """Every registered ggml device (RPC workers are not registered: see rpc_devices)."""
    get = _ggml_fn("ggml_backend_dev_get", _vp, _sz)
    return [get(i) for i in range(_ggml_fn("ggml_backend_dev_count", _sz)())]


def device_name(dev: int) -> str:
    return _ggml_fn("ggml_backend_dev_name", ctypes.c_char_p, _vp)(dev).decode()


def device_info(dev: int) -> dict:
    """name, description, type (cpu/gpu/igpu/accel), backend, memory of one device."""
    desc = _ggml_fn("ggml_backend_dev_description", ctypes.c_char_p, _vp)
    kind = _ggml_fn("ggml_backend_dev_type", ctypes.c_int, _vp)
    memory = _ggml_fn("ggml_backend_dev_memory", None, _vp, ctypes.POINTER(_sz), ctypes.POINTER(_sz))
    reg_of = _ggml_fn("ggml_backend_dev_backend_reg", _vp, _vp)
    reg_name = _ggml_fn("ggml_backend_reg_name", ctypes.c_char_p, _vp)
    free, total = _sz(0), _sz(0)
    memory(dev, ctypes.byref(free), ctypes.byref(total))
    return {
        "name": device_name(dev), "description": (desc(dev) or b"").decode(),
        "type": _DEV_TYPES.get(kind(dev), "unknown"), "backend": reg_name(reg_of(dev)).decode(),
        "memory_free": free.value, "memory_total": total.value,
    }


def devices() -> list[dict]:
    """Every ggml device: name, description, type (cpu/gpu/igpu/accel), backend, memory."""
    return [device_info(d) for d in device_handles()]


def backends() -> list[str]:
    """Registered ggml backends (CPU, CUDA, Metal, BLAS, RPC, ...)."""
    get = _ggml_fn("ggml_backend_reg_get", _vp, _sz)
    name = _ggml_fn("ggml_backend_reg_name", ctypes.c_char_p, _vp)
    return [name(get(i)).decode() for i in range(_ggml_fn("ggml_backend_reg_count", _sz)())]


def offload_handles() -> list[int]:
    """The local devices llama.cpp offloads to by default: GPUs, else integrated GPUs."""
    kind = _ggml_fn("ggml_backend_dev_type", ctypes.c_int, _vp)
    handles = device_handles()
    gpus = [d for d in handles if kind(d) == 1]
    return gpus or [d for d in handles if kind(d) == 2]


def supports_gpu_offload() -> bool:
    """A GPU (or integrated GPU) device is present to offload layers to. Not
    llama_supports_gpu_offload(): that is also true for a CPU build with RPC compiled in,
    where -ngl would then place every layer on devices that do not exist."""
    return bool(offload_handles())


def offload_compiled() -> bool:
    """llama.cpp was built with a backend it could offload to (a GPU backend, or RPC),
    whether or not such a device is present: only then does its load log say how many
    layers it offloaded."""
    init_backend()
    return bool(_ll.llama_supports_gpu_offload())


def max_devices() -> int:
    """Length of llama_model_params.tensor_split."""
    return int(_ll.llama_max_devices())


# ----- the RPC backend ---------------------------------------------------------------


def supports_rpc() -> bool:
    """This llama-cpp-python was built with -DGGML_RPC=on."""
    init_backend()
    return bool(_ll.llama_supports_rpc()) and bool(_rpc_reg())


def _rpc_reg() -> int | None:
    return _ggml_fn("ggml_backend_reg_by_name", _vp, ctypes.c_char_p)(b"RPC")


def _rpc_proc(name: str, restype: object, *argtypes: object):
    reg = _rpc_reg()
    addr = reg and _ggml_fn("ggml_backend_reg_get_proc_address", _vp, _vp, ctypes.c_char_p)(
        reg, name.encode())
    if not addr:
        raise BackendError(f"this llama.cpp build's RPC backend has no {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def rpc_add_server(endpoint: str) -> list[int]:
    """Connect to one worker (ggml keeps the connection per endpoint) and return its
    devices. ggml aborts the process when the worker cannot be reached: probe first."""
    add = _rpc_proc("ggml_backend_rpc_add_server", _vp, ctypes.c_char_p)
    reg = add(endpoint.encode())
    if not reg:
        raise BackendError(f"RPC worker {endpoint} reports no devices")
    count = _ggml_fn("ggml_backend_reg_dev_count", _sz, _vp)(reg)
    get = _ggml_fn("ggml_backend_reg_dev_get", _vp, _vp, _sz)
    return [get(reg, i) for i in range(count)]


def rpc_start_server(endpoint: str, cache_dir: str | None, n_threads: int, devs: Sequence[int]) -> None:
    """Serve `devs` to RPC clients on `endpoint` (HOST:PORT, HOST an IPv4 address). Blocks
    in C for as long as it serves; returns only when the socket cannot be set up."""
    start = _rpc_proc("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                      _sz, _sz, ctypes.POINTER(_vp))
    arr = (_vp * len(devs))(*devs)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, n_threads, len(devs), arr)


def server_handles() -> list[int]:
    """What a worker serves, as llama.cpp's rpc-server chooses: every device that is not
    the CPU (GPUs), else the CPU."""
    kind = _ggml_fn("ggml_backend_dev_type", ctypes.c_int, _vp)
    handles = device_handles()
    return [d for d in handles if kind(d) not in (0, 3)] or [d for d in handles if kind(d) == 0][:1]


_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_abort_hook: list = []  # keeps the ctypes callback alive


def on_abort(handler: Callable[[str], None]) -> None:
    """Call `handler(message)` when ggml aborts (GGML_ABORT; the process ends after it,
    unless the handler ends it first). Installed once; later calls replace the handler."""
    def call(message: bytes) -> None:
        handler((message or b"").decode("utf-8", errors="replace"))

    cb = _ABORT_FN(call)
    _ggml_fn("ggml_set_abort_callback", _vp, _ABORT_FN)(cb)
    _abort_hook[:] = [cb]

