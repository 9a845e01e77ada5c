"""A raw-socket HTTP/1.1 server on loopback that misbehaves on purpose.

Each connection runs on its own thread: the request is read (headers and a
``Content-Length`` body), then the path's behaviour writes whatever it likes
and says whether the connection takes another request. ``close`` wakes and
joins every thread and closes every socket, so a test can check that the
client left nothing behind.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

CHUNK = 64 * 1024


@dataclass
class Exchange:
    """One request and the connection to answer it on."""

    sock: socket.socket
    method: str
    path: str  # without the query
    headers: dict[str, str]  # lower-case names
    body: bytes
    stop: threading.Event = field(repr=False)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def trickle(self, data: bytes, every: float) -> None:
        """``data`` one byte every ``every`` seconds, until the server closes."""
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            self.sock.sendall(data[i:i + 1])


# A behaviour answers an exchange; True keeps the connection for another request.
Behaviour = Callable[[Exchange], bool]


def head(status: int, headers: Sequence[tuple[str, str]]) -> bytes:
    """A status line and headers, up to the blank line."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Odd"
    lines = [f"HTTP/1.1 {status} {phrase}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def response(status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """A whole answer with ``Content-Length``."""
    return head(status, [*headers, ("Content-Length", str(len(body)))]) + body


def json_answer(status: int, obj, headers: Sequence[tuple[str, str]] = ()) -> Behaviour:
    """A well-formed JSON answer; the connection is kept."""
    data = response(status, json.dumps(obj).encode(),
                    [("Content-Type", "application/json"), *headers])

    def behave(ex: Exchange) -> bool:
        ex.send(data)
        return True
    return behave


def raw_answer(status: int, body: bytes = b"", headers: Sequence[tuple[str, str]] = (),
               length: bool = True) -> Behaviour:
    """``body`` as is (with a ``Content-Length`` when ``length``); then close."""
    data = response(status, body, headers) if length else head(status, headers) + body

    def behave(ex: Exchange) -> bool:
        ex.send(data)
        return False
    return behave


def trickle_headers(every: float = 0.3) -> Behaviour:
    """A valid JSON answer, from its status line on, one byte every ``every`` s."""
    data = response(200, b'{"world_size": 1}', [("Content-Type", "application/json")])

    def behave(ex: Exchange) -> bool:
        ex.trickle(data, every)
        return False
    return behave


def trickle_body(every: float = 0.3) -> Behaviour:
    """Valid headers at once, then a 4 KiB JSON body one byte every ``every`` s."""
    body = json.dumps({"message": " " * 4096}).encode()

    def behave(ex: Exchange) -> bool:
        ex.send(head(200, [("Content-Type", "application/json"),
                           ("Content-Length", str(len(body)))]))
        ex.trickle(body, every)
        return False
    return behave


def endless_body(chunked: bool) -> Behaviour:
    """Bytes as fast as the socket takes them, for ever: chunked, or under a
    ``Content-Length`` of 1 TiB."""
    piece = b" " * CHUNK
    framing = ("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(2**40))
    if chunked:
        piece = b"%x\r\n" % len(piece) + piece + b"\r\n"

    def behave(ex: Exchange) -> bool:
        ex.send(head(200, [("Content-Type", "application/json"), framing]))
        while not ex.stop.is_set():
            ex.send(piece)
        return False
    return behave


@functools.cache
def gzip_bomb(gib: int = 1) -> bytes:
    """A gzip member of ``gib`` GiB of zeros, about 1 MiB per GiB.

    Built fast: each MiB of zeros compresses, after a full flush (which
    resets the compressor), to the same deflate blocks, so they are repeated
    rather than recomputed; the trailer's CRC and size are those of the
    whole.
    """
    mib = bytes(2**20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    deflate.compress(mib)
    deflate.flush(zlib.Z_FULL_FLUSH)  # the first MiB's blocks may differ: drop them
    block = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(1024 * gib):
        crc = zlib.crc32(mib, crc)
    gzip_header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    final_block = b"\x03\x00"  # an empty last block
    trailer = struct.pack("<II", crc, (gib << 30) & 0xFFFFFFFF)
    return gzip_header + block * (1024 * gib) + final_block + trailer


def gzip_answer(payload: bytes) -> Behaviour:
    """``payload`` (already gzip) sent with ``Content-Encoding: gzip``; then close."""
    return raw_answer(200, payload, [("Content-Type", "application/json"),
                                     ("Content-Encoding", "gzip")])


def echo(status: int = 500, as_json: bool = True, escape_slashes: bool = False) -> Behaviour:
    """An error that quotes the request body (JSON ``{"detail": ...}`` or
    text), optionally with ``/`` written ``\\/`` as some JSON encoders do."""
    def behave(ex: Exchange) -> bool:
        said = f"cannot parse the body {ex.body.decode()}"
        text = json.dumps({"detail": said}) if as_json else said
        if escape_slashes:
            text = text.replace("/", "\\/")
        kind = "application/json" if as_json else "text/plain"
        ex.send(response(status, text.encode(), [("Content-Type", kind)]))
        return True
    return behave


def silent(ex: Exchange) -> bool:
    """Read the request, never answer."""
    ex.stop.wait()
    return False


class BadServer:
    """``behave`` (one behaviour, or one per path; a path not in it gets a
    404) served on a free loopback port. ``deaf``: accept connections and
    never read them. ``requests``: (method, path, body) of each request;
    ``connections``: how many were accepted."""

    def __init__(self, behave: Behaviour | dict[str, Behaviour] | None = None,
                 deaf: bool = False):
        self._behave, self._deaf = behave, deaf
        self.requests: list[tuple[str, str, bytes]] = []
        self.connections = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, name="bad-http", daemon=True)]
        self._threads[0].start()

    def __enter__(self) -> BadServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            thread = threading.Thread(target=self._serve, args=(sock,), name="bad-http",
                                      daemon=True)
            with self._lock:
                self.connections += 1
                self._socks.add(sock)
                self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self._deaf:
                self._stop.wait()
                return
            pending = bytearray()
            while not self._stop.is_set():
                ex = self._read_request(sock, pending)
                if ex is None or not self._behaviour(ex.path)(ex):
                    return
        except OSError:
            pass  # the client went away (or close woke us): nothing more to say
        finally:
            with self._lock:
                self._socks.discard(sock)
            sock.close()

    def _behaviour(self, path: str) -> Behaviour:
        if isinstance(self._behave, dict):
            return self._behave.get(path, json_answer(404, {"detail": "Not Found"}))
        return self._behave

    def _read_request(self, sock: socket.socket, pending: bytearray) -> Exchange | None:
        while b"\r\n\r\n" not in pending:
            data = sock.recv(CHUNK)
            if not data:
                return None
            pending += data
        end = pending.index(b"\r\n\r\n")
        first, *lines = pending[:end].decode("latin-1").split("\r\n")
        del pending[:end + 4]
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines)}
        size = int(headers.get("content-length", 0))
        while len(pending) < size:
            data = sock.recv(CHUNK)
            if not data:
                return None
            pending += data
        body = bytes(pending[:size])
        del pending[:size]
        method, target, _ = first.split(" ", 2)
        self.requests.append((method, target.split("?")[0], body))
        return Exchange(sock, method, target.split("?")[0], headers, body, self._stop)

    def close(self) -> None:
        """Stop every behaviour, close every socket, join every thread."""
        self._stop.set()
        self._threads[0].join(10)  # accepts no more
        self._listener.close()
        with self._lock:
            for sock in self._socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads[1:]:
            thread.join(10)
