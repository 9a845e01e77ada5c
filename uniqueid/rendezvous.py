"""Joining vLLM's workers through the unique-id path, warm-up included, and
leaving them ready for the next trainer.

vLLM's workers enter ``ncclCommInitRank`` when ``/init_weight_transfer_engine``
reaches them and then issue a one-element float32 sum ``all_reduce`` (the
warm-up) before anything else. There is no barrier and vLLM sets no
timeout: once the init is posted, a trainer that fails to join leaves the
workers waiting inside NCCL for ever, and only a restart of the server frees
them. So everything the trainer can check is checked first (``preflight``:
the device exists and takes a context, libnccl loads; the servers' world
sizes are sane), and only then is the init posted, *concurrently* with the
trainer's own init, whose deadline bounds the whole call. A server whose
engine core does not answer (``engine_answers``: a worker still inside an
NCCL call a dead trainer left) would take the init and never join, so it is
named (``ServerStuck``) before any init is posted. While it waits it
watches the HTTP calls: a server that refuses init ends the trainer's init
at once.

Leaving (``Connection.close``): vLLM refuses to shut its engine down while
an update session is open, so a session left open is finished first; a
server whose engine does not answer at all is named as needing a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nccl_cffi import (
    DEFAULT_INIT_TIMEOUT,
    Communicator,
    Deadline,
    NcclTimeoutError,
    await_future,
    cuda,
    load_library,
)

from .codec import UNIQUE_ID_BYTES, UniqueId
from .errors import RendezvousError, RendezvousTimeout, ServerStuck
from .http import transport
from .http.client import (
    VLLMClient,
    VLLMHTTPError,
    VLLMTimeout,
)
from .http.fleet import GRACE_S, Calls, call_all
from .wire import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, InitInfo

if TYPE_CHECKING:
    from .m2n.wire import M2NInitInfo

log = logging.getLogger("uniqueid")

# Of connect's deadline, what is kept for the servers' init answers after
# the trainer's own init and warm-up (the workers answer right after theirs).
_ANSWER_RESERVE = 0.1
_ANSWER_RESERVE_MAX_S = 5.0
# The most workers one server may report: far beyond any deployment; a
# larger answer is a misconfigured or impostor server.
MAX_WORKERS = 1 << 16
# How long a server's engine core may take to answer a question before it is
# taken as stuck: a healthy one answers between two engine steps, one whose
# worker sits inside an NCCL call never does.
ENGINE_ANSWER_S = 5.0
# Stands in for the group's id while the settings are checked, before it is minted.
_ANY_ID = UniqueId(bytes(UNIQUE_ID_BYTES))

Servers = str | VLLMClient | Sequence[str | VLLMClient]


def warm_up(comm: Communicator, timeout: float | None,
            check: Callable[[], None] | None = None) -> None:
    """The handshake every vLLM worker expects right after init:
    ``all_reduce(count=1, float32, sum)``.

    Args:
        comm: the new communicator.
        timeout: seconds for the collective and its wait.
        check: polled while waiting; what it raises ends the wait (and aborts ``comm``).

    Raises:
        NcclError: the collective failed or overran ``timeout`` (``comm`` aborted).
        CudaError: its scratch buffer or stream cannot be made.
    """
    mem = cuda.DeviceMemory(8, comm.device)
    stream = cuda.Stream(comm.device)
    try:
        comm.all_reduce(mem.ptr, mem.ptr + 4, count=1, dtype="float32", op="sum",
                        stream=stream, timeout=timeout)
        comm.wait(stream, timeout, what="warm-up all_reduce", check=check)
    finally:
        stream.close()
        if comm.state == "open":  # after an abort the kernel may not be freeable
            mem.free()


def preflight(device: int) -> None:
    """What the trainer can check before any server is told to join it: the
    device exists and takes a context, and libnccl loads.

    Args:
        device: the trainer's CUDA ordinal.

    Raises:
        CudaError: no such device, or it cannot be used.
        NcclLibraryNotFound: no usable libnccl.
    """
    load_library()
    cuda.check_device(device)


def handshake(world_size: int, unique_id: UniqueId, rank: int, device: int, *,
              timeout: float | None = DEFAULT_INIT_TIMEOUT,
              check: Callable[[], None] | None = None, blocking: bool = True) -> Communicator:
    """Init and warm up, with one deadline for both, without any HTTP.

    For control planes of the caller's own: ship ``unique_id.to_b64()`` to
    the workers by any means, then call this on the trainer; every worker
    must do the same init and warm-up. The communicator is blocking, as
    vLLM's are (its collectives launch four times faster); its init runs on
    a kept thread that is abandoned if the deadline passes (see
    ``nccl_cffi.Communicator.init_rank``).

    Args:
        world_size: every rank of the group.
        unique_id: the group's id.
        rank: this process's rank.
        device: its CUDA ordinal.
        timeout: seconds for init and warm-up together.
        check: polled while waiting; what it raises gives the init up.
        blocking: a blocking communicator (as vLLM's workers use).

    Returns:
        The communicator, warmed up.

    Raises:
        ValueError: ``world_size``, ``rank`` or ``device`` out of range.
        CudaError: ``device`` cannot be used.
        NcclTimeoutError: the other ranks did not join in time.
        NcclError: NCCL refused (a version mismatch, a duplicate GPU, ...).
    """
    return Communicator.init_rank(world_size, unique_id.raw, rank, device, blocking=blocking,
                                  timeout=timeout, check=check, then=warm_up)


class Joiner(Protocol):
    """What ``connect`` does on the trainer's side: the checks before any
    server is told to join, minting the group's id (NCCL's embeds a
    bootstrap listener in this process), and the join itself. The default is
    NCCL's (``NCCL_JOIN``); tests on machines without a GPU pass their own."""

    def preflight(self, device: int) -> None:
        """Check that the trainer can join, before any server is told to.

        Args:
            device: the trainer's CUDA ordinal.

        Raises:
            CudaError, NcclLibraryNotFound: it cannot (NCCL's ``preflight``).
        """
        ...

    def mint(self) -> UniqueId:
        """A fresh id for the group (NCCL's: ``UniqueId.mint``).

        Returns:
            The id.
        """
        ...

    def join(self, world_size: int, unique_id: UniqueId, rank: int, device: int, *,
             timeout: float | None, check: Callable[[], None]) -> Communicator:
        """Join the group as ``rank``, warm-up included (NCCL's: ``handshake``).

        Args:
            world_size: every rank of the group.
            unique_id: the group's id.
            rank: the trainer's rank (0 for the process that connects).
            device: its CUDA ordinal.
            timeout: seconds for the whole join.
            check: polled while waiting; what it raises gives the join up.

        Returns:
            The communicator, warmed up.

        Raises:
            NcclTimeoutError: the other ranks did not join within ``timeout``.
            NcclError: the join failed.
            BaseException: what ``check`` raised.
        """
        ...


class _NcclJoin:
    """``preflight`` and ``handshake``."""

    preflight = staticmethod(preflight)
    mint = staticmethod(UniqueId.mint)

    @staticmethod
    def join(world_size: int, unique_id: UniqueId, rank: int, device: int, *,
             timeout: float | None, check: Callable[[], None]) -> Communicator:
        return handshake(world_size, unique_id, rank, device, timeout=timeout, check=check)


NCCL_JOIN: Joiner = _NcclJoin()


@dataclass
class Connection:
    """The trainer's end of one transfer group: the communicator, and the
    servers (each with its own ``init_info``) whose workers joined it.

    Attributes:
        comm: the trainer's communicator.
        clients: the servers, in rank order.
        init_infos: what each server was told at init.
        device: the trainer's CUDA ordinal.
        unique_id: the group's id (left out of ``repr``).
        owns_clients: ``close()`` closes the HTTP clients too (it made them).
    """

    comm: Communicator
    clients: list[VLLMClient]
    init_infos: list[InitInfo]
    device: int
    unique_id: UniqueId = field(repr=False)
    owns_clients: bool = False

    @property
    def client(self) -> VLLMClient:
        """The first server's client (the only one with a single server)."""
        return self.clients[0]

    @property
    def init_info(self) -> InitInfo:
        """The first server's ``init_info`` (the wire geometry is the same for all)."""
        return self.init_infos[0]

    def close(self, *, deadline: Deadline | None = None, shutdown_servers: bool = True,
              free_comm: bool = True, strict: bool = False) -> None:
        """Release the servers (``release``), free the communicator and close
        the HTTP clients this connection made.

        Args:
            deadline: bounds the servers' release (default: 60 s).
            shutdown_servers: release the servers' engines.
            free_comm: free the communicator (False: a thread is still
                inside one of its calls).
            strict: raise when a server cannot be released; otherwise log it.

        Raises:
            ServerStuck: with ``strict``, a server's engine did not answer.
            RendezvousError: with ``strict``, a server refused to shut down.
        """
        close_connection(self.clients, self.comm, owns_clients=self.owns_clients,
                         deadline=deadline, shutdown_servers=shutdown_servers,
                         free_comm=free_comm, strict=strict)


def close_connection(clients: Sequence[VLLMClient], comm: Any, *, owns_clients: bool,
                     deadline: Deadline | None, shutdown_servers: bool, free_comm: bool,
                     strict: bool, then: Callable[[], None] | None = None) -> None:
    """What closing a connection does, on either path (``Connection``,
    ``m2n.M2NConnection``): release the servers, free the data plane, run
    ``then`` (the M2N group's store), close the HTTP clients it made.

    Args:
        clients: the servers.
        comm: the communicator (or data plane), with ``destroy()``.
        owns_clients: close the HTTP clients too.
        deadline: bounds the servers' release (default: 60 s).
        shutdown_servers: release the servers' engines.
        free_comm: free ``comm`` (False: a thread is still inside one of its calls).
        strict: raise when a server cannot be released; otherwise log it.
        then: called after ``comm`` is freed, before the clients are closed.

    Raises:
        ServerStuck: with ``strict``, a server's engine did not answer.
        RendezvousError: with ``strict``, a server refused to shut down.
    """
    deadline = deadline or Deadline(60.0)
    problems = release_all(clients, deadline) if shutdown_servers else []
    if free_comm:
        comm.destroy()
    if then is not None:
        then()
    if owns_clients:
        for c in clients:
            c.close()
    for e in problems[1:] if strict else problems:
        log.warning("%s", e)
    if strict and problems:
        raise problems[0]


def release_all(clients: Sequence[VLLMClient], deadline: Deadline) -> list[RendezvousError]:
    """``release`` every server at once, each within ``deadline``: one stuck
    server must not use up the others' time (and be blamed on them).

    Args:
        clients: the servers.
        deadline: bounds each release (they run side by side).

    Returns:
        What each server that could not be released raised.
    """
    return [p for p in release_each(clients, deadline) if p is not None]


def release_each(clients: Sequence[VLLMClient],
                 deadline: Deadline) -> list[RendezvousError | None]:
    """``release`` every server at once on the HTTP loop, all within
    ``deadline``; what each raised, in order (None: released).

    Args:
        clients: the servers.
        deadline: bounds every release (they run side by side).

    Returns:
        Per server: None, or why it could not be released (a server whose
        release did not end by the deadline is ``ServerStuck``).
    """
    calls = Calls(clients, lambda i, _: _release(clients[i], deadline), deadline=Deadline(None))
    if not await_future(calls.ended, None if deadline.at is None else deadline.at + GRACE_S):
        calls.cancel()
    problems: list[RendezvousError | None] = []
    for c, done, e in zip(clients, calls.done, calls.errors):
        if not done:
            e = ServerStuck(f"{c.base_url}: its release did not end by the deadline; restart "
                            "that server")
        elif e is not None and not isinstance(e, RendezvousError):
            raise e
        problems.append(e)
    return problems


def release(client: VLLMClient, deadline: Deadline) -> None:
    """Shut a server's weight-transfer engine down, finishing an update
    session left open first (vLLM refuses to shut down during one), so the
    same server takes the next init.

    Args:
        client: the server.
        deadline: bounds the whole release.

    Raises:
        ServerStuck: the server's engine did not answer in time (or the
            deadline had passed).
        VLLMHTTPError: it refused, and there was no session to finish.
        VLLMConnectionError, VLLMProtocolError: it could not be reached, or
            answered what vLLM never does.
    """
    transport.run(_release(client, deadline))


async def _release(client: VLLMClient, deadline: Deadline) -> None:
    """``release``, as a coroutine on the HTTP loop."""
    shutdown = VLLMClient.shutdown_weight_transfer_engine.coroutine  # type: ignore[attr-defined]
    finish = VLLMClient.finish_weight_update.coroutine  # type: ignore[attr-defined]
    try:
        try:
            await shutdown(client, timeout=seconds_left(deadline))
            return
        except VLLMHTTPError as refused:
            try:
                await finish(client, timeout=seconds_left(deadline))
            except VLLMHTTPError:
                raise refused from None
            await shutdown(client, timeout=seconds_left(deadline))
    except (VLLMTimeout, RendezvousTimeout) as e:
        raise ServerStuck(
            f"{client.base_url}: its weight-transfer engine did not answer within the "
            "deadline: its workers are most likely inside an NCCL call whose trainer left "
            "(vLLM sets no deadline there); restart that server") from e


def seconds_left(deadline: Deadline, what: str = "the deadline") -> float:
    """What is left of ``deadline`` for one call (60 s when it has none).

    Args:
        deadline: the whole operation's.
        what: the deadline's name in the error.

    Returns:
        Seconds, more than 0.

    Raises:
        RendezvousTimeout: it passed.
    """
    left = deadline.left()
    if left is None:
        return 60.0
    if left <= 0:
        raise RendezvousTimeout(f"{what} passed")
    return left


def _made_here(servers: Servers) -> bool:
    """Whether ``as_clients`` makes the clients (URLs given), so they are ours to close."""
    items = [servers] if isinstance(servers, (str, VLLMClient)) else list(servers)
    return all(isinstance(s, str) for s in items)


def as_clients(servers: Servers) -> list[VLLMClient]:
    """One URL, one client, or a list of either, as clients.

    Args:
        servers: a URL (``http://host:port``), a ``VLLMClient``, or a
            sequence of either.

    Returns:
        One client per server, in order: those given, and new ones for URLs.

    Raises:
        ValueError: no server given, a URL that is not http(s), or one
            server given twice (however its URL is spelled:
            ``url.server_key``), which would join one group twice.
    """
    given = [servers] if isinstance(servers, (str, VLLMClient)) else list(servers)
    clients = [s if isinstance(s, VLLMClient) else VLLMClient(s) for s in given]
    if not clients:
        raise ValueError("no vLLM server given: pass its URL, e.g. http://127.0.0.1:8000")
    first: dict[str, int] = {}
    for i, c in enumerate(clients):
        j = first.setdefault(c.server_key, i)
        if j != i:
            _close_made(clients, given)
            raise ValueError(f"{clients[j].base_url} and {c.base_url} are one server "
                             f"({c.server_key}): give each server once")
    return clients


def _close_made(clients: list[VLLMClient], given: list[Any]) -> None:
    """Close the clients ``as_clients`` made for URLs (not those it was given)."""
    for client, item in zip(clients, given):
        if client is not item:
            client.close()


def world_sizes(clients: Sequence[VLLMClient], workers: Sequence[int] | int | None,
                deadline: Deadline) -> list[int]:
    """Each server's worker count: ``workers`` as given, else asked (every
    server at once, within ``deadline``); checked sane either way.

    Args:
        clients: the servers.
        workers: one count per server, one count for a single server, or
            None to ask each.
        deadline: bounds the questions (60 s each without one).

    Returns:
        One worker count per server.

    Raises:
        RendezvousError: a count that is not a positive int of at most
            ``MAX_WORKERS``, or not one per server; or a server's
            ``/get_world_size`` failed (its ``VLLMHTTPError``,
            ``VLLMConnectionError`` or ``VLLMProtocolError``).
        RendezvousTimeout: the deadline passed before a server was asked.
        VLLMTimeout: a server did not answer within the deadline.
    """
    if isinstance(workers, int):
        workers = [workers]
    if workers is None:
        if deadline.passed():
            raise RendezvousTimeout("the deadline passed before the servers were asked")
        workers = call_all(clients, VLLMClient.get_world_size, deadline=deadline)
    workers = list(workers)
    if len(workers) != len(clients):
        raise RendezvousError(f"{len(clients)} servers but {len(workers)} worker counts")
    for c, n in zip(clients, workers):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORKERS:
            raise RendezvousError(
                f"{c.base_url} has {n!r} workers, so no group can be formed with it: start "
                "vLLM with its model loaded (check GET /get_world_size), or pass each "
                f"server's worker count (1 to {MAX_WORKERS})")
    return workers


def engine_answers(client: VLLMClient, timeout: float) -> bool:
    """Whether the server's engine core answers: ``GET /is_paused``, then
    ``GET /weight_info``, both within ``timeout``.

    Why these: vLLM's engine core answers them between engine steps, and
    not at all while a worker sits inside an NCCL call (left there by a
    trainer that died mid-push: vLLM sets no deadline), whereas its API
    process answers ``/get_world_size`` from its config either way. This is
    the test ``doctor`` makes, and ``connect`` makes before any init.

    Args:
        client: the server.
        timeout: seconds for both answers.

    Returns:
        Whether generation is paused there.

    Raises:
        ServerStuck: no answer within ``timeout``: restart that server.
        VLLMHTTPError, VLLMConnectionError, VLLMProtocolError: it answered
            with an error, or could not be reached (as ``VLLMClient.request``).
    """
    return transport.run(_engine_core(client, timeout))


async def _engine_core(client: VLLMClient, timeout: float) -> bool:
    """``engine_answers`` on the HTTP loop."""
    deadline, route = Deadline(timeout), "/is_paused"
    try:
        paused = await VLLMClient.is_paused.coroutine(client, timeout=seconds_left(deadline))
        route = "/weight_info"
        await VLLMClient.weight_info.coroutine(client, timeout=seconds_left(deadline))
    except (VLLMTimeout, RendezvousTimeout) as e:
        raise ServerStuck(
            f"{client.base_url}: its engine does not answer (GET {route} took over {timeout:.2g} s, "
            "where a healthy vLLM answers between two engine steps): its workers are likely "
            "stuck inside NCCL waiting for a trainer that left (vLLM sets no deadline there); "
            "restart that server") from e
    return paused


def check_engines(clients: Sequence[VLLMClient], deadline: Deadline) -> None:
    """``engine_answers`` for every server at once (on the HTTP loop), each
    within ``ENGINE_ANSWER_S`` and ``deadline``: a server stuck inside NCCL
    would take the init and never join, and the trainer would wait its whole
    init deadline; so it is named before anything is posted to any server.

    Args:
        clients: the servers.
        deadline: bounds the questions.

    Raises:
        ServerStuck: naming each server whose engine did not answer.
        RendezvousTimeout: ``deadline`` had passed.
    """
    seconds = min(ENGINE_ANSWER_S, seconds_left(deadline))
    calls = Calls(clients, lambda i, left: _engine_core(clients[i], seconds),
                  deadline=Deadline(seconds))
    calls.wait()
    stuck = [str(e) for e in calls.errors if isinstance(e, ServerStuck)]
    if stuck:  # others answered, or cannot be reached: the init will say which
        raise ServerStuck("; ".join(stuck))


def connect(servers: Servers, *, device: int = 0,
            workers: Sequence[int] | int | None = None, packed: bool = True,
            packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
            timeout: float = DEFAULT_INIT_TIMEOUT, use_load_plan: bool = False,
            metadata: list[list] | None = None, trainer_ranks: int = 1,
            unique_id: UniqueId | None = None, joiner: Joiner = NCCL_JOIN) -> Connection:
    """Form the transfer group with one or more vLLM servers; the trainer is rank 0.

    Server *i* gets ``rank_offset`` ``trainer_ranks`` + the workers of the
    servers before it, so one broadcast can feed them all. A fresh id is
    minted for every call (unless ``unique_id`` is given: other trainer
    processes join as ranks 1.. with ``handshake`` and the same id), so
    calling again after a failure starts clean.

    Args:
        servers: URLs or clients.
        device: the trainer's CUDA ordinal.
        workers: each server's worker count (its ``/get_world_size``), asked
            when not given.
        packed, packed_buffer_size_bytes, packed_num_buffers: the wire
            geometry the workers are told.
        timeout: bounds the whole call (world sizes, init, warm-up, answers).
        use_load_plan, metadata: vLLM's load plan [newer vLLM].
        trainer_ranks: the group's trainer ranks.
        unique_id: the group's id (process 0 of a multi-process trainer).
        joiner: the trainer's side of the join (default: NCCL's).

    Returns:
        The connection.

    Raises:
        CudaError, NcclLibraryNotFound: the trainer cannot join (nothing posted).
        ValueError: no server given, or a URL that is not http(s).
        RendezvousError: a server refused (its ``/get_world_size`` too), or a setting.
        RendezvousTimeout: the group did not form within ``timeout``.
        ServerStuck: a server's engine does not answer: restart it (nothing posted).
        NcclError: NCCL could not mint the id, or refused the trainer's init
            or warm-up (a version mismatch, a duplicate GPU, ...).
    """
    deadline = _connect_deadline(timeout)
    joiner.preflight(device)
    owned, clients = _made_here(servers), as_clients(servers)
    settings = dict(packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes,
                    packed_num_buffers=packed_num_buffers, use_load_plan=use_load_plan,
                    metadata=metadata)
    uid, infos = _planned(clients, workers, trainer_ranks, unique_id, joiner, deadline, settings)
    comm = _join(clients, infos, joiner, device, deadline)
    return Connection(comm, clients, infos, device, uid, owns_clients=owned)


def _connect_deadline(timeout: Any) -> Deadline:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
        raise RendezvousError(f"connect's timeout must be a positive number of seconds, got "
                              f"{timeout!r}")
    return Deadline(timeout)


def _planned(clients: Sequence[VLLMClient], workers: Sequence[int] | int | None,
             trainer_ranks: int, unique_id: UniqueId | None, joiner: Joiner, deadline: Deadline,
             settings: dict[str, object]) -> tuple[UniqueId, list[InitInfo]]:
    """The group's id and each server's ``init_info``, once everything that
    can be checked before an init is posted was: the world sizes, the
    settings, and that every engine answers (before the id is minted:
    NCCL's listens until an init)."""
    counts = world_sizes(clients, workers, deadline)
    _init_infos(_ANY_ID, counts, trainer_ranks, **settings)  # refused before any more calls
    check_engines(clients, deadline)
    uid = unique_id or joiner.mint()
    return uid, _init_infos(uid, counts, trainer_ranks, **settings)


def _init_infos(uid: UniqueId, workers: Sequence[int], trainer_ranks: int,
                **settings: object) -> list[InitInfo]:
    """Each server's ``init_info``, validated before anything is posted."""
    world_size = trainer_ranks + sum(workers)
    infos, offset = [], trainer_ranks
    try:
        for n in workers:
            infos.append(InitInfo(nccl_unique_id_b64=uid.to_b64(), rank_offset=offset,
                                  world_size=world_size, **settings))
            offset += n
    except (TypeError, ValueError) as e:
        raise RendezvousError(f"invalid init settings: {e}") from e
    return infos


def _join(clients: Sequence[VLLMClient], infos: Sequence[InitInfo], joiner: Joiner,
          device: int, deadline: Deadline) -> Communicator:
    """Post each server's init and join the group, within ``deadline``."""
    inits = post_inits(clients, infos, deadline)
    left = deadline.left()
    try:
        comm = joiner.join(infos[0].world_size, infos[0].unique_id, 0, device,
                           timeout=left - min(_ANSWER_RESERVE * left, _ANSWER_RESERVE_MAX_S),
                           check=inits.raise_first)
    except RendezvousError as e:
        raise RendezvousError(
            f"the server refused init while the trainer waited in ncclCommInitRank: {e}. "
            f"The trainer's init was given up; fix the cause and connect again"
            f"{_left_waiting(inits)}") from e
    except NcclTimeoutError as e:
        raise RendezvousTimeout(f"{e}{_never_joined(inits, infos[0].world_size)}") from e
    try:
        await_inits(inits, deadline)
    except BaseException as e:
        comm.abort("server init failed")
        if isinstance(e, RendezvousTimeout):
            raise
        if isinstance(e, TimeoutError):  # the init's own call ran out of the same deadline
            raise RendezvousTimeout(f"the workers joined but a server's init did not answer "
                                    f"in time: {e}") from e
        raise RendezvousError(f"the server failed init after the group formed: {e}") from e
    return comm


def _left_waiting(inits: Calls[None]) -> str:
    """The servers that took an init the trainer gave up: their workers may
    wait inside NCCL for ranks that will not come."""
    waiting = [c.base_url for c in inits.pending()]
    if not waiting:
        return ""
    return (f"; {', '.join(waiting)} took the init and may now wait inside NCCL for ranks "
            "that will not come (vLLM sets no deadline there): restart them if their next "
            "init times out")


def _never_joined(inits: Calls[None], world_size: int) -> str:
    """Why servers that answered their init may still not have joined."""
    answered = [c.base_url for c in inits.succeeded()]
    if not answered:
        return ""
    return ("; the server answered 200 but its workers never joined: is it running with "
            f"VLLM_DISABLE_PYNCCL=1, is world_size {world_size} larger than the trainer ranks "
            f"+ its workers, or did a trainer rank not join? ({', '.join(answered)})")


def post_inits(clients: Sequence[VLLMClient], infos: Sequence[InitInfo | M2NInitInfo],
               deadline: Deadline) -> Calls[None]:
    """Post every server's ``/init_weight_transfer_engine`` at once on the
    HTTP loop, each answered within ``deadline``; the caller joins the group
    meanwhile, with ``raise_first`` as its check (a refusal ends its wait).

    Args:
        clients: the servers.
        infos: each server's ``init_info`` (``InitInfo``, or ``M2NInitInfo``).
        deadline: bounds every init.

    Returns:
        The inits, in flight.
    """
    return Calls(clients, lambda i, _: _post_init(clients[i], infos[i], deadline),
                 deadline=deadline)


def await_inits(inits: Calls[None], deadline: Deadline) -> None:
    """Wait for every server's answer to its init (``post_inits``), once the
    trainer joined.

    Args:
        inits: from ``post_inits``.
        deadline: by when the answers must have come.

    Raises:
        RendezvousTimeout: a server did not answer by ``deadline`` (named).
        BaseException: what the first init that failed raised.
    """
    if not await_future(inits.ended, deadline.at):
        raise RendezvousTimeout(f"the workers joined but {inits.named(inits.pending())}"
                                "/init_weight_transfer_engine did not answer in time")
    inits.raise_first()


async def _post_init(client: VLLMClient, info: InitInfo | M2NInitInfo,
                     deadline: Deadline) -> None:
    """``/init_weight_transfer_engine``, answered within ``deadline``."""
    init = VLLMClient.init_weight_transfer_engine.coroutine  # type: ignore[attr-defined]
    await init(client, info.to_payload(), timeout=seconds_left(deadline))
