"""Failures of a push on CPU, and what each leaves on the servers: a push
that has started ends there (wound down on the trainer's side, aborted for a
peer or a deadline), the sender says what to do, and the same servers take
the next push. Over the in-memory link and the independent memory server."""

import os
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
    SparseSender,
    TransferError,
    UpdateIncomplete,
)
from uniqueid import ServerStuck

from support.concurrency import raised_under, sigints, wait_for
from support.pushes import SMALL, calls, comm, expected, held, params, pushed, slow_step
from support.servers.memory_link import memory_sender

SESSION = ["/start_weight_update", "/update_weights", "/finish_weight_update"]


def failing_on(victim: str):
    """A transform that raises for ``victim`` on real arrays (not while
    ``describe`` traces it): a trainer-side failure after the push started."""
    def transform(path, x):
        if path[-1] == victim and not isinstance(x, jax.core.Tracer):
            raise RuntimeError(f"the transform of {victim} failed")
        return x
    return transform


@pytest.mark.parametrize("packed", [True, False])
def test_a_transform_failing_mid_push_finishes_the_update_on_the_servers(packed, monkeypatch):
    """The round is completed from scratch bytes, the update answered and
    finished (no version stamped): the sender stays usable, and its next
    push sends every tensor again (no metadata reuse) and repairs it."""
    monkeypatch.setattr("jax_sender._src.broadcast.packing.MAX_TENSORS", 1)  # packed: copies, not XLA
    config = SendConfig(packed=packed, buffer_size_bytes=4096)
    sender, (server,), caster = memory_sender(config, mapping=Mapping(transform=failing_on("w")))
    with pytest.raises(UpdateIncomplete, match="the transform of w failed.*next send"):
        sender.send(params(1), weight_version="v1")
    assert pushed(server) == SESSION and not server.active
    assert calls(server, "/finish_weight_update")[-1].body is None  # no version for it
    assert caster.passes[-1] == "complete" and not sender.broken and not comm(sender).aborted
    assert server.weight_version != "v1"


def test_the_push_after_an_incomplete_update_sends_everything_and_repairs_it():
    calls_left = {"n": 0}

    def once(path, x):
        if path[-1] == "w" and not isinstance(x, jax.core.Tracer) and calls_left["n"]:
            calls_left["n"] -= 1
            raise RuntimeError("transient")
        return x

    sender, (server,), _ = memory_sender(SendConfig(packed=False),
                                         mapping=Mapping(transform=once))
    sender.send(params(0))
    assert sender.send(params(1)).reused_metadata
    calls_left["n"] = 1
    with pytest.raises(UpdateIncomplete):
        sender.send(params(2))
    stats = sender.send(params(3))
    assert not stats.reused_metadata and held(server) == expected(params(3))
    assert pushed(server)[-3:] == SESSION


def test_arrays_not_computed_within_the_deadline_end_the_session_with_nothing_sent():
    """The readiness wait has the push's deadline; past it, before any
    ``/update_weights``, the session is finished empty: the servers keep
    their weights, the sender stays usable and reuses its metadata."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.3))
    sender.send(params())
    tree = slow_step()(params(1))
    t = time.monotonic()
    with pytest.raises(SendError, match=r"before any weights were sent.*not computed within "
                                        r"0.3s .*SendConfig.send_timeout_s"):
        sender.send(tree)
    assert time.monotonic() - t < 2.0 and not tree["head"].is_ready()
    assert not sender.broken and not comm(sender).aborted
    assert pushed(server)[3:] == ["/start_weight_update", "/finish_weight_update"]
    assert held(server) == expected(params())
    jax.block_until_ready(tree)
    assert sender.send(tree).reused_metadata and held(server) == expected(params(1))


def test_start_refused_by_the_second_server_finishes_the_first_and_keeps_the_group():
    sender, (a, b), caster = memory_sender(SMALL, servers=2)
    b.fail["/start_weight_update"] = 500
    with pytest.raises(SendError, match="before any weights were sent.*/start_weight_update"):
        sender.send(params())
    assert pushed(a) == ["/start_weight_update", "/finish_weight_update"] and not a.active
    assert not caster.sent and not sender.broken and not comm(sender).aborted
    del b.fail["/start_weight_update"]
    sender.send(params(1))
    assert held(a) == held(b) == expected(params(1))


@pytest.mark.parametrize("route", ["/finish_weight_update", "/update_weights"])
def test_a_server_failing_mid_push_aborts_and_reconnect_mends_it(route):
    """A server that refuses after the bytes went out: the communicator is
    aborted (no more bytes can be trusted), the pause undone, and
    ``reconnect()`` finishes what the server left open and forms a new group."""
    sender, (server,), _ = memory_sender(SMALL)
    server.fail[route] = 500
    with pytest.raises(SendError, match=f"injected failure of {route}.*reconnect"):
        sender.send(params(), pause="abort")
    assert sender.broken and comm(sender).aborted
    assert pushed(server)[-1] == "/resume"  # a pause is always undone
    with pytest.raises(SendError, match="broken"):
        sender.send(params())
    del server.fail[route]
    sender.reconnect()
    sender.send(params(2))
    assert held(server) == expected(params(2)) and not sender.broken


def test_a_pause_refused_keeps_the_group_and_touches_nothing():
    sender, (server,), _ = memory_sender(SMALL)
    server.fail["/pause"] = 500
    with pytest.raises(SendError, match="before any weights were sent"):
        sender.send(params(), pause="wait")
    assert pushed(server) == ["/pause"] and not sender.broken


@pytest.mark.parametrize("args, match", [
    (dict(pause="abrot"), "pause must be one of abort, wait, keep"),
    (dict(weight_version=7), "weight_version must be a str"),
    (dict(weight_version="v\ud800"), "cannot travel as JSON"),
    (dict(metadata=["embed"]), "metadata must be a sequence of TensorMeta"),
])
def test_arguments_a_push_cannot_carry_are_refused_before_any_http_call(args, match):
    sender, (server,), _ = memory_sender(SMALL)
    with pytest.raises(MetadataError, match=match):
        sender.send(params(), **args)
    assert pushed(server) == [] and not sender.broken and not comm(sender).aborted


def test_pairs_whose_names_are_not_strings_are_refused():
    sender, (server,), _ = memory_sender(SMALL)
    with pytest.raises(MetadataError, match="non-empty str names, got 1"):
        sender.send([(1, jnp.ones(3))])
    assert pushed(server) == []


def test_close_twice_and_send_after_close():
    sender, (server,), caster = memory_sender(SMALL)
    sender.send(params())
    sender.close()
    sender.close()
    assert caster.closed and comm_closed(sender, server)
    with pytest.raises(SenderClosed, match="closed"):
        sender.send(params())
    with pytest.raises(SenderClosed):
        sender.reconnect()


def comm_closed(sender, server) -> bool:
    return sender.session.connection is None and not server.initialized


def test_close_lets_a_push_in_flight_end_on_the_servers():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.2)
    pending = sender.send(params(1), wait=False)
    time.sleep(0.1)
    sender.close()
    assert pending.result(timeout=5).tensors == 5 and held(server) == expected(params(1))
    assert pushed(server)[-1] == "/shutdown_weight_transfer_engine" and caster.closed


def test_close_lets_a_push_waiting_for_its_arrays_end_within_its_deadline():
    """``close()`` does not drop a push in flight: one still waiting for its
    arrays waits for them (the push's deadline bounds it), then runs."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params())
    tree = slow_step()(params(2))
    pending = sender.send(tree, wait=False)
    assert wait_for(lambda: "/start_weight_update" in pushed(server)[3:])
    assert not tree["head"].is_ready()
    sender.close()
    assert pending.result(5).tensors == 5 and held(server) == expected(params(2))
    assert pushed(server)[3:] == ["/start_weight_update", "/update_weights",
                                  "/finish_weight_update", "/shutdown_weight_transfer_engine"]


@pytest.mark.usefixtures("python_sigint")
def test_a_first_ctrl_c_lets_a_blocking_push_end_then_raises():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.2)
    caster.gate = threading.Event()  # the push goes on once the Ctrl-C was sent
    e = raised_under(sigints(lambda: caster.sent, 1, then=caster.gate.set),
                     lambda: sender.send(params(1)))
    assert isinstance(e, KeyboardInterrupt) and "ended on the servers first" in str(e), repr(e)
    assert held(server) == expected(params(1)) and pushed(server) == SESSION
    assert not sender.broken and not comm(sender).aborted
    sender.send(params(2))
    assert held(server) == expected(params(2))
    sender.close()
    assert caster.closed


@pytest.mark.usefixtures("python_sigint")
def test_a_second_ctrl_c_aborts_at_once_and_reconnect_mends_it(monkeypatch):
    monkeypatch.setattr("support.servers.memory_server.WIRE_TIMEOUT_S", 1.0)
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.3)
    caster.gate = threading.Event()  # the push goes on once both Ctrl-Cs were sent
    fire = sigints(lambda: caster.sent, 2, then=caster.gate.set)
    e = raised_under(fire, lambda: sender.send(params(1)))
    assert isinstance(e, KeyboardInterrupt) and "second Ctrl-C aborted" in str(e), repr(e)
    assert time.monotonic() - fire.last_sent < 2.0 + 1.0  # the lane's grace and a margin
    assert comm(sender).aborted and "Ctrl-C" in sender.broken
    sender.reconnect()  # waits for the server to give its update up
    sender.send(params(2))
    assert held(server) == expected(params(2))


@pytest.mark.usefixtures("python_sigint")
def test_a_first_ctrl_c_while_waiting_on_an_asynchronous_push_lets_it_end():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.2)
    caster.gate = threading.Event()  # the push goes on once the Ctrl-C was sent
    pending = sender.send(params(1), wait=False)
    e = raised_under(sigints(lambda: caster.sent, 1, then=caster.gate.set),
                     lambda: pending.result(timeout=20))
    assert isinstance(e, KeyboardInterrupt) and "ended on the servers first" in str(e), repr(e)
    assert pending.done() and pending.result().tensors == 5 and not sender.broken
    assert held(server) == expected(params(1))


def test_reconnect_finishes_a_session_left_open_on_the_server():
    """vLLM refuses to shut its engine down during an update session; a
    session left open (here: opened by hand) is finished first."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.session.clients[0].start_weight_update()
    sender.reconnect()
    assert server.routes()[-8:] == ["/start_weight_update", "/shutdown_weight_transfer_engine",
                                    "/finish_weight_update", "/shutdown_weight_transfer_engine",
                                    "/get_world_size", "/is_paused", "/weight_info",
                                    "/init_weight_transfer_engine"]
    assert calls(server, "/shutdown_weight_transfer_engine")[0].status == 500
    sender.send(params(1))
    assert held(server) == expected(params(1))


def test_reconnect_names_a_stuck_server_within_its_deadline():
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096,
                                                    reconnect_timeout_s=1.0))
    server.hold["/shutdown_weight_transfer_engine"] = threading.Event()
    t = time.monotonic()
    with pytest.raises(ServerStuck, match=f"{server.url}.*restart that server"):
        sender.reconnect()
    assert time.monotonic() - t < 1.0 + 1.5 and sender.broken
    server.hold["/shutdown_weight_transfer_engine"].set()


def test_an_update_never_answered_fails_within_the_deadline():
    """A server that takes every byte and then never answers
    ``/update_weights`` (its loader stuck): the push fails at the deadline
    after the last broadcast, naming the server, and the communicator is aborted."""
    sender, (server,), caster = memory_sender(SendConfig(buffer_size_bytes=4096,
                                                         send_timeout_s=0.5))
    server.stall["/update_weights"] = threading.Event()
    t = time.monotonic()
    with pytest.raises(SendError, match=f"{server.url}/update_weights did not answer within 0.5s"):
        sender.send(params())
    assert time.monotonic() - t < 0.5 + 1.5 and sender.broken and comm(sender).aborted
    assert len(caster.sent) == 3  # every broadcast was taken
    server.stall["/update_weights"].set()


def test_a_server_that_never_takes_the_bytes_fails_the_broadcast_at_its_deadline():
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, send_timeout_s=0.5))
    server.hold["/update_weights"] = threading.Event()
    t = time.monotonic()
    with pytest.raises(SendError, match="NcclTimeoutError: broadcast did not complete within"):
        sender.send(params())
    assert time.monotonic() - t < 0.5 + 1.5 and sender.broken and comm(sender).aborted
    server.hold["/update_weights"].set()


def test_an_nccl_call_that_never_returns_is_abandoned_not_freed(monkeypatch):
    """A broadcast stuck inside an NCCL call (a peer gone while a connection
    is set up) holds the push's NCCL thread: the caller still gets a
    ``SendError`` past the deadline, the communicator is never aborted or
    freed under that call, and reconnect() forms a new group; if the call
    ever returns, the communicator is aborted then."""
    monkeypatch.setattr("support.servers.memory_server.WIRE_TIMEOUT_S", 1.0)
    sender, (server,), caster = memory_sender(SendConfig(buffer_size_bytes=4096,
                                                         send_timeout_s=0.2))
    sender.send(params(1))
    stuck_comm, release = comm(sender), threading.Event()

    def stuck(*args, **kwargs):  # as a blocking NCCL call that never returns
        stuck_comm.in_call_since = time.monotonic()
        release.wait(30)

    caster.packed = stuck
    t = time.monotonic()
    with pytest.raises(SendError, match=r"an NCCL call did not return within 0.2\d*s .*"
                                        r"abandoned; call reconnect\(\)"):
        sender.send(params(2))
    assert time.monotonic() - t < 1.5
    assert sender.broken and not stuck_comm.aborted
    assert [lane.busy for lane in sender.session._orphans] == [True]
    sender.reconnect()  # the old communicator is left to its stuck call
    assert not stuck_comm.aborted and not stuck_comm.destroyed
    assert not sender.broken and comm(sender) is not stuck_comm
    release.set()
    wait_for(lambda: stuck_comm.aborted, 5)
    assert stuck_comm.aborted and not comm(sender).aborted


def test_a_failed_asynchronous_push_never_lends_its_buffers_to_the_next():
    """A failed push's broadcasts may still read its buffers (a stuck NCCL
    call is abandoned, not freed): the next push writes into new ones."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params(1), wait=False).result(timeout=20)
    server.fail["/update_weights"] = 500
    with pytest.raises(SendError, match="injected failure"):
        sender.send(params(2), wait=False).result(timeout=20)
    assert sender._staging == {}
    del server.fail["/update_weights"]
    sender.reconnect()
    sender.send(params(3), wait=False).result(timeout=20)
    assert held(server) == expected(params(3)) and len(sender._staging) == 2


def test_a_group_sender_refuses_an_asynchronous_push_clearly():
    from jax_sender._src.core.group import TrainerGroup
    from jax_sender._src.core.routes import ProcessGroup
    from jax_sender._src.core.turns import BroadcastPlan
    sender, (server,), _ = memory_sender(SMALL)
    sender.session.route = ProcessGroup(group=TrainerGroup(
        plan=BroadcastPlan.single(5), process=0, device=0, share=None, clients=[], config=SMALL))
    with pytest.raises(TransferError, match="single-process sender"):
        sender.send(params(), wait=False)
    assert pushed(server) == [] and not sender.broken


def test_a_hundred_failed_sends_and_reconnects_leave_threads_and_files_flat():
    """Each push broadcasts everything, then the worker's load fails (HTTP 500
    on /update_weights, the session dropped, as vLLM does): the communicator
    is aborted and reconnect() forms a new group. Threads and file
    descriptors must not pile up."""
    sender, (server,), caster = memory_sender(SMALL)
    server.fail["/update_weights"] = 500
    p = params(8)
    counts = []
    for _ in range(100):
        with pytest.raises(SendError, match="injected failure of /update_weights"):
            sender.send(p)
        assert comm(sender).aborted and sender.broken
        sender.reconnect()
        assert not sender.broken and not sender.session._orphans
        counts.append((threading.active_count(), len(os.listdir("/proc/self/fd"))))
    # Flat: earlier tests' servers may still be winding down at the start, and a
    # thread or socket may be mid-exit at any one sample, so the last ten are
    # held to the first ten's peak plus two. A leak of one per send adds ninety.
    first, last = counts[:10], counts[-10:]
    for i, what in enumerate(("threads", "files")):
        assert max(c[i] for c in last) <= max(c[i] for c in first) + 2, (what, first, last)
    made = sender.session.route.joiner.comms
    assert len(made) == 101 and all(c.aborted for c in made[:-1])
    server.fail.clear()
    sender.send(p)
    assert held(server) == expected(p)


def test_a_sparse_push_sends_only_what_changed_and_lands_bit_exact():
    """``SparseSender`` over the same session: patches against what the workers
    hold, exact; what vLLM's sparse loader would refuse is refused before any
    HTTP call; a failed push breaks it like any sender, and reconnect() mends it."""
    sender, (server,), caster = memory_sender(SendConfig(packed=False), kind=SparseSender)
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    v0 = {"w": jax.random.normal(k[0], (64, 64), jnp.bfloat16),
          "b": jax.random.normal(k[1], (100,), jnp.float32), "s": jnp.float16(2.5)}
    first = sender.send(v0, None)  # every element: the server starts from nothing
    assert held(server) == expected(v0) and first.tensors == 3
    v1 = dict(v0, w=v0["w"].at[3, 5].set(7.0).at[60, 1].set(-0.0))  # two elements, one a signed zero
    second = sender.send(v1, v0)
    assert held(server) == expected(v1)
    # per tensor two broadcasts (indices, values), zero-count ones too
    assert second.chunks == 6 and second.bytes == 2 * (4 + 2)
    assert pushed(server)[-3:] == SESSION
    before = len(server.log)
    with pytest.raises(MetadataError, match="sparse worker loads only"):
        sender.send({"i": jnp.arange(3, dtype=jnp.int32)}, {"i": jnp.zeros(3, jnp.int32)})
    assert len(server.log) == before and not sender.broken
    server.fail["/update_weights"] = 500
    with pytest.raises(SendError, match="injected failure of /update_weights"):
        sender.send(v0, v1)
    assert sender.broken
    with pytest.raises(SendError, match="call reconnect"):
        sender.send(v0, v1)
    del server.fail["/update_weights"]
    sender.reconnect()
    sender.send(v0, None)
    assert held(server) == expected(v0) and not sender.broken
    sender.close()


def test_a_sparse_push_after_an_incomplete_update_must_send_everything():
    """A patch that fails to build mid-push (its transform raising on the
    lane) leaves the servers with an incomplete update; a sparse sender then
    refuses to diff against what it thinks they hold, until a push of every
    element (``previous=None``) repairs it."""
    seen = {"n": 0, "fail_at": -1}

    def counted(path, x):
        if path[-1] == "w" and not isinstance(x, jax.core.Tracer):
            seen["n"] += 1
            if seen["n"] == seen["fail_at"]:
                raise RuntimeError("transient")
        return x

    # Patches are made ahead within 16 bytes: "w"'s (the second) only on the lane.
    config = SendConfig(packed=False, buffer_size_bytes=16, num_buffers=1)
    sender, (server,), _ = memory_sender(config, kind=SparseSender,
                                         mapping=Mapping(transform=counted))
    v0 = {"w": jnp.arange(8, dtype=jnp.float32), "b": jnp.ones(4, jnp.float32)}
    v1 = {"w": v0["w"] + 1, "b": v0["b"] * 2}
    sender.send(v0, None)
    per_push = seen["n"]
    seen["fail_at"] = 2 * per_push  # the last use of "w" in the next push: its patch, on the lane
    with pytest.raises(UpdateIncomplete):
        sender.send(v1, None)
    with pytest.raises(MetadataError, match=r"incomplete update .*send\(params, None\)"):
        sender.send(v0, v1)
    sender.send(v1, None)
    assert held(server) == expected(v1) and not sender.broken


def test_every_packages_errors_pickle_with_their_cause_text():
    """They cross process boundaries in multi-process trainers and harnesses."""
    import pickle

    from jax_sender import GatherTimeout
    from uniqueid import RendezvousError, RendezvousTimeout, UniqueIdError, VLLMHTTPError
    http = VLLMHTTPError("/update_weights", 500, "worker 0 died", {"error": {}})
    back = pickle.loads(pickle.dumps(http))
    assert (back.route, back.status, back.message, str(back)) == (
        http.route, http.status, http.message, str(http))
    for err, root in ((http, RendezvousError), (RendezvousTimeout("late"), RendezvousError),
                      (ServerStuck("stuck"), RendezvousError),
                      (UniqueIdError("bad id"), RendezvousError),
                      (SendError("failed"), TransferError), (MetadataError("no"), TransferError),
                      (UpdateIncomplete("half"), SendError), (GatherTimeout("gather"), SendError),
                      (SenderClosed("closed"), TransferError)):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err) and isinstance(again, root)
