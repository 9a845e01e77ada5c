"""Ctrl-C on the main thread while the session works for its caller.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to
be. Between two lines of the session's own bookkeeping (its turn taken but
not yet owned by anything that gives it back, a push's thread half
started, a close half done) that would wedge the sender: every later
``send()`` waits for a turn nobody holds. So while the session works, the
SIGINT gate hands each Ctrl-C to a ``Guard`` instead, which raises only
inside a *window* (``Guard.during``) around work that may be cut short (the
caller's preparation of a push, the push's transaction with the servers),
and there only at the window's ``at``-th Ctrl-C, once. Elsewhere it counts
them, and the session acts on the count where it chooses: a wait stops, a
push not yet started is refused, or ``KeyboardInterrupt`` is raised once
the turn has been given back.

Why a gate installed once rather than handlers swapped around each call:
two ``signal.signal`` calls cost a small push a measurable share of its own
time. The gate is Python's own handler whenever no guard is active, so a
Ctrl-C anywhere else is what Python makes of it. Where the program set a
SIGINT handler of its own, the library leaves it alone (and its guards do
nothing), as it does off the main thread, which no signal reaches.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("jax_sender")

T = TypeVar("T")

FIRST_CTRL_C = ("Ctrl-C: letting the push in flight end on the servers (within its deadlines), so "
                "they are left ready for the next one; press Ctrl-C again to abort it at once")
SECOND_CTRL_C = ("a second Ctrl-C aborted the push mid-stream: the servers' workers may be left "
                 "inside their update (over NCCL: inside a collective); reconnect() says which "
                 "server, if any, needs a restart")
# The windows: where the first Ctrl-C raises (the caller's own work), and
# where the first lets the push end and the second aborts it.
FIRST, SECOND = 1, 2


class Guard:
    """The Ctrl-Cs of one call into the session, on the main thread.

    ``with Guard() as guard:`` hands them to it (see the module docstring).

    Attributes:
        count: the Ctrl-Cs so far.
        raised: one was raised (later ones are then ignored until the end).
        note: logged at a first Ctrl-C held outside a window (None: nothing).
    """

    def __init__(self) -> None:
        self.count = 0
        self.raised = False
        self.note: str | None = None
        self._at: int | None = None  # the window's: raise at the at-th Ctrl-C
        self._installed = False

    def handle(self) -> None:
        """One Ctrl-C (called by the gate).

        Raises:
            KeyboardInterrupt: inside a window, at its ``at``-th Ctrl-C.
        """
        self.count += 1
        if self.raised:
            log.warning("Ctrl-C: the sender returns in a moment")
        elif self._at is not None and self.count >= self._at:
            self._raise()
        elif self.count == 1 and (self._at == SECOND or self.note):
            log.warning(FIRST_CTRL_C if self._at == SECOND else self.note)

    def _raise(self) -> None:
        self.raised = True
        raise KeyboardInterrupt(SECOND_CTRL_C) if self._at == SECOND else KeyboardInterrupt()

    def during(self, at: int | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a window: a Ctrl-C raises there at the ``at``-th
        (at once if it already came), or none does (``at`` None).

        Args:
            at: ``FIRST``, ``SECOND`` or None.
            fn: the work.
            *args: its arguments.

        Returns:
            What ``fn`` returned.

        Raises:
            KeyboardInterrupt: the window's Ctrl-C.
            BaseException: what ``fn`` raised.
        """
        outer, self._at = self._at, at
        try:
            if at is not None and self.count >= at and not self.raised:
                self._raise()
            return fn(*args)
        finally:
            self._at = outer

    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread() and _GATE.guard is None:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, _GATE)
            if signal.getsignal(signal.SIGINT) is _GATE:
                _GATE.guard = self
                self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            _GATE.guard = None


class _Gate:
    """The SIGINT handler: Python's own, except while a ``Guard`` is active."""

    def __init__(self) -> None:
        self.guard: Guard | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.guard is None:
            signal.default_int_handler(signum, frame)
        else:
            self.guard.handle()


_GATE = _Gate()
