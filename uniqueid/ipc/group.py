"""Several trainer processes on one node pushing to one ``ipc`` server
together, as vLLM's torch trainer does with ``all_gather_object``: each
process exports from its own GPUs, and process 0 merges every process's
handles into each ``/update_weights`` it posts.

They talk through a store process 0 hosts (``store.StoreServer``; the
others join it with ``StoreClient``), every wait with a deadline:

* **connect**: each process sends process 0 its GPUs (a probe buffer's
  handle on each), its packing and whether it named its devices; process 0
  checks they agree, probes every worker with all of the buffers
  (``join.connect_ipc``, the slots in its own ref-counter file), and answers
  each with which GPU each worker is on, or why the group did not form.
* **push** ``n``, round ``k``: process 0 says *go* (round ``k - 1`` was
  answered, so a buffer may be written again), each process stages its part
  and sends its exports, process 0 merges them and posts the update. At the
  end process 0 sends each process the outcome (*stop*: empty when the
  push landed).

A process that fails says so (process 0 on *stop*, the others on *quit*),
and every wait watches for it: a failure reaches the others at once, not at
their deadline. Keys are named by the connect's generation, the push and
the round, so nothing of an earlier connect or push is ever read.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from nccl_cffi.waiting import Deadline

from ..errors import RendezvousError, RendezvousTimeout, StoreError, StoreTimeout
from ..store import KeyValueStore, StoreClient, StoreLimits, StoreServer
from .handles import RebuildArgs

POLL_S = 0.02  # the longest pause between two looks at the store while waiting
LINGER_S = 5.0  # how long process 0 keeps the store open for a failure to be read
Exports = list[dict[str, list[RebuildArgs]]]  # per worker rank: a GPU's UUID -> its exports


class GroupFailed(RendezvousError):
    """Another process of the group failed, and said why.

    Args:
        message: why.
        posted: from process 0, how many rounds of the push it posted (the
            others take back the exports of the rest: no worker saw them).
        kind: from process 0, the class of its error (the others raise alike).
    """

    def __init__(self, message: str, posted: int | None = None, kind: str = ""):
        super().__init__(message)
        self.posted = posted
        self.kind = kind

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.posted, self.kind)


@dataclass(frozen=True, kw_only=True)
class ProbeTarget:
    """A GPU of another process, for the connect's probe.

    Attributes:
        uuid: the GPU's UUID.
        device: that process's CUDA ordinal of it.
        handle: the IPC handle of that process's probe buffer on it.
        process: the process.
        strict: that process named its devices (each must host a worker).
    """

    uuid: str
    device: int
    handle: bytes
    process: int
    strict: bool


class GroupLink:
    """This process's end of the group's store (see the module docstring).

    Args:
        store: the store (``StoreServer`` on process 0, a ``StoreClient`` elsewhere).
        process: this process's index, 0 to ``processes - 1``.
        processes: how many trainer processes push together.
    """

    def __init__(self, store: KeyValueStore, process: int, processes: int):
        self.store, self.process, self.processes = store, process, processes
        self.generation = 0  # bumped by each connect: an older connect's keys never match
        self.push = 0  # bumped by each send(): every process calls it as often
        self.posted = 0  # process 0: the rounds of this push it posted

    @property
    def others(self) -> range:
        """The processes other than 0."""
        return range(1, self.processes)

    def key(self, name: str, process: int, push: int | None = None) -> str:
        """The key of ``name`` for ``process`` in this connect (and ``push``)."""
        at = "c" if push is None else push
        return f"ipc/{self.generation}/{at}/{name}/{process}"

    def step(self, name: str, deadline: Deadline, push: int | None = None) -> None:
        """Process 0 tells the others ``name`` may begin; they wait for it.

        Raises:
            GroupFailed: process 0 said it failed (the others).
            RendezvousTimeout: it did not come within ``deadline``.
        """
        if self.process:
            self.receive(name, deadline, push)
        else:
            self.tell(name, b"", deadline, push)

    # -- process 0 ------------------------------------------------------------
    def tell(self, name: str, value: bytes, deadline: Deadline, push: int | None = None) -> None:
        """Process 0: ``value`` to every other process under ``name``."""
        for p in self.others:
            self.store.set(self.key(name, p, push), value, deadline)

    def hear(self, name: str, deadline: Deadline, push: int | None = None) -> list[bytes]:
        """Process 0: every other process's value under ``name``, in process order.

        Raises:
            GroupFailed: a process said it failed (on ``quit``).
            RendezvousTimeout: one did not send it within ``deadline``.
        """
        return [self._take(name, p, "quit", deadline, push) for p in self.others]

    # -- the other processes ----------------------------------------------------
    def send(self, name: str, value: bytes, deadline: Deadline, push: int | None = None) -> None:
        """A process other than 0: ``value`` to process 0 under ``name``."""
        self.store.set(self.key(name, self.process, push), value, deadline)

    def receive(self, name: str, deadline: Deadline, push: int | None = None) -> bytes:
        """A process other than 0: what process 0 told it under ``name``.

        Raises:
            GroupFailed: process 0 said it failed (on ``stop``).
            RendezvousTimeout: nothing came within ``deadline``.
        """
        return self._take(name, self.process, "stop", deadline, push)

    def ended(self, push: int, deadline: Deadline) -> None:
        """A process other than 0: wait for process 0's outcome of ``push``.

        Raises:
            GroupFailed: the push failed there.
            RendezvousTimeout: no outcome within ``deadline``.
        """
        key = self.key("stop", self.process, push)
        try:
            outcome = self.store.get(key, deadline)
        except StoreTimeout:
            raise RendezvousTimeout(
                "trainer process 0 did not say how the push ended in time: it may have died; "
                "every process calls send() together") from None
        self.store.delete(key, Deadline(5.0))
        if outcome:
            raise _stopped(outcome)

    # -- both -------------------------------------------------------------------
    def fail(self, why: str, push: int | None = None, kind: str = "") -> None:
        """Tell the others this process failed (best effort: the store may be
        gone); process 0 tells the class of its error too (``kind``)."""
        try:
            if self.process:
                self.store.set(self.key("quit", self.process, push), why.encode(), Deadline(5.0))
            else:
                outcome = json.dumps({"why": why, "posted": self.posted, "kind": kind}).encode()
                self.tell("stop", outcome, Deadline(5.0), push)
        except StoreError:
            pass

    def sweep(self, names: Sequence[str], push: int | None = None) -> None:
        """Process 0: delete what ``names`` may have left unread (a failed push)."""
        try:
            for p in self.others:
                for name in names:
                    self.store.delete(self.key(name, p, push), Deadline(5.0))
        except StoreError:
            pass

    def close(self) -> None:
        """Close the store. Process 0 first lets the others read a failure
        it told them at connect (within ``LINGER_S``), so each reads why."""
        if not self.process:
            told = [self.key("stop", p) for p in self.others]
            end = time.monotonic() + LINGER_S
            while time.monotonic() < end and any(self.store.check([k]) for k in told):
                time.sleep(POLL_S)
        self.store.close()

    def _take(self, name: str, process: int, failure: str, deadline: Deadline,
              push: int | None) -> bytes:
        """The value of ``name`` for ``process``, deleted once read, watching
        for the other side's ``failure`` key; within ``deadline``."""
        key = self.key(name, process, push)
        failed = self.key(failure, process, push)
        who = "trainer process 0" if self.process else f"trainer process {process}"
        pause = 0.0005  # doubled up to POLL_S: a quick answer is taken at once
        while True:  # polled with CHECK: a timed-out WAIT would close the client's connection
            if self.store.check([failed]):
                said = self.store.get(failed, Deadline(5.0))
                self.store.delete(failed, Deadline(5.0))  # read: process 0 need not linger
                if failure == "stop":
                    raise _stopped(said)
                raise GroupFailed(f"{who} failed: {said.decode(errors='replace')}")
            if self.store.check([key]):
                value = self.store.get(key, Deadline(5.0))
                self.store.delete(key, Deadline(5.0))
                return value
            if deadline.passed():
                raise RendezvousTimeout(
                    f"{who} did not send {name!r} in time: every trainer process of an "
                    "IPC group must call connect_group(), send() and reconnect() together, "
                    "as often and with the same tree")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)


def _stopped(outcome: bytes) -> GroupFailed:
    """Process 0's failure, as it told it (``fail``)."""
    said = json.loads(outcome)
    return GroupFailed(f"trainer process 0 failed: {said['why']}", said["posted"], said["kind"])


def open_link(address: str, process: int, processes: int, deadline: Deadline) -> GroupLink:
    """Process 0 listens on ``address`` (``host:port``); the others join it,
    retrying while it is not up yet, until ``deadline``.

    Args:
        address: where process 0 listens (loopback: the group shares a node).
        process: this process's index.
        processes: how many push together (2 or more).
        deadline: bounds joining.

    Returns:
        The link.

    Raises:
        ValueError: a malformed address or index.
        StoreError, StoreTimeout: process 0 cannot listen there, or the
            others cannot reach it in time.
    """
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"the group's store address must be host:port (a port from 1 to "
                         f"65535, which every process names), got {address!r}")
    if not 0 <= process < processes or processes < 2:
        raise ValueError(f"process {process} of {processes}: a group has 2 or more processes, "
                         "each with an index from 0")
    if process == 0:
        store: KeyValueStore = StoreServer(host.strip("[]"), int(port), joined=1,
                                           limits=StoreLimits(max_joins=processes))
    else:
        store = StoreClient(host.strip("[]"), int(port), deadline=deadline, world_size=processes)
    return GroupLink(store, process, processes)


def hello(uuids: dict[int, str], handles: dict[int, bytes], *, packed: bool,
          strict: bool) -> bytes:
    """What a process other than 0 sends at connect: its GPUs, each with its
    probe buffer's handle, its packing, whether it named its devices."""
    gpus = [[u, d, base64.b64encode(handles[d]).decode()] for d, u in uuids.items()]
    return json.dumps({"gpus": gpus, "packed": packed, "strict": strict}).encode()


def targets(hellos: Sequence[bytes], packed: bool) -> list[ProbeTarget]:
    """Process 0: the other processes' GPUs from their hellos, their packing
    checked against its own.

    Raises:
        RendezvousError: a process packs otherwise, or two hold one GPU.
    """
    out = []
    for p, raw in enumerate(hellos, start=1):
        h = json.loads(raw)
        if h["packed"] != packed:
            raise RendezvousError(
                f"trainer process {p} connects with SendConfig(packed={h['packed']}) and "
                f"process 0 with packed={packed}: every process of the group must pack alike")
        out += [ProbeTarget(uuid=u, device=d, handle=base64.b64decode(b), process=p,
                            strict=h["strict"]) for u, d, b in h["gpus"]]
    return out


def encoded(exports: Exports, digest: str) -> bytes:
    """A round's exports of a process other than 0, with its push's digest."""
    ranks = [{u: [[list(a.shape), a.dtype, a.itemsize, a.device,
                   base64.b64encode(a.handle).decode(), a.offset, a.counter, a.slot]
                  for a in args] for u, args in e.items()} for e in exports]
    return json.dumps({"digest": digest, "ranks": ranks}).encode()


def merged(mine: Exports, theirs: Sequence[bytes], digest: str) -> Exports:
    """Process 0: every rank's exports from all the processes.

    Raises:
        ValueError: a process pushes another tree (its digest differs: its
            handles would be loaded as other tensors).
    """
    out = [dict(e) for e in mine]
    for p, raw in enumerate(theirs, start=1):
        part = json.loads(raw)
        if part["digest"] != digest:
            raise ValueError(
                f"trainer process {p} pushes other tensors than process 0 (names, shapes, "
                "dtypes or chunks differ): every process of an IPC group pushes the same tree")
        for rank, e in enumerate(part["ranks"]):
            for u, args in e.items():
                out[rank][u] = [RebuildArgs(shape=tuple(s), dtype=t, itemsize=i, device=d,
                                            handle=base64.b64decode(h), offset=o, counter=c,
                                            slot=n) for s, t, i, d, h, o, c, n in args]
    return out


def strict_idle(others: Sequence[ProbeTarget], ranks: Sequence[str]) -> list[str]:
    """Process 0: the GPUs of processes that named their devices where no
    worker is, for the refusal."""
    return [f"process {t.process}'s GPU {t.device} ({t.uuid})" for t in others
            if t.strict and t.uuid not in ranks]


def answer(ranks: Sequence[str]) -> bytes:
    """Process 0's answer to a connect: each worker rank's GPU."""
    return json.dumps(list(ranks)).encode()


def ranks_of(raw: bytes) -> list[str]:
    """The answer's ranks."""
    return list(json.loads(raw))


def failure(e: BaseException) -> str:
    """A failure as the others read it."""
    return f"{type(e).__name__}: {e}"

