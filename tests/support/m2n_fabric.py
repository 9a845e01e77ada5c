"""NCCL M2N's data plane over memory, for the CPU tests of ``M2NSender``.

vLLM 0.33.0's real ``M2NWeightTransferEngine`` runs in worker processes
(``jax_sender.testing.vllm_m2n --cpu``); only what needs a GPU is replaced:
NCCL's communicator and ``libnccl_m2n``'s reshard. The ``Fabric`` stands for
the communicators (one per unique id): the trainer's ranks reach it in
process, the workers over loopback TCP (``m2n_fabric_worker.py`` patches
vLLM's M2N entry points to do so). A reshard is what M2N's contract says:
every source rank posts its block with its own description of the layout,
every destination rank assembles the whole tensor from them and keeps its
block (checking the source's description against its own plan first, so a
trainer whose descriptors disagree with vLLM's is a failed push, not a
silent misload), and, as with NCCL, a rank's reshard ends only once every
destination took it.

Wire (``m2n_fabric_worker.send_frame``): a 4-byte length, a JSON header,
then ``header["nbytes"]`` raw bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np

from nccl_cffi import NcclTimeoutError
from uniqueid import UniqueId

from support.children.m2n_fabric_worker import recv_frame, send_frame, uid_key

WAIT_S = 20.0


class FabricError(RuntimeError):
    """A communicator of the fabric failed (aborted, or a wait ran out)."""


class _Group:
    """One communicator: its ranks, its broadcasts and its reshards' blocks."""

    def __init__(self, world: int):
        self.world = world
        self.joined: set[int] = set()
        self.bcasts: dict[int, bytes] = {}
        self.blocks: dict[tuple[int, int], tuple[bytes, dict]] = {}
        self.taken: dict[int, set[int]] = {}
        self.aborted = ""


class Fabric:
    """The communicators, served to the workers on a loopback port."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._cv = threading.Condition()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.reshards: list[dict] = []  # every block posted: (uid, seq, rank, description)
        threading.Thread(target=self._accept, daemon=True).start()

    # -- the communicators --------------------------------------------------
    def _wait(self, uid: str, ready: Any, what: str, timeout: float = WAIT_S) -> Any:
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                group = self._groups.get(uid)
                if group is not None and group.aborted:
                    raise FabricError(f"the communicator was aborted ({group.aborted})")
                if group is not None and (got := ready(group)) is not None:
                    return got
                left = end - time.monotonic()
                if left <= 0:
                    raise FabricError(f"{what} did not happen within {timeout}s")
                self._cv.wait(min(left, 0.05))

    def join(self, uid: str, rank: int, world: int, timeout: float = WAIT_S) -> None:
        with self._cv:
            group = self._groups.setdefault(uid, _Group(world))
            if group.world != world:
                raise FabricError(f"rank {rank} joined with world {world}, not {group.world}")
            group.joined.add(rank)
            self._cv.notify_all()
        self._wait(uid, lambda g: True if len(g.joined) == g.world else None,
                   f"every rank joining (rank {rank})", timeout)

    def bcast_put(self, uid: str, seq: int, data: bytes) -> None:
        with self._cv:
            self._groups[uid].bcasts[seq] = data
            self._cv.notify_all()

    def bcast_get(self, uid: str, seq: int, timeout: float = WAIT_S) -> bytes:
        return self._wait(uid, lambda g: g.bcasts.get(seq), f"broadcast {seq}", timeout)

    def put(self, uid: str, seq: int, rank: int, data: bytes, desc: dict) -> None:
        with self._cv:
            self._groups[uid].blocks[(seq, rank)] = (data, desc)
            self.reshards.append({"seq": seq, "rank": rank, **desc})
            self._cv.notify_all()

    def get(self, uid: str, seq: int, rank: int, timeout: float = WAIT_S) -> tuple[bytes, dict]:
        return self._wait(uid, lambda g: g.blocks.get((seq, rank)),
                          f"source rank {rank}'s block of reshard {seq}", timeout)

    def took(self, uid: str, seq: int, rank: int) -> None:
        with self._cv:
            self._groups[uid].taken.setdefault(seq, set()).add(rank)
            self._cv.notify_all()

    def all_took(self, uid: str, seq: int, ranks: set[int]) -> bool:
        with self._cv:
            group = self._groups.get(uid)
            if group is not None and group.aborted:
                raise FabricError(f"the communicator was aborted ({group.aborted})")
            return group is not None and ranks <= group.taken.get(seq, set())

    def abort(self, uid: str, reason: str) -> None:
        with self._cv:
            if uid in self._groups:
                self._groups[uid].aborted = reason
            self._cv.notify_all()

    # -- the workers' side, over TCP ------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    head, data = recv_frame(conn)
                except (OSError, ConnectionError):
                    return
                try:
                    reply, out = self._handle(head, data), b""
                    if isinstance(reply, tuple):
                        out, reply = reply[0], reply[1]
                    send_frame(conn, {"ok": True, **(reply or {})}, out)
                except FabricError as e:
                    send_frame(conn, {"ok": False, "error": str(e)}, b"")

    def _handle(self, head: dict, data: bytes) -> Any:
        op, uid = head["op"], head["uid"]
        if op == "join":
            return self.join(uid, head["rank"], head["world"])
        if op == "bcast_put":
            return self.bcast_put(uid, head["seq"], data)
        if op == "bcast_get":
            return self.bcast_get(uid, head["seq"]), {}
        if op == "get":
            block, desc = self.get(uid, head["seq"], head["rank"])
            return block, {"desc": desc}
        if op == "took":
            return self.took(uid, head["seq"], head["rank"])
        if op == "abort":
            return self.abort(uid, head["reason"])
        raise FabricError(f"unknown op {op!r}")

    def close(self) -> None:
        self._sock.close()


# -- the trainer's side ----------------------------------------------------------
class FabricComm:
    """A trainer rank's communicator on the fabric (what a session asks of one)."""

    def __init__(self, fabric: Fabric, uid: str, rank: int, world: int):
        self.fabric, self.uid, self.rank, self.world = fabric, uid, rank, world
        self.device = 0
        self.in_call_since = 0.0
        self.closed = ""
        self.reshard_seq = 0

    @property
    def state(self) -> str:
        return self.closed or "open"

    def abort(self, reason: str = "aborted") -> None:
        self.closed = self.closed or reason
        self.fabric.abort(self.uid, reason)

    def destroy(self, timeout: float | None = None) -> None:
        self.closed = self.closed or "destroyed"


class FabricHandle:
    """The M2N handle stand-in: finalized once."""

    def __init__(self) -> None:
        self.open = True
        self.finalized = 0

    def finalize(self) -> None:
        self.finalized += 1
        self.open = False


class FabricPlane:
    """``uniqueid.m2n.M2NPlane`` over the fabric."""

    def __init__(self, comm: FabricComm, handle: FabricHandle):
        self.comm, self.handle = comm, handle

    device = property(lambda self: 0)
    in_call_since = property(lambda self: self.comm.in_call_since)
    state = property(lambda self: self.comm.state)

    def abort(self, reason: str = "aborted") -> None:
        self.comm.abort(reason)
        self.handle.finalize()

    def destroy(self, timeout: float | None = None) -> None:
        self.handle.finalize()
        self.comm.destroy()


class FabricJoin:
    """The trainer's data-plane side of an M2N join over the fabric
    (``uniqueid.m2n.M2NJoiner``); ``joins`` records each join."""

    def __init__(self, fabric: Fabric):
        self.fabric = fabric
        self.joins: list[dict] = []
        self.handles: list[FabricHandle] = []

    def preflight(self, device: int) -> None:
        pass

    def mint(self) -> UniqueId:
        import os
        return UniqueId(os.urandom(128))

    def runtime(self, max_cta: int | None) -> FabricHandle:
        self.handles.append(FabricHandle())
        return self.handles[-1]

    def join(self, world_size: int, unique_id: UniqueId, rank: int, device: int, *,
             timeout: float | None, check: Any) -> FabricComm:
        self.joins.append({"world": world_size, "rank": rank})
        uid = uid_key(unique_id.raw)
        end = time.monotonic() + (WAIT_S if timeout is None else timeout)
        done = threading.Event()
        failed: list[BaseException] = []

        def go() -> None:
            try:
                self.fabric.join(uid, rank, world_size, max(end - time.monotonic(), 0.1))
            except BaseException as e:
                failed.append(e)
            done.set()

        threading.Thread(target=go, daemon=True).start()
        while not done.wait(0.02):
            check()
        if failed:
            raise NcclTimeoutError(f"the fabric's join failed: {failed[0]}")
        return FabricComm(self.fabric, uid, rank, world_size)

    def placements(self, comm: FabricComm, nbytes: int, root: int,
                   timeout: float | None) -> bytes:
        data = self.fabric.bcast_get(comm.uid, 0, WAIT_S if timeout is None else timeout)
        assert len(data) == nbytes, (len(data), nbytes)
        return data

    def plane(self, comm: FabricComm, handle: FabricHandle) -> FabricPlane:
        return FabricPlane(comm, handle)


class FabricResharder:
    """The trainer's reshards over the fabric (``resharder.Resharder``'s part
    in a push); ``passes`` says what each pass was."""

    def __init__(self, plane: FabricPlane):
        self.plane = plane
        self.started = self.host_s = self.link_s = 0.0
        self.link_bytes = 0
        self.launched = 0
        self.passes: list[str] = []
        self.closed = False

    def _post(self, part: Any, data: bytes, timeout: float | None, check: Any) -> None:
        comm = self.plane.comm
        self.started = self.started or time.perf_counter()
        seq, comm.reshard_seq = comm.reshard_seq, comm.reshard_seq + 1
        src, dst = part.src, part.dst
        desc = {"name": part.name, "local_shape": list(src.local_shape), "dtype": src.dtype,
                "mesh": list(src.mesh), "placements": list(src.placements),
                "dst_mesh": list(dst.mesh), "dst_placements": list(dst.placements),
                "dst_start": dst.start_rank, "dst_local_shape": list(dst.local_shape)}
        assert len(data) == part.nbytes, (part.name, len(data), part.nbytes)
        comm.fabric.put(comm.uid, seq, comm.rank, data, desc)
        self.launched += 1
        ranks = set(range(dst.start_rank, dst.start_rank + dst.mesh[0] * dst.mesh[1]))
        end = time.monotonic() + (WAIT_S if timeout is None else timeout)
        while not comm.fabric.all_took(comm.uid, seq, ranks):
            check()
            if time.monotonic() > end:
                raise NcclTimeoutError(f"reshard {seq} ({part.name}) was not taken within "
                                       f"{timeout}s")
            time.sleep(0.005)
        check()

    def reshards(self, parts: Any, get: Any, *, timeout: float | None, check: Any) -> None:
        self.passes.append("reshards")
        self.launched = 0
        for k, part in enumerate(parts):
            self._post(part, np.asarray(get(k)).tobytes(), timeout, check)

    def scratch(self, parts: Any, root: int, *, timeout: float | None, check: Any,
                fill: Any = None) -> None:
        self.passes.append("scratch")
        for part in parts:
            self._post(part, bytes(part.nbytes), timeout, check)

    def complete(self, parts: Any, root: int, *, timeout: float | None, check: Any,
                 fill: Any = None) -> None:
        done = self.launched
        self.scratch(parts[done:], root, timeout=timeout, check=check)
        self.passes[-1] = "complete"

    def close(self) -> None:
        self.closed = True


def m2n_sender_on(url: str, fabric: Fabric, params: Any, *, config: Any = None,
                  mapping: Any = None, process: int = 0, processes: int = 1,
                  share: Any = None, store_port: int = 0, joiner: Any = None) -> Any:
    """An ``M2NSender`` on JAX's first CPU device, joined to the server at
    ``url`` through the real metadata store and agreements, its data plane
    the fabric (``joiner``, by default a ``FabricJoin``; ``FabricResharder``:
    ``sender.resharders`` lists those made, one per group); the store on
    ``store_port`` (0: any)."""
    import jax

    from jax_sender import Mapping, SendConfig
    from jax_sender._src.core.session import Session
    from jax_sender._src.core.tensors.describe import describe
    from jax_sender._src.m2n.route import M2NRoute
    from jax_sender._src.m2n.sender import M2NSender, plan_tensors, wire_params
    from uniqueid import VLLMClient

    config, mapping = config or SendConfig(init_timeout_s=60), mapping or Mapping()
    tensors = plan_tensors(*describe(params, mapping), mapping, processes, process)
    clients = [VLLMClient(url, timeout=30)] if process == 0 else []
    route = M2NRoute(clients=clients, device=0, config=config, params=wire_params(tensors),
                     process=process, processes=processes, share=share,
                     store_host="127.0.0.1", store_port=store_port,
                     joiner=joiner or FabricJoin(fabric))
    made: list[FabricResharder] = []

    def resharder(conn: Any) -> FabricResharder:
        made.append(FabricResharder(conn.comm))
        return made[-1]

    session = Session(route, route.form(config.init_timeout_s), config, broadcaster=resharder)
    sender = M2NSender(session, tensors, mapping=mapping, device=jax.devices("cpu")[0])
    sender.resharders = made  # for the tests: what each push's reshards were
    return sender
