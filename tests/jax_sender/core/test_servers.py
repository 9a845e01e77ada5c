"""One push to several servers, each route made on all of them at once:
pause and resume, start and finish, an update refused by one, ``verify``. What each
server got is read from its own log (``support.servers.memory_server``), and every
failure ends with the same servers taking a bit-exact push."""


import pytest

from jax_sender import SendError

from support.concurrency import together, wait_for
from support.pushes import SMALL, answered, calls, comm, expected, held, params, pushed
from support.servers.memory_link import memory_sender

SESSION = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
PAUSED = ["/pause", *SESSION, "/resume"]
# reconnect() on a server left inside an open update session: its shutdown
# is refused, the session finished, the shutdown made again, the group formed anew
# (connect asks each engine core before the init: /is_paused, /weight_info)
FORM = ["/get_world_size", "/is_paused", "/weight_info", "/init_weight_transfer_engine"]
MEND_OPEN = ["/shutdown_weight_transfer_engine", "/finish_weight_update",
             "/shutdown_weight_transfer_engine", *FORM]
MEND_CLOSED = ["/shutdown_weight_transfer_engine", *FORM]


def since(server, n: int) -> list[str]:
    return server.routes()[n:]


@pytest.mark.parametrize("refusing", [0, 2])
def test_a_pause_refused_by_one_server_is_undone_on_every_other(refusing):
    """Every server is asked to pause at once; once all answered, those that
    paused are resumed, the refusing one is left alone, and no update
    starts anywhere."""
    sender, servers, caster = memory_sender(SMALL, servers=3)
    servers[refusing].fail["/pause"] = 500
    with pytest.raises(SendError, match=r"before any weights were sent.*"
                                        rf"{servers[refusing].url}/pause"):
        sender.send(params(1), pause="wait")
    for i, s in enumerate(servers):
        assert pushed(s) == (["/pause"] if i == refusing else ["/pause", "/resume"]), s.routes()
        assert not s.paused and not s.active
    assert not caster.sent and not sender.broken and not comm(sender).aborted
    del servers[refusing].fail["/pause"]
    sender.send(params(2), pause="wait")
    for s in servers:
        assert pushed(s)[-5:] == PAUSED and not s.paused and held(s) == expected(params(2))


def test_resume_reaches_every_paused_server_when_one_refuses_the_update():
    sender, servers, _ = memory_sender(SMALL, servers=3)
    servers[2].fail["/update_weights"] = 500
    with pytest.raises(SendError, match=f"{servers[2].url}/update_weights.*injected failure"):
        sender.send(params(1), pause="abort")
    assert sender.broken and comm(sender).aborted
    for s in servers:
        assert pushed(s)[0] == "/pause" and pushed(s)[-1] == "/resume" and not s.paused
    del servers[2].fail["/update_weights"]
    sender.reconnect()
    sender.send(params(2), pause="keep")
    for s in servers:
        assert held(s) == expected(params(2)) and not s.paused


def test_a_resume_refused_by_one_server_still_resumes_the_others_and_keeps_the_group():
    """The update was finished on every server before ``/resume``: the weights
    are in place everywhere and nothing on the wire is in doubt, so the
    other servers are resumed and the communicator has no reason to go."""
    sender, servers, _ = memory_sender(SMALL, servers=3)
    servers[0].fail["/resume"] = 500
    with pytest.raises(SendError, match=f"{servers[0].url}/resume"):
        sender.send(params(1), pause="keep")
    for s in servers:
        assert pushed(s) == PAUSED and held(s) == expected(params(1)) and not s.active
    assert [s.paused for s in servers] == [True, False, False]
    assert not comm(sender).aborted and not sender.broken, sender.broken


def test_a_start_refused_by_a_middle_server_finishes_every_session_that_started():
    sender, servers, caster = memory_sender(SMALL, servers=3)
    servers[1].fail["/start_weight_update"] = 500
    with pytest.raises(SendError, match=r"before any weights were sent.*"
                                        rf"{servers[1].url}/start_weight_update"):
        sender.send(params(1))
    assert [pushed(s) for s in servers] == [
        ["/start_weight_update", "/finish_weight_update"], ["/start_weight_update"],
        ["/start_weight_update", "/finish_weight_update"]]
    assert not any(s.active for s in servers)
    assert not caster.sent and not sender.broken and not comm(sender).aborted
    del servers[1].fail["/start_weight_update"]
    sender.send(params(2))
    for s in servers:
        assert pushed(s)[-3:] == SESSION and held(s) == expected(params(2))


@pytest.mark.parametrize("refusing", [0, 1])
def test_a_finish_refused_by_one_server_aborts_and_reconnect_mends_it(refusing):
    """Every byte went out, then one server refused ``/finish_weight_update``
    (every server is asked at once, so the other finished): the communicator
    is aborted; ``reconnect()`` finishes the session left open, shuts each
    engine down, forms a new group."""
    sender, servers, _ = memory_sender(SMALL, servers=2)
    bad = servers[refusing]
    bad.fail["/finish_weight_update"] = 500
    with pytest.raises(SendError, match=f"{bad.url}/finish_weight_update.*reconnect"):
        sender.send(params(1))
    assert sender.broken and comm(sender).aborted
    assert [pushed(s) for s in servers] == [SESSION, SESSION]
    assert [s.active for s in servers] == [i == refusing for i in range(2)]
    del bad.fail["/finish_weight_update"]
    before = [len(s.log) for s in servers]
    sender.reconnect()
    mended = [since(s, n) for s, n in zip(servers, before)]
    assert mended == [MEND_OPEN if i == refusing else MEND_CLOSED for i in range(2)]
    for s in servers:
        assert calls(s, "/shutdown_weight_transfer_engine")[-1].status == 200
    assert not sender.broken and not comm(sender).aborted
    sender.send(params(2))
    for s in servers:
        assert pushed(s) == SESSION and held(s) == expected(params(2))


def test_an_update_refused_by_one_of_two_servers_leaves_the_other_to_reconnect():
    """The second server takes the bytes, then refuses (its session dropped);
    the first took them too and answered, but the push aborts without finishing
    it: its session stays open until ``reconnect()``, after which both take a
    bit-exact push."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2)
    b.fail["/update_weights"] = 500
    with pytest.raises(SendError, match=f"{b.url}/update_weights.*injected failure.*reconnect"):
        sender.send(params(1))
    assert sender.broken and comm(sender).aborted
    assert wait_for(lambda: answered(a, "/update_weights"))
    assert calls(a, "/update_weights")[-1].status == 200 and a.active
    assert calls(b, "/update_weights")[-1].status == 500 and not b.active
    assert pushed(a) == pushed(b) == SESSION[:2]
    assert a.wire.empty() and b.wire.empty()  # nothing left on the wire for the next push
    del b.fail["/update_weights"]
    before = [len(s.log) for s in (a, b)]
    sender.reconnect()
    assert [since(s, n) for s, n in zip((a, b), before)] == [MEND_OPEN, MEND_CLOSED]
    sender.send(params(2))
    assert held(a) == held(b) == expected(params(2))
    assert pushed(a) == pushed(b) == SESSION


def test_verify_names_a_tensor_that_differs_on_one_server_only():
    sender, servers, _ = memory_sender(SMALL, servers=3)
    p = params(4)
    sender.send(p)
    assert sender.verify(p).ok
    middle = servers[1]
    middle.store["layer.n"] = middle.store["layer.n"].copy()
    middle.store["layer.n"].reshape(-1).view("uint16")[0] ^= 1  # one bit, one server
    check = sender.verify(p)
    assert check.mismatched == ("layer.n",) and not check.unchecked
    assert sorted(check.matched) == sorted(set(expected(p)) - {"layer.n"})


def test_verify_names_a_tensor_that_differs_on_one_worker_of_one_server():
    """vLLM answers one digest per worker (``dp0:pp0:pcp0:tp<w>:<name>``): a
    single worker that differs is a mismatch, though its server's other
    workers agree."""
    sender, (a, b), _ = memory_sender(SMALL, servers=2, workers=2)
    p = params(5)
    sender.send(p)
    honest = b._worker_checksums

    def one_worker_off() -> dict[str, str]:
        out = honest()
        out["dp0:pp0:pcp0:tp1:head"] = "0" * 64
        return out

    b._worker_checksums = one_worker_off
    check = sender.verify(p)
    assert check.mismatched == ("head",) and not check.unchecked
    assert sorted(check.matched) == sorted(set(expected(p)) - {"head"})


def test_pushes_to_several_servers_in_a_row_stay_bit_exact_and_in_order():
    """Each push reaches every server whole, in the protocol's order, and
    the servers' logs never interleave two pushes' sessions."""
    sender, servers, _ = memory_sender(SMALL, servers=3, delay_s=0.005)
    errors = together(lambda seed: sender.send(params(seed), pause="keep"), [(1,), (2,)], 60)
    assert not errors
    for s in servers:
        assert pushed(s) == PAUSED * 2 and not s.paused
    assert held(servers[0]) in (expected(params(1)), expected(params(2)))
    assert held(servers[0]) == held(servers[1]) == held(servers[2])
