"""Waiting with a way out: deadlines that bound a whole call, a poll loop
that checks between polls, and jobs on kept threads that a caller may stop
waiting for.

Every blocking step of these packages waits through here. Why poll rather
than block: the CUDA driver offers no timed wait, a stream stuck behind a
collective whose peer died never completes, and a blocking NCCL call cannot
be interrupted; so a wait is a query loop that also watches what may end it
early (a server's refusal, a cancel, NCCL's asynchronous errors), and a call
that cannot be interrupted runs on a thread the caller can give up on.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Generic, TypeVar

from .threads import run_in_thread

T = TypeVar("T")
# What a long wait calls between its slices: it raises to end the wait early
# (a stopped push, a server's refusal, NCCL's asynchronous error).
Check = Callable[[], None]

__all__ = ["MAX_TIMEOUT_S", "Check", "Deadline", "Job", "JobStopped", "await_future", "check_timeout",
           "in_background", "no_check", "poll_until"]

# The longest deadline any call or setting may ask for: 10^9 s (32 years).
# Python's timed waits (threading's, a socket's) raise OverflowError past
# about 9.2e9 s (2**63 ns), and callers add deadlines up (a push's waits,
# margins), so what is asked stays an order of magnitude below.
MAX_TIMEOUT_S = 1e9



def check_timeout(name: str, seconds: Any, *, optional: bool = False, zero: bool = False,
                  at_most: float = MAX_TIMEOUT_S) -> None:
    """Refuse ``seconds`` unless it is a number of seconds a wait can take.

    Args:
        name: what it is, for the message (e.g. ``"timeout"``).
        seconds: the value.
        optional: None is allowed (no deadline).
        zero: 0 is allowed (a deadline already passed).
        at_most: the largest allowed.

    Raises:
        ValueError: a bool, not a number, NaN, infinite, negative (or 0
            unless ``zero``), or over ``at_most``; one sentence naming ``name``.
    """
    if seconds is None and optional:
        return
    # A float first: every call of a fleet's phase checks one, and the ABC's
    # isinstance costs ten times more.
    number = type(seconds) is float or (isinstance(seconds, numbers.Real)
                                        and not isinstance(seconds, bool))
    if not (number and (0 <= seconds if zero else 0 < seconds) and seconds <= at_most):
        least = "0" if zero else "above 0"
        raise ValueError(f"{name} must be a finite number of seconds from {least} to {at_most:g}"
                         f"{' or None' if optional else ''}, got {seconds!r}")


def no_check() -> None:
    """The :data:`Check` of a wait that only its deadline ends."""


class Deadline:
    """An instant on the monotonic clock that bounds a whole call, or none.

    Why an object: a call made of several waits (an HTTP request's connect,
    send and reads; a connect's world-size query, init and warm-up) hands
    the same deadline to each, so the whole call ends in time, not each
    wait on its own.

    Args:
        seconds: how long from now, 0 to ``MAX_TIMEOUT_S``; None for no deadline.

    Raises:
        ValueError: ``seconds`` is not such a number (``check_timeout``).
    """

    __slots__ = ("at",)

    def __init__(self, seconds: float | None):
        check_timeout("a deadline", seconds, optional=True, zero=True)
        self.at = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        """Seconds left (0.0 once passed); None without a deadline.

        Returns:
            The seconds left, never negative, or None.
        """
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        """Whether the deadline has passed.

        Returns:
            True once it has; False before, and always without a deadline.
        """
        return self.at is not None and time.monotonic() >= self.at

    def cap(self, seconds: float | None) -> float | None:
        """The smaller of ``seconds`` and the time left (None only if both are).

        Args:
            seconds: a wait's own limit in seconds, or None.

        Returns:
            What that wait may take within this deadline, or None for no limit.
        """
        left = self.left()
        if seconds is None:
            return left
        return seconds if left is None else min(seconds, left)

    def __repr__(self) -> str:
        return f"Deadline(left={self.left()})"


def poll_until(done: Callable[[], bool], timeout: float | None, *, check: Check = no_check,
               on_timeout: Callable[[], BaseException]) -> None:
    """Call ``done`` until it is true, ``check`` between calls (it may raise).

    Spins for the first 100 us, then sleeps, backing off to 200 us: a sleep
    lasts at least ~60 us whatever it asks for, which would cost every short
    wait (one per tensor in a per-tensor push), while a long wait costs only
    a few thousand wake-ups a second and reacts within 0.2 ms.

    Args:
        done: the condition, polled.
        timeout: seconds to wait at most; None waits for ever.
        check: called between polls; what it raises ends the wait.
        on_timeout: builds the exception raised past ``timeout`` (where a
            caller aborts what it waited on).

    Raises:
        BaseException: ``on_timeout()`` past the deadline, or what ``check``
            raised.
    """
    if done():
        return
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    spin_until = now + 1e-4
    pause = 2e-5
    while not done():
        check()
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise on_timeout()
        if now > spin_until:
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)


def await_future(future: Future, deadline: float | Callable[[], float | None] | None,
                 check: Check = no_check) -> bool:
    """Wait for ``future``, polling ``check`` every 50 ms.

    Args:
        future: what to wait for; its exception, if any, is raised.
        deadline: an instant of ``time.monotonic()``, a callable giving one
            (or None while there is none yet: a deadline that starts later),
            or None for no deadline.
        check: called between polls; what it raises ends the wait.

    Returns:
        True once ``future`` is done; False once ``deadline`` has passed.

    Raises:
        BaseException: the future's exception, or what ``check`` raised.
    """
    while True:
        check()
        limit = deadline() if callable(deadline) else deadline
        left = 0.05 if limit is None else min(0.05, max(limit - time.monotonic(), 0.0))
        # Not ``future.result(timeout)``: a future whose own exception is a
        # TimeoutError would read as not done yet (FutureTimeout is TimeoutError).
        # ``exception`` raises FutureTimeout only while the future runs.
        try:
            future.exception(timeout=left)
        except FutureTimeout:
            if limit is not None and time.monotonic() > limit:
                return False
            continue
        future.result()
        return True


def in_background(fn: Callable[..., T], *args: Any, name: str) -> Future[T]:
    """Run ``fn(*args)`` on a kept daemon thread and return its future.

    Daemon, unlike an executor's worker: a call stuck in NCCL, or in HTTP to
    a stuck server, must not keep the interpreter from exiting. Kept: a new
    thread per call costs the caller a wait for its start (see ``threads``).

    Args:
        fn: the function; what it raises goes to the future.
        *args: its arguments.
        name: the kind of thread it runs on (kept threads are reused per kind).

    Returns:
        The future of ``fn``'s result.
    """
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # delivered to the waiter
            fut.set_exception(e)

    run_in_thread(run, name)
    return fut


class JobStopped(Exception):
    """Raised inside a job by its ``check`` once its caller stopped it."""


class Job(Generic[T]):
    """``fn(check)`` on a kept daemon thread, which its caller may stop or give up on.

    Why: a blocking NCCL call (an init, a broadcast into a peer that is gone
    while a connection is set up) cannot be interrupted. The caller waits
    for the job with a deadline; past it the caller stops the job (``check``
    raises inside it at its next poll) and, if the job is inside a call that
    does not return, leaves it there, with ``then`` saying what to do should
    it ever return (abort the communicator it holds). Nothing is ever freed
    under a call still running.

    Args:
        fn: the work; it should call ``check`` between steps.
        name: the kind of kept thread it runs on.
    """

    def __init__(self, fn: Callable[[Check], T], *, name: str):
        self._stop = threading.Event()
        self.future: Future[T] = in_background(fn, self._check, name=name)

    def _check(self) -> None:
        if self._stop.is_set():
            raise JobStopped("the job was stopped by its caller")

    def wait(self, deadline: float | Callable[[], float | None] | None,
             check: Check = no_check) -> bool:
        """``await_future`` on the job: True once it ended (its exception
        raised), False past ``deadline``.

        Args:
            deadline: an instant of ``time.monotonic()``, a callable giving
                one (or None while there is none yet), or None for no deadline.
            check: called between polls; what it raises ends the wait (the
                job goes on).

        Returns:
            True once the job ended; False once ``deadline`` has passed.

        Raises:
            BaseException: what the job raised, or what ``check`` raised.
        """
        return await_future(self.future, deadline, check)

    def stop(self, grace: float) -> bool:
        """Make ``check`` raise inside the job; whether it ended within
        ``grace`` seconds (then nothing of it runs any more).

        Args:
            grace: seconds to wait for the job to end (0 does not wait).

        Returns:
            True if the job ended, False if it still runs (inside a call
            that does not return: see ``then``).
        """
        self._stop.set()
        try:
            self.future.exception(timeout=grace)
        except FutureTimeout:
            return False
        return True

    def then(self, cleanup: Callable[[Future[T]], None]) -> None:
        """Call ``cleanup(future)`` once the job ends: at once if it has,
        else on the job's thread when its call returns.

        Args:
            cleanup: called with the job's future, done.
        """
        self.future.add_done_callback(cleanup)

    @property
    def busy(self) -> bool:
        """Whether the job still runs (for an abandoned one: is still inside its call)."""
        return not self.future.done()
