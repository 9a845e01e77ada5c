"""Joining vLLM's workers through the unique-id path, warm-up included.

vLLM's workers enter ``ncclCommInitRank`` when ``/init_weight_transfer_engine``
reaches them and then issue a one-element float32 sum ``all_reduce`` (the
warm-up) before anything else. There is no barrier and vLLM sets no
timeout, so the trainer must post the HTTP call *concurrently* with its own
init, match the warm-up, and bound every wait itself. While it waits it also
watches the HTTP call: a server that refuses init (HTTP 4xx/5xx) ends the
trainer's init at once instead of leaving it waiting for peers that will
never come.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from nccl_cffi import DEFAULT_INIT_TIMEOUT, Communicator, NcclTimeoutError, cuda

from .client import VLLMClient, VLLMConnectionError, VLLMHTTPError, in_background
from .codec import UniqueId
from .errors import RendezvousError, RendezvousTimeout
from .wire import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, InitInfo

# Beyond the NCCL deadline, how long the server's init answer may lag behind.
_HTTP_GRACE = 30.0


def warm_up(comm: Communicator, timeout: float | None,
            check: Callable[[], None] | None = None) -> None:
    """The handshake every vLLM worker expects: all_reduce(count=1, float32, sum)."""
    mem = cuda.DeviceMemory(8, comm.device)
    stream = cuda.Stream(comm.device)
    try:
        comm.all_reduce(mem.ptr, mem.ptr + 4, count=1, dtype="float32", op="sum",
                        stream=stream, timeout=timeout)
        comm.wait(stream, timeout, what="warm-up all_reduce", check=check)
    finally:
        stream.close()
        if comm._handle is not None:  # after an abort the kernel may not be freeable
            mem.free()


def handshake(world_size: int, unique_id: UniqueId, rank: int, device: int, *,
              timeout: float | None = DEFAULT_INIT_TIMEOUT,
              check: Callable[[], None] | None = None, blocking: bool = True) -> Communicator:
    """Init and warm up, with a deadline for both, without any HTTP.

    For control planes of the caller's own: ship ``unique_id.to_b64()`` to
    the workers by any means, then call this on the trainer; every worker
    must do the same init and warm-up. The communicator is blocking, as
    vLLM's are (its collectives launch four times faster); its init runs on
    a daemon thread that is abandoned if the deadline passes (see
    ``nccl_cffi.Communicator.init_rank``).
    """
    return Communicator.init_rank(world_size, unique_id.raw, rank, device, blocking=blocking,
                                  timeout=timeout, check=check, then=warm_up)


@dataclass
class Connection:
    """The trainer's end of one transfer group: the communicator, and the
    servers (each with its own ``init_info``) whose workers joined it.
    ``owns_clients``: ``close()`` closes the HTTP clients too (it made them)."""

    comm: Communicator
    clients: list[VLLMClient]
    init_infos: list[InitInfo]
    device: int
    unique_id: UniqueId = field(repr=False)
    owns_clients: bool = False

    @property
    def client(self) -> VLLMClient:
        return self.clients[0]

    @property
    def init_info(self) -> InitInfo:
        return self.init_infos[0]

    def close(self, *, shutdown_servers: bool = True, free_comm: bool = True) -> None:
        """Shut the servers' engines down (best effort), free the communicator
        (unless ``free_comm`` is false: a thread is still inside one of its
        calls), and close the HTTP clients this connection made."""
        if shutdown_servers:
            for c in self.clients:
                try:
                    c.shutdown_weight_transfer_engine()
                except (VLLMHTTPError, VLLMConnectionError):
                    pass
        if free_comm:
            self.comm.destroy()
        if self.owns_clients:
            for c in self.clients:
                c.close()


def _made_here(servers: str | VLLMClient | Sequence[str | VLLMClient]) -> bool:
    """Whether ``as_clients`` makes the clients (URLs given), so they are ours to close."""
    items = [servers] if isinstance(servers, (str, VLLMClient)) else list(servers)
    return all(isinstance(s, str) for s in items)


def as_clients(servers: str | VLLMClient | Sequence[str | VLLMClient]) -> list[VLLMClient]:
    """One URL, one client, or a list of either, as clients."""
    if isinstance(servers, (str, VLLMClient)):
        servers = [servers]
    return [s if isinstance(s, VLLMClient) else VLLMClient(s) for s in servers]


def connect(servers: str | VLLMClient | Sequence[str | VLLMClient], *, device: int = 0,
            workers: Sequence[int] | int | None = None, packed: bool = True,
            packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
            timeout: float = DEFAULT_INIT_TIMEOUT, use_load_plan: bool = False,
            metadata: list[list] | None = None, trainer_ranks: int = 1,
            unique_id: UniqueId | None = None) -> Connection:
    """Form the transfer group with one or more vLLM servers; the trainer is rank 0.

    ``workers``: each server's worker count (its ``/get_world_size``), asked
    when not given. Server *i* gets ``rank_offset`` ``trainer_ranks`` + the
    workers of the servers before it, so one broadcast can feed them all.
    ``trainer_ranks`` > 1: other trainer processes join as ranks 1.. with
    ``handshake`` and the same ``unique_id``. Otherwise a fresh id is minted
    for every call, so calling again after a failure starts clean.
    """
    owned = _made_here(servers)
    clients = as_clients(servers)
    if isinstance(workers, int):
        workers = [workers]
    if workers is None:
        workers = [c.get_world_size() for c in clients]
    if len(workers) != len(clients):
        raise ValueError(f"{len(clients)} servers but {len(workers)} worker counts")
    world_size = trainer_ranks + sum(workers)
    uid = unique_id or UniqueId.mint()
    infos, offset = [], trainer_ranks
    for n in workers:
        if n < 1:
            raise RendezvousError(
                f"a server reports {n} workers, so none would join: start vLLM with its "
                "model loaded (check GET /get_world_size)")
        infos.append(InitInfo(
            nccl_unique_id_b64=uid.to_b64(), rank_offset=offset, world_size=world_size,
            packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes,
            packed_num_buffers=packed_num_buffers, use_load_plan=use_load_plan,
            metadata=metadata))
        offset += n

    futures = [in_background(c.init_weight_transfer_engine, i.to_payload(), timeout + _HTTP_GRACE)
               for c, i in zip(clients, infos)]

    def server_refused() -> None:
        for f in futures:
            if f.done() and f.exception() is not None:
                f.result()

    try:
        comm = handshake(world_size, uid, 0, device, timeout=timeout, check=server_refused)
    except (VLLMHTTPError, VLLMConnectionError) as e:
        raise RendezvousError(
            f"the server refused init while the trainer waited in ncclCommInitRank: {e}. "
            "The trainer's init was aborted; fix the cause and connect again") from e
    except NcclTimeoutError as e:
        answered = [c.base_url for c, f in zip(clients, futures)
                    if f.done() and f.exception() is None]
        why = ("; the server answered 200 but its workers never joined: is it running "
               f"with VLLM_DISABLE_PYNCCL=1, is world_size {world_size} larger than "
               f"{trainer_ranks} + its workers, or did a trainer rank not join? "
               f"({', '.join(answered)})") if answered else ""
        raise RendezvousTimeout(f"{e}{why}") from e
    deadline = time.monotonic() + _HTTP_GRACE
    try:
        for f in futures:
            f.result(timeout=max(deadline - time.monotonic(), 0.0))
    except FutureTimeout as e:
        comm.abort("server did not answer init")
        raise RendezvousTimeout(
            f"the workers joined but /init_weight_transfer_engine did not answer within "
            f"{_HTTP_GRACE}s") from e
    except (VLLMHTTPError, VLLMConnectionError) as e:
        comm.abort("server init failed")
        raise RendezvousError(f"the server failed init after the group formed: {e}") from e
    return Connection(comm, clients, infos, device, uid, owns_clients=owned)
