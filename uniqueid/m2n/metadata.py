"""vLLM's ``StatelessProcessGroup``, torch-free: the metadata group in which
trainer ranks and vLLM's ``nccl_m2n`` workers agree before NCCL init.

Why a copy of vLLM's and not a protocol of our own: vLLM's workers run
their own ``StatelessProcessGroup`` in the same group, so ours must name
the same keys in the same order. Each rank counts what it sends
(``send_to/{dst}/{n}``, one counter per destination;
``broadcast_from/{rank}/{n}``, one counter for all its broadcasts,
all-gathers included) and what it reads (per source), exactly as vLLM's
does; objects travel as ``pickle.dumps(obj)``, as vLLM's do. (vLLM's
``recv_obj`` reads ``send_to/{rank}/{n}`` with its counter for the
source: two sources sending to one rank collide; the same holds here.)

What differs is what a wait may cost and what a record may contain:

* every wait ends by a deadline, and its error names the ranks that did
  not arrive, what was awaited, and how many ranks joined the store;
* what other ranks wrote is unpickled as plain data only (dict, list,
  tuple, str, bytes, int, float, bool, None): a pickle that needs any
  global is refused, naming the rank, before anything of it runs;
* an all-gather publishes this rank's record first and then reads the
  others: no rank ever waits for this one (vLLM's reads in rank order,
  which is the same keys); it stops at the first record it refuses, so it
  fails where vLLM's ranks fail when they cannot unpickle that record.
"""

from __future__ import annotations

import io
import pickle
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nccl_cffi.waiting import Deadline

from ..errors import RendezvousError, RendezvousTimeout, StoreError, StoreTimeout
from ..store import KeyValueStore, StoreClient, StoreLimits, StoreServer

__all__ = ["GroupError", "GroupTimeout", "MetadataGroup", "plain_loads"]

DATA_EXPIRATION_SECONDS = 3600  # vLLM's default
# Connections the host's store takes beyond its ranks' own: room for ranks
# in their handshake beside strangers, each of whom makes room for the next.
SPARE_CONNECTIONS = 16
_PLAIN = (dict, list, tuple, str, bytes, int, float, bool, type(None))
_MAX_NODES = 1_000_000  # what one record may hold, counted while checking it
_PROBE_SECONDS = 2.0  # how long naming the other missing ranks may take


class GroupError(RendezvousError):
    """A rank of the metadata group sent what cannot be read, or the store
    went away."""


class GroupTimeout(GroupError, RendezvousTimeout):
    """Ranks of the metadata group did not publish within the deadline."""


class _NotPlain(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise _NotPlain(f"it names the global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("it holds a persistent id")


def plain_loads(data: bytes) -> Any:
    """Unpickle ``data`` if it is plain data only.

    Args:
        data: a pickle, as ``pickle.dumps`` wrote it.

    Returns:
        The object: dicts, lists, tuples, strs, bytes, ints, floats,
        bools and None, nested.

    Raises:
        ValueError: it is no pickle, names a global (no class, function or
            module is ever looked up), or holds another type (a set, a
            bytearray); the message says which.
    """
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except _NotPlain as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises
        raise ValueError(f"it is not a pickle ({type(e).__name__}: {e})") from None
    _check_plain(obj)
    return obj


def _check_plain(obj: Any) -> None:
    """Walk ``obj`` without recursion, each container once (a pickle may
    hold a list that holds itself)."""
    stack, seen, nodes = [obj], set(), 0
    while stack:
        item = stack.pop()
        nodes += 1
        if nodes > _MAX_NODES:
            raise ValueError(f"it holds more than {_MAX_NODES} objects")
        if type(item) not in _PLAIN:
            raise ValueError(f"it holds a {type(item).__name__}")
        if isinstance(item, dict | list | tuple) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.items() if isinstance(item, dict) else item)


class MetadataGroup:
    """vLLM's ``StatelessProcessGroup`` over a ``KeyValueStore``, every wait
    within a deadline, every record read as plain data.

    Args:
        store: the group's store (``StoreServer`` on the rank that hosts
            it, ``StoreClient`` elsewhere); the group closes it.
        rank: this rank, from 0.
        world_size: every rank of the group: trainer ranks first, then
            vLLM's workers (``rank_offset`` + each worker's index).
        describe: names a rank in errors (default ``"group rank N"``).
        data_expiration_seconds: what this rank published is deleted after
            this long, on its next send (vLLM's ``expire_data``).

    Raises:
        ValueError: ``rank`` is not below ``world_size``.
    """

    def __init__(self, store: KeyValueStore, rank: int, world_size: int, *,
                 describe: Callable[[int], str] | None = None,
                 data_expiration_seconds: float = DATA_EXPIRATION_SECONDS) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.describe = describe or (lambda r: f"group rank {r}")
        self.data_expiration_seconds = data_expiration_seconds
        self.send_dst_counter = dict.fromkeys(range(world_size), 0)
        self.recv_src_counter = dict.fromkeys(range(world_size), 0)
        self.broadcast_send_counter = 0
        self.broadcast_recv_src_counter = dict.fromkeys(range(world_size), 0)
        self._entries: deque[tuple[str, float]] = deque()

    @classmethod
    def host(cls, host: str, world_size: int, *, port: int = 0, limits: StoreLimits | None = None,
             describe: Callable[[int], str] | None = None) -> MetadataGroup:
        """Rank 0's group: hosts the store (``group.store.port`` is where
        the others join) and counts itself as joined.

        Args:
            host: the address to listen on (one the other ranks reach).
            world_size: every rank of the group.
            port: the port; 0 picks a free one.
            limits: the store's limits; by default the group's: its ranks
                join (``max_joins``), and it takes ``SPARE_CONNECTIONS``
                more connections than they hold.
            describe: names a rank in errors.

        Returns:
            The group, rank 0.

        Raises:
            StoreError: the address cannot be bound.
            ValueError: ``world_size`` is below 1.
        """
        if limits is None:
            limits = StoreLimits(max_joins=world_size,
                                 max_connections=max(world_size - 1, 0) + SPARE_CONNECTIONS)
        server = StoreServer(host, port, limits=limits, joined=1)
        try:
            group = cls(server, 0, world_size, describe=describe)
        except BaseException:
            server.close()
            raise
        return group

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, *, deadline: Deadline,
             describe: Callable[[int], str] | None = None) -> MetadataGroup:
        """A rank other than 0 joins the group hosted at ``host:port``.

        Args:
            host: rank 0's store address.
            port: its port.
            rank: this rank.
            world_size: every rank of the group.
            deadline: bounds reaching the store (retried while refused).
            describe: names a rank in errors.

        Returns:
            The group.

        Raises:
            StoreTimeout: the store could not be reached in time.
            ValueError: ``rank`` is not in [1, world_size).
        """
        if not 0 < rank < world_size:
            raise ValueError(f"a joining rank is in [1, world_size={world_size}), got {rank}")
        client = StoreClient(host, port, deadline=deadline, world_size=world_size)
        return cls(client, rank, world_size, describe=describe)

    def send_obj(self, obj: Any, dst: int, deadline: Deadline | None = None) -> None:
        """Send ``obj`` to rank ``dst`` (``send_to/{dst}/{n}``).

        Args:
            obj: plain data.
            dst: the destination rank.
            deadline: bounds the store call.

        Raises:
            GroupError: the store refused it or went away.
            ValueError: ``dst`` is not a rank of the group.
        """
        self._check_rank(dst)
        self._publish(f"send_to/{dst}/{self.send_dst_counter[dst]}", obj, deadline)
        self.send_dst_counter[dst] += 1

    def recv_obj(self, src: int, deadline: Deadline, *, what: str = "message") -> Any:
        """What rank ``src`` sent this rank (vLLM's key: ``send_to/{rank}/{n}``).

        Args:
            src: the source rank.
            deadline: the whole wait's.
            what: names what is awaited in errors (e.g. "round outcome").

        Returns:
            The object.

        Raises:
            GroupTimeout: not sent within the deadline (the error names ``src``).
            GroupError: it is not plain data, or the store went away.
        """
        self._check_rank(src)
        obj = self._read(src, f"send_to/{self.rank}/{self.recv_src_counter[src]}", deadline, what,
                         deadline.left())
        self.recv_src_counter[src] += 1
        return obj

    def broadcast_obj(self, obj: Any, src: int, deadline: Deadline, *, what: str = "broadcast") -> Any:
        """Rank ``src`` publishes ``obj`` (``broadcast_from/{src}/{n}``); the
        other ranks read it.

        Args:
            obj: what to publish on ``src``; ignored elsewhere.
            src: the publishing rank.
            deadline: the whole call's.
            what: names what is awaited in errors.

        Returns:
            ``obj`` on ``src``; what ``src`` published elsewhere.

        Raises:
            GroupTimeout: ``src`` did not publish within the deadline.
            GroupError: its record is not plain data, or the store went away.
        """
        self._check_rank(src)
        if src == self.rank:
            self._broadcast(obj, deadline)
            return obj
        return self._read_broadcast(src, deadline, what, deadline.left())

    def all_gather_obj(self, obj: Any, deadline: Deadline, *, what: str = "record") -> list[Any]:
        """Every rank's ``obj``, in rank order (vLLM's keys: each rank's
        broadcast). This rank publishes first, then reads the others.

        Args:
            obj: this rank's record (plain data).
            deadline: the whole call's.
            what: names a record in errors, e.g. "record of the
                source-plan agreement".

        Returns:
            The records, ``obj`` at this rank's index.

        Raises:
            GroupTimeout: ranks did not publish within the deadline; the
                error names every rank still missing.
            GroupError: a rank's record is not plain data (named), or the
                store went away.
        """
        total = deadline.left()
        self._broadcast(obj, deadline)
        gathered = []
        for src in range(self.world_size):
            if src == self.rank:
                gathered.append(obj)
                continue
            try:
                gathered.append(self._read_broadcast(src, deadline, what, total))
            except GroupTimeout as e:
                missing = self._missing_after(src)
                if len(missing) > 1:
                    raise self._timeout(missing, what, total) from None
                raise e from None
        return gathered

    def close(self, turn_away_s: float = 0.0) -> None:
        """Close the store: the host's stops serving the other ranks.

        Args:
            turn_away_s: the group will not form: the host's store closes
                every rank's connection now, and for this long answers a
                rank still on its way with an end that makes it leave (see
                ``StoreServer.close``); ignored on other ranks.
        """
        self.store.close(turn_away_s)

    def _broadcast(self, obj: Any, deadline: Deadline | None) -> None:
        self._publish(f"broadcast_from/{self.rank}/{self.broadcast_send_counter}", obj, deadline)
        self.broadcast_send_counter += 1

    def _read_broadcast(self, src: int, deadline: Deadline, what: str, total: float | None) -> Any:
        key = f"broadcast_from/{src}/{self.broadcast_recv_src_counter[src]}"
        obj = self._read(src, key, deadline, what, total)
        self.broadcast_recv_src_counter[src] += 1
        return obj

    def _publish(self, key: str, obj: Any, deadline: Deadline | None) -> None:
        try:
            self._expire(deadline)
            self.store.set(key, pickle.dumps(obj), deadline)
        except StoreError as e:
            raise GroupError(f"{self.describe(self.rank)} could not publish to the metadata "
                             f"store: {e}") from None
        self._entries.append((key, time.time()))

    def _expire(self, deadline: Deadline | None) -> None:
        while self._entries and time.time() - self._entries[0][1] > self.data_expiration_seconds:
            self.store.delete(self._entries.popleft()[0], deadline)

    def _read(self, src: int, key: str, deadline: Deadline, what: str, total: float | None) -> Any:
        try:
            data = self.store.get(key, deadline)
        except StoreTimeout:
            raise self._timeout([src], what, total) from None
        except StoreError as e:
            raise GroupError(f"the metadata store failed while {self.describe(self.rank)} waited "
                             f"for {self.describe(src)}'s {what}: {e}") from None
        try:
            return plain_loads(data)
        except ValueError as e:
            raise GroupError(f"{self.describe(src)} sent a {what} that is not plain data ({e}): "
                             "only a vLLM worker or a trainer rank of this protocol belongs in the "
                             "group; check what runs at that rank") from None

    def _missing_after(self, first: int) -> list[int]:
        """The ranks from ``first`` on whose next broadcast is not there
        (``first`` itself is known missing)."""
        missing = [first]
        probe = Deadline(_PROBE_SECONDS)
        for src in range(first + 1, self.world_size):
            key = f"broadcast_from/{src}/{self.broadcast_recv_src_counter[src]}"
            try:
                if src != self.rank and not self.store.check([key], probe):
                    missing.append(src)
            except StoreError:
                break
        return missing

    def _timeout(self, ranks: list[int], what: str, total: float | None) -> GroupTimeout:
        names = [self.describe(r) for r in ranks]
        who = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        try:
            joined = f"; {self.store.joined(Deadline(_PROBE_SECONDS))} of {self.world_size} ranks " \
                     "joined the store"
        except StoreError:
            joined = ""
        troubles = self.store.troubles()
        joined += f"; {troubles}" if troubles else ""
        within = "" if total is None else f" within {total:.3g} s"
        whose = "its" if len(ranks) == 1 else "their"
        return GroupTimeout(
            f"{who} did not publish {whose} {what}{within}{joined}: check that every rank of the group "
            "was started, reaches the store and runs the same steps (a rank that failed earlier, "
            "or left, never arrives)")

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not in [0, {self.world_size})")
