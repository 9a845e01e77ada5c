"""A sender's session with the servers: its connection, its pushes one at a
time (each a ``push.Transaction``), and what a failure leaves behind.

Senders hold a session; they differ only in how ``params`` become a push.
The session owns everything a push shares with the next: the communicator
and its broadcaster, the metadata the workers hold (``sent``), whether the
group is broken, and the admission of pushes:

* **One push at a time.** A push holds the session's turn from admission to
  its end, on whichever thread it ends; a second ``send`` (another thread,
  or after ``send(wait=False)``) waits for it, within the deadlines of the
  push in flight, or is refused once they have passed.
* **Ctrl-C** (on the main thread, through ``interrupts.py``): none, at any
  instant, leaves the turn taken. While waiting for the turn it ends the
  wait; during the caller's preparation of a push it stops it, nothing
  sent; during a blocking push the first lets the push end on the servers,
  within its deadlines, then raises ``KeyboardInterrupt``, and a second
  aborts at once. The same holds while waiting in ``PendingSend.result()``,
  and at interpreter exit a push in flight is let end. ``close()`` stops
  waiting for a push in flight (a later ``close()`` finishes), but finishes
  releasing the servers once it began.
* **Failures that abort.** The lane is stopped at its next poll and the
  communicator aborted once no NCCL call is in flight; a lane stuck inside
  one past its deadline is abandoned instead (never freed under the call;
  the communicator is aborted if the call ever returns). The sender is
  broken until ``reconnect()``, which finishes the servers' open update
  sessions, shuts their engines down and forms a new group.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import TypeVar

from nccl_cffi import Deadline, NcclTimeoutError, in_background
from uniqueid import (
    Connection,
    InitInfo,
    RendezvousError,
    VLLMClient,
    VLLMConnectionError,
    as_clients,
    release_each,
    world_sizes,
)

from . import fleet
from .broadcaster import Broadcaster
from .config import SendConfig
from .control import ControlPlane, best_effort
from .errors import SenderClosed, SendError
from .fleet import DroppedServer
from .interrupts import FIRST, FIRST_CTRL_C, SECOND, SECOND_CTRL_C, Guard
from .push import Aborted, Lane, PreparedPush, Transaction
from .routes import Route
from .stats import SendStats
from .tensors.plan import TensorMeta

log = logging.getLogger("jax_sender")

T = TypeVar("T")

# How long a stopped push may take to leave its NCCL calls before it is abandoned.
CANCEL_GRACE_S = 2.0


class Stuck(NcclTimeoutError):
    """An NCCL call of the push did not return within its deadline."""


def _nothing() -> None:
    pass


class Ticket:
    """A caller's turn to push, from admission to the push's end.

    Args:
        release: gives the turn back.
        guard: the caller's Ctrl-Cs (``interrupts.Guard``).
    """

    def __init__(self, release: Callable[[], None], guard: Guard):
        self._release = release
        self.guard = guard

    def hand_over(self) -> Callable[[], None]:
        """The release, for the push that now owns the turn (after which
        ``release()`` does nothing).

        Returns:
            What gives the turn back (a no-op once handed over).
        """
        release, self._release = self._release, _nothing
        return release

    def release(self) -> None:
        """Give the turn back, unless a push owns it now (then it does)."""
        self.hand_over()()


class PendingSend:
    """A push in flight. ``result()`` waits for it.

    ``done()``: whether it ended, either way. ``result(timeout)``: its
    ``SendStats``, or its error; ``TimeoutError`` if it has not ended within
    ``timeout`` seconds (it goes on). A Ctrl-C while waiting lets the push end
    on the servers, then raises ``KeyboardInterrupt``; a second aborts it.

    Args:
        bound_s: the push's deadlines, all of them, in seconds: how long the
            interpreter's exit waits for it to end.
    """

    def __init__(self, bound_s: float):
        self._future: Future[SendStats] = Future()
        self._abort = threading.Event()
        self.bound_s = bound_s  # its deadlines, all of them

    def start(self, work: Callable[[], SendStats], name: str) -> None:
        """Run ``work`` on a kept thread of its own; let it end at exit.

        Args:
            work: the push; what it returns or raises is ``result()``'s.
            name: the kind of kept thread it runs on.

        Raises:
            RuntimeError: no thread could be started (``work`` will not run).
        """
        _in_flight.add(self)
        try:
            in_background(self._run, work, name=name)
        except BaseException:
            _in_flight.discard(self)
            raise

    def run_here(self, work: Callable[[], SendStats]) -> SendStats:
        """Run ``work`` on this thread; its figures, or what it raised.

        Args:
            work: the push.

        Returns:
            What ``work`` returned.

        Raises:
            BaseException: what ``work`` raised.
        """
        self._run(work)
        return self._future.result()

    def _run(self, work: Callable[[], SendStats]) -> None:
        try:
            self._future.set_result(work())
        except BaseException as e:
            self._future.set_exception(e)
        finally:
            _in_flight.discard(self)

    def aborted(self) -> None:
        """Raises ``Aborted`` once ``abort`` was called (the push polls it).

        Raises:
            Aborted: ``abort`` was called (``push.Aborted``; the session
                turns it into ``KeyboardInterrupt``).
        """
        if self._abort.is_set():
            raise Aborted(SECOND_CTRL_C)

    def abort(self) -> None:
        """Stop the push at once (its communicator is aborted)."""
        self._abort.set()

    def done(self) -> bool:
        """Whether the push ended (either way).

        Returns:
            True once it succeeded or failed; False while it runs.
        """
        return self._future.done()

    def result(self, timeout: float | None = None) -> SendStats:
        """Wait for the push.

        Args:
            timeout: seconds to wait at most; None: until it ends (its own
                deadlines bound it).

        Returns:
            Its ``SendStats``.

        Raises:
            SendError: the push's failure.
            TimeoutError: not ended within ``timeout`` (it goes on).
            KeyboardInterrupt: a Ctrl-C while waiting (see the class).
        """
        with Guard() as guard:
            ended = self.settle(guard, timeout)
        if not ended:
            raise TimeoutError(f"the push did not end within {timeout}s; it goes on "
                               "(wait again, or close() the sender)")
        if guard.count and self._future.exception() is None:
            raise KeyboardInterrupt("Ctrl-C; the push in flight ended on the servers first")
        return self._future.result()

    def settle(self, guard: Guard, timeout: float | None) -> bool:
        """Wait for the push to end, polling ``guard``: after a first Ctrl-C
        until it ends (its own deadlines bound it); a second aborts it.

        Args:
            guard: the waiting caller's Ctrl-Cs.
            timeout: seconds to wait at most, until a first Ctrl-C.

        Returns:
            Whether the push ended (either way).

        Raises:
            KeyboardInterrupt: a second Ctrl-C (the push aborted).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        guard.note = FIRST_CTRL_C
        while not self.wait_stopped(0.05):
            if guard.count >= 2:
                self.abort()
                self.wait_stopped(CANCEL_GRACE_S)
                raise KeyboardInterrupt(SECOND_CTRL_C)
            if not guard.count and deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the push to end; whether it did.

        Args:
            timeout: seconds to wait at most.

        Returns:
            True if it ended (either way), False if it still runs.
        """
        return bool(futures.wait([self._future], timeout).done)


# Pushes running in the background: at exit each is let end on the servers.
_in_flight: set[PendingSend] = set()


@atexit.register
def _let_pushes_end() -> None:
    for pending in list(_in_flight):
        log.warning("exiting: letting the push in flight end on the servers")
        try:
            with Guard() as guard:
                pending.settle(guard, pending.bound_s)
        except KeyboardInterrupt as e:
            log.warning("%s", e)


def _unresumed(exc: BaseException) -> BaseException:
    """The error for a push whose update finished everywhere but whose
    ``/resume`` failed: the weights are in; nothing needs aborting."""
    if isinstance(exc, (KeyboardInterrupt, Aborted)):
        return KeyboardInterrupt("Ctrl-C after the push ended on the servers")
    return SendError(f"the push ended on every server, but resuming generation failed: "
                     f"{type(exc).__name__}: {exc}. Generation may still be paused there: "
                     "call resume() on that server's client; the sender is usable")


def _gone(exc: BaseException) -> str:
    """How to go on without a server that a push could not reach."""
    return f"; {fleet.GONE_HINT}" if isinstance(exc, VLLMConnectionError) else ""


class Session:
    """A route's connection to the servers' workers, and its pushes.

    Args:
        route: how this trainer takes part (``routes.py``).
        connection: the formed group (None off the transfer group).
        config: every setting.
        broadcaster: makes what moves the bytes over a connection.
    """

    def __init__(self, route: Route, connection: Connection | None, config: SendConfig, *,
                 broadcaster: Callable[[Connection], Broadcaster]):
        self.route = route
        self.connection = connection
        self.config = config
        self.sent: dict[int, list[TensorMeta]] = {}  # per src: the metadata the workers hold
        self.broken = ""  # why the group is broken, until reconnect()
        self.closing = False  # close() began: a push still being prepared will not run
        self._closing_lock = threading.Lock()
        self._closer = False  # a close() is at it
        self._closed = threading.Event()  # close() released everything
        # Called with ``aborted`` when a communicator is given up (aborted mid-push,
        # or dropped by reconnect/close): what the senders keep about it goes.
        self.on_reset: list[Callable[[bool], None]] = []
        self._make_broadcaster = broadcaster
        self._broadcaster: Broadcaster | None = None
        self._orphans: list[Lane] = []  # lanes abandoned inside an NCCL call
        self._turn = threading.Lock()
        self._busy_until = 0.0  # the push in flight's deadlines, all of them
        # Servers whose /pause went unanswered: it may land late; resumed before the next push.
        self._late_pause: list[VLLMClient] = []

    @property
    def info(self) -> InitInfo:
        """What the workers were told at init (this process's view)."""
        return self.connection.init_info if self.connection else self.route.group.init_info

    @property
    def broadcaster(self) -> Broadcaster | None:
        """What moves the bytes over the connection now (None before its
        first push): a sender may ask what it holds before a push."""
        return self._broadcaster

    @property
    def clients(self) -> list[VLLMClient]:
        """The servers this process talks to (none off process 0)."""
        return self.connection.clients if self.connection else []

    # -- admission ------------------------------------------------------
    def in_turn(self, work: Callable[[Ticket], T], *, ready: bool = True) -> T:
        """``work(ticket)`` in this caller's turn, once the push in flight,
        if any, ended; the turn is given back when ``work`` returns, unless
        a push it started owns it (``run``).

        Ctrl-C on the main thread: while waiting, the wait ends; during
        ``work``, it raises there (``work`` may be the caller's preparation
        of a push, cut short); at any other instant it is held and raised
        once the turn is given back, so none can leave the turn taken.

        Args:
            work: what to do in the turn.
            ready: refuse to when the sender is closing or broken (False:
                ``reconnect``, which repairs a broken one).

        Returns:
            What ``work`` returned.

        Raises:
            SenderClosed: the sender is closed.
            SendError: the group is broken (``reconnect()``), or the push in
                flight did not end by its deadlines.
            KeyboardInterrupt: a Ctrl-C (nothing was sent, or the push ended
                on the servers first).
            BaseException: what ``work`` raised.
        """
        with Guard() as guard:
            ticket = self._take_turn(guard)
            try:
                if ready:
                    self._check_ready()
                # The holder's own work (tracing, compiling): no deadline of ours.
                self._busy_until = float("inf")
                out = guard.during(FIRST, work, ticket)
            finally:
                ticket.release()
        if guard.count and not guard.raised:
            raise KeyboardInterrupt("Ctrl-C, held until the sender's turn was safe to leave (a "
                                    "push already started goes on: the next send() waits for it)")
        return out

    def _check_ready(self) -> None:
        if self.closing:
            raise SenderClosed("this sender is closed; build a new one with connect()")
        if self.broken:
            raise SendError(f"the transfer group is broken ({self.broken}); call reconnect()")

    def _take_turn(self, guard: Guard, *, closing: bool = False) -> Ticket:
        """This caller's turn, once the push in flight ended (within its
        deadlines; a push still being prepared has none of ours). Refused
        once the sender is closing, unless ``closing`` (``close()`` itself).
        No Ctrl-C raises in here (the guard's window is shut): it ends the
        wait, before the turn is taken."""
        holder_since = time.monotonic()
        while not self._turn.acquire(timeout=0.05):
            if guard.count:
                raise KeyboardInterrupt("Ctrl-C while waiting for the push in flight; this "
                                        "call did nothing")
            if self.closing and not closing:
                raise SenderClosed("this sender is closed; build a new one with connect()")
            if time.monotonic() > max(self._busy_until, holder_since) + CANCEL_GRACE_S:
                raise SendError("another push on this sender did not end by its deadlines; a "
                                "sender pushes one at a time: call send() from one thread, or "
                                "close() it and connect() again")
        return Ticket(self._turn.release, guard)

    # -- a push ---------------------------------------------------------
    def run(self, ticket: Ticket, push: PreparedPush, *, background: bool,
            t0: float) -> SendStats | PendingSend:
        """Run ``push``, owning ``ticket`` until it ends.

        Args:
            ticket: this caller's turn (``in_turn``).
            push: the validated push.
            background: run it on a thread of its own and return at once.
            t0: when ``send()`` was called (``time.perf_counter()``).

        Returns:
            Its ``SendStats`` (blocking), or its ``PendingSend``.

        Raises:
            SendError: see ``push.Transaction`` and the module docstring.
            KeyboardInterrupt: a Ctrl-C during a blocking push (or before
                it started: then nothing was sent).
        """
        # No Ctrl-C raises while the turn is handed to the push and its thread starts.
        return ticket.guard.during(None, self._launch, ticket, push, background, t0)

    def _launch(self, ticket: Ticket, push: PreparedPush, background: bool,
                t0: float) -> SendStats | PendingSend:
        if ticket.guard.count:
            raise KeyboardInterrupt("Ctrl-C while the push was being prepared; nothing was sent")
        if self.closing:
            raise SenderClosed("the sender was closed while this push was being prepared; "
                               "nothing was sent")
        conn, broadcaster = self.connection, self._broadcaster_of(self.connection)
        pending = PendingSend(push.bound_s)
        self._busy_until = time.monotonic() + push.bound_s + CANCEL_GRACE_S
        release = ticket.hand_over()
        # A background push's thread gets no signal: its guard stays inactive.
        guard = Guard() if background else ticket.guard
        work = functools.partial(self._owning, release, guard, push, conn, broadcaster, pending,
                                 t0)
        if not background:
            return self._blocking(pending, work, guard)
        try:
            pending.start(work, name="jax-sender-push")
        except BaseException:
            release()  # the push never ran
            raise
        push.stats.returned_s = time.perf_counter() - t0
        return pending

    def _owning(self, release: Callable[[], None], guard: Guard, push: PreparedPush,
                conn: Connection, broadcaster: Broadcaster, pending: PendingSend,
                t0: float) -> SendStats:
        """The push, which gives the turn back when it ends; a Ctrl-C raises
        only inside its transaction, at the second (``SECOND``)."""
        try:
            return guard.during(SECOND, self._transact, push, conn, broadcaster, pending, t0)
        finally:
            release()

    @staticmethod
    def _blocking(pending: PendingSend, work: Callable[[], SendStats], guard: Guard) -> SendStats:
        """``work`` on this thread; a first Ctrl-C meanwhile is raised once it ended."""
        try:
            stats = pending.run_here(work)
        except BaseException as e:
            if guard.count != 1 or isinstance(e, KeyboardInterrupt):
                raise
            raise KeyboardInterrupt(f"Ctrl-C; meanwhile the push failed: {e}") from e
        if guard.count:
            raise KeyboardInterrupt("Ctrl-C; the push in flight ended on the servers first")
        return stats

    def _transact(self, push: PreparedPush, conn: Connection, broadcaster: Broadcaster,
                  pending: PendingSend, t0: float) -> SendStats:
        lane, control = Lane(), ControlPlane(conn.clients, push.timeout_s)
        late, self._late_pause = self._late_pause, []
        if late:
            best_effort([functools.partial(control.resume, late)])
        tx = Transaction(push, control, broadcaster, lane,
                         check=self._checker(pending, conn, push.timeout_s))
        try:
            stats = tx.run()
        except BaseException as e:
            self._late_pause += control.late_pause  # resumed before the next push
            if tx.finished and tx.failure is None:  # the weights are in: only /resume failed
                self.sent = push.sent
                raise _unresumed(e) from e
            if not tx.announced:  # no collective was started: the group is intact
                raise self._refused(e, tx.left_open) from e
            raise self._fail(e, conn, lane, broadcaster) from e
        if tx.failure is not None:
            if tx.announced:
                self.sent = {}  # the workers hold an incomplete update: the next push sends all
            raise tx.outcome()
        self.sent = push.sent
        stats.returned_s = stats.returned_s or time.perf_counter() - t0
        log.info("sent %s", stats)
        return stats

    def _checker(self, pending: PendingSend, conn: Connection,
                 timeout: float) -> Callable[[], None]:
        def check() -> None:
            pending.aborted()
            since = conn.comm.in_call_since
            if since and time.monotonic() - since > timeout:
                raise Stuck(f"an NCCL call did not return within {timeout}s (a peer is gone "
                            "while a connection was being set up)")
        return check

    def _fail(self, exc: BaseException, conn: Connection, lane: Lane,
              broadcaster: Broadcaster) -> BaseException:
        """Give the communicator up after a failure that aborts; the error
        for the caller (a ``KeyboardInterrupt`` stays one)."""
        stopped = lane.stop(0.0 if isinstance(exc, Stuck) else CANCEL_GRACE_S)
        why = f"{type(exc).__name__}: {exc}"
        if stopped:
            self.broken = why
            conn.comm.abort(f"send failed: {type(exc).__name__}")
        else:  # inside NCCL past its deadline: give it up, never free under it
            self._broadcaster = None  # the call may still read its buffers
            lane.then(lambda: (conn.comm.abort("an abandoned NCCL call returned"),
                               broadcaster.close()))
            self._orphans.append(lane)
            self.broken = f"an NCCL call did not return ({why})"
        self._reset(aborted=True)
        if isinstance(exc, (KeyboardInterrupt, Aborted)):
            return KeyboardInterrupt(SECOND_CTRL_C)
        return SendError(
            f"weight push failed: {why}. The communicator was "
            f"{'aborted' if stopped else 'abandoned'}; call reconnect() before the next send "
            "(it finishes the servers' open update sessions, and names a server that needs a "
            f"restart, if any){_gone(exc)}")

    def _refused(self, exc: BaseException, left_open: bool) -> BaseException:
        """The error for a push that failed before any ``/update_weights`` was
        posted: no collective was started, so nothing needs aborting. But a
        server may be left inside an update session (a start that went
        unanswered may land late; a finish that failed): the sender is then
        broken until ``reconnect()`` finishes it."""
        why = f"{type(exc).__name__}: {exc}"
        if left_open:
            self.broken = f"a server may be left inside an update session ({why})"
        if isinstance(exc, (KeyboardInterrupt, Aborted)):
            return KeyboardInterrupt("Ctrl-C before any weights were sent; the servers keep "
                                     "theirs" + ("; call reconnect() before the next send"
                                                 if left_open else ""))
        if left_open:
            return SendError(f"weight push failed before any weights were sent: {why}. A "
                             "server may be left inside its update session: call reconnect() "
                             f"(it finishes open sessions) before the next send{_gone(exc)}")
        late = (" A server that did not answer its /pause may pause late (it was sent a "
                "/resume): resume it if it stays paused."
                if isinstance(exc, VLLMConnectionError) else "")
        return SendError(f"weight push failed before any weights were sent: {why}. The "
                         f"servers keep their weights and the sender is usable.{late}")

    def _reset(self, aborted: bool) -> None:
        """The communicator was given up: the metadata the workers hold is
        unknown (``aborted``: so are their weights)."""
        self.sent = {}
        for hook in self.on_reset:
            hook(aborted)

    def _broadcaster_of(self, conn: Connection) -> Broadcaster:
        if self._broadcaster is None:
            self._broadcaster = self._make_broadcaster(conn)
        return self._broadcaster

    # -- lifetime -------------------------------------------------------
    def reconnect(self, *, drop_dead: bool = False) -> list[DroppedServer]:
        """Finish the servers' open update sessions and shut their engines
        down (all at once), mint a new id and form the group again, all
        within ``config.reconnect_timeout_s``. In a group, every process
        calls it together.

        Args:
            drop_dead: leave out of the new group each server that cannot
                be released (gone, or stuck), rather than raise.

        Returns:
            The servers left out (``fleet.DroppedServer``), none without ``drop_dead``.

        Raises:
            ServerStuck: a server's engine does not answer (a restart is needed).
            RendezvousError: a server could not be released, or the new
                group could not be formed.
            SenderClosed: the sender is closed.
        """
        return self._reform(drop_dead=drop_dead)

    def drop_server(self, server: str | VLLMClient) -> None:
        """Leave ``server`` out: a new group with the others (``fleet.py``).
        It is looked up in this sender's turn, so drops from two threads
        at once cannot leave it without a server.

        Args:
            server: its URL (however spelled), or a client of it.

        Raises:
            TransferError: a multi-process sender.
            ValueError: not one of the servers, or the last one.
            RendezvousError, SenderClosed: as ``reconnect``.
        """
        fleet.single(self.route, "drop_server()")
        self._reform(leaving=server)

    def add_server(self, server: str | VLLMClient, *, workers: int | None = None) -> None:
        """Take ``server`` in: its world size is asked (or ``workers``
        checked) before the running group is touched, then a new group is
        formed with every server (``fleet.py``). Whether the fleet has it
        already is decided in this sender's turn, so adds of one server
        from two threads at once take it once.

        Args:
            server: its URL, or a client.
            workers: its worker count, asked when not given.

        Raises:
            TransferError: a multi-process sender.
            ValueError: a URL that is not http(s), or already a server
                (however its URL is spelled).
            RendezvousError: it cannot join (the group is left as it was),
                or the new group could not be formed.
            SenderClosed: as ``reconnect``.
        """
        route = fleet.single(self.route, "add_server()")
        client = as_clients(server)[0]
        try:
            self._reform(joining=(client, workers))
        except BaseException:
            if client not in route.clients and client is not server:
                client.close()  # made here, never taken in
            raise

    def _reform(self, *, drop_dead: bool = False, leaving: str | VLLMClient | None = None,
                joining: tuple[VLLMClient, int | None] | None = None) -> list[DroppedServer]:
        """Form the group anew with the fleet changed (see ``reconnect``,
        ``drop_server``, ``add_server``), on this sender's turn."""
        if self.closing:
            raise SenderClosed("this sender is closed; build a new one with connect()")
        return self.in_turn(lambda ticket: self._reformed(drop_dead, leaving, joining),
                            ready=False)

    def _reformed(self, drop_dead: bool, leaving: str | VLLMClient | None,
                  joining: tuple[VLLMClient, int | None] | None) -> list[DroppedServer]:
        deadline = Deadline(self.config.reconnect_timeout_s)
        gone = None if leaving is None else fleet.find(self.route, leaving)
        if joining is not None:
            self._take_in(*joining, deadline)
        self.broken = self.broken or "reconnecting"
        # Half the deadline for the releases: a stuck server must leave time to
        # form the group with the others (drop_dead).
        released = self._let_go(Deadline(self.config.reconnect_timeout_s / 2))
        dropped = fleet.settle(self.route, released, drop_dead=drop_dead, leaving=gone)
        self.connection = self.route.form(deadline.left())
        self.broken = ""
        if joining is not None:
            self._reset(aborted=True)  # the server taken in holds weights of its own
        return dropped

    def _take_in(self, client: VLLMClient, workers: int | None, deadline: Deadline) -> None:
        """Refuse a server the fleet has; ask (or check) ``client``'s worker
        count; then add it to the fleet."""
        route = fleet.single(self.route, "add_server()")
        fleet.refuse_known(route, client)
        count = world_sizes([client], workers, deadline)[0]
        if route.workers is not None:
            route.workers = [*route.workers, count]
        route.clients.append(client)

    def _let_go(self, deadline: Deadline) -> list[tuple[VLLMClient, RendezvousError | None]]:
        """Free the broadcaster and the communicator (unless an abandoned
        lane is still inside one of its calls) and release every server at
        once; what each server's release raised, for ``fleet.settle``.
        Without a group (the last attempt failed), every server of the
        fleet is released again: a release of a released engine does
        nothing, and one an attempt left inside an init is freed or named."""
        self._reset(aborted=False)
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        conn, self.connection = self.connection, None
        clients = conn.clients if conn is not None else list(fleet.fleet_of(self.route))
        released = list(zip(clients, release_each(clients, deadline)))
        if conn is not None:
            alive = any(lane.busy for lane in self._orphans)
            conn.close(deadline=deadline, shutdown_servers=False, free_comm=not alive)
        return released

    def close(self) -> None:
        """Let a push in flight end on the servers (within its deadlines; a
        push still being prepared is refused with ``SenderClosed``), free
        the streams and buffers, shut the servers' engines down, free the
        communicator, close the HTTP clients this sender made. Calling it
        again, from any thread, waits for a close in progress; once closed,
        it does nothing.

        Raises:
            KeyboardInterrupt: a Ctrl-C while it waited for the push in
                flight (or another close()): the sender takes no new push,
                and a later close() finishes the job. One while it releases
                the servers is raised once they are released.
        """
        with Guard() as guard:
            if self._claim_close(guard):
                try:
                    self._shut(guard)
                finally:
                    self._closer = False
        if guard.count and not guard.raised:
            raise KeyboardInterrupt("Ctrl-C; close() released the servers first")

    def _claim_close(self, guard: Guard) -> bool:
        """Whether this call closes the sender (no other close() is at it);
        False once it is closed, or another close() did not end in time."""
        end = time.monotonic() + self._busy_deadline_s() + self.config.wait_timeout_s(0) + 60.0
        while True:
            with self._closing_lock:
                self.closing = True
                if self._closed.is_set():
                    return False
                if not self._closer:
                    self._closer = True
                    return True
            if guard.count:
                raise KeyboardInterrupt("Ctrl-C while close() waited for another close()")
            if time.monotonic() > end:
                log.warning("close(): another close() of this sender did not end in time")
                return False
            self._closed.wait(0.05)

    def _shut(self, guard: Guard) -> None:
        """Wait for the turn (a push in flight that overran is torn down
        beside), then release everything; no Ctrl-C raises in here."""
        try:
            ticket = self._take_turn(guard, closing=True)
        except SendError:
            ticket = Ticket(_nothing, guard)  # the push in flight overran: tear down beside it
        except KeyboardInterrupt:
            raise KeyboardInterrupt("Ctrl-C while close() waited for the push in flight, which "
                                    "goes on; the sender takes no new push: call close() again "
                                    "to release the servers") from None
        guard.note = "Ctrl-C: close() first finishes releasing the servers (within its deadline)"
        try:
            self._drop_connection(Deadline(self.config.wait_timeout_s(0)), strict=False)
            for client in getattr(self.route, "clients", []):
                client.close()
        finally:
            self._closed.set()
            ticket.release()

    def _busy_deadline_s(self) -> float:
        """Seconds until the push in flight's deadlines have all passed (0 if none)."""
        left = self._busy_until - time.monotonic()
        return min(max(left, 0.0), 24 * 3600.0)

    def _drop_connection(self, deadline: Deadline, *, strict: bool) -> None:
        """Free the broadcaster, release the servers, free the communicator
        (unless an abandoned lane is still inside one of its calls)."""
        self._reset(aborted=False)
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        conn, self.connection = self.connection, None
        if conn is not None:
            alive = any(lane.busy for lane in self._orphans)
            conn.close(deadline=deadline, free_comm=not alive, strict=strict)

    def __repr__(self) -> str:
        state = "closed" if self.closing else f"broken: {self.broken}" if self.broken else "ready"
        return f"Session({state}, {len(self.clients)} server(s))"
