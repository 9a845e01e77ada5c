"""The ref-counter file of torch's CUDA IPC producer, written without torch.

A worker that rebuilds a tensor from the trainer's IPC handle counts its
use on the trainer's behalf: when the rebuilt storage dies it opens the
file named in the handle's arguments (``/dev/shm/<name>``, never creating
it), adds one to the file's header, subtracts one from the export's slot,
subtracts one from the header, and unlinks the file once the header is 0.
The producer may reuse or free the exported memory only once every slot it
handed out is back to 0: before that a worker may still read it.

Layout, as torch's ``RefcountedMapAllocator`` makes it (80,064 bytes): a
64-byte header whose first int32 counts the processes that map the file
(the producer creates it at 1), then ``SLOTS`` int64 counters.

Why the producer holds its own count on the header for the file's whole
life and unlinks the file itself: a worker that took the header to 0 would
unlink it, and a failed unlink inside the storage's destructor aborts the
worker. The file is unlinked on ``close()`` (and at interpreter exit if
``close()`` was never called). A trainer killed outright cannot unlink it:
so the producer holds an ``flock`` on its file for the file's life, and
each new one removes the files of its prefix whose lock it can take (their
producer is gone; a lock, unlike a process id, holds across containers
sharing ``/dev/shm``). A file appears under its name already locked: it is
made under a hidden name, locked, then renamed.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import weakref
from collections import deque
from collections.abc import Iterable

from nccl_cffi.waiting import Check, no_check, poll_until

from ..errors import RendezvousError

log = logging.getLogger("uniqueid")
HEADER_BYTES = 64  # at::map_alloc_alignment
SLOTS = 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE
FILE_BYTES = HEADER_BYTES + 8 * SLOTS
SHM = "/dev/shm"


class CountersHeld(RendezvousError):
    """Exported memory a worker still counts as in use past the deadline."""


class RefCounters:
    """This process's ref-counter file: one slot per export, taken with
    ``take`` (set to 1) and free again once a worker brought it back to 0.

    Args:
        prefix: the file's name starts ``/<prefix>_<pid>_``.

    Raises:
        RendezvousError: ``/dev/shm`` cannot hold the file (a sentence with
            the fix: a container needs a shared ``/dev/shm``).
    """

    def __init__(self, prefix: str = "jax_vllm"):
        sweep(prefix)
        self.name = f"/{prefix}_{os.getpid()}_{secrets.token_hex(6)}"
        path, hidden = SHM + self.name, f"{SHM}/.{self.name[1:]}"
        try:
            fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise RendezvousError(
                f"cannot create the CUDA IPC ref-counter file {path} ({e.strerror}): the trainer "
                "and vLLM share memory through /dev/shm; it must exist and be writable (in a "
                "container: --ipc=host or a shared /dev/shm)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for the file's life (``sweep``)
            os.ftruncate(fd, FILE_BYTES)
            self._map = mmap.mmap(fd, FILE_BYTES)
            struct.pack_into("<i", self._map, 0, 1)  # this process maps it
            os.rename(hidden, path)
        except BaseException:
            os.close(fd)
            _remove(hidden)
            raise
        self._fd = fd
        self._taken: set[int] = set()
        self._free = deque(range(SLOTS))
        self._unlink = weakref.finalize(self, _remove, path)
        atexit.register(self._unlink)

    def take(self, n: int = 1) -> list[int]:
        """``n`` slots no export holds, each set to 1 (one export's count).

        Args:
            n: how many.

        Returns:
            Their indices.

        Raises:
            CountersHeld: fewer than ``n`` free slots (exports that workers
                never released).
        """
        if n > len(self._free):
            self.settle()
        if n > len(self._free):
            raise CountersHeld(f"{SLOTS - len(self._free)} of the {SLOTS} CUDA IPC ref counters "
                               "are still held by vLLM's workers (they never released the "
                               "trainer's memory): reconnect() or restart the server")
        out = [self._free.popleft() for _ in range(n)]
        for slot in out:
            struct.pack_into("<q", self._map, _at(slot), 1)
        self._taken.update(out)
        return out

    def value(self, slot: int) -> int:
        """A slot's count now.

        Args:
            slot: its index.

        Returns:
            The count (0: no worker holds that export).
        """
        return struct.unpack_from("<q", self._map, _at(slot))[0]

    def settle(self) -> None:
        """Free again the slots workers brought back to 0, behind the others
        (round robin: a slot a late worker may still decrement is not handed
        out at once)."""
        back = [s for s in self._taken if self.value(s) <= 0]
        self._taken.difference_update(back)
        self._free.extend(sorted(back))

    def held(self, slots: Iterable[int]) -> list[int]:
        """Those of ``slots`` some worker still counts.

        Args:
            slots: slot indices.

        Returns:
            The ones whose count is above 0.
        """
        return [s for s in slots if self.value(s) > 0]

    def wait(self, slots: Iterable[int], timeout: float | None, what: str, *,
             check: Check = no_check) -> None:
        """Return once every slot of ``slots`` is back to 0.

        Workers release after they answer (the rebuilt storage dies when
        their call returns, or at ``/finish_weight_update`` for a packed
        buffer), so the counters are polled, within ``timeout``.

        Args:
            slots: the exports to wait for.
            timeout: seconds to wait at most.
            what: the memory, for the error.
            check: polled while waiting; what it raises ends the wait.

        Raises:
            CountersHeld: some are still held past ``timeout``.
        """
        slots = list(slots)
        poll_until(lambda: not self.held(slots), timeout, check=check,
                   on_timeout=lambda: self._still_held(slots, what))

    def _still_held(self, slots: list[int], what: str) -> CountersHeld:
        return CountersHeld(
            f"vLLM's workers still map {what} ({len(self.held(slots))} of {len(slots)} exports, "
            f"ref-counter file /dev/shm{self.name}): a worker that cannot open that file "
            "(another /dev/shm, another user) never releases it; run trainer and server with "
            "a shared /dev/shm (--ipc=host) as the same user, or restart the server")

    def drop(self, slots: Iterable[int]) -> None:
        """Withdraw exports no worker will rebuild (set to 0, free again).

        Args:
            slots: their slots.
        """
        for slot in slots:
            struct.pack_into("<q", self._map, _at(slot), 0)
        self.settle()

    def close(self) -> None:
        """Unlink the file (a worker's later release finds none, and skips it)."""
        self._unlink()
        self._map.close()
        os.close(self._fd)


def sweep(prefix: str) -> list[str]:
    """Remove the ref-counter files of ``prefix`` in ``/dev/shm`` whose
    producer is gone (their lock is free); another user's are left alone.

    Args:
        prefix: the files' prefix (``RefCounters``'s).

    Returns:
        The names removed.
    """
    pattern, out = re.compile(rf"{re.escape(prefix)}_\d+_[0-9a-f]{{12}}"), []
    for name in os.listdir(SHM):
        if not pattern.fullmatch(name):
            continue
        try:
            fd = os.open(f"{SHM}/{name}", os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its producer is alive
        else:
            _remove(f"{SHM}/{name}")
            out.append(name)
        finally:
            os.close(fd)
    if out:
        log.info("removed %d ref-counter file(s) of trainers that are gone: %s", len(out), out)
    return out


def _at(slot: int) -> int:
    if not 0 <= slot < SLOTS:
        raise ValueError(f"ref-counter slot {slot} is outside 0..{SLOTS - 1}")
    return HEADER_BYTES + 8 * slot


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
