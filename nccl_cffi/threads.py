"""Daemon threads kept for reuse: the blocking inits, a push's NCCL calls,
its HTTP calls.

Why kept: ``Thread.start`` returns only once the new thread runs, which
the caller pays for every thread, and a push starts two (its NCCL calls'
and its ``/update_weights`` call's); and ``ncclCommInitRank`` was measured
slower on a fresh thread than on one that had made one before
(docs/benchmarks.md, "Figures behind the design").

Why daemon: a job stuck in NCCL or in an HTTP call to a stuck server must
not keep the interpreter from exiting. A thread still inside such a job is
not reused until the job returns; other jobs get another thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable


class _Worker:
    """One kept thread, named for its kind of job (``name``) for its life."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()  # a job never raises: it reports through its own future
            with _lock:
                _idle.setdefault(self.name, []).append(self)


_idle: dict[str, list[_Worker]] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: a job queued for one
    would never run."""
    global _lock
    _idle.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def run_in_thread(job: Callable[[], None], name: str) -> None:
    """Run ``job`` on an idle kept thread that ran jobs of the same ``name``,
    or on a new one. ``job`` must not raise: it reports through a future or
    an event.

    Kinds are kept apart: an init was measured faster on a thread that had
    made an init before, so an init thread stays an init thread.
    """
    with _lock:
        idle = _idle.get(name)
        worker = idle.pop() if idle else _Worker(name)
    worker.jobs.put(job)
