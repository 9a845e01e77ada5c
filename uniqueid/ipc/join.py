"""Joining a vLLM server started with the ``ipc`` backend (CUDA IPC, no
NCCL): the trainer and the workers share GPUs, and each update carries
handles to trainer memory the workers map.

``connect_ipc`` checks, before anything reaches the server, what it can
ask without changing it: that the server runs the ``ipc`` backend and
unpickles handles (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; ``/server_info``),
its worker count, and that its engine answers (``ServerStuck`` otherwise).
Then one empty update, the *probe*: init packed, start, an update of no
tensors whose handles (a small buffer on every trainer GPU, one
ref-counter slot per worker and GPU) each worker maps and releases, finish.
It proves, before any weights move, that every worker can map this
process's memory and count it in its ``/dev/shm`` file (the same IPC
namespace and user), and it tells which GPU each worker rank is on: the
slot it released. A worker on a GPU the trainer holds no device of is
named with both UUID lists; the server is left as it was (released, its
engine shut down). Last, the init with the connection's own ``packed``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nccl_cffi.waiting import Check, Deadline, poll_until

from ..errors import RendezvousError
from ..http.client import VLLMClient, VLLMHTTPError
from ..rendezvous import check_engines, close_connection, release, seconds_left, world_sizes
from .counters import CountersHeld, RefCounters
from .group import GroupLink, ProbeTarget, answer, failure, hello, ranks_of, strict_idle, targets
from .handles import RebuildArgs, pickled
from .wire import IPCInitInfo, IPCUpdateInfo

log = logging.getLogger("uniqueid")

PROBE_BYTES = 256  # the probe's buffer on each trainer GPU (a worker maps it, reads none)
RELEASE_S = 10.0  # how long a release may lag the server's answer, at close
CONNECT = "the connect's deadline"  # what passed, when a connect's call finds none left
_MISSING = re.compile(r"IPC handle not found for GPU UUID ([0-9a-fA-F-]+)")
_NO_PICKLES = "VLLM_ALLOW_INSECURE_SERIALIZATION"
UNSAFE = ("it then unpickles whatever any client of /update_weights sends, which runs code in "
          "the server: keep vLLM's port reachable from this host only (--host 127.0.0.1), "
          "never from a network")


class Memory(Protocol):
    """What the IPC path asks of the GPU (``nccl_cffi.ipc.CudaIPC``, or a
    stand-in on CPU)."""

    def uuid(self, device: int) -> str: ...

    def free_bytes(self, device: int) -> int: ...

    def export(self, device: int, nbytes: int) -> Any: ...

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None: ...

    def sync(self, device: int, timeout: float | None, check: Check = ...) -> None: ...

    def close(self) -> None: ...


class IPCPlane:
    """What an IPC connection shares with the workers: the ref-counter file
    and exported buffers that may still be mapped (``retire``), freed once
    their exports are released, after the servers' own release at close.

    Args:
        memory: the GPU's side (``Memory``).
        counters: this connection's ref-counter file.
    """

    in_call_since = None  # no collective: nothing can sit inside a call

    def __init__(self, memory: Memory, counters: RefCounters):
        self.memory = memory
        self.counters = counters
        self.aborted = ""
        self._limbo: list[tuple[Any, list[int]]] = []

    def abort(self, why: str) -> None:
        """A push failed mid-way: workers may still map what it exported
        (freed at close, once released)."""
        self.aborted = why

    def retire(self, buffer: Any, slots: Sequence[int]) -> None:
        """Free ``buffer`` once the exports ``slots`` are released (at ``destroy``).

        Args:
            buffer: an exported buffer (``free()``).
            slots: the ref-counter slots of its exports.
        """
        self._limbo.append((buffer, list(slots)))

    def destroy(self) -> None:
        """Free every retired buffer once its exports are released (within
        ``RELEASE_S``: after that it is freed all the same, with a warning,
        since no update reads it any more), then the counter file."""
        for buffer, slots in self._limbo:
            try:
                self.counters.wait(slots, RELEASE_S, "a staging buffer")
            except CountersHeld as e:
                log.warning("freeing it anyway: %s", e)
            buffer.free()
        self._limbo.clear()
        self.counters.close()
        self.memory.close()


@dataclass(kw_only=True)
class IPCConnection:
    """The trainer's end of an ``ipc`` server: which GPU each worker is on,
    and the plane its pushes export through.

    Attributes:
        comm: the plane (``IPCPlane``); freed after the server's release.
        clients: the server (one).
        init_info: what it was told at init.
        ranks: per global worker rank, the UUID of its GPU.
        uuids: per trainer device hosting a worker, its UUID.
        owns_clients: ``close()`` closes the HTTP client too (it made it).
    """

    comm: IPCPlane
    clients: list[VLLMClient]
    init_info: IPCInitInfo
    ranks: list[str]
    uuids: dict[int, str] = field(default_factory=dict)
    owns_clients: bool = False

    @property
    def client(self) -> VLLMClient:
        """The server's client."""
        return self.clients[0]

    def close(self, *, deadline: Deadline | None = None, shutdown_servers: bool = True,
              free_comm: bool = True, strict: bool = False) -> None:
        """Release the server (its update session finished, its engine shut
        down: the workers drop their mappings), then free the plane.

        Args:
            deadline: bounds the release (default: 60 s).
            shutdown_servers: release the server's engine.
            free_comm: free the plane.
            strict: raise when the server cannot be released; otherwise log it.

        Raises:
            ServerStuck, RendezvousError: with ``strict``, as ``release``.
        """
        close_connection(self.clients, self.comm, owns_clients=self.owns_clients,
                         deadline=deadline, shutdown_servers=shutdown_servers,
                         free_comm=free_comm, strict=strict)


def check_ipc_server(client: VLLMClient, deadline: Deadline) -> None:
    """Refuse a server that cannot take this push, asking only what leaves
    it unchanged (``/server_info``). A server that does not answer it
    (an older vLLM) is let through: the probe finds the same refusals.

    Args:
        client: the server.
        deadline: bounds the question.

    Raises:
        RendezvousError: not the ``ipc`` backend, or pickles refused.
    """
    try:
        info = client.server_info(timeout=min(30.0, seconds_left(deadline, CONNECT)))
    except VLLMHTTPError:
        return
    config = info["vllm_config"].get("weight_transfer_config") or {}
    backend = config.get("backend") if isinstance(config, dict) else None
    if backend != "ipc":
        raise RendezvousError(
            f"{client.base_url} runs the {backend or 'no'} weight-transfer backend, and a "
            "colocated push needs vLLM's ipc backend: start it with --weight-transfer-config "
            "'{\"backend\":\"ipc\"}'")
    if not info["vllm_env"].get(_NO_PICKLES):
        raise _pickles_refused(client)


def _pickles_refused(client: VLLMClient) -> RendezvousError:
    return RendezvousError(
        f"{client.base_url} refuses pickled IPC handles, which vLLM's ipc backend reads from "
        f"every update: start it with {_NO_PICKLES}=1 ({UNSAFE})")


def connect_ipc(client: VLLMClient | None, *, devices: Sequence[int], packed: bool,
                memory: Memory, timeout: float, owns_client: bool = False,
                strict_devices: bool = False, group: GroupLink | None = None) -> IPCConnection:
    """Join an ``ipc`` server whose workers share this process's GPUs
    (with ``group``, those of every process of the group: ``group.py``).

    Args:
        client: the server (None on a group's processes other than 0).
        devices: the trainer's CUDA ordinals it may export from.
        packed: the connection's packing (sent at init).
        memory: the GPU's side (``nccl_cffi.ipc.CudaIPC()``).
        timeout: seconds for the whole connect.
        owns_client: close the client when the connection closes.
        strict_devices: a device of ``devices`` no worker is on is refused
            (False: it is left out).
        group: this process's link to the others pushing with it.

    Returns:
        The connection.

    Raises:
        RendezvousError: the server cannot take this push (in one sentence,
            see the module docstring), or the group did not form; the
            server is left released.
        ServerStuck: its engine does not answer.
    """
    deadline = Deadline(timeout)
    uuids = {d: memory.uuid(d) for d in devices}
    if group is not None and group.process:
        return _member(group, uuids, packed=packed, memory=memory, deadline=deadline,
                       strict=strict_devices)
    try:
        return _lead(client, uuids, packed=packed, memory=memory, deadline=deadline,
                     owns_client=owns_client, strict=strict_devices, group=group)
    except BaseException as e:
        if group is not None:
            group.fail(failure(e))  # the others stop waiting, and read why
        raise


def _lead(client: VLLMClient, uuids: dict[int, str], *, packed: bool, memory: Memory,
          deadline: Deadline, owns_client: bool, strict: bool,
          group: GroupLink | None = None) -> IPCConnection:
    """``connect_ipc`` on the process that talks to the server: its checks,
    a group's other processes' GPUs, the probe over all of them, the init,
    then each worker rank's GPU told to the others."""
    check_ipc_server(client, deadline)
    workers = world_sizes([client], None, deadline)[0]
    check_engines([client], deadline)
    others = targets(group.hear("hello", deadline), packed) if group else []
    plane = IPCPlane(memory, RefCounters())
    try:
        ranks = _probe(client, workers, uuids, plane, deadline, others)
        hosting = _hosting(client, uuids, ranks, strict, others)
        if not packed:
            client.init_weight_transfer_engine(IPCInitInfo(packed=False).to_payload(),
                                               timeout=seconds_left(deadline, CONNECT))
        if group is not None:
            group.tell("ranks", answer(ranks), deadline)
    except BaseException:
        _leave(client, deadline)
        plane.destroy()
        raise
    return IPCConnection(comm=plane, clients=[client], init_info=IPCInitInfo(packed=packed),
                         ranks=ranks, uuids=hosting, owns_clients=owns_client)


def _member(group: GroupLink, uuids: dict[int, str], *, packed: bool, memory: Memory,
            deadline: Deadline, strict: bool) -> IPCConnection:
    """A process other than 0 joins: its GPUs and a probe buffer on each to
    process 0, which answers with each worker rank's GPU once the probe
    went through (every worker that mapped a buffer released it)."""
    buffers: dict[int, Any] = {}
    try:
        buffers = {d: memory.export(d, PROBE_BYTES) for d in uuids}
        group.send("hello", hello(uuids, {d: b.handle for d, b in buffers.items()},
                                  packed=packed, strict=strict), deadline)
        ranks = ranks_of(group.receive("ranks", deadline))
    except BaseException as e:
        group.fail(failure(e))  # process 0 stops waiting for this one
        memory.close()
        raise
    finally:
        for buffer in buffers.values():
            buffer.free()
    return IPCConnection(comm=IPCPlane(memory, RefCounters()), clients=[],
                         init_info=IPCInitInfo(packed=packed), ranks=ranks,
                         uuids={d: u for d, u in uuids.items() if u in ranks})


def _probe(client: VLLMClient, workers: int, uuids: dict[int, str], plane: IPCPlane,
           deadline: Deadline, others: Sequence[ProbeTarget] = ()) -> list[str]:
    """The empty update (see the module docstring), over this process's
    GPUs and ``others`` (a group's other processes' buffers); each global
    rank's GPU UUID."""
    buffers = {d: plane.memory.export(d, PROBE_BYTES) for d in uuids}
    gpus = [(u, d, buffers[d].handle) for d, u in uuids.items()]
    gpus += [(t.uuid, t.device, t.handle) for t in others]
    slots = plane.counters.take(workers * len(gpus))
    per_rank = [{u: slots[r * len(gpus) + i] for i, (u, _, _) in enumerate(gpus)}
                for r in range(workers)]
    payloads = [_probe_payload(gpus, mine, plane.counters.name) for mine in per_rank]
    try:
        release(client, deadline)  # a session a trainer left open (killed mid-push) is finished
        client.init_weight_transfer_engine(IPCInitInfo(packed=True).to_payload(),
                                           timeout=seconds_left(deadline, CONNECT))
        client.start_weight_update(timeout=seconds_left(deadline, CONNECT))
        try:
            client.update_weights(payloads, timeout=seconds_left(deadline, CONNECT))
        except VLLMHTTPError as e:
            raise _refused(client, e, [u for u, _, _ in gpus]) from None
        client.finish_weight_update(timeout=seconds_left(deadline, CONNECT))
        ranks = _mapped(plane.counters, per_rank, deadline, client)
    except BaseException:  # a worker may still map them: freed once released
        for d, buffer in buffers.items():
            plane.retire(buffer, [mine[uuids[d]] for mine in per_rank])
        raise
    for buffer in buffers.values():
        buffer.free()
    return ranks


def _probe_payload(gpus: Sequence[tuple[str, int, bytes]], mine: dict[str, int],
                   counter: str) -> dict[str, Any]:
    handles = {u: RebuildArgs(shape=(PROBE_BYTES,), dtype="uint8", itemsize=1, device=d,
                              handle=handle, offset=0, counter=counter, slot=mine[u]).to_tuple()
               for u, d, handle in gpus}
    return IPCUpdateInfo(names=[], dtype_names=[], shapes=[], tensor_sizes=[],
                         ipc_handles_pickled=pickled(handles)).to_payload()


def _mapped(counters: RefCounters, per_rank: list[dict[str, int]], deadline: Deadline,
            client: VLLMClient) -> list[str]:
    """Each rank's GPU: the one slot of its own it released (polled: a
    release may lag the answer); the rest (GPUs it is not on) withdrawn."""
    def released(mine: dict[str, int]) -> list[str]:
        return [u for u, slot in mine.items() if counters.value(slot) <= 0]

    try:
        poll_until(lambda: all(released(mine) for mine in per_rank), deadline.left(),
                   on_timeout=lambda: CountersHeld(
                       f"{client.base_url}'s workers mapped the trainer's probe buffer but never "
                       f"released it through the ref-counter file /dev/shm{counters.name}: "
                       "trainer and server must share /dev/shm and run as the same user (in "
                       "containers: --ipc=host)"))
        return [released(mine)[0] for mine in per_rank]
    finally:
        counters.drop(s for mine in per_rank for s in mine.values())


def _hosting(client: VLLMClient, uuids: dict[int, str], ranks: list[str], strict: bool,
             others: Sequence[ProbeTarget] = ()) -> dict[int, str]:
    """The trainer's devices a worker is on; with ``strict``, every one must
    be (and every device of a group's process that named its own)."""
    idle = [f"trainer GPU {d} ({u})" for d, u in uuids.items() if strict and u not in ranks]
    idle += strict_idle(others, ranks)
    if idle:
        raise RendezvousError(
            f"no worker of {client.base_url} is on {', '.join(idle)}; its workers are on "
            f"{sorted(set(ranks))}: pass only the GPUs the server shares (devices=)")
    return {d: u for d, u in uuids.items() if u in ranks}


def _refused(client: VLLMClient, e: VLLMHTTPError, ours: list[str]) -> RendezvousError:
    """The probe's refusal, in one sentence (vLLM's words are in ``e``)."""
    missing = _MISSING.search(str(e))
    if missing:
        return RendezvousError(
            f"a worker of {client.base_url} runs on GPU {missing.group(1)}, which this trainer "
            f"holds no device of (it exports from {ours}): run the trainer where JAX sees that "
            "GPU (CUDA_VISIBLE_DEVICES), or the server on the trainer's GPUs")
    if _NO_PICKLES in str(e):
        return _pickles_refused(client)
    return RendezvousError(f"{client.base_url} refused the empty update that checks the IPC "
                           f"path before any weights move: {e}")


def _leave(client: VLLMClient, deadline: Deadline) -> None:
    """Leave the server as it was after a failed connect (the probe's
    session finished, its engine shut down); a failure is logged."""
    try:
        release(client, Deadline(max(deadline.left() or 0.0, 5.0)))
    except RendezvousError as e:
        log.warning("%s", e)
