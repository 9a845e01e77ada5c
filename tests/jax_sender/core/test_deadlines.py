"""Every deadline of a push and of forming the group, on CPU: a server that
holds a route past it (``server.hold[path]``, released at the end) gets the
caller an error no earlier than the deadline and within it plus ``MARGIN``;
then the sender is in the state the error says (broken or not), and once the
server answers again the same servers take a bit-exact push (after
``reconnect()`` where the sender says so).

Deadlines elsewhere: the arrays' readiness, the answer after the last
broadcast, a broadcast never taken and ``reconnect()``'s shutdown are in
``test_failures.py``."""

import time

import pytest

from jax_sender import SendConfig, SendError, WeightSender
from uniqueid import RendezvousError

from support.pushes import Held, comm, expected, held, params, pushed
from support.servers.memory_link import memory_route, memory_sender, sender_on

SEND_S = 0.5  # SendConfig.send_timeout_s: each HTTP call of a push
INIT_S = 1.0  # SendConfig.init_timeout_s / reconnect_timeout_s: forming the group, whole
# What a loaded 2-core machine (two copies of the suite at once) may add to
# a deadline before the error reaches the caller.
MARGIN = 2.0
EARLY = 0.05
CONFIG = SendConfig(buffer_size_bytes=4096, send_timeout_s=SEND_S)
SESSION = ["/start_weight_update", "/update_weights", "/finish_weight_update"]


def timed(fn, deadline_s: float, exc: type, match: str):
    """Call ``fn``, which must raise ``exc`` (matching ``match``) no earlier than
    ``deadline_s`` and within ``deadline_s + MARGIN``; the error."""
    t = time.monotonic()
    with pytest.raises(exc, match=match) as err:
        fn()
    took = time.monotonic() - t
    # not before the deadline (a socket wait may wake a hair early), and within it plus the margin
    assert deadline_s - EARLY <= took < deadline_s + MARGIN, (took, deadline_s, MARGIN)
    return err.value


def warm(servers=1):
    """A sender that has pushed once (so what is timed is the held call, not a
    first push's compiles), and the next tree to push."""
    sender, hosts, caster = memory_sender(CONFIG, servers=servers)
    sender.send(params(0))
    return sender, hosts, caster, params(1)


# ---- each HTTP answer of a push --------------------------------------------------

def test_a_pause_not_answered_in_time_fails_the_push_before_anything_starts():
    sender, (server,), caster, tree = warm()
    sent = len(caster.sent)
    with Held(server, "/pause"):
        timed(lambda: sender.send(tree, pause="wait"), SEND_S, SendError,
              rf"before any weights were sent.*{server.url}/pause: no answer within the "
              rf"timeout of {SEND_S} s")
        # no update started; the unanswered pause was sent a /resume, in case it lands late
        assert pushed(server)[3:] == ["/pause", "/resume"]
        assert not sender.broken and not comm(sender).aborted and len(caster.sent) == sent
    sender.send(tree, pause="keep")  # the late pause landed: this push's resume undoes it
    assert held(server) == expected(tree) and not server.paused


def test_a_start_not_answered_in_time_leaves_the_sender_as_its_error_says():
    """The push fails within its deadline before any weights were sent. The
    held ``/start_weight_update`` may still land (here: once released): the
    sender must then either take the next push as its error promises, or
    say it is broken and have ``reconnect()`` finish that session."""
    sender, (server,), caster, tree = warm()
    with Held(server, "/start_weight_update"):
        err = timed(lambda: sender.send(tree), SEND_S, SendError,
                    rf"before any weights were sent.*{server.url}/start_weight_update: no "
                    rf"answer within the timeout of {SEND_S} s")
        assert not comm(sender).aborted
    assert server.active  # the late start opened a session on the server
    if sender.broken:
        assert "reconnect()" in str(err)
        sender.reconnect()
    else:
        assert "the sender is usable" in str(err)
    sender.send(tree)
    assert held(server) == expected(tree) and not server.active


def test_a_finish_not_answered_in_time_aborts_and_reconnect_mends_it():
    sender, (server,), caster, tree = warm()
    with Held(server, "/finish_weight_update"):
        timed(lambda: sender.send(tree, weight_version="v1"), SEND_S, SendError,
              rf"{server.url}/finish_weight_update: no answer within the timeout of "
              rf"{SEND_S} s.*reconnect\(\)")
        assert sender.broken and comm(sender).aborted
        assert pushed(server)[3:] == SESSION
        with pytest.raises(SendError, match="broken"):
            sender.send(tree)
    sender.reconnect()
    assert not sender.broken and not comm(sender).aborted
    sender.send(params(2), weight_version="v2")
    assert held(server) == expected(params(2)) and server.weight_version == "v2"


def test_a_resume_not_answered_in_time_fails_after_the_weights_landed():
    """The update finished on the server before ``/resume`` was held: the
    weights are in place; the sender is in the state its error says."""
    sender, (server,), caster, tree = warm()
    with Held(server, "/resume"):
        err = timed(lambda: sender.send(tree, pause="keep"), SEND_S, SendError,
                    rf"{server.url}/resume: no answer within the timeout of {SEND_S} s")
        assert held(server) == expected(tree) and not server.active
    assert not server.paused  # the late resume landed
    if sender.broken:
        assert "reconnect()" in str(err) and comm(sender).aborted
        sender.reconnect()
    sender.send(params(2), pause="keep")
    assert held(server) == expected(params(2)) and not server.paused


# ---- forming the group -----------------------------------------------------------

@pytest.mark.parametrize("path", ["/get_world_size", "/init_weight_transfer_engine"])
def test_connect_ends_within_its_deadline_when_a_server_does_not_answer(path):
    """``init_timeout_s`` bounds the whole connect: the world size asked, the
    init posted and joined, its answer. Past it the caller gets a
    ``RendezvousError`` naming the route; a communicator the join made is
    aborted; once the server answers again the same servers form a group
    and take a push."""
    config = SendConfig(buffer_size_bytes=4096, init_timeout_s=INIT_S)
    route, (a, b), wire = memory_route(config, servers=2)
    with Held(b, path):
        timed(lambda: route.form(config.init_timeout_s), INIT_S, RendezvousError,
              f"{b.url}{path}")
    joins = route.joiner.comms
    assert all(c.aborted for c in joins) and len(joins) == (path != "/get_world_size")
    sender, _ = sender_on(route, wire)
    sender.send(params(1))
    assert held(a) == held(b) == expected(params(1))


def test_a_reconnect_whose_init_is_not_answered_ends_within_its_deadline():
    config = SendConfig(buffer_size_bytes=4096, reconnect_timeout_s=INIT_S)
    route, (server,), wire = memory_route(config)
    sender, _ = sender_on(route, wire, kind=WeightSender)
    sender.send(params(0))
    with Held(server, "/init_weight_transfer_engine"):
        timed(sender.reconnect, INIT_S, RendezvousError,
              f"{server.url}/init_weight_transfer_engine")
        assert sender.broken
        with pytest.raises(SendError, match="broken"):
            sender.send(params(1))
    sender.reconnect()
    assert not sender.broken
    sender.send(params(1))
    assert held(server) == expected(params(1))
