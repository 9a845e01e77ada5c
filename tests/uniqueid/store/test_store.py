"""The metadata store without torch: the wire format, ``StoreServer`` and
``StoreClient`` over loopback, and the server against raw-socket peers that
misbehave on purpose (each is closed alone; the others keep being served;
``close()`` ends within a bound). Torch's own client: test_store_torch.py."""

import socket
import struct
import threading
import time

import pytest

from nccl_cffi.waiting import Deadline
from uniqueid.store import StoreClient, StoreError, StoreLimits, StoreServer, StoreTimeout
from uniqueid.store.wire import (
    JOIN_KEY,
    MAGIC,
    Query,
    Request,
    WaitAnswer,
    WireError,
    WireLimits,
    blob,
    encode_request,
    parse_request,
)

from support import closed_by_peer
from support.vllm_children import wait_until

MARGIN = 3.0  # a loaded 2-core machine's scheduling, on top of a deadline
HELLO = encode_request(Request(query=Query.VALIDATE, number=MAGIC))


def frame(query, *, keys=(), values=(), number=0):
    return encode_request(Request(query=query, keys=keys, values=values, number=number))


@pytest.fixture
def server():
    s = StoreServer("127.0.0.1", limits=StoreLimits(stall_timeout=0.5, handshake_timeout=0.5,
                                                     max_connections=8, max_value_bytes=1 << 16,
                                                     max_total_bytes=1 << 18, max_output_bytes=1 << 18))
    yield s
    s.close()


def raw(server, hello=True):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if hello:
        sock.sendall(HELLO)
    return sock


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


def client(server, **kw):
    return StoreClient("127.0.0.1", server.port, deadline=Deadline(10), **kw)


# ---- the wire format ----

@pytest.mark.parametrize("request_", [
    Request(query=Query.VALIDATE, number=MAGIC),
    Request(query=Query.PING, number=1234),
    Request(query=Query.SET, keys=(b"/k",), values=(b"v" * 300,)),
    Request(query=Query.COMPARE_SET, keys=(b"/k",), values=(b"", b"x")),
    Request(query=Query.ADD, keys=(b"init/",), number=-7),
    Request(query=Query.CHECK, keys=(b"/a", b"/b")),
    Request(query=Query.WAIT, keys=()),
    Request(query=Query.GETNUMKEYS),
    Request(query=Query.MULTI_SET, keys=(b"/a", b"/b"), values=(b"1", b"")),
    Request(query=Query.CANCEL_WAIT),
])
def test_a_request_round_trips_and_waits_for_its_last_byte(request_):
    data = encode_request(request_)
    limits = WireLimits()
    assert parse_request(data + b"\x07", limits) == (request_, len(data))
    for cut in range(len(data)):
        assert parse_request(data[:cut], limits) is None


def test_the_encoding_is_torchs_little_endian_layout():
    assert encode_request(Request(query=Query.SET, keys=(b"/k",), values=(b"ab",))) == \
        b"\x01" + struct.pack("<Q", 2) + b"/k" + struct.pack("<Q", 2) + b"ab"
    assert HELLO == b"\x00" + struct.pack("<I", 0x3C85F7CE)


@pytest.mark.parametrize("data", [
    b"\x63",                                                   # an unknown code
    b"\x03" + struct.pack("<Q", 1 << 62),                     # a key of 2**62 bytes, refused at its header
    b"\x01" + blob(b"/k") + struct.pack("<Q", 1 << 40),       # a value over the limit
    b"\x05" + struct.pack("<Q", 5000),                        # CHECK naming 5000 keys
    b"\x0b" + struct.pack("<q", -1),                          # MULTI_SET of -1 pairs
])
def test_a_request_over_the_limits_is_refused_before_its_bytes_arrive(data):
    with pytest.raises(WireError):
        parse_request(data, WireLimits())


# ---- the server and the client ----

def test_the_client_and_the_host_see_the_same_keys(server):
    c = client(server)
    c.set("a", b"1")
    assert server.get("a", Deadline(1)) == b"1"
    server.set("b", b"2")
    assert c.get("b", Deadline(5)) == b"2"
    assert c.add("n", 5) == 5 and server.add("n", -2) == 3 and c.add("n", 0) == 3
    assert c.check(["a", "b"]) and not c.check(["a", "zz"])
    assert server.delete("a") and not c.delete("a")
    assert set(server._table.data) == {b"/b", b"/n"}  # torch's client adds the same "/"
    c.close()


def test_a_get_waits_for_the_key_on_either_side(server):
    c = client(server)
    timer = threading.Timer(0.3, server.set, ("late", b"x"))
    timer.start()
    assert c.get("late", Deadline(10)) == b"x"
    timer = threading.Timer(0.3, c.set, ("later", b"y"))
    timer.start()
    assert server.get("later", Deadline(10)) == b"y"
    timer.join()
    c.close()


def test_a_get_that_times_out_ends_by_its_deadline_and_leaves_the_connection_usable(server):
    c = client(server)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'missing' was not set"):
        c.get("missing", Deadline(1.0))
    assert time.monotonic() - start < 1.0 + MARGIN
    c.set("k", b"v")
    assert c.get("k", Deadline(5)) == b"v"
    with pytest.raises(StoreTimeout):
        server.get("missing", Deadline(0.2))
    c.close()


def test_joined_counts_clients_given_a_world_size(server):
    assert server.join() == 1
    a, b = client(server, world_size=3), client(server)
    assert a.joined() == 2 and b.joined() == 2 and server.joined() == 2
    a.close(), b.close()


def test_a_set_over_the_store_budget_is_refused_by_that_set(server):
    c = client(server)
    with pytest.raises(StoreError, match="connection to the metadata store at .* failed"):
        for i in range(8):
            c.set(f"big{i}", b"x" * 60000)  # 8 x 60 kB > 256 kB
    with pytest.raises(StoreError, match="is closed"):
        c.get("big0", Deadline(1))
    with pytest.raises(StoreError, match="full"):
        server.set("one-more", b"x" * 60000)
    assert client(server).get("big0", Deadline(5)) == b"x" * 60000


def test_the_client_gives_up_on_a_host_that_never_answers():
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match="did not answer"):
            StoreClient("127.0.0.1", silent.getsockname()[1], deadline=Deadline(1.0))
        assert time.monotonic() - start < 1.0 + MARGIN
    finally:
        silent.close()


def test_the_client_retries_a_host_not_listening_yet_until_its_deadline():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="refused connections"):
        StoreClient("127.0.0.1", port, deadline=Deadline(1.0))
    assert 0.5 < time.monotonic() - start < 1.0 + MARGIN
    late = []
    threading.Timer(0.5, lambda: late.append(StoreServer("127.0.0.1", port))).start()
    c = StoreClient("127.0.0.1", port, deadline=Deadline(10))
    c.set("k", b"v")
    assert late[0].get("k", Deadline(1)) == b"v"
    c.close(), late[0].close()


def test_a_cancelled_wait_whose_key_arrived_first_answers_both(server):
    """The race torch's client handles: STOP_WAITING already sent, then
    CANCEL_WAIT is answered WAIT_CANCELED."""
    sock = raw(server)
    sock.sendall(frame(Query.WAIT, keys=(b"/k",)))
    time.sleep(0.2)
    server.set("k", b"v")
    assert recv_exact(sock, 1) == bytes([WaitAnswer.STOP_WAITING])
    sock.sendall(frame(Query.CANCEL_WAIT))
    assert recv_exact(sock, 1) == bytes([WaitAnswer.WAIT_CANCELED])
    sock.sendall(frame(Query.GET, keys=(b"/k",)))
    assert recv_exact(sock, 9) == blob(b"v")
    sock.close()


# ---- hostile peers ----

def serves(server):
    """Whether a fresh client still gets answers."""
    c = client(server)
    c.set("probe", b"ok")
    ok = c.get("probe", Deadline(5)) == b"ok"
    c.close()
    return ok


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",                        # not torch at all
    b"\x00" + struct.pack("<I", 0xDEADBEEF),                     # a wrong magic
    frame(Query.SET, keys=(b"/k",), values=(b"v",)),             # no VALIDATE first
    HELLO + b"\x03" + struct.pack("<Q", 1 << 62),                # a key of 2**62 bytes
    HELLO + frame(Query.GET, keys=(b"/missing",)),               # torch closes this too
    HELLO + frame(Query.ADD, keys=(b"/s",), number=1) + frame(Query.APPEND, keys=(b"/s",), values=(b"x",))
    + frame(Query.ADD, keys=(b"/s",), number=1),                 # ADD to a value that is no number
    HELLO + frame(Query.WAIT, keys=(b"/a",)) + frame(Query.WAIT, keys=(b"/b",)),  # two WAITs
    HELLO + HELLO,                                               # VALIDATE twice
])
def test_a_peer_that_breaks_the_protocol_is_closed_alone(server, data):
    good = client(server)
    bad = raw(server, hello=False)
    bad.sendall(data)
    assert closed_by_peer(bad)
    good.set("still", b"here")
    assert good.get("still", Deadline(5)) == b"here"
    assert serves(server)
    wait_until(lambda: server.connections() == 1, 10, "the bad connection stays open")
    good.close(), bad.close()


def test_a_half_sent_request_or_a_silent_peer_is_closed_after_its_timeout(server):
    half = raw(server)
    half.sendall(b"\x01" + struct.pack("<Q", 100) + b"/k")  # a SET that stops inside its key
    silent = raw(server, hello=False)  # never validates
    idle = raw(server)  # validated and quiet: a torch client between calls, kept
    assert closed_by_peer(half) and closed_by_peer(silent)
    idle.sendall(frame(Query.PING, number=7))
    assert recv_exact(idle, 4) == struct.pack("<I", 7)
    for s in (half, silent, idle):
        s.close()


def test_a_request_that_keeps_trickling_is_closed_once_its_deadline_passed(server):
    """Progress does not keep a request open: it must arrive whole within
    ``stall_timeout`` of its first byte."""
    slow = raw(server)
    slow.sendall(b"\x01" + struct.pack("<Q", 100) + b"/k")  # a SET that stops inside its key
    start = time.monotonic()

    def trickle():
        for _ in range(40):
            time.sleep(0.1)
            try:
                slow.send(b"k")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    assert closed_by_peer(slow)
    assert time.monotonic() - start < 0.5 + MARGIN
    slow.close()


def test_a_connection_that_never_joined_is_closed_when_quiet_or_waiting_too_long():
    server = StoreServer("127.0.0.1", limits=StoreLimits(idle_timeout=1.0))
    try:
        quiet, waiting, rank = raw(server), raw(server), raw(server)
        waiting.sendall(frame(Query.WAIT, keys=(b"/never",)))
        rank.sendall(JOIN)
        assert len(recv_exact(rank, 8)) == 8
        start = time.monotonic()
        assert closed_by_peer(quiet) and closed_by_peer(waiting)
        assert time.monotonic() - start < 1.0 + MARGIN
        time.sleep(0.5)
        rank.sendall(frame(Query.PING, number=5))  # a rank that joined idles as long as it likes
        assert recv_exact(rank, 4) == struct.pack("<I", 5)
        for s in (quiet, waiting, rank):
            s.close()
    finally:
        server.close()


def test_in_a_group_only_ranks_that_joined_use_the_store_and_no_more_than_its_ranks_join():
    server = StoreServer("127.0.0.1", limits=StoreLimits(max_joins=4, handshake_timeout=1.0))
    try:
        assert server.join() == 1
        stranger, late = raw(server), raw(server)
        stranger.sendall(frame(Query.PING, number=1))  # its handshake, still
        assert recv_exact(stranger, 4) == struct.pack("<I", 1)
        stranger.sendall(frame(Query.SET, keys=(b"/k",), values=(b"v",)))
        assert closed_by_peer(stranger) and not server.check(["k"])
        for undo in (frame(Query.ADD, keys=(JOIN_KEY,), number=-5),  # from a stranger, then a rank
                     JOIN + frame(Query.SET, keys=(JOIN_KEY,), values=(b"0",))):
            cheat = raw(server)
            cheat.sendall(undo)
            assert closed_by_peer(cheat)
            cheat.close()
        assert server.joined() == 2  # the rank's join stands, nothing else it sent
        start = time.monotonic()
        assert closed_by_peer(late)  # validated, never joined
        assert time.monotonic() - start < 1.0 + MARGIN
        rank = raw(server)
        rank.sendall(JOIN + frame(Query.SET, keys=(b"/k",), values=(b"v",)) + frame(Query.PING, number=2))
        assert recv_exact(rank, 12)[8:] == struct.pack("<I", 2) and server.get("k", Deadline(1)) == b"v"
        assert StoreClient("127.0.0.1", server.port, deadline=Deadline(10), world_size=4).joined() == 4
        past = raw(server)
        past.sendall(JOIN)
        assert closed_by_peer(past)
        with pytest.raises(StoreError, match="a join past the group's 4 ranks"):
            server.join()
        assert server.troubles() == ("the metadata store refused 2 joins past the group's 4 ranks: "
                                     "another process on this host joined it")
        for s in (stranger, late, rank, past):
            s.close()
    finally:
        server.close()


def test_a_peer_that_does_not_read_its_answers_is_closed(server):
    server.set("big", b"x" * 60000)
    reader = raw(server)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.sendall(frame(Query.MULTI_GET, keys=(b"/big",) * 8) * 4)  # ~2 MB of answers, never read
    wait_until(lambda: server.connections() == 0, 15, "the peer that does not read stays open")
    assert serves(server)
    reader.close()


JOIN = frame(Query.ADD, keys=(JOIN_KEY,), number=1)


def test_at_the_limit_a_newcomer_takes_the_place_of_the_quietest_connection_that_never_joined(server):
    ranks = [raw(server) for _ in range(4)]
    for s in ranks:
        s.sendall(JOIN)
        assert len(recv_exact(s, 8)) == 8
    guests = []
    for _ in range(4):
        guests.append(raw(server))
        time.sleep(0.05)  # each quiet a little less long than the one before
    wait_until(lambda: server.connections() == 8, 10, "the first 8 are not all open")
    newcomers = [raw(server), raw(server)]
    assert closed_by_peer(guests[0]) and closed_by_peer(guests[1])
    assert serves(server)  # the probe took guests[2]'s place, and left
    for s in ranks + newcomers:
        s.sendall(frame(Query.PING, number=3))
        assert recv_exact(s, 4) == struct.pack("<I", 3)
    assert server.troubles() == ""


def test_at_the_limit_of_ranks_that_joined_a_newcomer_is_closed_at_once_and_named(server):
    held = [raw(server) for _ in range(8)]
    for s in held:
        s.sendall(JOIN)
    wait_until(lambda: server.joined() == 8, 10, "the first 8 did not all join")
    extra = raw(server)
    assert closed_by_peer(extra, timeout=5)
    assert server.troubles() == ("the metadata store turned 1 connections away at its limit of 8, "
                                 "every one held by a rank that joined")
    for s in held:
        s.close()
    wait_until(lambda: server.connections() == 0, 10, "closed peers are not reaped")
    assert serves(server)
    extra.close()


def test_close_is_bounded_with_peers_in_every_state_and_wakes_local_waits():
    server = StoreServer("127.0.0.1")
    waiting = raw(server)
    waiting.sendall(frame(Query.WAIT, keys=(b"/never",)))
    half = raw(server)
    half.sendall(b"\x01" + struct.pack("<Q", 100))
    unvalidated = raw(server, hello=False)
    c = client(server)
    errors = []
    local = threading.Thread(target=lambda: errors.append(pytest.raises(
        StoreError, server.get, "never", Deadline(60))))
    local.start()
    time.sleep(0.2)
    threads = threading.active_count()
    start = time.monotonic()
    server.close()
    assert time.monotonic() - start < 1.0 + MARGIN
    local.join(5)
    assert not local.is_alive() and errors
    assert all(closed_by_peer(s, timeout=5) for s in (waiting, half, unvalidated))
    assert threading.active_count() <= threads - 1  # the server's thread ended
    with pytest.raises(StoreError):
        c.get("never", Deadline(2))
    with pytest.raises(StoreError, match="closed"):
        server.set("k", b"v")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)
    server.close()  # idempotent
    for s in (waiting, half, unvalidated):
        s.close()


def test_the_server_binds_the_given_host_only():
    server = StoreServer("127.0.0.1")
    try:
        assert server._listener.getsockname()[0] == "127.0.0.1"
    finally:
        server.close()
    with pytest.raises(StoreError, match="cannot listen"):
        StoreServer("192.0.2.1")  # TEST-NET-1: not an address of this host


def test_an_ipv6_host_is_served_on_that_address():
    try:
        server = StoreServer("::1")
    except StoreError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert server._listener.family == socket.AF_INET6
        c = StoreClient("::1", server.port, deadline=Deadline(10))
        c.set("k", b"v")
        assert server.get("k", Deadline(1)) == b"v"
        c.close()
    finally:
        server.close()
