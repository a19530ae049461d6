"""`localspec worker`: serve this machine's devices to other machines' localspec (their
`--rpc HOST:PORT`), through llama.cpp's own RPC server (ggml-rpc), in this process."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import click

from localspec.core.errors import UsageError
from localspec.core.rpc import DEFAULT_PORT

NO_AUTH = ("the RPC protocol has no authentication and no encryption: anyone who can reach "
           "{endpoint} can use this machine's devices and memory, and read what is sent. "
           "Keep it on a trusted network.")
# upstream calls ggml's RPC server insecure: it trusts what clients send, and it has had
# remote out-of-bounds reads and writes; a client can read and write the worker's memory
REMOTE_RISK = ("anyone who can reach port {port} can read and write this worker's memory through ggml RPC "
               "(no authentication, no encryption; upstream calls it insecure, and it has had remote "
               "out-of-bounds bugs) and use its devices")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="IPv4 address to listen on: 127.0.0.1 (this machine only), an address of one "
                   "interface, or 0.0.0.0 (every interface)")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--allow-remote", is_flag=True,
              help="allow a --host other machines can reach. Only on a network you trust: "
                   + REMOTE_RISK.format(port="PORT"))
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the layers this worker computes [default: all cores available]")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="keep received tensors here, so a client that loads the same model again "
                   "sends hashes instead of weights")
@click.pass_context
def worker(ctx: click.Context, host: str, port: int, allow_remote: bool, n_threads: int | None,
           cache_dir: str | None) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to localspec on other
    machines, which name it with --rpc HOST:PORT. One client at a time; Ctrl-C stops.

    \b
      localspec worker --host 0.0.0.0 --allow-remote     # on the machine with the GPU
      localspec run --rpc 192.168.1.20:50052 "..."       # on the machine you type on

    Other machines reach a worker only with --allow-remote: ggml RPC lets whoever
    connects read and write the worker's memory. An SSH tunnel to a 127.0.0.1 worker
    needs no such flag (ssh -L 50052:127.0.0.1:50052 gpu-box).
    """
    from localspec.core import rpc
    from localspec.core.backend import default_threads, ggml

    if not allow_remote and _is_ipv4(host) and not _is_loopback(host):
        raise UsageError(f"--host {host} would expose this machine: {REMOTE_RISK.format(port=port)}. "
                         "Add --allow-remote on a network you trust, or keep --host 127.0.0.1 "
                         "and reach it through an SSH tunnel")

    ggml.set_verbose(bool((ctx.obj or {}).get("verbose")))
    endpoint = f"{host}:{port}"
    threads = n_threads or default_threads()

    def announce(devices: list[dict]) -> None:
        loud = not _is_loopback(host)
        click.echo(("WARNING: " if loud else "warning: ") + NO_AUTH.format(endpoint=endpoint), err=True)
        if loud:
            click.echo(f"WARNING: listening on {endpoint}, reachable from other machines.", err=True)
        served = ", ".join(f"{d['name']} ({d['description']})" for d in devices)
        click.echo(f"localspec worker: serving {served} on {endpoint} with {threads} threads; "
                   "Ctrl-C stops", err=True)

    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    try:
        rpc.serve(host, port, threads, cache_dir, announce)
    except KeyboardInterrupt:
        click.echo("localspec worker: stopped", err=True)
        raise SystemExit(130) from None


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False  # rpc.check_listen says what it must be
    return True


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False
