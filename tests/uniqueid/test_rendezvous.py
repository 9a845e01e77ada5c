"""``uniqueid.connect`` and the release of servers, over real HTTP on loopback.

The servers are ``support.servers.memory_server.MemoryServer``: vLLM's routes and
its worker rules (written from vLLM's code, not this library's), which
record every request and each ``init_info`` they took, and can refuse a
route (``fail``), hold it unanswered (``hold``) or report any worker count.
Only the NCCL handshake is replaced: ``support.servers.memory_link.MemoryJoin``, a
``Joiner`` whose join succeeds at once, or ``WaitingJoin`` below, whose
join waits like a blocking init for workers that never come. Everything
else (world sizes, payloads, the init posts and their answers, deadlines,
the release) is the library's own code against a server it does not
control.

``warm_up`` and ``handshake`` are NCCL calls on a GPU: the GPU tests cover
them (tests/jax_sender/test_gpu.py); here only their absence on CPU
(``preflight``) is shown.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures

import pytest

import uniqueid.rendezvous as rendezvous
from nccl_cffi import CudaError, Deadline, NcclTimeoutError, cuda
from uniqueid import (
    MAX_WORKERS,
    NCCL_JOIN,
    RendezvousError,
    RendezvousTimeout,
    ServerStuck,
    UniqueId,
    VLLMClient,
    VLLMHTTPError,
    as_clients,
    connect,
    release,
    world_sizes,
)

from support.servers.memory_link import MemoryJoin
from support.servers.memory_server import MemoryServer

SLACK = 1.5  # seconds a deadline may be overrun on a loaded machine
INIT = "/init_weight_transfer_engine"
SHUTDOWN = "/shutdown_weight_transfer_engine"
ENGINE = ["/is_paused", "/weight_info"]  # connect asks each engine core before any init


class WaitingJoin(MemoryJoin):
    """A join that, like NCCL's init, waits for the workers to join: it
    polls ``check`` (which raises once a server refused its init) until
    ``timeout``, or until ``gives_up()`` (NCCL's own deadline), and then
    raises ``NcclTimeoutError``: the workers never come."""

    def __init__(self, gives_up=lambda: False) -> None:
        super().__init__()
        self.gives_up = gives_up

    def join(self, world_size, unique_id, rank, device, *, timeout, check):
        self.joins.append(dict(world_size=world_size, rank=rank, timeout=timeout))
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.gives_up():
            check()
            time.sleep(0.01)
        raise NcclTimeoutError(f"ncclCommInitRank did not complete within {timeout}s")


class AnsweredJoin(MemoryJoin):
    """A join that returns once every init post has its answer (``posts``):
    the trainer's init done, what the servers said still to be read."""

    def __init__(self, posts: list) -> None:
        super().__init__()
        self.posts = posts

    def join(self, world_size, unique_id, rank, device, *, timeout, check):
        futures.wait([p.ended for p in self.posts], timeout=10)
        return super().join(world_size, unique_id, rank, device, timeout=timeout,
                            check=lambda: None)


@pytest.fixture
def posts(monkeypatch) -> list:
    """The calls on every server at once ``connect`` makes (``fleet.Calls``,
    watched where the rendezvous makes them): the engines' check, then the
    init posts, last."""
    made, calls = [], rendezvous.Calls

    def watched(*args, **kwargs):
        made.append(calls(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(rendezvous, "Calls", watched)
    return made


@pytest.fixture
def servers():
    """``make(workers)``: a memory server with that many workers; all closed after."""
    made: list[MemoryServer] = []

    def make(workers: int = 1) -> MemoryServer:
        made.append(MemoryServer(queue.Queue(), workers=workers))
        return made[-1]

    yield make
    for s in made:
        s.close()


def client(server: MemoryServer) -> VLLMClient:
    return VLLMClient(server.url, timeout=10, transfer_timeout=10)


def inits(server: MemoryServer) -> list[str]:
    return [p for p in server.routes() if p == INIT]


# -- forming the group ------------------------------------------------------------

def test_three_servers_get_consecutive_rank_offsets_in_one_world(servers):
    """Servers of 1, 2 and 4 workers behind one trainer rank: each is asked
    its world size once, told ``rank_offset`` 1, 2 and 4 of a world of 8,
    the same id, and the wire geometry; the trainer joins as rank 0 of 8
    within connect's deadline (less the reserve for the answers); closing
    releases every server and frees the communicator."""
    hosts = [servers(1), servers(2), servers(4)]
    joiner = MemoryJoin()
    conn = connect([h.url for h in hosts], device=3, packed_buffer_size_bytes=4096,
                   packed_num_buffers=3, timeout=20, joiner=joiner)
    b64 = conn.unique_id.to_b64()
    for host, offset in zip(hosts, (1, 2, 4)):
        assert host.routes() == ["/get_world_size", *ENGINE, INIT]
        assert host.init_infos == [{"nccl_unique_id_b64": b64, "rank_offset": offset,
                                    "world_size": 8, "packed": True,
                                    "packed_buffer_size_bytes": 4096, "packed_num_buffers": 3}]
        assert host.initialized
    ((join),) = joiner.joins
    assert (join["world_size"], join["rank"], join["device"], join["unique_id"]) == \
        (8, 0, 3, conn.unique_id)
    assert 10 < join["timeout"] < 20
    assert [i.rank_offset for i in conn.init_infos] == [1, 2, 4]
    assert conn.client is conn.clients[0] and conn.init_info is conn.init_infos[0]
    assert conn.owns_clients and conn.device == 3
    conn.close()
    assert [h.routes()[-1] for h in hosts] == [SHUTDOWN] * 3
    assert not any(h.initialized for h in hosts)
    assert joiner.comms[0].destroyed
    with pytest.raises(RuntimeError, match="is closed"):
        conn.clients[0].get_world_size()


def test_given_worker_counts_are_not_asked_and_more_trainer_ranks_shift_the_offsets(servers):
    """``workers`` given: no ``/get_world_size`` at all. Two trainer ranks
    put the first server at rank 2; a given id is the one sent; unpacked
    is sent as a JSON false (vLLM 0.33.0 reads ``"false"`` as true)."""
    a, b = servers(2), servers(3)
    uid = UniqueId(bytes(range(128)))
    conn = connect([a.url, b.url], workers=[2, 3], trainer_ranks=2, unique_id=uid,
                   packed=False, timeout=20, joiner=MemoryJoin())
    try:
        assert a.routes() == [*ENGINE, INIT] and b.routes() == [*ENGINE, INIT]
        assert [(i["rank_offset"], i["world_size"]) for i in a.init_infos + b.init_infos] == \
            [(2, 7), (4, 7)]
        assert conn.unique_id is uid
        assert {i["nccl_unique_id_b64"] for i in a.init_infos + b.init_infos} == {uid.to_b64()}
        assert a.init_infos[0]["packed"] is False and "use_load_plan" not in a.init_infos[0]
    finally:
        conn.close(shutdown_servers=False)


def test_one_server_with_its_count_given_as_an_int(servers):
    """A single URL and ``workers`` an int: the simplest call."""
    host = servers(2)
    conn = connect(host.url, workers=2, timeout=20, joiner=MemoryJoin())
    assert host.routes() == [*ENGINE, INIT] and conn.init_info.world_size == 3
    conn.close()


@pytest.mark.parametrize("count", [0, True, -1, MAX_WORKERS + 1, 2.0])
def test_world_sizes_refuses_counts_no_group_can_be_formed_with(count):
    """A count that is not a positive int of at most ``MAX_WORKERS`` (a bool
    is no count) is refused naming the server, before anything is posted."""
    c = VLLMClient("http://127.0.0.1:9")  # never contacted: the counts are given
    with pytest.raises(RendezvousError, match=r"http://127.0.0.1:9 has .* workers, so no group"):
        world_sizes([c], [count], Deadline(5))
    assert world_sizes([c], [MAX_WORKERS], Deadline(5)) == [MAX_WORKERS]
    with pytest.raises(RendezvousError, match="1 servers but 2 worker counts"):
        world_sizes([c], [1, 1], Deadline(5))


def test_a_server_reporting_no_workers_is_refused_before_any_init(servers):
    """A server with its model not loaded reports 0 workers: connect refuses
    it by name, and neither it nor the healthy server gets an init (a posted
    init would leave workers waiting in NCCL for a group that cannot form)."""
    good, empty = servers(2), servers(1)
    empty.workers = 0
    with pytest.raises(RendezvousError, match=f"{empty.url} has 0 workers"):
        connect([good.url, empty.url], timeout=20, joiner=MemoryJoin())
    assert inits(good) == inits(empty) == []


def test_invalid_settings_or_timeout_are_refused_before_any_init(servers):
    """Settings vLLM would refuse (no buffers) and timeouts that bound
    nothing are refused before any request: a server never sees an init
    that cannot succeed."""
    host = servers(1)
    with pytest.raises(RendezvousError, match="invalid init settings"):
        connect(host.url, workers=1, packed_num_buffers=0, timeout=20, joiner=MemoryJoin())
    for bad in (0, -1, True, float("inf"), "5"):
        with pytest.raises(RendezvousError, match="timeout must be a positive number"):
            connect(host.url, workers=1, timeout=bad, joiner=MemoryJoin())
    assert host.routes() == []


@pytest.mark.skipif(cuda.device_count() > 0, reason="this machine has a GPU")
def test_without_a_gpu_nccls_join_fails_before_any_server_is_told(servers):
    """The default joiner's preflight (libnccl loads, the device takes a
    context) runs before any HTTP: on a machine without a GPU, connect
    raises ``CudaError`` and the server never heard of it."""
    host = servers(1)
    with pytest.raises(CudaError):
        connect(host.url, timeout=20, joiner=NCCL_JOIN)
    assert host.routes() == []


# -- a server stuck inside NCCL ----------------------------------------------------

@pytest.mark.parametrize("route", ENGINE)
def test_a_server_whose_engine_does_not_answer_is_named_before_any_init(servers, monkeypatch,
                                                                          route):
    """Issue 35, item 5. A trainer killed mid-push leaves vLLM's worker
    inside NCCL: its API process still answers ``/get_world_size``, its
    engine core nothing. ``connect`` posted the init there (never joined)
    and waited its whole init deadline for ``RendezvousTimeout``. Now it
    asks each engine core first: ``ServerStuck`` naming that server alone
    and the restart, within ``ENGINE_ANSWER_S``; no init posted anywhere;
    once it answers again (restarted), the same call forms the group."""
    monkeypatch.setattr(rendezvous, "ENGINE_ANSWER_S", 1.0)
    good, stuck = servers(1), servers(2)
    stuck.hold[route] = threading.Event()
    t = time.monotonic()
    with pytest.raises(ServerStuck, match=f"{stuck.url}: its engine does not answer "
                                          rf"\(GET {route} took over 1 s.*restart that server"):
        connect([good.url, stuck.url], timeout=20, joiner=MemoryJoin())
    assert time.monotonic() - t < 1.0 + SLACK
    assert inits(good) == inits(stuck) == []
    stuck.hold.pop(route).set()
    connect([good.url, stuck.url], timeout=20, joiner=MemoryJoin()).close()
    assert inits(good) == inits(stuck) == [INIT]


def test_stuck_servers_are_asked_at_once_and_each_named_in_one_sentence(servers, monkeypatch):
    """Two stuck servers cost one wait, not two, and the error names both."""
    monkeypatch.setattr(rendezvous, "ENGINE_ANSWER_S", 1.0)
    hosts = [servers(1), servers(1)]
    for h in hosts:
        h.hold["/is_paused"] = threading.Event()
    t = time.monotonic()
    with pytest.raises(ServerStuck) as e:
        connect([h.url for h in hosts], timeout=20, joiner=MemoryJoin())
    assert time.monotonic() - t < 1.0 + SLACK
    assert all(h.url in str(e.value) for h in hosts) and "\n" not in str(e.value)
    assert all(inits(h) == [] for h in hosts)


def test_the_engine_question_stays_within_connects_deadline(servers):
    """A deadline shorter than ``ENGINE_ANSWER_S`` bounds the question too."""
    stuck = servers(1)
    stuck.hold["/is_paused"] = threading.Event()
    t = time.monotonic()
    with pytest.raises(ServerStuck, match=r"took over 0\.\d+ s"):
        connect(stuck.url, workers=1, timeout=0.5, joiner=MemoryJoin())
    assert time.monotonic() - t < 0.5 + SLACK and inits(stuck) == []


# -- refused and silent inits -------------------------------------------------------

def test_a_refused_init_ends_the_trainers_wait_naming_the_server(servers):
    """While the trainer waits in its init, a server answering 500 to its
    init ends the wait at once (not at the deadline): ``RendezvousError``
    naming that server, and naming the one still holding an init (its
    workers may now wait in NCCL)."""
    bad, slow = servers(1), servers(1)
    bad.fail[INIT] = 500
    slow.hold[INIT] = threading.Event()
    t = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        connect([bad.url, slow.url], timeout=30, joiner=WaitingJoin())
    assert time.monotonic() - t < 10
    text = str(err.value)
    assert "refused init while the trainer waited" in text
    assert f"{bad.url}{INIT} -> HTTP 500" in text
    assert f"{slow.url} took the init and may now wait inside NCCL" in text


def test_a_refused_init_after_the_join_is_raised_naming_the_server(servers, posts):
    """The trainer's init done, and then a server's answer is a 500: the
    communicator is aborted and the error names the server."""
    host = servers(1)
    host.fail[INIT] = 500
    joiner = AnsweredJoin(posts)
    with pytest.raises(RendezvousError, match=f"the server failed init after the group formed: "
                                              f"POST {host.url}{INIT} -> HTTP 500"):
        connect(host.url, timeout=20, joiner=joiner)
    assert joiner.comms[0].aborted == "server init failed"


def test_an_init_that_never_answers_ends_within_the_timeout(servers):
    """A server that takes the init and never answers (a stuck engine): the
    call ends within its ``timeout`` (+1 s), a ``RendezvousError``, the
    trainer's communicator aborted."""
    host = servers(1)
    host.hold[INIT] = threading.Event()
    joiner = MemoryJoin()
    t = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        connect(host.url, workers=1, timeout=0.5, joiner=joiner)
    assert time.monotonic() - t < 0.5 + SLACK
    assert "did not answer in time" in str(err.value) or "no answer within" in str(err.value)
    assert joiner.comms[0].aborted == "server init failed"


def test_workers_that_never_join_time_out_naming_the_servers_that_answered(servers, posts):
    """The servers answered 200 but no worker joined (say, a world size
    larger than the workers) and the trainer's init timed out:
    ``RendezvousTimeout`` with the likely causes and the servers that
    answered."""
    hosts = [servers(1), servers(2)]
    joiner = WaitingJoin(gives_up=lambda: bool(posts) and posts[-1].ended.done())
    with pytest.raises(RendezvousTimeout) as err:
        connect([h.url for h in hosts], timeout=30, joiner=joiner)
    assert "answered 200 but its workers never joined" in str(err.value)
    assert f"({hosts[0].url}, {hosts[1].url})" in str(err.value)


# -- releasing servers ---------------------------------------------------------------

def test_release_finishes_an_open_session_before_shutting_down(servers):
    """vLLM refuses to shut the engine down during an update session: the
    release finishes the session and shuts down again, so the server takes
    the next trainer's init."""
    host = servers(1)
    c = client(host)
    c.init_weight_transfer_engine({"nccl_unique_id_b64": UniqueId(bytes(128)).to_b64(),
                                   "rank_offset": 1, "world_size": 2})
    c.start_weight_update()
    release(c, Deadline(10))
    assert host.routes()[-3:] == [SHUTDOWN, "/finish_weight_update", SHUTDOWN]
    assert [x.status for x in host.log[-3:]] == [500, 200, 200]
    assert not host.active and not host.initialized


def test_a_refusal_without_a_session_is_raised(servers):
    """A shutdown refused for another reason (no session to finish) is
    raised as the server's own refusal."""
    host = servers(1)
    host.fail[SHUTDOWN] = 500
    with pytest.raises(VLLMHTTPError, match=f"{SHUTDOWN} -> HTTP 500"):
        release(client(host), Deadline(10))
    assert host.routes() == [SHUTDOWN, "/finish_weight_update"]


def test_a_stuck_server_is_named_within_the_release_deadline(servers):
    """An engine that never answers the shutdown (its workers inside NCCL):
    ``ServerStuck`` naming the server and the restart, within the deadline;
    a deadline already passed says so without a call."""
    host = servers(1)
    host.hold[SHUTDOWN] = threading.Event()
    t = time.monotonic()
    with pytest.raises(ServerStuck, match=f"{host.url}: its weight-transfer engine did not "
                                          "answer.*restart that server"):
        release(client(host), Deadline(0.5))
    assert time.monotonic() - t < 0.5 + SLACK
    calls = len(host.routes())
    with pytest.raises(ServerStuck):
        release(client(host), Deadline(0))
    assert len(host.routes()) == calls


def test_close_strict_raises_the_first_problem_and_logs_the_rest(servers, caplog):
    """``close(strict=True)`` raises the first server that could not be
    released, logs the others, and still frees the communicator and the
    clients it made; without ``strict`` every problem is logged only."""
    hosts = [servers(1), servers(1)]
    joiner = MemoryJoin()
    conn = connect([h.url for h in hosts], workers=[1, 1], timeout=20, joiner=joiner)
    for h in hosts:
        h.fail[SHUTDOWN] = 500
    with caplog.at_level(logging.WARNING, logger="uniqueid"), \
            pytest.raises(VLLMHTTPError, match=hosts[0].url):
        conn.close(strict=True)
    (logged,) = [r for r in caplog.records if r.name == "uniqueid"]
    assert hosts[1].url in logged.getMessage() and hosts[0].url not in logged.getMessage()
    assert joiner.comms[0].destroyed and conn.clients[0]._closed

    caplog.clear()
    conn = connect([h.url for h in hosts], workers=[1, 1], timeout=20, joiner=joiner)
    with caplog.at_level(logging.WARNING, logger="uniqueid"):
        conn.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "uniqueid"]
    assert len(logged) == 2 and all(h.url in m for m, h in zip(logged, hosts))


def test_close_leaves_given_clients_open_and_can_skip_release_and_free(servers):
    """Clients passed in are the caller's: ``close`` leaves them open. With
    ``shutdown_servers=False`` and ``free_comm=False`` (a thread still in a
    call) nothing is sent and the communicator is left alone."""
    host = servers(1)
    c = client(host)
    joiner = MemoryJoin()
    conn = connect(c, workers=1, timeout=20, joiner=joiner)
    assert not conn.owns_clients
    conn.close(shutdown_servers=False, free_comm=False)
    assert host.routes() == [*ENGINE, INIT] and not joiner.comms[0].destroyed
    assert c.get_world_size() == 1  # still open


def test_as_clients_takes_urls_clients_or_a_list_and_refuses_none():
    """One URL, one client, or a list of either become clients (a URL's
    trailing slash dropped); an empty list is refused with the fix."""
    c = VLLMClient("http://127.0.0.1:9")
    assert as_clients(c) == [c]
    (made,) = as_clients("http://127.0.0.1:8/")
    assert made.base_url == "http://127.0.0.1:8"
    assert [x.base_url for x in as_clients([c, "http://h:1"])] == ["http://127.0.0.1:9", "http://h:1"]
    with pytest.raises(ValueError, match="no vLLM server given"):
        as_clients([])
