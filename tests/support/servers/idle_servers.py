"""Many do-nothing vLLM servers in one process: one asyncio loop serving a
port per server, for the fleet bench and the fleet tests.

Why not ``memory_server``: it runs a thread per connection and copies every
broadcast to every server, so at 256 servers it starves the process it
shares with the sender; it is kept for correctness. These answer every
weight-transfer route at once with vLLM 0.33.0's answer shapes and receive
nothing (the sender's data plane is replaced in the same run), so what a
fleet measures is the sender's own cost per server. Like uvicorn under
vLLM (``timeout_keep_alive`` 5 s), a connection idle for ``--keep-alive``
seconds is closed.

    python -m support.servers.idle_servers --servers 256 --workers 8   # prints READY <json ports>

``GET /_calls`` on any port answers that port's calls so far, by route.
The process ends when its stdin closes (its parent went away).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections import Counter

from support import child

READY = "READY "
# vLLM 0.33.0's router's answers (api_router.py), by route; others: {"message": "ok"}.
ANSWERS = {
    "/is_paused": {"is_paused": False},
    "/weight_info": {"weight_version": "default"},
    "/pause": {"status": "paused"},
    "/resume": {"status": "resumed"},
}


class _Port(asyncio.Protocol):
    """One connection to one server: reads requests (``Content-Length``
    bodies, as the sender sends), answers each at once, keeps the connection
    until it has been idle ``keep_alive`` seconds."""

    def __init__(self, workers: int, calls: Counter, keep_alive: float):
        self.workers, self.calls, self.keep_alive = workers, calls, keep_alive
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._idle_from_now()

    def _idle_from_now(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = asyncio.get_running_loop().call_later(self.keep_alive, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle is not None:
            self.idle.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := self._next()) is not None:
            self._answer(request)
        self._idle_from_now()

    def _next(self) -> str | None:
        """The next whole request's path, taken off the buffer (None: not whole yet)."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-length":
                length = int(value)
        if len(self.buffer) < end + 4 + length:
            return None
        self.buffer = self.buffer[end + 4 + length:]
        return head[0].split(" ")[1].split("?")[0]

    def _answer(self, path: str) -> None:
        self.calls[path] += 1
        if path == "/get_world_size":
            body = {"world_size": self.workers}
        elif path == "/_calls":
            body = dict(self.calls)
        else:
            body = ANSWERS.get(path, {"message": "ok"})
        data = json.dumps(body).encode()
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(data), data))


async def serve(servers: int, workers: int, keep_alive: float) -> None:
    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(servers):
        calls: Counter = Counter()
        server = await loop.create_server(lambda c=calls: _Port(workers, c, keep_alive),
                                          "127.0.0.1", 0, backlog=1024)
        ports.append(server.sockets[0].getsockname()[1])
    print(READY + json.dumps(ports), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent goes away


class IdleServers:
    """``servers`` do-nothing servers of ``workers`` workers each, in a child
    process (``with`` ends it); ``urls``: theirs, in order."""

    def __init__(self, servers: int, *, workers: int = 1, keep_alive: float = 5.0):
        argv, env = child("servers.idle_servers", "--servers", str(servers), "--workers", str(workers),
                          "--keep-alive", str(keep_alive), env=dict(os.environ))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith(READY):
            self.close()
            raise RuntimeError(f"the idle servers did not start: {line!r}")
        self.urls = [f"http://127.0.0.1:{p}" for p in json.loads(line[len(READY):])]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> IdleServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--keep-alive", type=float, default=5.0)
    args = ap.parse_args()
    asyncio.run(serve(args.servers, args.workers, args.keep_alive))


if __name__ == "__main__":
    main()
