"""Hostile probes of a push's transaction and its session, over the
in-memory link and the independent memory server. Each test pins a promise
of ``docs/failures.md`` that the code did not keep when it was written (see
each docstring for the promise and the code at fault). Every wait is
bounded; every ``hold``/``stall`` event is released in a ``finally``."""

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from jax_sender import (
    Mapping,
    MetadataError,
    SendConfig,
    SenderClosed,
    SendError,
    SendStats,
    SparseSender,
)

from support import on_tests_path
from support.concurrency import (
    bounded,
    busy_kept_threads,
    line_events,
    named,
    raised_under,
    sigint_at,
    sigints,
    wait_for,
)
from support.pushes import (
    SMALL,
    Held,
    answered,
    comm,
    expected,
    held,
    params,
    pushed,
    slow_step,
    torch_layout,
)
from support.servers.memory_link import memory_sender

pytestmark = pytest.mark.timeout(90)

START_FINISH = ["/start_weight_update", "/finish_weight_update"]


@pytest.fixture(scope="module")
def step():
    """``slow_step``, compiled once for the module."""
    return slow_step()


# -- an ambiguous control call: sent, not answered in time -----------------

def test_a_start_that_times_out_leaves_no_session_open_on_the_server():
    """Promise 2 ("no server is left inside an open update session") and the
    error's own "the sender is usable". A ``/start_weight_update`` that the
    server takes but answers after the push's deadline is never finished:
    ``ControlPlane.start`` finishes only the servers that *answered*
    (control.py, ``start``: ``started`` holds answered ones), and
    ``_refused`` (session.py) reports the sender usable without marking it
    broken. The server stays in the session; every later push is then
    refused by ``/start_weight_update`` ("already active") with the same
    "the sender is usable" sentence, and nothing tells the caller to
    ``reconnect()``."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.5))
    p = jax.block_until_ready(params())
    with Held(server, "/start_weight_update"):
        t = time.monotonic()
        with pytest.raises(SendError, match="before any weights were sent.*reconnect"):
            sender.send(p)
        assert time.monotonic() - t < 0.5 + 1.0
    # The sender said it is usable: its next push must go through, or it must
    # at least know it is broken (reconnect() finishes an open session).
    assert not server.active or sender.broken
    if sender.broken:
        sender.reconnect()  # finishes the session the late start opened
    sender.send(params(1))
    assert held(server) == expected(params(1))


def test_a_pause_that_times_out_is_undone():
    """Promise 2 and the "Other faults" table: "a pause is undone". A
    ``/pause`` that the server takes after the push's deadline is never
    resumed (``ControlPlane.pause`` resumes only the servers that answered):
    the server stays paused, generation stopped, after a push whose error
    says the servers keep their weights and the sender is usable; a later
    push without ``pause`` never resumes it."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.5))
    with Held(server, "/pause"), pytest.raises(SendError, match="before any weights were sent"):
        sender.send(params(), pause="wait")
    sender.send(params(1))
    assert not server.paused, pushed(server)


def test_a_finish_refused_after_an_empty_session_leaves_the_sender_knowing(step):
    """Promise 2. A push wound down before any ``/update_weights`` (its
    arrays not computed in time) finishes the session empty; when that
    ``/finish_weight_update`` is refused, ``_transact`` sees ``not
    tx.announced`` and raises ``_refused`` ("the sender is usable"), so the
    server is left inside the session and the sender is not broken: every
    later push is refused at ``/start_weight_update``."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.4))
    sender.send(params())
    tree = step(params(1))
    server.fail["/finish_weight_update"] = 500
    try:
        with pytest.raises(SendError, match="before any weights were sent"):
            sender.send(tree)
    finally:
        del server.fail["/finish_weight_update"]
        jax.block_until_ready(tree)
    assert pushed(server)[3:] == START_FINISH
    assert not server.active or sender.broken


# -- Ctrl-C ----------------------------------------------------------------

@pytest.mark.parametrize("wait", [True, False], ids=["blocking", "async"])
@pytest.mark.usefixtures("python_sigint")
def test_a_second_ctrl_c_while_waiting_for_the_arrays_leaves_no_session_open(wait, step):
    """Promise 2/3. Two Ctrl-Cs while the push waits for its arrays (after
    ``/start_weight_update``): ``Transaction._start`` re-raises the
    ``KeyboardInterrupt``/``Aborted`` (``aborts(e)``) without finishing the
    session it opened, and ``_transact`` maps it through ``_refused``:
    "Ctrl-C before any weights were sent; the servers keep theirs", the
    sender not broken. The server stays inside the update session, and every
    later push is refused at ``/start_weight_update`` while the error says
    the sender is usable."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=20))
    sender.send(params())
    tree = step(params(2))
    fire = sigints(lambda: "/start_weight_update" in pushed(server)[3:], 2)
    e = raised_under(fire, lambda: sender.send(tree) if wait
                     else sender.send(tree, wait=False).result(30))
    jax.block_until_ready(tree)
    assert isinstance(e, KeyboardInterrupt), f"two Ctrl-Cs raise, not {e!r}"
    assert wait_for(lambda: answered(server))
    assert not server.active or sender.broken, (pushed(server)[3:], sender.broken)


@pytest.mark.usefixtures("python_sigint")
def test_a_third_ctrl_c_does_not_undo_the_abort(monkeypatch):
    """Promise 3 ("the sender is broken until reconnect()"). The second
    Ctrl-C's handler (``_Interrupts._handle``) puts back Python's default
    handler before raising, so a third Ctrl-C, pressed while ``_fail``
    waits for the lane to stop (``lane.stop(CANCEL_GRACE_S)``), raises out
    of ``_fail`` before ``self.broken`` is set and before the communicator
    is aborted. The server is left inside ``/update_weights`` (vLLM's
    workers inside NCCL) and the sender believes it is healthy."""
    monkeypatch.setattr("support.servers.memory_server.WIRE_TIMEOUT_S", 5.0)
    sender, (server,), caster = memory_sender(SMALL, delay_s=1.0)  # the lane polls once a second
    caster.gate = threading.Event()  # the push goes on once the Ctrl-Cs were sent
    fire = sigints(lambda: caster.sent, 3, then=caster.gate.set)
    e = raised_under(fire, lambda: sender.send(params(1)))
    assert isinstance(e, KeyboardInterrupt), repr(e)
    assert sender.broken and comm(sender).aborted, (sender.broken, pushed(server))


def test_a_ctrl_c_right_after_the_update_is_posted_is_an_abort(monkeypatch):
    """Promise 3. ``Transaction._round`` posts ``/update_weights`` and only
    then sets ``announced``; a second Ctrl-C's ``KeyboardInterrupt`` landing
    between the two (here: raised as the posting returns) is taken by
    ``_transact`` for a push that announced nothing: ``_refused``, "the
    servers keep theirs", no abort, not broken, while the workers wait in
    ``/update_weights`` for broadcasts that never come."""
    from jax_sender._src.core.control import ControlPlane

    monkeypatch.setattr("support.servers.memory_server.WIRE_TIMEOUT_S", 1.0)
    posted = ControlPlane.update

    def update_then_ctrl_c(self, payload, timeout_s):
        posted(self, payload, timeout_s)
        raise KeyboardInterrupt("a second Ctrl-C")

    sender, (server,), _ = memory_sender(SMALL)
    monkeypatch.setattr(ControlPlane, "update", update_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sender.send(params(1))
    monkeypatch.setattr(ControlPlane, "update", posted)
    assert wait_for(lambda: "/update_weights" in pushed(server))
    assert sender.broken, "an update was posted: its broadcasts never came"


@pytest.mark.usefixtures("python_sigint")
def test_a_first_ctrl_c_does_not_hide_an_abort():
    """Promise 2's wording for the first Ctrl-C: "lets the push in flight
    end on the servers ... then raises KeyboardInterrupt". When the push
    instead *aborted* (here ``/finish_weight_update`` refused), ``Session.run``'s
    ``finally`` still raises "the push in flight ended on the servers first",
    replacing the ``SendError`` that says to ``reconnect()``."""
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.2)
    server.fail["/finish_weight_update"] = 500
    caster.gate = threading.Event()  # the push goes on once the Ctrl-C was sent
    fire = sigints(lambda: caster.sent, 1, then=caster.gate.set)
    e = raised_under(fire, lambda: sender.send(params(1)))
    assert sender.broken
    assert e is not None
    assert "reconnect" in str(e), f"{type(e).__name__}: {e}"


# -- work reaching the servers before the arrays are computed ---------------

@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_with_a_transform_nothing_is_announced_before_the_arrays_are_computed(packed, step):
    """Promise 1/2 and ``Transaction._start``'s own docstring: "the first
    /update_weights is posted only once they are [computed], so no worker
    waits in NCCL for the trainer's step"; the docs' row "the arrays not
    computed within send_timeout_s -> SendError before any weights were
    sent". With any ``Mapping.transform`` the push has no readiness wait
    (sender.py ``_feeds``: ``ready = None if temporaries`` and the
    ``_xla_or_copies`` branch returns ``None``): ``/update_weights`` is
    posted at once and the lane blocks in ``block_until_ready`` with no
    deadline (unpacked, ``Placement.getter``) or fails after the broadcasts
    were announced (packed on GPU: ``UpdateIncomplete``, filler bytes)."""
    config = SendConfig(packed=packed, buffer_size_bytes=4096, send_timeout_s=0.3)
    sender, (server,), _ = memory_sender(config, mapping=Mapping(transform=torch_layout))
    sender.send(params())
    tree = step(params(1))
    try:
        t = time.monotonic()
        with pytest.raises(SendError, match="before any weights were sent"):
            sender.send(tree)
        assert time.monotonic() - t < 0.3 + 1.5
        assert pushed(server)[3:] == START_FINISH
    finally:
        jax.block_until_ready(tree)


# -- inputs that reach a server ----------------------------------------------

def test_a_name_json_cannot_carry_is_refused_before_any_http_call():
    """Promise 1. ``check_push`` refuses a ``weight_version`` UTF-8 cannot
    encode, but a tensor *name* with a lone surrogate passes ``describe``;
    ``/start_weight_update`` is posted, then encoding the ``/update_weights``
    body fails, which is taken for a peer failure: the communicator is
    aborted, the sender broken, the server left inside the session."""
    sender, (server,), _ = memory_sender(SMALL)
    got = None
    try:
        sender.send([("model.w\ud800", jnp.ones(3))])
    except MetadataError:
        pass
    except Exception as e:  # reported outside the handler: pytest cannot print a surrogate
        got = f"{type(e).__name__}: {ascii(str(e))[:200]}"
    assert got is None, got
    assert pushed(server) == [] and not sender.broken and not server.active


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_deleted_array_through_a_transform_is_refused_before_any_http_call(packed):
    """Promise 1 ("send checks the arrays ... before /start_weight_update").
    A donated (deleted) parameter is only found on the lane, after
    ``/update_weights``: the round is completed with filler bytes and the
    servers hold an ``UpdateIncomplete``, although ``is_deleted()`` says so
    before anything is sent."""
    config = SendConfig(packed=packed, buffer_size_bytes=4096)
    sender, (server,), _ = memory_sender(config, mapping=Mapping(transform=torch_layout))
    sender.send(params(0))
    p = params(1)
    p["layer"]["w"].delete()
    with pytest.raises(MetadataError):
        sender.send(p)
    assert pushed(server)[3:] == [] and held(server) == expected(params(0), torch_layout)


def test_a_deleted_array_does_not_crash_the_trainer():
    """Promise 1. ``describe.readiness`` calls ``is_ready()`` on every
    caller array; on a deleted (donated) one jaxlib 0.10.2 segfaults (CPU;
    ``x.delete(); x.is_ready()`` alone reproduces it), so a blocking push of
    a tree holding a donated array kills the process. Run in a child."""
    script = textwrap.dedent("""
        import jax
        jax.config.update("jax_platforms", "cpu")
        from jax_sender import SendConfig, TransferError
        from support.servers.memory_link import memory_sender
        from support.pushes import params, pushed
        sender, (server,), _ = memory_sender(SendConfig(packed=False))
        p = params(1)
        jax.block_until_ready(p)
        p["layer"]["w"].delete()
        try:
            sender.send(p)
        except TransferError as e:
            print("refused:", type(e).__name__, pushed(server))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=on_tests_path(dict(os.environ)))
    assert run.returncode == 0, (run.returncode, run.stderr[-600:])
    assert "refused: MetadataError []" in run.stdout


# -- close and reconnect beside a push ---------------------------------------

def test_send_async_then_close_lets_the_push_end():
    """"close() lets a push in flight end (one still waiting for its arrays
    is cancelled)". Here the arrays are computed, yet ``close()`` right after
    ``send(wait=False)`` always cancels the push (``Session.close`` cancels
    any pending push; ``Transaction._start`` honours the cancel after the
    readiness wait, whether or not it waited): ``with connect(...) as s:
    s.send(final, wait=False)`` drops the final weights."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params(0))
    p = params(1)
    jax.block_until_ready(p)
    pending = sender.send(p, wait=False)
    sender.close()
    assert pending.result(10).tensors == 5
    assert held(server) == expected(p)


def test_close_beside_a_push_still_preparing_gives_it_sender_closed():
    """"send after close raises SenderClosed". ``admit`` guesses the
    turn's holder is done by ``wait_timeout_s(0)`` (session.py ``admit``:
    ``_busy_until``), which does not cover the push's preparation (tracing
    a transform, compiling the snapshot's copies, a sparse push's host sync
    on the arrays); past it ``close()`` tears the connection down beside the
    holder, which then fails with ``AttributeError: 'NoneType' object has no
    attribute 'init_info'`` (or takes the ``_gathers_only`` branch, since
    ``session.connection is None``)."""
    slow = {"on": False}

    def slow_trace(path, x):
        if slow["on"] and isinstance(x, jax.core.Tracer):
            time.sleep(3.0)  # a slow trace, as a large model's first describe
        return x

    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.2),
                                         mapping=Mapping(transform=slow_trace))
    sender.send(params())
    slow["on"] = True
    out = []

    def push():
        try:
            out.append(sender.send({"x": jnp.ones(3)}))
        except BaseException as e:
            out.append(e)

    th = threading.Thread(target=push, daemon=True)
    th.start()
    time.sleep(0.1)
    sender.close()
    th.join(15)
    assert not th.is_alive()
    (result,) = out
    assert isinstance(result, SenderClosed), repr(result)


def test_a_second_close_at_the_same_time_does_nothing():
    """"a second close() does nothing". A ``close()`` that starts while
    another waits for the push in flight and then tears down raises
    ``SenderClosed`` (``_wait_turn`` sees ``closed`` set by the first);
    ``with sender:`` plus a ``close()`` from another thread then masks the
    block's own exception."""
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.3)
    pending = sender.send(params(1), wait=False)
    time.sleep(0.1)
    shutdown = server.hold["/shutdown_weight_transfer_engine"] = threading.Event()
    errors = []

    def close():
        try:
            sender.close()
        except BaseException as e:
            errors.append(e)

    closers = [threading.Thread(target=close, daemon=True) for _ in range(2)]
    try:
        for c in closers:
            c.start()
        time.sleep(1.5)
    finally:
        shutdown.set()
    for c in closers:
        c.join(10)
    assert pending.result(10).tensors == 5
    assert errors == []


def test_reconnect_names_only_the_server_that_is_stuck(caplog):
    """Promise 3: "A server whose engine does not answer is named
    (ServerStuck: restart that server)". With two servers and the first
    holding ``/shutdown_weight_transfer_engine``, the first spends the
    whole deadline; the second, never asked anything, is then logged as
    stuck, "restart that server" (``rendezvous.release``: ``seconds_left``
    raises ``RendezvousTimeout`` before any call, and it becomes
    ``ServerStuck``), and it is left initialized."""
    sender, (a, b), _ = memory_sender(SendConfig(buffer_size_bytes=4096, reconnect_timeout_s=1.0),
                                      servers=2)
    stuck = a.hold["/shutdown_weight_transfer_engine"] = threading.Event()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(Exception, match=a.url):
            sender.reconnect()
    finally:
        stuck.set()
    blamed = [r.getMessage() for r in caplog.records if b.url in r.getMessage()]
    assert not any("restart" in m for m in blamed), blamed


# -- metadata and what the workers hold after a failure -----------------------

def test_a_sparse_sender_does_not_diff_against_weights_an_aborted_push_may_have_changed():
    """Promise 2's rule for ``SparseSender`` ("refuses to diff against
    weights it no longer knows") and ``Session._reset``'s own docstring
    ("the communicator was given up: what the workers hold is unknown").
    ``SparseSender`` sets ``_unknown`` only on ``UpdateIncomplete`` and does
    not hook ``session.on_reset``: after an aborted push whose bytes the
    workers loaded (``/finish_weight_update`` refused), ``reconnect()`` and
    ``send(v2, v0)`` patches silently over v1's change."""
    sender, (server,), _ = memory_sender(SendConfig(packed=False), kind=SparseSender)
    v0 = {"w": jnp.arange(8, dtype=jnp.float32)}
    v1 = {"w": v0["w"].at[2].set(100.0)}
    v2 = {"w": v0["w"].at[5].set(-1.0)}
    sender.send(v0, None)
    server.fail["/finish_weight_update"] = 500
    try:
        with pytest.raises(SendError, match="reconnect"):
            sender.send(v1, v0)
    finally:
        del server.fail["/finish_weight_update"]
    sender.reconnect()
    try:
        sender.send(v2, v0)
    except MetadataError:
        return  # refused, as after an UpdateIncomplete: send(v2, None) repairs
    assert held(server) == expected(v2), server.store["w"]


# -- one Ctrl-C at any instant -------------------------------------------------
# A SIGINT is raised before each line the main thread runs in the session
# (``sigint_at``: the handler in place runs right there, as for a real
# Ctrl-C), the lines found by a first, clean run of the same call; after
# each, the sender must push exactly within its deadline and close() must
# release everything. One Ctrl-C never breaks the sender.

CONFIG = SendConfig(buffer_size_bytes=4096, num_buffers=2, send_timeout_s=5.0)


@pytest.fixture(scope="module")
def trees():
    return [jax.block_until_ready(params(i)) for i in range(3)]


def _session_lines(*also: str) -> tuple[str, ...]:
    from jax_sender._src.broadcast import sender
    from jax_sender._src.core import interrupts, session
    return (session.__file__, interrupts.__file__, sender.__file__, *also)


def _fresh(trees):
    sender, (server,), _ = memory_sender(CONFIG)
    sender.send(trees[0])  # as after any first push: the SIGINT gate is in place
    return sender, server


def _released(sender, server, busy: int) -> list[str]:
    """What a close() left unreleased."""
    from jax_sender._src.core import session
    problems = []
    if server.initialized or "/shutdown_weight_transfer_engine" not in server.routes():
        problems.append("the server's engine was not shut down")
    for client in sender.session.route.clients:
        try:
            client.get_world_size(timeout=2)
            problems.append(f"{client!r} was left open")
        except RuntimeError:
            pass
    if not wait_for(lambda: busy_kept_threads() <= busy, 5):
        problems.append(f"{busy_kept_threads() - busy} kept thread(s) left busy")
    if session._in_flight:
        problems.append("a push is left for the interpreter's exit to wait for")
    return problems


def _usable_then_closed(sender, server, trees, busy: int) -> list[str]:
    """A push exact within its deadline, then close() releasing everything."""
    problems = []
    t = time.monotonic()
    ended, out = bounded(lambda: sender.send(trees[2]), CONFIG.send_timeout_s + 10)
    took = time.monotonic() - t
    if not ended:
        return [f"the next send did not end within {CONFIG.send_timeout_s + 10:g}s"]
    if isinstance(out, BaseException):
        problems.append(f"the next send raised {type(out).__name__}: {out}")
    elif held(server) != expected(trees[2]) or took > CONFIG.send_timeout_s + 5:
        problems.append(f"the next send was not exact within its deadline ({took:.1f}s)")
    ended, out = bounded(sender.close, 30)
    if not ended:
        return problems + ["close() did not return within 30s"]
    if isinstance(out, BaseException):
        problems.append(f"close() raised {type(out).__name__}: {out}")
    return problems + _released(sender, server, busy)


def _outcome(e: BaseException | None, sender) -> list[str]:
    """One Ctrl-C: the call returns or raises KeyboardInterrupt, and the sender is not broken."""
    problems = []
    if e is not None and not isinstance(e, KeyboardInterrupt):
        problems.append(f"raised {type(e).__name__}: {e}")
    if sender.broken:
        problems.append(f"one Ctrl-C broke the sender: {sender.broken}")
    return problems


def _every_line(case, lines) -> None:
    """``case(line)`` for each line; every problem reported at once."""
    assert len(lines) > 10, [named(w) for w in lines]
    report = [f"{named(w)}: {'; '.join(p)}" for w in lines if (p := case(w))]
    assert not report, f"{len(report)} of {len(lines)} lines:\n" + "\n".join(report)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("python_sigint")
def test_one_ctrl_c_at_any_line_of_a_blocking_send_leaves_the_sender_usable(trees):
    """Issue 35, item 1: a SIGINT while ``send`` is admitted or enters its
    interrupt guard raised ``KeyboardInterrupt`` with the session's turn
    still taken: every later ``send()``/``close()`` waited for ever (the
    admission's budget is unbounded) or until the lost push's deadlines."""
    sender, server = _fresh(trees)
    lines = line_events(lambda: sender.send(trees[1]), _session_lines())
    sender.close()

    def case(where):
        sender, server = _fresh(trees)
        busy = busy_kept_threads()
        e = sigint_at(where, lambda: sender.send(trees[1]))
        return _outcome(e, sender) + _usable_then_closed(sender, server, trees, busy)

    _every_line(case, lines)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("python_sigint")
def test_one_ctrl_c_at_any_line_of_an_asynchronous_send_leaves_the_sender_usable(trees):
    """Issue 35, item 1: a SIGINT while ``send(wait=False)`` starts its
    push's thread (a fresh one here: the kept ones are set aside) lost the
    push: the turn stayed taken and the interpreter's exit waited for a push
    that never ran."""
    import threading as stdlib_threading

    from nccl_cffi import threads, waiting
    files = _session_lines(waiting.__file__, threads.__file__, stdlib_threading.__file__)

    def on_a_fresh_thread(call):
        saved = threads._idle.pop("jax-sender-push", [])
        try:
            return call()
        finally:
            with threads._lock:
                threads._idle.setdefault("jax-sender-push", []).extend(saved)

    def push(sender, got):
        got.append(sender.send(trees[1], wait=False))

    sender, server = _fresh(trees)
    lines = on_a_fresh_thread(lambda: line_events(lambda: push(sender, []), files))
    sender.close()

    def case(where):
        sender, server = _fresh(trees)
        busy, got = busy_kept_threads(), []
        e = on_a_fresh_thread(lambda: sigint_at(where, lambda: push(sender, got)))
        problems = _outcome(e, sender)
        if got:
            ended, out = bounded(lambda: got[0].result(), CONFIG.send_timeout_s + 10)
            if not ended or isinstance(out, BaseException):
                problems.append(f"its push did not end: {out!r}")
        return problems + _usable_then_closed(sender, server, trees, busy)

    _every_line(case, lines)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("python_sigint")
def test_one_ctrl_c_at_any_line_of_a_wait_for_a_push_leaves_the_sender_usable(trees):
    """``PendingSend.result()``: one Ctrl-C lets the push end (it is never
    lost), and the sender stays usable."""
    def in_flight(sender, server):
        hold = server.hold["/finish_weight_update"] = threading.Event()
        pending = sender.send(trees[1], wait=False)
        threading.Timer(0.3, hold.set).start()
        return pending

    sender, server = _fresh(trees)
    pending = in_flight(sender, server)
    lines = line_events(lambda: pending.result(20), _session_lines())
    sender.close()

    def case(where):
        sender, server = _fresh(trees)
        busy = busy_kept_threads()
        pending = in_flight(sender, server)
        e = sigint_at(where, lambda: pending.result(20))
        problems = _outcome(e, sender)
        ended, out = bounded(lambda: pending.result(), CONFIG.send_timeout_s + 10)
        if not ended or isinstance(out, BaseException) or held(server) != expected(trees[1]):
            problems.append(f"the push did not end on the server: {out!r}")
        return problems + _usable_then_closed(sender, server, trees, busy)

    _every_line(case, lines)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("python_sigint")
def test_one_ctrl_c_at_any_line_of_close_then_close_again_releases_everything(trees):
    """Issue 35, item 2: a SIGINT while ``close()`` waited for the push in
    flight left it half closed: a second ``close()`` waited for the last
    push's budget + 60 s, then returned without releasing the servers'
    engines or closing the HTTP clients. Here the push in flight is held at
    ``/finish_weight_update`` for 0.3 s; it must end on the server whatever
    the Ctrl-C did, and a second ``close()`` must finish the job."""
    def in_flight(sender, server):
        hold = server.hold["/finish_weight_update"] = threading.Event()
        pending = sender.send(trees[1], wait=False)
        assert wait_for(lambda: "/finish_weight_update" in server.routes())
        threading.Timer(0.3, hold.set).start()
        return pending

    sender, server = _fresh(trees)
    in_flight(sender, server)
    lines = line_events(sender.close, _session_lines())

    def case(where):
        sender, server = _fresh(trees)
        busy = busy_kept_threads()
        pending = in_flight(sender, server)
        e = sigint_at(where, sender.close)
        problems = [] if e is None or isinstance(e, KeyboardInterrupt) else [f"raised {e!r}"]
        ended, out = bounded(lambda: pending.result(), CONFIG.send_timeout_s + 10)
        if not ended or isinstance(out, BaseException) or held(server) != expected(trees[1]):
            problems.append(f"the push in flight did not end on the server: {out!r}")
        ended, out = bounded(lambda: sender.send(trees[2]), 10)
        began = not isinstance(out, SendStats) or held(server) != expected(trees[2])
        if began and not isinstance(out, SenderClosed):  # (a Ctrl-C before it began: no close)
            problems.append(f"a send after close() gave {out!r}")
        ended, out = bounded(sender.close, 30)
        if not ended or out is not None:
            return problems + [f"a second close() did not end at once: {out!r}"]
        return problems + _released(sender, server, busy)

    _every_line(case, lines)


def test_a_ctrl_c_aimed_at_a_push_that_already_ended_cannot_end_the_run():
    """Issue 35, item 6: a Ctrl-C test whose SIGINTs came after the push
    they aimed at had ended let one reach Python's default handler after
    the test returned, and its KeyboardInterrupt ended the whole run (a
    loaded host). In a child: SIGINTs aimed at calls that return at once,
    and others a failed test never ended; the child must live on."""
    script = textwrap.dedent("""
        import signal
        import time
        from support.concurrency import raised_under, sigints
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's run has
        for _ in range(20):  # aimed at calls that return at once
            e = raised_under(sigints(lambda: True, 3, gap=0.01), lambda: None)
            assert e is None or isinstance(e, KeyboardInterrupt), repr(e)
            time.sleep(0.05)
        armed = []
        sigints(lambda: armed, 3, gap=0.01)  # its test failed before its call
        armed.append(True)  # a later test's push
        time.sleep(0.5)
        print("lived on")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=on_tests_path(dict(os.environ)))
    assert run.returncode == 0 and "lived on" in run.stdout, (run.returncode, run.stderr[-600:])
