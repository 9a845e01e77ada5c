"""The core of a push: vLLM's update protocol around the broadcasts, and the
handle the caller waits on.

``run_push`` is the protocol: pause, ``/start_weight_update``, per round an
``/update_weights`` in flight while that round's broadcasts run,
``/finish_weight_update``, resume. It takes what it talks to (a control
plane, a broadcaster) as arguments, so it runs on CPU against in-memory ones.

Where it runs: the protocol on the caller's thread (a blocking ``send``) or
on a thread of its own (``send(wait=False)``); the NCCL calls always on a
kept thread of their own (``Lane``). Why split: the communicator is
blocking (its calls launch four times faster), and a blocking NCCL call
can, in a rare failure (a peer gone while a connection is set up), never
return; it then holds the lane's thread, while the protocol's thread, which
makes no NCCL call, still fails the push with its reason. Why the caller's
thread: each handoff between threads costs a wake-up (~0.05 ms), and a
blocking push whose protocol ran elsewhere paid two more of them, a few
percent of a 4 KiB push.

Every wait of the push polls ``check``, which raises once the push is
cancelled (Ctrl-C, ``close``), a server answered with an error, or an NCCL
call overstayed its deadline. On any failure the lane is stopped at its
next poll and the communicator aborted once no NCCL call is in flight; a
lane stuck inside one is abandoned instead: the sender is broken, the
communicator is never freed under it (the lane aborts it if the call ever
returns), and ``reconnect()`` forms a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

from nccl_cffi.threads import run_in_thread
from uniqueid import in_background

from .control import ControlPlane
from .errors import SendError

Check = Callable[[], None]
# A round: the update_info payload, and what broadcasts it (given a check).
Round = tuple[dict[str, Any], Callable[[Check], None]]
# How long a cancelled push may take to stop before the caller stops waiting.
CANCEL_GRACE_S = 2.0


class PushCancelled(SendError):
    """The push was cancelled (Ctrl-C while waiting on it, or ``close()``)."""


@dataclass
class SendStats:
    """What one push moved and where its time went (seconds)."""

    bytes: int
    tensors: int
    chunks: int
    packed: bool
    reused_metadata: bool
    prepare_s: float
    start_s: float = 0.0
    transfer_s: float = 0.0  # posting /update_weights -> every server answered
    # the /update_weights calls themselves, timed inside their threads (the
    # slowest server's), as vLLM's torch engine is timed: transfer_s less handoffs
    update_s: float = 0.0
    finish_s: float = 0.0
    broadcast_s: float = 0.0  # first broadcast launched -> last one done (host clock)
    host_s: float = 0.0  # host time getting and packing tensors, inside transfer_s
    link_s: float = 0.0  # GPU time from the end of each round's first broadcast to its last
    link_bytes: int = 0  # the bytes sent in link_s
    returned_s: float = 0.0  # send() called -> it returned (all of it when blocking)

    @property
    def total_s(self) -> float:
        return self.prepare_s + self.start_s + self.transfer_s + self.finish_s

    @property
    def transfer_gbps(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0

    def __str__(self) -> str:
        return (f"{self.bytes / 1e9:.3f} GB, {self.tensors} tensors, {self.chunks} "
                f"{'chunks' if self.packed else 'broadcasts'}: prepare {self.prepare_s:.3f}s, "
                f"start {self.start_s:.3f}s, transfer {self.transfer_s:.3f}s "
                f"({self.transfer_gbps:.1f} GB/s; broadcasts {self.broadcast_s:.3f}s), "
                f"finish {self.finish_s:.3f}s")


class Timed(Protocol):
    """What a broadcaster reports of its last pass."""

    started: float
    host_s: float
    link_s: float
    link_bytes: int


class Lane:
    """The kept thread (``jax-sender-nccl``) that makes one push's NCCL calls,
    a round's broadcasts at a time, and the way to stop it."""

    def __init__(self) -> None:
        self._job: Future[float] | None = None
        self._stop = threading.Event()

    def run(self, broadcast: Callable[[Check], None], check: Check) -> Future[float]:
        """Start ``broadcast(check)`` on the lane's thread; its future, whose
        result is the instant it ended (``time.perf_counter()``)."""
        def guarded() -> None:
            if self._stop.is_set():
                raise PushCancelled("the push was stopped after a failure")
            check()

        def job() -> float:
            broadcast(guarded)
            return time.perf_counter()

        self._job = in_background(job, name="jax-sender-nccl")
        return self._job

    def stop(self, grace: float) -> bool:
        """Make a running round stop at its next poll; whether the lane has
        left its NCCL calls within ``grace`` seconds (then nothing uses the
        communicator and it may be aborted)."""
        self._stop.set()
        job = self._job
        if job is None:
            return True
        try:
            job.exception(timeout=grace)
        except FutureTimeout:
            return False
        return True

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the lane's thread once its round ends (at once if
        none runs)."""
        if self._job is None:
            fn()
        else:
            self._job.add_done_callback(lambda _: fn())

    @property
    def busy(self) -> bool:
        """A round still runs (an abandoned lane: inside an NCCL call)."""
        return self._job is not None and not self._job.done()


def run_push(rounds: Sequence[Round], control: ControlPlane, broadcaster: Timed, lane: Lane, *,
             timeout_s: float, http_timeout_s: float, weight_version: str | None,
             pause: str | None, cancelled: Check, stats: SendStats,
             ready: Callable[[], None] | None = None) -> None:
    """Run the protocol on this thread and the broadcasts on ``lane``,
    filling ``stats``; raises on the first failure (the caller stops the
    lane and aborts its communicator). ``cancelled`` raises once the push is
    cancelled; it is polled in every wait, here and on the lane.

    ``ready`` waits until the arrays the broadcasts read are computed. It
    runs on a thread of its own while ``/start_weight_update`` is answered,
    and ``/update_weights`` is posted only once it is done: the workers then
    never sit in NCCL waiting for the trainer's step, yet a push of
    thousands of arrays does not pay for their readiness before it starts.
    Like every wait of the push, it has ``timeout_s``."""
    if pause:
        control.pause(pause)
    try:
        t1 = time.perf_counter()
        computed = in_background(ready, name="jax-sender-ready") if ready else None
        deadline = time.monotonic() + timeout_s
        control.start()
        if computed is not None and not _await(computed, deadline, cancelled):
            raise TimeoutError(
                f"the arrays to push were not computed within {timeout_s}s of send() (is the "
                "trainer's step still running, or stuck?): call send() once the step is done, "
                "or raise SendConfig.send_timeout_s")
        t2 = time.perf_counter()
        for payload, broadcast in rounds:
            span, update = _round(payload, broadcast, control, broadcaster, lane, timeout_s,
                                  http_timeout_s, cancelled)
            stats.broadcast_s += span
            stats.update_s += update
            stats.host_s += broadcaster.host_s
            stats.link_s += broadcaster.link_s
            stats.link_bytes += broadcaster.link_bytes
        t3 = time.perf_counter()
        control.finish(weight_version)
        t4 = time.perf_counter()
    except BaseException:
        if pause:
            try:
                control.resume()
            except Exception:  # the first failure is the one to report
                pass
        raise
    if pause:
        control.resume()
    stats.start_s, stats.transfer_s, stats.finish_s = t2 - t1, t3 - t2, t4 - t3


def _round(payload: dict[str, Any], broadcast: Callable[[Check], None], control: ControlPlane,
           broadcaster: Timed, lane: Lane, timeout_s: float, http_timeout_s: float,
           cancelled: Check) -> tuple[float, float]:
    """Broadcast on ``lane`` while the workers receive in ``/update_weights``;
    returns the broadcasts' span (first launch to last done, host clock)
    and the slowest ``/update_weights`` call's own time."""
    futures = control.update(payload, http_timeout_s)

    def check() -> None:
        cancelled()
        for f in futures:  # a worker that refused fails the push at once
            if f.done() and f.exception() is not None:
                f.result()

    check()
    sent = lane.run(broadcast, check)
    # The answers are awaited first: the broadcasts end before them, so this
    # thread wakes once a round, not twice. The broadcasts' waits have their
    # own deadlines (and ``cancelled`` raises for an NCCL call that
    # overstays its own); the answers' runs from the broadcasts' end.
    answer_by: list[float] = []

    def watch() -> None:
        check()
        if not answer_by and sent.done():
            sent.result()  # the lane's failure
            answer_by.append(time.monotonic() + timeout_s)

    for client, f in zip(control.clients, futures):
        if not _await(f, lambda: answer_by[0] if answer_by else None, watch):
            raise TimeoutError(
                f"{client.base_url}/update_weights did not answer within {timeout_s}s of the "
                "last broadcast: a worker is stuck (in load_weights, or in NCCL waiting for "
                "data that was never sent)")
    _await(sent, None, check)
    span = sent.result() - broadcaster.started if broadcaster.started else 0.0
    return span, max((f.result() for f in futures), default=0.0)


def _await(future: Future, deadline: float | Callable[[], float | None] | None,
           check: Check) -> bool:
    """Wait for ``future`` (raising its exception), polling ``check``; False
    once ``deadline`` (``time.monotonic()``, or what a callable gives) has passed."""
    while True:
        check()
        limit = deadline() if callable(deadline) else deadline
        left = 0.05 if limit is None else min(0.05, max(limit - time.monotonic(), 0.0))
        try:
            future.result(timeout=left)
            return True
        except FutureTimeout:
            if limit is not None and time.monotonic() > limit:
                return False


def _no_check() -> None:
    pass


class PendingSend:
    """A push in flight. ``result()`` waits for it.

    ``done()``: whether it finished (either way). ``result(timeout)``: its
    ``SendStats``, or its ``SendError``; ``TimeoutError`` if it has not
    finished within ``timeout`` seconds (it goes on). A Ctrl-C while
    waiting cancels the push (the communicator is aborted) and propagates.

    ``name``: the kept thread it runs on; None for a push the caller runs
    itself (``run_here``, a blocking send), which ``cancel`` still stops.
    """

    def __init__(self, work: Callable[[Check], SendStats], *, name: str | None):
        self._future: Future[SendStats] = Future()
        self._cancel = threading.Event()
        self._stopped = threading.Event()
        self._why = ""
        self._work = work
        if name is not None:
            run_in_thread(self._run, name)

    def _run(self) -> None:
        try:
            self._future.set_result(self._work(self._cancelled))
        except BaseException as e:
            self._future.set_exception(e)
        finally:
            self._stopped.set()

    def run_here(self) -> SendStats:
        """Run the push on the calling thread; its ``SendStats``, or what it
        raised (a Ctrl-C meanwhile propagates, once the push has stopped)."""
        self._run()
        return self._future.result()

    def _cancelled(self) -> None:
        if self._cancel.is_set():
            raise PushCancelled(f"the push was cancelled ({self._why})")

    def cancel(self, why: str) -> None:
        """Ask the push to stop: it aborts its communicator at its next poll."""
        self._why = why
        self._cancel.set()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SendStats:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if _await(self._future, deadline, _no_check):
                return self._future.result()
            raise TimeoutError(f"the push did not finish within {timeout}s; it goes on "
                               "(wait again, or close() to cancel it)")
        except KeyboardInterrupt:
            self.cancel("KeyboardInterrupt")
            self.wait_stopped(CANCEL_GRACE_S)
            raise

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the push to end, whatever the outcome."""
        return self._stopped.wait(timeout)
