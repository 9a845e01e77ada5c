"""Waiting on another thread's progress, Ctrl-Cs on cue or at a chosen line,
and threads run together, for the CPU tests (every wait bounded, so a broken
library fails a test instead of hanging it).

A SIGINT a test sends must never outlive the test: one that lands after the
push it aimed at has ended reaches Python's default handler, and its
``KeyboardInterrupt`` would end the whole test run. So ``Sigints`` sends
only to the main thread and only while ``raised_under`` runs the call it
aims at; ``raised_under`` blocks SIGINT the moment that call returns, then
stops the sender, waits for it and drops what it sent meanwhile.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import CodeType

from nccl_cffi import threads as kept


def wait_for(pred: Callable[[], object], seconds: float = 10.0, poll: float = 0.005) -> bool:
    """Whether ``pred()`` became true within ``seconds`` (polled every ``poll``)."""
    end = time.monotonic() + seconds
    while not pred() and time.monotonic() < end:
        time.sleep(poll)
    return bool(pred())


class Sigints:
    """SIGINT to the main thread ``times`` times, ``gap`` apart, once
    ``raised_under`` runs its call and ``when()`` (none if it does not come
    within 60 s), until ``end()``; then, in any case, ``then()``: it may open
    a gate that kept the push going meanwhile (a loaded host may run this
    thread late, after a push that did not wait for it had ended)."""

    def __init__(self, when: Callable[[], object], times: int, gap: float,
                 then: Callable[[], object] = lambda: None):
        self._armed, self._stop = threading.Event(), threading.Event()
        self._when, self._times, self._gap, self._then = when, times, gap, then
        self.last_sent: float | None = None  # when the last SIGINT went (time.monotonic())
        self._thread = threading.Thread(target=self._fire, daemon=True)
        self._thread.start()

    def _fire(self) -> None:
        self._armed.wait()
        if wait_for(lambda: self._stop.is_set() or self._when(), 60):
            main = threading.main_thread().ident
            for k in range(self._times):
                if self._stop.is_set():
                    break
                signal.pthread_kill(main, signal.SIGINT)
                self.last_sent = time.monotonic()
                if k + 1 < self._times:
                    self._stop.wait(self._gap)
        self._then()

    def arm(self) -> None:
        """From now on, send once ``when()``."""
        self._armed.set()

    def end(self) -> None:
        """Send no more, and drop what was sent but not yet handled. On the
        main thread with SIGINT blocked there (``raised_under``), so nothing
        lands while it waits."""
        self._stop.set()
        self._armed.set()
        self._thread.join()
        while signal.sigtimedwait({signal.SIGINT}, 0) is not None:
            pass


def sigints(when: Callable[[], object], times: int, gap: float = 0.15,
            then: Callable[[], object] = lambda: None) -> Sigints:
    """``Sigints(when, times, gap, then)``, for ``raised_under`` (nothing is sent before)."""
    return Sigints(when, times, gap, then)


def raised_under(fire: Sigints, call: Callable[[], object]) -> BaseException | None:
    """``call()`` with ``fire`` sending: what it raised, or else what a
    Ctrl-C landing as it returned raised; None if nothing. SIGINT is
    blocked here the moment ``call()`` ends (no check for signals comes
    between), so none sent later can land anywhere: ``fire`` is ended, and
    what it sent meanwhile dropped, before this returns."""
    got: BaseException | None = None
    try:
        try:
            fire.arm()
            call()
        finally:
            # At most one SIGINT can be on its way now: it lands in this call.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except BaseException as e:  # the caller's to judge
        got = e
    try:
        fire.end()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return got


# -- a Ctrl-C at a chosen line -------------------------------------------------

Line = tuple[CodeType, int]


def line_events(call: Callable[[], object], files: Sequence[str]) -> list[Line]:
    """Each (code, line) of ``files`` that ``call()`` reaches on this thread,
    in the order first reached (the lines a Ctrl-C could land before)."""
    seen: dict[Line, None] = {}

    def local(frame, event, arg):
        if event == "line":
            seen.setdefault((frame.f_code, frame.f_lineno), None)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
    try:
        call()
    finally:
        sys.settrace(None)
    return list(seen)


def sigint_at(where: Line, call: Callable[[], object]) -> BaseException | None:
    """``call()`` with a real SIGINT raised on this (the main) thread the first
    time it reaches line ``where``: CPython runs the handler in place at once
    (``signal.raise_signal``), right before that line, as it would for a
    Ctrl-C pressed then; a ``KeyboardInterrupt`` it raises is raised there.
    What ``call()`` raised (None if nothing)."""
    code, line = where
    reached: list[bool] = []

    def local(frame, event, arg):
        if reached:
            return None
        if event == "line" and frame.f_code is code and frame.f_lineno == line:
            reached.append(True)
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code and not reached else None)
    try:
        call()
    except BaseException as e:  # the caller's to judge
        return e
    finally:
        sys.settrace(None)
    return None


def named(where: Line) -> str:
    """``file:line (function)`` for a report."""
    code, line = where
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{line} ({code.co_qualname})"


def bounded(call: Callable[[], object], seconds: float) -> tuple[bool, object]:
    """``call()`` on a thread of its own: whether it ended within ``seconds``,
    and what it returned or raised (a hung call is left behind, a daemon)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as e:  # reported to the caller
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    return (not th.is_alive()), (out[0] if out else None)


def busy_kept_threads() -> int:
    """How many of the library's kept threads are running a job now."""
    with kept._lock:
        idle = sum(len(v) for v in kept._idle.values())
        names = set(kept._idle)
    alive = sum(1 for t in threading.enumerate() if t.name in names or t.name in KEPT)
    return alive - idle


KEPT = {"jax-sender-push", "jax-sender-ready", "jax-sender-nccl", "vllm-update", "vllm-init",
        "vllm-release", "vllm-probe", "nccl-init", "share-from-process-0"}


def inside(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is in a call of ``function`` now (its stack read)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def together(work: Callable[..., None], args: list[tuple], timeout: float) -> list[BaseException]:
    """``work(*a)`` for each ``a`` in ``args``, each on a thread of its own,
    all at once; what they raised, once all ended (each joined within
    ``timeout``)."""
    errors: list[BaseException] = []

    def run(*a: object) -> None:
        try:
            work(*a)
        except BaseException as e:  # reported to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors
