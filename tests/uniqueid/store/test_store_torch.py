"""``StoreServer`` against torch's own ``TCPStore`` client (torch 2.13.0 CPU
in a child process, ``support.children.torch_store_ops``): every call torch's client
makes, a ``get`` that waits past torch's own timeout, torch's client beside
hostile raw-socket peers, and the keys torch's client and ours share."""

import socket
import struct
import time

import pytest

from nccl_cffi.waiting import Deadline
from uniqueid.store import StoreClient, StoreLimits, StoreServer

from support import nothing_listens
from support.vllm_children import Child, wait_until

MARGIN = 5.0


@pytest.fixture
def server():
    s = StoreServer("127.0.0.1", limits=StoreLimits(stall_timeout=1.0, handshake_timeout=1.0,
                                                     max_connections=6))
    yield s
    s.close()


@pytest.fixture
def torch_client(server):
    child = Child("torch_store_ops.py", "127.0.0.1", server.port, 2.0, 3, stdin=True)
    assert child.next(120)["ok"] == "connected"
    yield child
    child.kill()


def ok(answer):
    assert "error" not in answer, answer["error"]
    return answer["ok"]


def test_every_call_of_torchs_client_is_answered_as_torchs_server_answers(server, torch_client):
    t = torch_client.call
    assert server.joined() == 1  # its world size made it add 1 to init/
    ok(t("set", "a", b"hello".hex()))
    assert ok(t("get", "a")) == b"hello".hex()
    assert ok(t("add", "n", 5)) == 5 and ok(t("add", "n", -2)) == 3
    assert ok(t("check", ["a"])) is True and ok(t("check", ["a", "zz"])) is False
    assert ok(t("num_keys")) == 3  # init/, /a, /n
    assert ok(t("delete_key", "a")) is True and ok(t("delete_key", "a")) is False
    assert ok(t("compare_set", "c", "", b"x".hex())) == b"x".hex()
    assert ok(t("compare_set", "c", b"x".hex(), b"y".hex())) == b"y".hex()
    assert ok(t("compare_set", "c", b"q".hex(), b"z".hex())) == b"y".hex()
    assert ok(t("compare_set", "nokey", b"q".hex(), b"z".hex())) == b"q".hex()
    ok(t("append", "ap", b"12".hex())), ok(t("append", "ap", b"34".hex()))
    assert ok(t("get", "ap")) == b"1234".hex()
    ok(t("multi_set", ["m1", "m2"], [b"1".hex(), b"2".hex()]))
    assert ok(t("multi_get", ["m1", "m2"])) == [b"1".hex(), b"2".hex()]
    ok(t("wait", ["m1", "m2"], 5))
    # The same keys on our side, in process and over our client.
    assert server.get("ap", Deadline(1)) == b"1234"
    server.set("ours", b"\x00\xff")
    assert ok(t("get", "ours")) == "00ff"
    ours = StoreClient("127.0.0.1", server.port, deadline=Deadline(10))
    assert ours.get("m2", Deadline(1)) == b"2" and ours.add("n", 10) == 13
    ours.close()


def test_a_torch_get_past_its_own_timeout_cancels_and_its_connection_goes_on(server, torch_client):
    answer = torch_client.call("get", "never")
    assert "wait timeout" in answer["error"] and answer["seconds"] < 2.0 + MARGIN
    # torch sent CANCEL_WAIT and read WAIT_CANCELED: the same connection still works
    ok(torch_client.call("set", "after", b"ok".hex()))
    assert ok(torch_client.call("get", "after")) == b"ok".hex()
    assert server.get("after", Deadline(1)) == b"ok"
    # and a wait that times out leaves no waiter behind for a later set
    server.set("never", b"late")
    assert ok(torch_client.call("get", "never")) == b"late".hex()
    answer = torch_client.call("wait", ["nothing"], 0.5)
    assert "timeout" in answer["error"]
    assert ok(torch_client.call("num_keys")) >= 3


def test_torchs_client_is_served_beside_hostile_peers(server, torch_client):
    bad = []
    for data in (b"\xff" * 64, b"\x00" + struct.pack("<I", MAGIC_WRONG) + b"junk",
                 b"\x00\xce\xf7\x85\x3c\x01" + struct.pack("<Q", 1 << 62)):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(data)
        bad.append(sock)
    half = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    half.sendall(b"\x00\xce\xf7\x85\x3c" + b"\x01" + struct.pack("<Q", 10))  # stops inside a SET
    bad.append(half)
    ok(torch_client.call("set", "busy", b"1".hex()))
    assert ok(torch_client.call("get", "busy")) == b"1".hex()
    wait_until(lambda: server.connections() == 1, 15, "a hostile peer is still connected")
    for s in bad:
        s.close()


def squat(server, count, *join):
    """Another process holding ``count`` connections to ``server`` (each
    validated, then quiet; with "--join" each joined too)."""
    squatter = Child("store_squatter.py", "127.0.0.1", server.port, count, *join, stdin=True)
    assert squatter.next(STARTUP)["trying"]
    wait_until(lambda: squatter.call("status")["opened"] == count, 30, "the squatter did not connect")
    return squatter


def test_another_process_holding_every_connection_does_not_keep_a_torch_rank_out(server):
    """Connections that validated and never joined are not the group's: a
    torch client given a world size takes the place of one, at once."""
    squatter = squat(server, 20)
    try:
        assert server.connections() == 6
        rank = Child("torch_store_ops.py", "127.0.0.1", server.port, 20.0, 3, stdin=True)
        try:
            assert ok(rank.next(STARTUP)) == "connected"
            ok(rank.call("set", "k", b"v".hex()))
            assert server.get("k", Deadline(5)) == b"v" and server.joined() == 1
        finally:
            rank.kill()
        assert squatter.call("status")["closed"] >= 1
    finally:
        squatter.kill()


def test_a_torch_client_refused_by_ranks_that_joined_retries_and_gets_in_when_a_slot_frees(server):
    squatter = squat(server, 6, "--join")
    late = Child("torch_store_ops.py", "127.0.0.1", server.port, 60.0, stdin=True)
    try:
        wait_until(lambda: "turned" in server.troubles(), STARTUP, "torch's client was not refused")
        assert late.lines.empty() and server.connections() == 6
        squatter.kill()
        assert ok(late.next(STARTUP)) == "connected"
        ok(late.call("set", "late", b"1".hex()))
        assert server.get("late", Deadline(5)) == b"1"
    finally:
        late.kill()
        squatter.kill()


def test_a_rank_still_connecting_when_the_group_is_given_up_is_turned_away_at_once():
    """A torch rank refused at capacity retries (torch's backoff); the group
    is given up (``close(turn_away_s)``): the rank's next attempt is
    answered its handshake and closed at its join, which ends torch's
    client there, not at its timeout; once every rank of the group joined
    or was turned away, the store stops listening."""
    server = StoreServer("127.0.0.1", limits=StoreLimits(max_connections=2, max_joins=4))
    server.join()
    squatter = squat(server, 2, "--join")  # two more ranks, holding both connections
    rank = Child("torch_store_ops.py", "127.0.0.1", server.port, 120.0, 4, stdin=True)
    try:
        wait_until(lambda: "turned" in server.troubles(), STARTUP, "torch's client was not refused")
        given_up = time.monotonic()
        server.close(turn_away_s=600)
        answer = rank.next(STARTUP)
        assert "DistNetworkError" in answer["error"], answer
        assert time.monotonic() - given_up < TORCH_NEXT_ATTEMPT + MARGIN  # not its 120 s
        wait_until(lambda: nothing_listens("127.0.0.1", server.port), 10, "the store still listens")
    finally:
        rank.kill()
        squatter.kill()
        server.close()


STARTUP = 120.0  # a child imports torch on a loaded machine
# Torch's backoff between attempts: 0.5 s x 1.5 per attempt, +-50%; a few
# attempts in, the next one comes within this.
TORCH_NEXT_ATTEMPT = 15.0
MAGIC_WRONG = 0x12345678
