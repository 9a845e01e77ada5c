"""One push as a transaction: vLLM's update protocol around the broadcasts,
and what each failure leaves on the servers.

The protocol: pause, ``/start_weight_update``, per round an
``/update_weights`` in flight while that round's broadcasts run,
``/finish_weight_update``, resume. vLLM's workers wait inside NCCL for
every broadcast a round announced, with no deadline, so once a server has
started an update the push must end there:

* a failure on the **trainer's side** (a transform or XLA raising, the
  arrays not computed in time) while the communicator and the
  peers are healthy is *wound down*: the broadcasts the round announced are
  completed from scratch bytes, the answers awaited, no new round posted
  (except in a group, whose other processes cannot know: every round goes
  on, this process's part from scratch), the session finished, the pause
  undone. The caller gets ``UpdateIncomplete`` (or, when nothing was
  announced yet, the failure itself: the servers keep their weights), and
  the sender stays usable.
* a failure of a **peer or a deadline** (a server refused or went silent,
  NCCL failed, a wait overran its deadline) or a second Ctrl-C propagates:
  the session (``session.py``) aborts the communicator, since no more bytes
  can be trusted to arrive.

It takes what it talks to (a control plane, a broadcaster, a lane) as
arguments, so it runs on CPU against in-memory ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from nccl_cffi import Job, NcclError, await_future, in_background
from nccl_cffi.waiting import Check
from uniqueid import RendezvousError, RendezvousTimeout
from uniqueid.http.fleet import Calls

from .broadcaster import Fill, Part
from .control import ControlPlane, best_effort
from .errors import SendError, UpdateIncomplete
from .feeds import Received, Rest
from .stats import SendStats
from .tensors.plan import TensorMeta


class Broadcasts(Protocol):
    """What the protocol asks of a broadcaster (``Broadcaster``, or a
    stand-in on CPU): complete a failed pass, and report the last one."""

    started: float
    host_s: float
    link_s: float
    link_bytes: int

    def complete(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                 check: Check) -> None: ...

    def scratch(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                check: Check) -> None: ...


# A round's part on this process: its broadcasts (or receiving another
# rank's), given the broadcaster, one wait's deadline and the check to poll.
Feed = Callable[[Any, float, Check], None]


@dataclass(kw_only=True)
class Round:
    """One ``/update_weights`` call and the broadcasts that go with it.

    Attributes:
        update: the ``update_info`` payload (posted by process 0 only).
        root: the broadcasting group rank.
        parts: every broadcast the workers expect, in order.
        feed: this process's part of the round.
        fill: what completes part ``k`` after the feed failed, where the
            workers' loader needs more than scratch bytes (sparse patches:
            distinct indices); None: scratch bytes.
        staged: the workers read the bytes by handles the update carries
            (CUDA IPC), so the feed places them first and returns the
            update to post (``update`` is unused); the round has no broadcasts.
    """

    update: dict[str, Any]
    root: int
    parts: list[Part]
    feed: Feed
    fill: Fill | None = None
    staged: bool = False


@dataclass(kw_only=True)
class PreparedPush:
    """A validated push, ready to run.

    Attributes:
        rounds: in order.
        stats: filled as it runs.
        timeout_s: one wait's deadline (a broadcast, an HTTP call, the
            answers after the last broadcast).
        update_timeout_s: an ``/update_weights`` call's, as a whole.
        sent: per broadcasting rank, the metadata the workers hold after it.
        ready: waits until the arrays read are computed, or None.
        weight_version: stamped by ``/finish_weight_update``.
        pause: ``"abort"``/``"wait"``/``"keep"``, or None.
        alone: one trainer process (a failure posts no further round).
        rank: this process's group rank.
    """

    rounds: list[Round]
    stats: SendStats
    timeout_s: float
    update_timeout_s: float
    sent: dict[int, list[TensorMeta]] = field(default_factory=dict)
    ready: Callable[[], None] | None = None
    weight_version: str | None = None
    pause: str | None = None
    alone: bool = True
    rank: int = 0

    @property
    def bound_s(self) -> float:
        """How long the whole push may take at most, every wait at its deadline."""
        calls = 4 if self.pause else 2  # start and finish, pause and resume
        return calls * self.timeout_s + len(self.rounds) * (self.update_timeout_s + self.timeout_s)


class Lane:
    """The kept thread (``jax-sender-nccl``) that makes a push's NCCL calls,
    one round at a time, and the way to stop it.

    Why a thread of its own: the communicator is blocking (its calls launch
    four times faster than a non-blocking one's), and a blocking NCCL call
    can, in a rare failure (a peer gone while a connection is set up), never
    return; it then holds the lane, while the protocol's thread, which makes
    no NCCL call, still fails the push with its reason.
    """

    def __init__(self) -> None:
        self._job: Job[float] | None = None

    def run(self, feed: Callable[[Check], None], check: Check) -> Future[float]:
        """Start ``feed(check)`` on the lane; its future's result is the
        instant it ended (``time.perf_counter()``)."""
        def work(stopped: Check) -> float:
            def guarded() -> None:
                stopped()
                check()
            feed(guarded)
            return time.perf_counter()

        self._job = Job(work, name="jax-sender-nccl")
        return self._job.future

    def stop(self, grace: float) -> bool:
        """Make a running round stop at its next poll; whether it left its
        NCCL calls within ``grace`` seconds (then the communicator may be aborted)."""
        return self._job is None or self._job.stop(grace)

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the lane's round ends (at once if none runs)."""
        if self._job is None:
            fn()
        else:
            self._job.then(lambda _: fn())

    @property
    def busy(self) -> bool:
        """A round still runs (for an abandoned lane: inside an NCCL call)."""
        return self._job is not None and self._job.busy


class Aborted(Exception):
    """Raised inside a push that must stop at once (a second Ctrl-C)."""


def aborts(exc: BaseException) -> bool:
    """Whether a failure leaves the communicator or the peers untrustworthy
    (abort), rather than being the trainer's own (wind down)."""
    return isinstance(exc, (NcclError, RendezvousError, Aborted, KeyboardInterrupt, SystemExit))


class Transaction:
    """One push from ``/start_weight_update`` to ``/finish_weight_update``.

    Args:
        push: what to send.
        control: the servers' routes (none off process 0).
        broadcaster: what moves the bytes.
        lane: where the NCCL calls run.
        check: raises once the push must stop at once (polled in every wait).
    """

    def __init__(self, push: PreparedPush, control: ControlPlane, broadcaster: Broadcasts,
                 lane: Lane, *, check: Check):
        self.push, self.control, self.broadcaster, self.lane = push, control, broadcaster, lane
        self.check = check
        self.failure: BaseException | None = None  # the trainer's own, wound down
        self.started = False  # /start_weight_update answered on every server
        self.announced = False  # an /update_weights was (or was being) posted
        self.finishing = False  # /finish_weight_update was posted
        self.finished = False  # /finish_weight_update answered on every server
        self.left_open = False  # a server may be left inside an update session
        self._sent: Future[float] | None = None  # the lane's current round
        self._span = 0.0

    def run(self) -> SendStats:
        """Run the push on this thread and its broadcasts on the lane.

        Returns:
            Its figures; if it was wound down, ``failure`` is set and
            ``outcome()`` is the error to raise.

        Raises:
            BaseException: a failure that aborts (see ``aborts``); the
                caller stops the lane and aborts the communicator.
        """
        p, stats = self.push, self.push.stats
        if p.pause:
            self.control.pause(p.pause)
        try:
            t1 = time.perf_counter()
            self._start()
            t2 = time.perf_counter()
            for r in p.rounds:
                if self.failure is not None and p.alone:
                    break
                self._round(r)
            t3 = time.perf_counter()
            self.finishing = True
            self.control.finish(None if self.failure else p.weight_version)
            self.finished = True
            t4 = time.perf_counter()
        except BaseException:
            self._close_session()
            if p.pause:  # the first failure is the one to report
                best_effort([self.control.resume])
            raise
        if p.pause:
            self.control.resume()
        stats.start_s, stats.transfer_s, stats.finish_s = t2 - t1, t3 - t2, t4 - t3
        return stats

    def _start(self) -> None:
        """``/start_weight_update`` while a thread waits for the arrays to be
        computed; the first ``/update_weights`` is posted only once they
        are, so no worker waits in NCCL for the trainer's step."""
        ready = self.push.ready
        computed = in_background(ready, name="jax-sender-ready") if ready else None
        deadline = time.monotonic() + self.push.timeout_s
        try:
            self.control.start()
        except BaseException:
            self.left_open = self.control.left_open
            raise
        self.started = True
        try:
            if computed is not None and not await_future(computed, deadline, self.check):
                raise TimeoutError(
                    f"the arrays to push were not computed within {self.push.timeout_s}s of "
                    "send() (is the trainer's step still running, or stuck?): call send() once "
                    "the step is done, or raise SendConfig.send_timeout_s")
        except BaseException as e:
            if aborts(e):
                raise
            self.failure = e

    def _close_session(self) -> None:
        """After a failure before any ``/update_weights``: finish the session
        the servers opened (nothing is in flight); one that cannot be
        finished is left open, for ``reconnect()`` to finish."""
        if not self.started or self.announced or self.finished:
            return
        if self.finishing:  # it was posted and failed: the session's state is unknown
            self.left_open = True
            return
        try:
            self.control.finish(None)
            self.finished = True
        except BaseException:
            self.left_open = True

    def _round(self, r: Round) -> None:
        if r.staged:
            self._staged(r)
            return
        p = self.push
        self.announced = True  # before posting: an interrupt in between must abort
        calls = self.control.update(r.update, p.update_timeout_s)
        feed = r.feed if self.failure is None or r.root != p.rank else Received(
            parts=r.parts, root=r.root)
        try:
            self._broadcast(feed, calls)
        except BaseException as e:
            if aborts(e) or not self._lane_failed(e):
                calls.cancel()  # the communicator goes: no answer is worth waiting for
                raise
            self.failure = e  # the feed failed on the trainer's side: complete the round
            self._broadcast(Rest(parts=r.parts, root=r.root, fill=r.fill), calls)
            return
        if self.failure is None:
            self._tally(calls)

    def _staged(self, r: Round) -> None:
        """A round whose update names bytes the trainer placed before
        posting it (CUDA IPC: a worker maps them as the update reaches
        it). The feed stages them on the lane and returns the update; a
        feed that fails on the trainer's side sent nothing of the round, so
        the push winds down with no further round."""
        timeout, made = self.push.timeout_s, []
        staged = self._sent = self.lane.run(
            lambda c: made.append(r.feed(self.broadcaster, timeout, c)), self.check)
        try:
            await_future(staged, None, self.check)  # the feed's waits have their deadlines
            staged.result()
        except BaseException as e:
            if aborts(e) or not self._lane_failed(e):
                raise
            self.failure = e
            return
        self.announced = True
        calls = self.control.update(made[0], self.push.update_timeout_s)
        if not await_future(calls.settled, time.monotonic() + self.push.update_timeout_s,
                            lambda: (self.check(), calls.raise_first())):
            raise RendezvousTimeout(
                f"{calls.named(calls.pending(), '/update_weights')} did not answer within "
                f"{self.push.update_timeout_s}s: a worker is stuck loading the weights")
        calls.raise_first()
        self._span = staged.result() - self.broadcaster.started if self.broadcaster.started else 0.0
        self._tally(calls)

    def _broadcast(self, feed: Feed, calls: Calls[Any]) -> None:
        """Run ``feed`` on the lane while the workers receive in
        ``/update_weights``; wait for the answers, then for the lane."""
        def check() -> None:
            self.check()
            calls.raise_first()  # a worker that refused fails the push at once

        check()
        timeout = self.push.timeout_s
        sent = self._sent = self.lane.run(lambda c: feed(self.broadcaster, timeout, c), check)
        # The answers are awaited first: the broadcasts end before them, so this
        # thread wakes once a round, not twice. The answers' deadline runs from
        # the broadcasts' end; the broadcasts' waits have their own.
        answer_by: list[float] = []

        def watch() -> None:
            check()
            if not answer_by and sent.done():
                sent.result()  # the lane's failure
                answer_by.append(time.monotonic() + timeout)

        if not await_future(calls.settled, lambda: answer_by[0] if answer_by else None, watch):
            raise RendezvousTimeout(
                f"{calls.named(calls.pending(), '/update_weights')} did not answer within "
                f"{timeout}s of the last broadcast: a worker is stuck (in load_weights, or in "
                "NCCL waiting for data that was never sent)")
        calls.raise_first()
        await_future(sent, None, check)
        self._span = sent.result() - self.broadcaster.started if self.broadcaster.started else 0.0

    def _lane_failed(self, e: BaseException) -> bool:
        """Whether ``e`` is what the lane's feed raised (not this thread's own)."""
        sent = self._sent
        return sent is not None and sent.done() and sent.exception() is e

    def _tally(self, calls: Calls[Any]) -> None:
        stats, b = self.push.stats, self.broadcaster
        stats.broadcast_s += self._span
        stats.update_s += max(calls.times, default=0.0)
        stats.host_s += b.host_s
        stats.link_s += b.link_s
        stats.link_bytes += b.link_bytes

    def outcome(self) -> SendError:
        """The error a wound-down push raises, its cause chained:
        ``UpdateIncomplete`` once the servers were told to expect bytes, else
        a ``SendError`` (the servers keep their weights)."""
        e = self.failure
        why = f"{type(e).__name__}: {e}"
        if not self.announced:
            err = SendError(f"weight push stopped before any weights were sent ({why}); the "
                            "servers finished the update with nothing in it and keep their "
                            "weights; the sender is usable")
        else:
            err = UpdateIncomplete(
                f"weight push failed on the trainer's side after the servers started the update "
                f"({why}); the rest of what they expected was sent as filler bytes and the "
                "update finished, so the servers now hold an incomplete update: the next "
                "send() pushes every tensor again and repairs it")
        err.__cause__ = e
        return err
