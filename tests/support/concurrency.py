"""Waiting on another thread's progress, Ctrl-Cs on cue, and threads run together,
for the CPU tests (every wait bounded, so a broken library fails a test
instead of hanging it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], seconds: float = 10.0, poll: float = 0.005) -> bool:
    """Whether ``pred()`` became true within ``seconds`` (polled every ``poll``)."""
    end = time.monotonic() + seconds
    while not pred() and time.monotonic() < end:
        time.sleep(poll)
    return bool(pred())


def sigints(when: Callable[[], object], times: int, gap: float = 0.15) -> threading.Thread:
    """SIGINT to this process ``times`` times, ``gap`` apart, once ``when()``
    (none if it does not come within 10 s, so no SIGINT outlives the test:
    join it with a timeout above 10 s)."""
    def fire() -> None:
        if not wait_for(when, 10):
            return
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(gap)
    th = threading.Thread(target=fire, daemon=True)
    th.start()
    return th


def raised_under(fire: threading.Thread, call: Callable[[], object]) -> BaseException | None:
    """What ``call()`` raised, a Ctrl-C from ``fire`` (``sigints``' thread)
    landing after it returned included, once ``fire`` ended; None if nothing."""
    try:
        try:
            call()
        finally:
            fire.join(15)
    except BaseException as e:  # the caller's to judge
        return e
    return None


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
