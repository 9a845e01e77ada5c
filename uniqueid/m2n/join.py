"""Joining a vLLM server started with the ``nccl_m2n`` backend, torch-free:
the steps of vLLM 0.33.0's own M2N trainer (``m2n_trainer.py``), each
within one deadline.

Every trainer rank ``[0, T)`` and every worker ``[T, T + N)`` share one
NCCL communicator; the plan (every parameter's trainer layout) travels
once, in the init payload. The order of the steps is vLLM's, and the
workers take them in lockstep with the trainer, so it is followed to the
letter:

1. rank 0 starts the metadata store (``store.py``, torch c10d's wire
   protocol) and posts ``/init_weight_transfer_engine``, concurrently; the
   workers join the store with torch's own client;
2. every rank agrees on the source plan, the data plane (the unique id's
   digest) and its local runtime (an M2N handle), through the metadata
   group (``metadata.py``, ``m2n_agreement.py``): a rank that failed locally
   says so there, so no rank waits for it;
3. every rank joins the NCCL communicator (no warm-up on this path);
4. the first worker broadcasts, over NCCL, the destination placement of
   every parameter, which only the workers can resolve (their model's
   tensor-parallel loaders);
5. every rank agrees on the complete plan; then rank 0 awaits the servers'
   answer.

Whatever fails on the trainer's side before the communicator exists
reaches the workers through the store, so they end their init with an
error instead of waiting: the server stays usable. A group given up
closes every connection of its store at once (a worker inside a store call
fails it) and keeps answering for ``WORKERS_LEAVE_S`` a worker still on its
way with an end that makes torch's client give up there, where a closed
port makes it retry for minutes (``StoreServer.close``). A server whose
engine does not answer (its workers still inside an earlier init or push)
is named before anything is posted (``ServerStuck``).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from nccl_cffi import (
    Communicator,
    Deadline,
    Job,
    cuda,
    load_library,
)
from nccl_cffi import m2n as m2nlib
from nccl_cffi.waiting import no_check

from ..codec import UNIQUE_ID_BYTES, UniqueId
from ..errors import RendezvousError, RendezvousTimeout, ServerStuck, StoreError
from ..http.client import VLLMClient
from ..http.fleet import Calls
from ..rendezvous import (
    await_inits,
    check_engines,
    close_connection,
    post_inits,
    seconds_left,
    world_sizes,
)
from .agreement import (
    M2NMesh,
    M2NWireParam,
    Placements,
    check_complete_plan_agreement,
    check_data_plane_agreement,
    check_runtime_ready_agreement,
    check_source_plan_agreement,
    decode_destination_placements,
    described,
)
from .metadata import MetadataGroup
from .plan import MAX_DEST_SHARDS, validate_transfer_plan
from .wire import M2NInitInfo

log = logging.getLogger("uniqueid")

# How long a vLLM M2N worker may still try to reach the metadata store after
# the init was posted: torch's TCPStore client, given vLLM's store_timeout
# (300 s), retries a store that refuses or closes it for up to two connect
# phases of that timeout and one backoff between (60 s at most, +50%
# jitter); 631 s measured against a port that refuses it.
WORKERS_LEAVE_S = 2 * 300.0 + 90.0


class M2NJoiner(Protocol):
    """What the trainer's side of an M2N join does on the data plane: NCCL
    and libnccl_m2n (``M2N_JOIN``), or a stand-in on machines without a GPU."""

    def preflight(self, device: int) -> None:
        """Check the trainer can join (GPU, NCCL >= 2.30.5, libnccl_m2n), before any server is told to."""
        ...

    def mint(self) -> UniqueId:
        """A fresh id for the group."""
        ...

    def runtime(self, max_cta: int | None) -> Any:
        """The rank-local M2N resources (a handle), made before NCCL init."""
        ...

    def join(self, world_size: int, unique_id: UniqueId, rank: int, device: int, *,
             timeout: float | None, check: Callable[[], None]) -> Any:
        """Join the communicator as ``rank`` (vLLM's M2N path has no warm-up)."""
        ...

    def placements(self, comm: Any, nbytes: int, root: int, timeout: float | None) -> bytes:
        """Receive ``nbytes`` int8 from ``root`` over the communicator."""
        ...

    def plane(self, comm: Any, handle: Any) -> Any:
        """The data plane a push reshards through (``M2NPlane``)."""
        ...


class M2NPlane:
    """A group's data plane: the trainer's communicator and its M2N handle.

    What a session asks of a communicator (``in_call_since``, ``abort``,
    ``destroy``, ``state``) applies to both: the handle is released before
    the communicator, and only once no reshard of it runs on the GPU (the
    library does not wait for its work, and freeing under it is not safe).

    Args:
        comm: the ``Communicator``.
        handle: the ``nccl_cffi.m2n.Handle``.
    """

    def __init__(self, comm: Communicator, handle: m2nlib.Handle):
        self.comm = comm
        self.handle = handle
        self.idle: Callable[[], bool] = lambda: True  # set by the resharder: no work in flight

    @property
    def device(self) -> int:
        return self.comm.device

    @property
    def in_call_since(self) -> float:
        return self.comm.in_call_since

    @property
    def state(self) -> str:
        return self.comm.state

    def reshard(self, src: m2nlib.DistTensor, dst: m2nlib.DistTensor, stream: int) -> None:
        """One reshard on this group, enqueued on ``stream`` (``Handle.reshard``)."""
        self.handle.reshard(self.comm, src, dst, stream)

    def _release_handle(self) -> None:
        if not self.handle.open:
            return
        if self.idle():
            self.handle.finalize()
        else:
            log.warning("the NCCL M2N handle is left allocated: a reshard of the aborted "
                        "communicator may still run on the GPU")

    def abort(self, reason: str = "aborted") -> None:
        """Abort the communicator, then release the handle where it is safe."""
        self.comm.abort(reason)
        self._release_handle()

    def destroy(self, timeout: float | None = None) -> None:
        """Release the handle, then free the communicator (every wait returned)."""
        self._release_handle()
        self.comm.destroy()


def _placements_nccl(comm: Communicator, nbytes: int, root: int, timeout: float | None) -> bytes:
    mem = cuda.DeviceMemory(nbytes, comm.device)
    stream = cuda.Stream(comm.device)
    try:
        comm.broadcast(mem.ptr, count=nbytes, dtype="int8", root=root, stream=stream,
                       timeout=timeout)
        comm.wait(stream, timeout, what="the destination plan's broadcast")
        return mem.read()
    finally:
        stream.close()
        if comm.state == "open":
            mem.free()


class _NcclM2nJoin:
    """NCCL's communicator and libnccl_m2n's handle."""

    @staticmethod
    def preflight(device: int) -> None:
        load_library()
        m2nlib.load_m2n()
        cuda.check_device(device)

    mint = staticmethod(UniqueId.mint)

    @staticmethod
    def runtime(max_cta: int | None) -> m2nlib.Handle:
        return m2nlib.Handle(max_cta)

    @staticmethod
    def join(world_size: int, unique_id: UniqueId, rank: int, device: int, *,
             timeout: float | None, check: Callable[[], None]) -> Communicator:
        return Communicator.init_rank(world_size, unique_id.raw, rank, device, blocking=True,
                                      timeout=timeout, check=check)

    placements = staticmethod(_placements_nccl)
    plane = staticmethod(M2NPlane)


M2N_JOIN: M2NJoiner = _NcclM2nJoin()


@dataclass(kw_only=True)
class M2NConnection:
    """One trainer rank's end of an M2N group.

    Attributes:
        comm: the data plane (``M2NPlane``, or a stand-in's).
        clients: the server (rank 0), or none.
        init_info: what the workers were told at init.
        destinations: per parameter, the workers' placements (None:
            every worker receives the whole tensor).
        group: the metadata group (closing it closes its store: rank 0's
            server, or this rank's client).
        rank: this trainer rank.
        owns_clients: ``close()`` closes the HTTP clients too.
    """

    comm: Any
    clients: list[VLLMClient]
    init_info: M2NInitInfo
    destinations: list[Placements | None]
    group: MetadataGroup = field(repr=False)
    rank: int = 0
    owns_clients: bool = False

    @property
    def device(self) -> int:
        return self.comm.device

    def close(self, *, deadline: Deadline | None = None, shutdown_servers: bool = True,
              free_comm: bool = True, strict: bool = False) -> None:
        """Release the server, the data plane, the store and the clients.

        Args:
            deadline: bounds the server's release (default: 60 s).
            shutdown_servers: release the server's engine.
            free_comm: free the data plane (False: a thread is inside it).
            strict: raise when the server cannot be released.

        Raises:
            ServerStuck, RendezvousError: with ``strict``, as ``Connection.close``.
        """
        close_connection(self.clients, self.comm, owns_clients=self.owns_clients,
                         deadline=deadline, shutdown_servers=shutdown_servers,
                         free_comm=free_comm, strict=strict, then=self.group.close)


def advertised_host(url: str) -> str:
    """The address of this machine that ``url``'s host reaches it by (the
    source address of a route there; no packet is sent)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


@dataclass(kw_only=True)
class _Join:
    """One trainer rank's part of steps 2 to 5 (see the module docstring)."""

    group: Any
    info: M2NInitInfo
    rank: int
    device: int
    joiner: M2NJoiner
    deadline: Deadline
    check: Callable[[], None]

    def run(self) -> tuple[Any, list[Placements | None]]:
        """The data plane and the destination plan, once every rank agreed."""
        info, deadline = self.info, self.deadline
        digest = check_source_plan_agreement(self.group, info.params, deadline,
                                             expected_digest=info.source_digest)
        check_data_plane_agreement(self.group, info.unique_id.raw, deadline)
        handle = self._runtime()
        try:
            comm = self.joiner.join(info.world_size, info.unique_id, self.rank, self.device,
                                    timeout=deadline.left(), check=self.check)
        except BaseException:
            handle.finalize()
            raise
        plane = self.joiner.plane(comm, handle)
        try:
            return plane, self._destinations(plane, digest)
        except BaseException:
            plane.abort("the M2N group did not form")
            raise

    def _runtime(self) -> Any:
        """The local M2N handle, its failure said to every rank (which all stop)."""
        handle, failed = None, None
        try:
            handle = self.joiner.runtime(self.info.max_cta)
        except Exception as e:
            failed = described(e)
        try:
            check_runtime_ready_agreement(self.group, failed, self.deadline)
        except BaseException:
            if handle is not None:
                handle.finalize()
            raise
        return handle

    def _destinations(self, plane: Any, digest: str) -> list[Placements | None]:
        """The first worker's placements (over NCCL), checked by every rank together."""
        info, n = self.info, len(self.info.params)
        raw = self.joiner.placements(plane.comm, 2 * n, info.rank_offset, self.deadline.left())
        mesh = M2NMesh(dims=info.dst_mesh_dims, start_rank=info.rank_offset)
        placements: list[Placements | None] = []
        failed = None
        try:
            placements = decode_destination_placements(raw, n)
            validate_transfer_plan(info.params, mesh, placements)
        except (ValueError, TypeError) as e:  # every rank hears it, and all stop
            failed = described(e)
        check_complete_plan_agreement(self.group, digest, mesh, placements, self.deadline,
                                      local_error=failed)
        return placements


def _server_mesh(server: VLLMClient, deadline: Deadline) -> tuple[int, int]:
    """The server's workers as (replicas, tensor-parallel ranks): its world
    size with and without data parallelism."""
    total = world_sizes([server], None, deadline)[0]
    per_replica = server.get_world_size(False, timeout=seconds_left(deadline))
    if not 1 <= per_replica <= total or total % per_replica:
        raise RendezvousError(
            f"{server.base_url} reports {total} workers in all but {per_replica} per replica, "
            "so its mesh cannot be described: check its GET /get_world_size")
    if per_replica > MAX_DEST_SHARDS:
        raise RendezvousError(
            f"{server.base_url} runs {per_replica} workers per replica, but NCCL M2N fans one "
            f"source shard out to at most {MAX_DEST_SHARDS}: use the broadcast sender for it")
    return total // per_replica, per_replica


def _shared(info: M2NInitInfo) -> bytes:
    """What process 0 tells the other trainer processes: the id, the store, the world."""
    meta = json.dumps({"host": info.master_address, "port": info.master_port,
                       "world": info.world_size, "dst": list(info.dst_mesh_dims),
                       "trainers": info.rank_offset, "max_cta": info.max_cta})
    return info.unique_id.raw + meta.encode()


def _from_shared(blob: bytes, params: Sequence[M2NWireParam]) -> M2NInitInfo:
    if len(blob) <= UNIQUE_ID_BYTES:
        raise RendezvousError("trainer process 0 could not reach the vLLM server; see its error")
    meta = json.loads(blob[UNIQUE_ID_BYTES:])
    return M2NInitInfo(master_address=meta["host"], master_port=meta["port"],
                       unique_id=UniqueId(blob[:UNIQUE_ID_BYTES]), rank_offset=meta["trainers"],
                       world_size=meta["world"], dst_mesh_dims=tuple(meta["dst"]),
                       params=list(params), max_cta=meta["max_cta"])


def _run_join(join: _Join, deadline: Deadline) -> tuple[Any, list[Placements | None]]:
    """``join.run()`` on a kept thread, given up when ``join.check`` raises
    (the server refused): the group is given up (``_give_up``), which ends
    the workers' and this rank's waits on the store at once."""
    job = Job(lambda stopped: join.run(), name="m2n-join")
    try:
        if not job.wait(None if deadline.at is None else deadline.at + 1.0, join.check):
            raise RendezvousTimeout("the deadline passed")
        return job.future.result()
    except RendezvousError as e:
        said = f"the M2N group did not form: {e}{_give_up(join, job, str(e))}"
        raise (RendezvousTimeout if isinstance(e, RendezvousTimeout) else RendezvousError)(said) from e
    except BaseException:
        _give_up(join, job, "")
        raise


def _give_up(join: _Join, job: Job, error: str) -> str:
    """Give the group up: its store turns away the ranks still on their way
    (``WORKERS_LEAVE_S``), the join's thread is stopped, a data plane it
    made meanwhile aborted. Returns what the host's store says of it and
    ``error`` does not: the ranks that never reached it, what it refused."""
    group, missing = join.group, 0
    if join.rank == 0:  # the host: it knows who joined
        try:
            missing = group.world_size - group.store.joined(Deadline(1.0))
        except StoreError:
            pass
    troubles = group.store.troubles()
    group.close(WORKERS_LEAVE_S)
    job.stop(5.0)
    job.then(_abort_plane)
    said = f"; {troubles}" if troubles and troubles not in error else ""
    if missing <= 0:
        return said
    where = f"{join.info.master_address}:{join.info.master_port}"
    return (f"; {missing} of the group's {group.world_size} ranks never reached the metadata "
            f"store at {where} (check that the server's workers reach that address: store_host=, "
            f"a firewall); a vLLM worker among them may keep trying for up to "
            f"{WORKERS_LEAVE_S:.0f} s, and until then a connect to that server is told it is "
            f"stuck{said}")


def _abort_plane(done: Future) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result()[0].abort("the M2N join was given up")


def connect_m2n(server: VLLMClient, params: Sequence[M2NWireParam], *, device: int,
                timeout: float, trainer_ranks: int = 1,
                share: Callable[[bytes | None, float | None], bytes] | None = None,
                store_host: str | None = None, store_port: int = 0, max_cta: int | None = None,
                joiner: M2NJoiner = M2N_JOIN, owns_client: bool = False) -> M2NConnection:
    """Form an M2N group with one vLLM server as trainer rank 0 (see the module docstring).

    Args:
        server: the server (one deployment: its data-parallel replicas included).
        params: the plan, in the order every push reshards it.
        device: the trainer's CUDA ordinal.
        timeout: bounds the whole call.
        trainer_ranks: every trainer rank (process) of the group.
        share: with several trainer ranks, how process 0's id, store and
            world reach the others (``share(data, seconds)``).
        store_host: the address the workers reach the metadata store at
            (default: this machine's address on the route to the server).
        store_port: its port (default 0: one the system picks); a fixed
            one for a firewall rule.
        max_cta: the most CTAs a reshard kernel uses.
        joiner: the data plane's side of the join (default: NCCL's).
        owns_client: the connection closes the client with itself.

    Returns:
        The connection.

    Raises:
        CudaError, NcclLibraryNotFound: the trainer cannot join (nothing posted).
        RendezvousError: the server refused, or a rank's plan or runtime was
            refused by every rank.
        RendezvousTimeout: the group did not form within ``timeout``.
        NcclError: NCCL refused the trainer's init.
    """
    deadline = Deadline(timeout)
    info, group = _plan_group(server, params, device=device, deadline=deadline,
                              trainer_ranks=trainer_ranks, share=share,
                              store=(store_host, store_port), max_cta=max_cta, joiner=joiner)
    init = post_inits([server], [info], deadline)
    join = _Join(group=group, info=info, rank=0, device=device, joiner=joiner,
                 deadline=deadline, check=init.raise_first)
    plane, destinations = _run_join(join, deadline)
    _answered(init, deadline, lambda: (plane.abort("server init failed"), group.close()))
    return M2NConnection(comm=plane, clients=[server], init_info=info,
                         destinations=destinations, group=group, owns_clients=owns_client)


def _answered(init: Calls[None], deadline: Deadline, undo: Callable[[], Any]) -> None:
    """The server's answer to its init (``await_inits``); else ``undo()``."""
    try:
        await_inits(init, deadline)
    except BaseException:
        undo()
        raise


def _plan_group(server: VLLMClient, params: Sequence[M2NWireParam], *, device: int,
                deadline: Deadline, trainer_ranks: int,
                share: Callable[[bytes | None, float | None], bytes] | None,
                store: tuple[str | None, int], max_cta: int | None,
                joiner: M2NJoiner) -> tuple[M2NInitInfo, MetadataGroup]:
    """Step 1 before any init is posted: the trainer's checks, the server's
    mesh, the id and the store; shared with the other trainer processes
    (told of a failure too, so they raise rather than wait)."""
    try:
        joiner.preflight(device)
        replicas, per_replica = _server_mesh(server, deadline)
        _check_engine(server, deadline)
        uid = joiner.mint()
        host = store[0] or advertised_host(server.base_url)
        group = MetadataGroup.host(host, trainer_ranks + replicas * per_replica, port=store[1])
    except BaseException:
        if share is not None:
            share(b"", deadline.left())
        raise
    info = M2NInitInfo(master_address=host, master_port=group.store.port, unique_id=uid,
                       rank_offset=trainer_ranks,
                       world_size=trainer_ranks + replicas * per_replica,
                       dst_mesh_dims=(replicas, per_replica), params=list(params),
                       max_cta=max_cta)
    if share is not None:
        try:
            share(_shared(info), deadline.left())
        except BaseException:
            group.close()
            raise
    return info, group


def _check_engine(server: VLLMClient, deadline: Deadline) -> None:
    """The server's engine answers (``check_engines``): one whose workers
    are still inside an earlier init or push would take the init and never
    join, so it is named before anything is posted."""
    try:
        check_engines([server], deadline)
    except ServerStuck as e:
        raise ServerStuck(
            f"{e} (or, for an nccl_m2n worker still trying to reach an earlier trainer's metadata "
            f"store, connect again once torch's client gave up, within {WORKERS_LEAVE_S:.0f} s of "
            "that trainer's init)") from None


def join_m2n(params: Sequence[M2NWireParam], *, rank: int, device: int, timeout: float,
             share: Callable[[bytes | None, float | None], bytes],
             joiner: M2NJoiner = M2N_JOIN) -> M2NConnection:
    """Join the M2N group process 0 forms (``connect_m2n``) as trainer rank
    ``rank`` > 0. Every trainer process calls its side together.

    Args:
        params: the plan, as process 0's (its digest is checked by every rank).
        rank: this trainer rank.
        device: its CUDA ordinal.
        timeout: bounds the whole call.
        share: the same ``share`` as process 0's.
        joiner: the data plane's side of the join.

    Returns:
        The connection (no server: process 0 drives the control plane).

    Raises:
        RendezvousError: process 0 failed, or the group refused this rank.
        RendezvousTimeout: the group did not form within ``timeout``.
        NcclError: NCCL refused this rank's init.
    """
    deadline = Deadline(timeout)
    joiner.preflight(device)
    info = _from_shared(share(None, deadline.left()), params)
    group = MetadataGroup.join(info.master_address, info.master_port, rank, info.world_size,
                               deadline=deadline)
    join = _Join(group=group, info=info, rank=rank, device=device, joiner=joiner,
                 deadline=deadline, check=no_check)
    plane, destinations = _run_join(join, deadline)
    return M2NConnection(comm=plane, clients=[], init_info=info, destinations=destinations,
                         group=group, rank=rank)

