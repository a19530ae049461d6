"""ggml RPC workers: a model's layers on other machines' devices, through llama.cpp's
own RPC backend (no protocol of ours).

ggml's client connects without a time limit and aborts the whole process when a worker
is unreachable or stops answering. So before ggml first connects to a worker we check
that it answers a HELLO within a bounded time, and while workers are in use a ggml
abort caused by one becomes one line on stderr and exit status 1.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
import threading
from collections.abc import Callable, Sequence

from localspec.core.errors import LocalspecError, UsageError

DEFAULT_PORT = 50052
RPC_PROTO_MAJOR = 7  # RPC_PROTO_MAJOR_VERSION in ggml-rpc.h of llama-cpp-python 0.3.36
_CMD_HELLO = 14  # RPC_CMD_HELLO: always 14
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities (none offered: plain TCP)
REBUILD = ('this llama-cpp-python was built without RPC support; rebuild it with: '
           'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir '
           '"llama-cpp-python>=0.3.36,<0.3.37"')


class WorkerUnreachable(LocalspecError):
    """A worker did not answer (exit 1)."""


def parse_endpoints(text: str) -> tuple[str, ...]:
    """'host:port[,host:port...]' -> ('host:port', ...); ValueError says what is wrong."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
        if ":" in host:
            raise ValueError(f"{part!r}: ggml's RPC client speaks IPv4 only (a name or a.b.c.d)")
        out.append(f"{host}:{int(port)}")
    if len(set(out)) != len(out):
        raise ValueError("the same worker is named twice")
    return tuple(out)


def connect_timeout() -> float:
    """Seconds a worker has to accept and answer HELLO (LOCALSPEC_RPC_TIMEOUT, default 5)."""
    try:
        return max(0.1, float(os.environ.get("LOCALSPEC_RPC_TIMEOUT", "5")))
    except ValueError:
        return 5.0


def _ggml():
    # imported when used: parsing endpoints and the worker's --help need no llama.cpp
    from localspec.core.backend import ggml

    return ggml


def require_rpc() -> None:
    if not _ggml().supports_rpc():
        raise UsageError(REBUILD)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed the connection")
        data += chunk
    return data


def probe(endpoint: str, timeout: float | None = None) -> str:
    """Open a connection to a worker and exchange HELLO, as ggml's client does first;
    return the worker's protocol version. Raises WorkerUnreachable within ~2x timeout."""
    timeout = connect_timeout() if timeout is None else timeout
    host, _, port = endpoint.rpartition(":")
    hint = f"is `localspec worker --host {host} --port {port}` running there?"
    try:
        addr = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4]
        with socket.create_connection(addr, timeout=timeout) as sock:
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS) + bytes(_CONN_CAPS))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            reply = _recv_exact(sock, size) if size == 4 + _CONN_CAPS else b""
    except socket.gaierror as exc:
        raise WorkerUnreachable(f"RPC worker {endpoint}: cannot resolve {host!r} ({exc.strerror})") from None
    except TimeoutError:
        raise WorkerUnreachable(
            f"RPC worker {endpoint} did not answer within {timeout:g} s (unreachable, or busy: "
            f"a worker serves one client at a time; LOCALSPEC_RPC_TIMEOUT sets the limit)") from None
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise WorkerUnreachable(f"RPC worker {endpoint} is unreachable: {why}; {hint}") from None
    if not reply:
        raise WorkerUnreachable(f"{endpoint} answered, but not as a ggml RPC worker")
    major, minor, patch = reply[0], reply[1], reply[2]
    if major != RPC_PROTO_MAJOR:
        raise WorkerUnreachable(
            f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch}, this build "
            f"{RPC_PROTO_MAJOR}.x: run the same llama-cpp-python version on both machines")
    return f"{major}.{minor}.{patch}"


# ----- attaching workers to this process ---------------------------------------------

_lock = threading.Lock()
_attached: dict[str, list[int]] = {}  # endpoint -> its ggml devices, once probed


def attach(endpoints: Sequence[str]) -> list[int]:
    """The ggml devices of `endpoints`, in order. Each worker is probed the first time
    this process uses it (later its one connection may be held by a loaded model, and a
    worker serves one client at a time)."""
    require_rpc()
    ggml = _ggml()
    with _lock:
        for ep in endpoints:
            if ep not in _attached:
                probe(ep)
                ggml.on_abort(_on_abort)
                _attached[ep] = []  # named in the abort line should ggml fail to connect
                try:
                    _attached[ep] = ggml.rpc_add_server(ep)
                except BaseException:
                    del _attached[ep]
                    raise
        return [d for ep in endpoints for d in _attached[ep]]


def _on_abort(message: str) -> None:
    """ggml aborts the process on a lost worker (no error path back to us): say so in one
    line and exit 1. Other aborts print ggml's message and abort as before."""
    text = re.sub(r"^.*?:\d+: ", "", message.strip())
    if "ggml-rpc" not in message and "RPC" not in text:
        os.write(2, f"{message}\n".encode())
        return
    workers = ", ".join(_attached)
    which = f"RPC worker {workers}" if len(_attached) == 1 else f"an RPC worker (one of {workers})"
    line = (f"Error: lost the connection to {which}: the worker stopped or the network failed; "
            f"the generation was abandoned (llama.cpp: {text})\n")
    os.write(2, line.encode("utf-8", errors="replace"))
    os._exit(1)


# ----- serving this machine's devices -------------------------------------------------


def check_listen(host: str, port: int) -> None:
    """ggml's server binds an IPv4 address (not a name): check it can, for a clear error."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(f"--host {host!r}: give an IPv4 address of this machine "
                         "(127.0.0.1, 0.0.0.0 for every interface, or one address)") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml's server does
        try:
            s.bind((host, port))
        except OSError as exc:
            raise LocalspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(host: str, port: int, n_threads: int, cache_dir: str | None,
          announce: Callable[[list[dict]], None] = lambda devices: None) -> None:
    """Run ggml's RPC server on this machine's devices until interrupted; `announce`
    gets the devices once the address is known to be free. The server blocks in C, so
    it runs in a daemon thread and Ctrl-C reaches the main thread."""
    require_rpc()
    check_listen(host, port)
    ggml = _ggml()
    devs = ggml.server_handles()
    announce([ggml.device_info(d) for d in devs])
    server = threading.Thread(target=ggml.rpc_start_server, name="ggml-rpc-server", daemon=True,
                              args=(f"{host}:{port}", cache_dir, n_threads, devs))
    server.start()
    while server.is_alive():
        server.join(0.5)
    raise LocalspecError(f"the RPC server on {host}:{port} stopped (it could not set up its socket)")
