"""`localspec worker` processes on this machine's loopback, for the RPC benchmark and
tests; and a relay that adds network latency in front of a worker without touching any
interface (tc netem needs a kernel module and a namespace, which not every machine has)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

from localspec.core import rpc


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localspec_cmd(*args: str) -> list[str]:
    exe = shutil.which("localspec")
    return [*([exe] if exe else [sys.executable, "-m", "localspec"]), *args]


class LoopbackWorkers:
    """n `localspec worker` processes on 127.0.0.1, started and answering HELLO. Their
    output goes to files (a pipe nobody reads would stall a worker once full)."""

    def __init__(self, n: int, threads: int = 1, log_dir: Path | None = None, timeout: float = 60) -> None:
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix="localspec-workers-"))
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.logs = [log_dir / f"worker{i}.log" for i in range(n)]
        try:
            for log in self.logs:
                port = free_port()
                with open(log, "w") as out:
                    self.procs.append(subprocess.Popen(
                        localspec_cmd("worker", "--port", str(port), "-t", str(threads)),
                        stdout=out, stderr=subprocess.STDOUT))
                self.endpoints.append(f"127.0.0.1:{port}")
            self._wait(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, deadline: float) -> None:
        for ep, proc, log in zip(self.endpoints, self.procs, self.logs):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {ep} exited: {log.read_text()}")
                try:
                    rpc.probe(ep, timeout=2)
                    break
                except rpc.WorkerUnreachable:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"worker {ep} never answered") from None
                    time.sleep(0.2)

    @property
    def rpc(self) -> str:
        """The --rpc value naming every worker."""
        return ",".join(self.endpoints)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def __enter__(self) -> LoopbackWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class DelayRelay:
    """Forwards TCP connections from a loopback port to `upstream`, holding every chunk
    `delay_s` in each direction: a round trip costs 2 * delay_s more, as over a network."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream, self.delay = (host, int(port)), delay_s
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.endpoint = ""
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def receive() -> None:
            while data := await reader.read(1 << 16):
                queue.put_nowait((self.loop.time() + self.delay, data))
            queue.put_nowait((self.loop.time() + self.delay, b""))

        async def send() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.gather(receive(), send())
        except (ConnectionError, OSError):
            writer.close()
