"""A whole push on CPU: the sender's real code over an in-memory wire.

``MemoryServer`` is a real HTTP server on loopback that serves vLLM's update
routes with vLLM's session rules, and whose ``/update_weights`` receives
like a vLLM worker: it cuts the call's metadata into chunks with vLLM's rule
(or one broadcast per tensor), takes exactly that many broadcasts off the
wire, and stores each tensor's bytes. ``MemoryBroadcaster`` stands where
NCCL stands on a GPU: it lays the sender's tensors out as the broadcasts
would carry them and puts them on the wire. Only the transport is in memory;
the route order, the chunking, the metadata reuse, and which tensor lands
where are the sender's own.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from hashlib import sha256
from typing import Any

import jax
import numpy as np
from recorder import JSONHandler, answer, serve

from jax_sender import SendConfig, SparseSender, WeightSender
from jax_sender.base import BaseSender
from jax_sender.plan import TensorMeta, plan_chunks
from jax_sender.routes import SingleProcess
from nccl_cffi.dtypes import numpy_dtype
from uniqueid import Connection, InitInfo, SparseUpdateInfo, UniqueId, UpdateInfo, VLLMClient


class MemoryComm:
    """What a sender asks of its communicator outside the broadcasts."""

    def __init__(self) -> None:
        self.in_call_since = 0.0
        self.aborted = ""
        self.destroyed = False

    def abort(self, reason: str = "aborted") -> None:
        self.aborted = self.aborted or reason

    def destroy(self) -> None:
        self.destroyed = True


class MemoryBroadcaster:
    """Puts each broadcast's bytes on ``wire``; like NCCL's, a broadcast ends
    only once every receiver took it (``check`` polled meanwhile, 10 s at most)."""

    def __init__(self, wire: _Tee, delay_s: float = 0.0):
        self.wire = wire
        self.delay_s = delay_s
        self.started = 0.0
        self.host_s = 0.0
        self.link_s = 0.0
        self.link_bytes = 0
        self.closed = False
        self.sent: list[tuple[int, int, float]] = []  # (root, nbytes, time issued)
        self.passes: list[str] = []  # per packed pass: "copies" or "xla" (packed by XLA)

    def _put(self, root: int, data: bytes, check) -> None:
        self.started = self.started or time.perf_counter()
        time.sleep(self.delay_s)
        self.sent.append((root, len(data), time.monotonic()))
        taken = self.wire.put((root, data))
        deadline = time.monotonic() + 10
        while not all(e.wait(0.01) for e in taken):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError("a receiver did not take the broadcast within 10 s")
        check()

    def packed(self, metas, chunks, get, root, *, timeout, check, temporaries=True) -> None:
        self.started = 0.0
        self.passes.append("copies")
        for c in chunks:
            data = b"".join(np.asarray(get(i)).tobytes() for i in range(c.start, c.stop))
            assert len(data) == c.nbytes
            self._put(root, data, check)

    def produced(self, chunks, make, root, *, timeout, check, reuse=False) -> None:
        self.started = 0.0
        self.passes.append("xla")
        for k, c in enumerate(chunks):
            data = np.asarray(make(k, None)).tobytes()
            assert len(data) == c.nbytes
            self._put(root, data, check)

    def unpacked(self, metas, get, root, *, timeout, check) -> None:
        self.started = 0.0
        for i, m in enumerate(metas):
            self._put(root, np.asarray(get(i)).tobytes()[:m.nbytes], check)

    def discard(self, metas, chunks, root, *, timeout, check) -> None:
        raise AssertionError("a single process never discards")

    def close(self) -> None:
        self.closed = True


class MemoryServer:
    """vLLM's update routes over the wire; ``fail`` maps a path to an HTTP
    status it answers with instead (vLLM's error shape). ``sparse``: the
    ``sparse_nccl`` backend (patches: int32 flat indices, then values)."""

    def __init__(self, wire: queue.Queue, info: InitInfo, sparse: bool = False):
        self.wire, self.info, self.sparse = wire, info, sparse
        self.fail: dict[str, int] = {}
        self.log: list[tuple[str, float, float]] = []  # (path, arrived, answered)
        self.store: dict[str, np.ndarray] = {}
        self.active = False
        self._last: UpdateInfo | None = None
        server = self

        class Handler(JSONHandler):
            def _do(self) -> None:
                raw = self.body()
                path = self.path.split("?")[0]
                arrived = time.monotonic()
                answer(self, *server.route(path, json.loads(raw) if raw else None))
                server.log.append((path, arrived, time.monotonic()))

            do_GET = do_POST = _do

        self.http, self.url = serve(Handler)

    def routes(self) -> list[str]:
        return [p for p, _, _ in self.log]

    def route(self, path: str, body) -> tuple[int, dict]:
        if path in self.fail:
            if path == "/update_weights" and self.active:  # like a load_weights that raises:
                self.update(body["update_info"])  # after the bytes,
                self.active = False  # and vLLM drops the session
            return self.fail[path], {"error": {"message": f"injected failure of {path}",
                                               "type": "InternalServerError", "code": 500}}
        if path == "/start_weight_update":
            if self.active:
                return 500, {"error": {"message": "an update is already active"}}
            self.active = True
        elif path == "/update_weights":
            if not self.active:
                return 500, {"error": {"message": "start_weight_update must be called first"}}
            try:
                self.update(body["update_info"])
            except Exception as e:
                self.active = False
                return 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        elif path == "/finish_weight_update":
            if not self.active:
                return 500, {"error": {"message": "no matching start_weight_update"}}
            self.active = False
        elif path == "/weight_checker" and body == {"action": "checksum"}:
            return 200, {"checksums": {f"dp0:pp0:pcp0:tp0:{name}": sha256(a.tobytes()).hexdigest()
                                       for name, a in self.store.items()}}
        return 200, {"message": "ok"}

    def update(self, payload: dict) -> None:
        if self.sparse:
            self.receive_sparse(SparseUpdateInfo.from_payload(payload))
        else:
            self.receive(UpdateInfo.from_payload(payload))

    def receive(self, update: UpdateInfo) -> None:
        if not update.names:
            update = self._last
        self._last = update
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in
                 zip(update.names, update.dtype_names, update.shapes)]
        if self.info.packed:
            for c in plan_chunks(metas, self.info.packed_buffer_size_bytes):
                data = self._take(c.nbytes, update.src)
                for m, off in zip(metas[c.start:c.stop], c.offsets):
                    self._load(m, data[off:off + m.nbytes])
        else:
            for m in metas:
                self._load(m, self._take(m.nbytes, update.src))

    def receive_sparse(self, update: SparseUpdateInfo) -> None:
        """Per tensor, in vLLM's order: its indices, then its values; each patch
        applied to what is held (zeros if nothing yet)."""
        for name, dt, shape, n in zip(update.names, update.dtype_names, update.shapes,
                                      update.num_updates_list):
            indices = np.frombuffer(self._take(4 * n, 0), np.int32)
            values = np.frombuffer(self._take(n * np.dtype(numpy_dtype(dt)).itemsize, 0),
                                   numpy_dtype(dt))
            held = self.store.get(name)
            out = (np.zeros(shape, numpy_dtype(dt)) if held is None else held).copy()
            out.reshape(-1)[indices] = values
            self.store[name] = out

    def _take(self, nbytes: int, src: int) -> bytes:
        root, data, taken = self.wire.get(timeout=10)
        taken.set()
        assert (root, len(data)) == (src, nbytes), (root, len(data), src, nbytes)
        return data

    def _load(self, m: TensorMeta, data: bytes) -> None:
        self.store[m.name] = np.frombuffer(data, numpy_dtype(m.dtype)).reshape(m.shape)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def memory_sender(config: SendConfig = SendConfig(), *, servers: int = 1,
                  delay_s: float = 0.0, kind: type[BaseSender] = WeightSender,
                  **kwargs) -> tuple[Any, list[MemoryServer], MemoryBroadcaster]:
    """A sender (``kind``) on JAX's first CPU device, joined to ``servers``
    memory servers that one broadcast feeds (like one NCCL group), as
    ``connect`` builds it; a ``SparseSender``'s servers run ``sparse_nccl``."""
    wires = [queue.Queue() for _ in range(servers)]
    uid = UniqueId.mint()
    infos = [InitInfo(nccl_unique_id_b64=uid.to_b64(), rank_offset=1 + i,
                      world_size=1 + servers, packed=config.packed,
                      packed_buffer_size_bytes=config.buffer_size_bytes,
                      packed_num_buffers=config.num_buffers) for i in range(servers)]
    hosts = [MemoryServer(w, i, sparse=kind is SparseSender) for w, i in zip(wires, infos)]
    clients = [VLLMClient(h.url, read_timeout=20) for h in hosts]
    route = MemoryRoute(clients, 0, config, infos=infos)
    conn = route.form(config.init_timeout_s)
    tee = _Tee(wires)
    caster = MemoryBroadcaster(tee, delay_s)
    sender = kind(conn, route, config=config, device=jax.devices("cpu")[0],
                  broadcaster=lambda _: caster, **kwargs)
    return sender, hosts, caster


class MemoryRoute(SingleProcess):
    """``SingleProcess`` whose (re)connect forms a fresh in-memory group with
    the same servers (and the same unique id: minting one opens NCCL's
    bootstrap listener, which only a real init closes)."""

    def __init__(self, *args, infos: list[InitInfo], **kwargs):
        super().__init__(*args, **kwargs)
        self.infos = infos
        self.formed: list[Connection] = []

    def form(self, timeout_s: float) -> Connection:
        conn = Connection(MemoryComm(), self.clients, self.infos, 0, self.infos[0].unique_id)
        self.formed.append(conn)
        return conn


class _Tee:
    """One broadcast reaches every server's wire."""

    def __init__(self, wires: list[queue.Queue]):
        self.wires = wires

    def put(self, item) -> list[threading.Event]:
        """Hand ``item`` to every wire; the events are set as each takes it."""
        taken = [threading.Event() for _ in self.wires]
        for w, e in zip(self.wires, taken):
            w.put((*item, e))
        return taken
