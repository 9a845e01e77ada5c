"""A fleet of servers: every phase of a push (and of forming the group) on
all servers at once, threads and the push thread's own work that do not
grow with the servers, and an elastic fleet (a server dropped, added, taken
back). Up to 64 servers over the in-memory link (``support.servers.memory_server``,
whose logs and stores show what each server got, bit for bit); at 256, over
``support.servers.idle_servers`` (do-nothing servers in another process, the data
plane replaced by one that moves nothing)."""

from __future__ import annotations

import re
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from jax_sender import DroppedServer, SendConfig, SendError, SparseSender, TransferError
from jax_sender._src.core.group import TrainerGroup
from jax_sender._src.core.routes import ProcessGroup
from jax_sender._src.core.session import Session
from nccl_cffi import Deadline
from uniqueid import RendezvousError, ServerStuck, VLLMClient, VLLMConnectionError
from uniqueid.http.fleet import call_all

from support.concurrency import inside, wait_for
from support.pushes import SMALL, answered, calls, expected, held, params, pushed
from support.servers import memory_link
from support.servers.idle_servers import IdleServers
from support.servers.memory_link import null_sender

SESSION = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
MARGIN = 2.0  # what a loaded 2-core machine may add to a deadline


# What the running test made (a sender or None, memory servers): closed after
# it, so the 64-server tests leave no sockets behind for the tests that follow.
_MADE: list[tuple] = []


@pytest.fixture(autouse=True)
def closes_what_it_made():
    yield
    while _MADE:
        sender, servers = _MADE.pop()
        for s in servers:
            for event in [*s.hold.values(), *s.stall.values()]:
                event.set()
        if sender is not None:
            sender.close()
        killers = [threading.Thread(target=s.kill) for s in servers]  # each waits 0.5 s
        for k in killers:
            k.start()
        for k in killers:
            k.join(10)


def memory_sender(*args, **kwargs):
    """``memory_link.memory_sender``, closed after the test."""
    sender, servers, caster = memory_link.memory_sender(*args, **kwargs)
    _MADE.append((sender, servers))
    return sender, servers, caster


def restarted(server, wire):
    """``memory_link.restarted``, the fresh server closed after the test."""
    fresh = memory_link.restarted(server, wire)
    _MADE.append((None, [fresh]))
    return fresh


def exact(servers, tree) -> bool:
    """Every server holds ``tree``, bit for bit."""
    return all(held(s) == expected(tree) for s in servers)


class AllArrived:
    """``server.hold[path]`` on every server until the call reached every one
    of them, then released (within ``seconds`` in any case, so a sender that
    calls them one after another fails the test instead of hanging it);
    ``all_arrived``: whether the call was on every server at once."""

    def __init__(self, servers, path: str, seconds: float = 10.0):
        self.servers, self.path, self.seconds = servers, path, seconds
        self.all_arrived = False

    def __enter__(self) -> AllArrived:
        before = [len(calls(s, self.path)) for s in self.servers]
        events = [threading.Event() for _ in self.servers]
        for s, e in zip(self.servers, events):
            s.hold[self.path] = e

        def gate() -> None:
            self.all_arrived = wait_for(lambda: all(
                len(calls(s, self.path)) > n for s, n in zip(self.servers, before)), self.seconds)
            for e in events:
                e.set()

        self.thread = threading.Thread(target=gate, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(self.seconds + 5)
        for s in self.servers:
            s.hold.pop(self.path)
        assert wait_for(lambda: all(answered(s) for s in self.servers))


# ---- every phase on every server at once -----------------------------------------

def push(sender) -> None:
    sender.send(params(2), pause="keep")


PHASES = {
    "/pause": push, "/start_weight_update": push, "/update_weights": push,
    "/finish_weight_update": push, "/resume": push,
    "/shutdown_weight_transfer_engine": lambda s: s.reconnect(),
    "/get_world_size": lambda s: s.reconnect(),
    "/init_weight_transfer_engine": lambda s: s.reconnect(),
}


@pytest.mark.parametrize("path", PHASES)
def test_each_phase_reaches_every_server_before_any_answers(path):
    """Each route of a push and of a reconnect is held on every server until
    it reached all of them: made one server after another, the first held
    call would stop the rest. Then the push lands, bit-exact."""
    sender, servers, _ = memory_sender(SMALL, servers=8)
    sender.send(params(1))
    with AllArrived(servers, path) as gate:
        PHASES[path](sender)
    assert gate.all_arrived, f"{path} did not reach every server at once"
    sender.send(params(3))
    assert exact(servers, params(3)) and not sender.broken


def test_a_phase_has_one_deadline_however_many_servers_are_late():
    """Three of eight servers never answer ``/start_weight_update``: the push
    fails once, at the phase's deadline (not at one deadline per late
    server), naming one of them; the others' sessions are finished."""
    config = SendConfig(buffer_size_bytes=4096, send_timeout_s=1.0)
    sender, servers, caster = memory_sender(config, servers=8)
    sender.send(params(1))
    late = servers[2:5]
    for s in late:
        s.hold["/start_weight_update"] = threading.Event()
    t = time.monotonic()
    try:
        with pytest.raises(SendError, match=r"before any weights were sent.*"
                                            r"/start_weight_update: no answer within the "
                                            r"timeout of 1 s") as err:
            sender.send(params(2))
        took = time.monotonic() - t
    finally:
        for s in late:
            s.hold.pop("/start_weight_update").set()
    assert 1.0 - 0.05 <= took < 1.0 + MARGIN, took
    assert any(s.url in str(err.value) for s in late)
    for s in servers:
        assert pushed(s)[-2:] == ["/start_weight_update", "/finish_weight_update"] \
            or s in late
    assert wait_for(lambda: all(answered(s) for s in servers))
    sender.reconnect()  # the late starts landed: reconnect finishes them
    sender.send(params(3))
    assert exact(servers, params(3))


# ---- what a push to many servers costs the sender --------------------------------

def test_a_push_to_256_servers_runs_on_a_few_threads():
    """Connecting to 256 servers and pushing to them three times: the
    sender's threads grow by a handful (its HTTP loop, its NCCL thread),
    not by a thread per server per call; every server got every push."""
    with IdleServers(256) as fleet:
        before = threading.active_count()
        most, stop = [before], threading.Event()

        def sample() -> None:
            while not stop.wait(0.001):
                most.append(threading.active_count() - 1)  # less this sampler

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            sender = null_sender(fleet.urls, SendConfig(send_timeout_s=60.0))
            tree = [("w", jnp.arange(1024, dtype=jnp.float32))]
            for _ in range(3):
                sender.send(tree)
        finally:
            stop.set()
            sampler.join()
        assert max(most) - before <= 6, (before, max(most))
        counts = call_all(sender.session.clients, VLLMClient.request, "GET", "/_calls",
                          deadline=Deadline(30))
        assert all(c["/start_weight_update"] == c["/update_weights"] ==
                   c["/finish_weight_update"] == 3 for c in counts)
        sender.close()


def test_a_push_after_the_servers_closed_their_kept_connections_dials_them_again():
    """The servers close a connection idle for 0.3 s (uvicorn under vLLM: 5 s,
    the usual pause between RL steps): the next push dials all 64 again,
    within its start phase, and lands everywhere."""
    with IdleServers(64, keep_alive=0.3) as fleet:
        sender = null_sender(fleet.urls, SendConfig(send_timeout_s=60.0))
        tree = [("w", jnp.arange(1024, dtype=jnp.float32))]
        for _ in range(3):
            sender.send(tree)
            time.sleep(0.6)
        counts = call_all(sender.session.clients, VLLMClient.request, "GET", "/_calls",
                          deadline=Deadline(30))
        assert all(c["/finish_weight_update"] == 3 for c in counts)
        sender.close()


def calls_on_this_thread(fn) -> int:
    """How many functions (Python and C) ``fn()`` calls on this thread."""
    count = [0]

    def profile(frame, event, arg) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_the_push_threads_own_work_does_not_grow_with_the_servers():
    """The push's thread waits on one future per phase, however many servers
    answer: the calls it makes during a push to 256 servers are within twice
    those of a push to 16. (Waiting on each server's answer in turn, and
    looking at every server's at each wait, grew with the square of the
    servers: over 60,000 looks at 256.)"""
    tree = [("w", jnp.arange(1024, dtype=jnp.float32))]
    counts = {}
    for n in (16, 256):
        with IdleServers(n) as fleet:
            sender = null_sender(fleet.urls, SendConfig(send_timeout_s=60.0))
            sender.send(tree)
            counts[n] = min(calls_on_this_thread(lambda s=sender: s.send(tree))
                            for _ in range(3))
            sender.close()
    assert counts[256] < 2 * counts[16], counts


# ---- 64 servers: one late, one failing, one dead ----------------------------------

def fleet64(send_timeout_s: float):
    config = SendConfig(buffer_size_bytes=4096, send_timeout_s=send_timeout_s,
                        reconnect_timeout_s=10.0)
    sender, servers, caster = memory_sender(config, servers=64)
    sender.send(params(0))
    return sender, servers, caster


def late_by(server, path: str, seconds: float) -> threading.Timer:
    """``server`` answers ``path`` ``seconds`` after the call arrives (the first one)."""
    event = server.hold[path] = threading.Event()
    timer = threading.Timer(seconds, event.set)

    def arm() -> None:
        wait_for(lambda: calls(server, path), 30)
        timer.start()

    threading.Thread(target=arm, daemon=True).start()
    return timer


def test_at_64_servers_one_answering_2s_late_holds_the_push_2s():
    sender, servers, _ = fleet64(send_timeout_s=5.0)
    late = servers[17]
    late_by(late, "/start_weight_update", 2.0)
    t = time.monotonic()
    sender.send(params(1))
    took = time.monotonic() - t
    late.hold.pop("/start_weight_update")
    assert 2.0 - 0.05 <= took < 2.0 + MARGIN, took
    assert exact(servers, params(1)) and not sender.broken


def test_at_64_servers_one_answering_past_the_deadline_fails_the_push_naming_it():
    sender, servers, _ = fleet64(send_timeout_s=1.0)
    late = servers[17]
    late_by(late, "/finish_weight_update", 2.0)
    t = time.monotonic()
    with pytest.raises(SendError, match=f"{late.url}/finish_weight_update: no answer within "
                                        "the timeout of 1 s.*reconnect"):
        sender.send(params(1))
    assert time.monotonic() - t < 1.0 + MARGIN
    assert wait_for(lambda: answered(late))
    late.hold.pop("/finish_weight_update")
    sender.reconnect()
    sender.send(params(2))
    assert exact(servers, params(2)) and not sender.broken


def test_at_64_servers_one_failing_fails_the_push_naming_it_and_reconnect_mends_it():
    sender, servers, _ = fleet64(send_timeout_s=5.0)
    bad = servers[40]
    bad.fail["/update_weights"] = 500
    t = time.monotonic()
    with pytest.raises(SendError, match=f"{bad.url}/update_weights.*injected failure"):
        sender.send(params(1))
    assert time.monotonic() - t < MARGIN
    assert sender.broken
    del bad.fail["/update_weights"]
    sender.reconnect()
    sender.send(params(2))
    assert exact(servers, params(2)) and not sender.broken


def test_at_64_servers_a_dead_one_is_dropped_and_taken_back_once_it_returns():
    """The push fails at once naming the dead server and how to go on;
    ``reconnect()`` names it again; ``reconnect(drop_dead=True)`` leaves it
    out, and the 63 others take exact pushes; restarted, ``add_server``
    takes it back and all 64 take an exact push."""
    sender, servers, caster = fleet64(send_timeout_s=5.0)
    dead = servers[63]
    dead.kill()
    t = time.monotonic()
    with pytest.raises(SendError, match=f"{dead.url}/start_weight_update: the connection "
                                        r"failed.*reconnect\(drop_dead=True\)"):
        sender.send(params(1))
    assert time.monotonic() - t < MARGIN
    with pytest.raises(VLLMConnectionError, match=rf"{dead.url}/shutdown_weight_transfer_engine"
                                                  r".*reconnect\(drop_dead=True\)"):
        sender.reconnect()
    assert sender.broken
    dropped = sender.reconnect(drop_dead=True)
    assert [d.url for d in dropped] == [dead.url] and "connection failed" in dropped[0].reason
    assert sender.servers == tuple(s.url for s in servers[:63]) and not sender.broken
    for seed in (2, 3):
        sender.send(params(seed))
        assert exact(servers[:63], params(seed))
    back = restarted(dead, caster.wire)
    sender.add_server(back.url)
    assert sender.servers == tuple(s.url for s in servers[:63]) + (back.url,)
    sender.send(params(4))
    assert exact([*servers[:63], back], params(4)) and pushed(back) == SESSION


# ---- dropping and adding, one at a time ---------------------------------------------

def test_drop_server_releases_it_and_pushes_to_the_others():
    sender, (a, b, c), _ = memory_sender(SMALL, servers=3)
    sender.send(params(1))
    sender.drop_server(b.url + "/")
    assert sender.servers == (a.url, c.url)
    assert calls(b, "/shutdown_weight_transfer_engine")[-1].status == 200  # ready for another trainer
    after = len(b.log)
    sender.send(params(2))
    assert exact([a, c], params(2)) and len(b.log) == after and held(b) == expected(params(1))


def test_drop_server_refuses_a_server_it_lacks_and_its_last():
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    with pytest.raises(ValueError, match="not one of this sender's servers"):
        sender.drop_server("http://127.0.0.1:1")
    sender.drop_server(a.url)
    with pytest.raises(ValueError, match=r"last server: close\(\)"):
        sender.drop_server(b.url)
    sender.send(params(1))
    assert held(b) == expected(params(1))


def test_drop_server_leaves_it_out_even_when_another_cannot_be_released():
    sender, (a, b, c), _ = memory_sender(SMALL, servers=3)
    c.kill()
    with pytest.raises(VLLMConnectionError, match=f"{c.url}/shutdown_weight_transfer_engine"):
        sender.drop_server(a.url)
    assert sender.servers == (b.url, c.url) and sender.broken
    assert [d.url for d in sender.reconnect(drop_dead=True)] == [c.url]
    sender.send(params(1))
    assert held(b) == expected(params(1)) and sender.servers == (b.url,)


def test_add_server_that_cannot_join_leaves_the_sender_as_it_was():
    """The new server's world size is asked before anything reaches the
    running group: one that does not answer changes nothing."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    sender.send(params(1))
    logs = [len(a.log), len(b.log)]
    with pytest.raises(RendezvousError, match="127.0.0.1:1/get_world_size"):
        sender.add_server("http://127.0.0.1:1")
    assert [len(a.log), len(b.log)] == logs and not sender.broken
    assert sender.servers == (a.url, b.url)
    with pytest.raises(ValueError, match="already one of this sender's servers"):
        sender.add_server(a.url)
    sender.send(params(2))
    assert exact([a, b], params(2))


def test_a_server_is_one_server_however_its_url_is_spelled():
    """Before, ``http://localhost:P`` was taken as a new server beside
    ``127.0.0.1:P`` (its init made twice in one group)."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    port = a.url.rsplit(":", 1)[1]
    for spelled in (f"http://localhost:{port}", f"HTTP://127.000.000.001:0{port}/"):
        with pytest.raises(ValueError, match=r"is already one of this sender's servers "
                                             rf"\(as {re.escape(a.url)}\)$"):
            sender.add_server(spelled)
    sender.drop_server(f"http://localhost:0{port}/")
    assert sender.servers == (b.url,)
    sender.send(params(1))
    assert held(b) == expected(params(1))


def _racing(change, args, gate) -> list[BaseException | None]:
    """``change(arg)`` on a thread per arg, at once, ``gate`` held until one
    of them holds the sender's turn (inside it, held by ``gate``) and every
    other waits for it; what each raised (None if nothing), in ``args`` order."""
    out: list[BaseException | None] = [None] * len(args)

    def run(i: int) -> None:
        try:
            change(args[i])
        except BaseException as e:  # reported to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(args))]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: gate.arrived() and sum(inside(t, "_take_turn")
                                                      for t in threads) == len(args) - 1)
    finally:
        gate.release()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


class Gate:
    """``server.hold[path]``: ``arrived()`` once a call of it came, ``release()`` lets it go."""

    def __init__(self, server, path: str):
        self.server, self.path, self.before = server, path, len(calls(server, path))
        self.event = server.hold[path] = threading.Event()

    def arrived(self) -> bool:
        return len(calls(self.server, self.path)) > self.before

    def release(self) -> None:
        self.event.set()
        self.server.hold.pop(self.path)


def test_one_server_added_by_two_threads_at_once_is_taken_once():
    """Both adds passed the check before either took the server in: it was
    inited twice in one group, and the next push failed. Now the second is
    refused, and the fleet pushes."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    sender.drop_server(b.url)
    port = b.url.rsplit(":", 1)[1]
    errors = _racing(sender.add_server, [b.url, f"http://localhost:{port}"],
                     Gate(b, "/get_world_size"))
    assert sorted(e is None for e in errors) == [False, True], errors
    refused = next(e for e in errors if e is not None)
    assert isinstance(refused, ValueError) and "already one of this sender's servers" in str(
        refused), refused
    assert len(sender.servers) == 2 and not sender.broken
    assert len(calls(b, "/init_weight_transfer_engine")) == 2  # its first group, and this one
    sender.send(params(1))
    assert exact([a, b], params(1))


def test_two_threads_dropping_the_two_last_servers_at_once_keep_one():
    """Both drops passed the last-server check first: ``servers == ()`` and
    the sender broken. Now the second is refused, and the one left pushes."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    sender.send(params(1))
    errors = _racing(sender.drop_server, [a.url, b.url],
                     Gate(a, "/shutdown_weight_transfer_engine"))
    assert sorted(e is None for e in errors) == [False, True], errors
    refused = next(e for e in errors if e is not None)
    assert isinstance(refused, ValueError) and "last server: close()" in str(refused), refused
    kept = [s for s, e in zip((a, b), errors) if e is not None]
    assert sender.servers == (kept[0].url,) and not sender.broken
    sender.send(params(2))
    assert held(kept[0]) == expected(params(2))


def test_reconnect_drop_dead_drops_a_stuck_server_within_its_deadline():
    """A server whose engine never answers its release (stuck inside NCCL,
    say) is dropped once the reconnect's deadline passes, named with what
    to do; the others go on."""
    config = SendConfig(buffer_size_bytes=4096, reconnect_timeout_s=1.0)
    sender, (a, stuck, c), _ = memory_sender(config, servers=3)
    stuck.hold["/shutdown_weight_transfer_engine"] = threading.Event()
    t = time.monotonic()
    try:
        dropped = sender.reconnect(drop_dead=True)
    finally:
        stuck.hold.pop("/shutdown_weight_transfer_engine").set()
    assert time.monotonic() - t < 1.0 + MARGIN
    assert dropped == [DroppedServer(url=stuck.url, reason=dropped[0].reason)]
    assert "restart that server" in dropped[0].reason
    sender.send(params(1))
    assert exact([a, c], params(1))


def test_reconnect_without_drop_dead_names_a_stuck_server_and_how_to_go_on():
    config = SendConfig(buffer_size_bytes=4096, reconnect_timeout_s=1.0)
    sender, (a, stuck), _ = memory_sender(config, servers=2)
    stuck.hold["/shutdown_weight_transfer_engine"] = threading.Event()
    try:
        with pytest.raises(ServerStuck, match=rf"{stuck.url}.*restart that server.*"
                                              r"reconnect\(drop_dead=True\)"):
            sender.reconnect()
    finally:
        stuck.hold.pop("/shutdown_weight_transfer_engine").set()
    assert sender.broken and sender.servers == (a.url, stuck.url)


def test_reconnect_drop_dead_keeps_the_fleet_when_no_server_is_left():
    sender, servers, _ = memory_sender(SMALL, servers=2)
    for s in servers:
        s.kill()
    with pytest.raises(RendezvousError, match="no server could be released"):
        sender.reconnect(drop_dead=True)
    assert sender.servers == tuple(s.url for s in servers)


def test_a_sparse_sender_drops_and_adds_and_repairs_the_added_server():
    """After ``add_server`` the new server holds weights of its own, so a
    patch against the old weights is refused until a full push."""
    sender, (a, b), caster = memory_sender(SendConfig(packed=False), servers=2,
                                           kind=SparseSender)
    k = jax.random.split(jax.random.PRNGKey(5), 2)
    v0 = {"w": jax.random.normal(k[0], (32, 8), jnp.bfloat16), "b": jnp.zeros(5, jnp.float32)}
    v1 = dict(v0, w=v0["w"].at[1, 2].set(3.0))
    sender.send(v0, None)
    b.kill()
    assert [d.url for d in sender.reconnect(drop_dead=True)] == [b.url]
    sender.send(v1, v0)
    assert held(a) == expected(v1)
    back = restarted(b, caster.wire)
    sender.add_server(back.url)
    with pytest.raises(Exception, match=r"weights of its own.*send\(params, None\)"):
        sender.send(v0, v1)
    sender.send(v0, None)
    assert exact([a, back], v0)


def test_a_multi_process_sender_refuses_drop_and_add_by_name():
    route = ProcessGroup(group=TrainerGroup(plan=None, process=0, device=0, share=None,
                                            clients=[VLLMClient("http://127.0.0.1:1")],
                                            config=SendConfig()))
    session = Session(route, None, SendConfig(), broadcaster=lambda conn: None)
    for change in (lambda: session.drop_server("http://127.0.0.1:1"),
                   lambda: session.add_server("http://127.0.0.1:2")):
        with pytest.raises(TransferError, match="single-process sender.*drop_dead=True"):
            change()
