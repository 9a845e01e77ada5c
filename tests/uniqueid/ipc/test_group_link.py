"""The IPC group's exchange (``uniqueid.ipc.group``) over a real store:
process 0's ``StoreServer`` in this process, another process's end a
``StoreClient`` over loopback."""

import threading
import time

import pytest

from jax_sender.testing.harness import free_port
from nccl_cffi.waiting import Deadline
from uniqueid import RendezvousTimeout
from uniqueid.ipc.group import GroupFailed, open_link


@pytest.fixture
def links():
    address = f"127.0.0.1:{free_port()}"
    zero = open_link(address, 0, 2, Deadline(10))
    one = open_link(address, 1, 2, Deadline(10))
    yield zero, one
    one.close()
    zero.store.close()


def test_a_long_wait_keeps_the_link_and_takes_the_value_once(links):
    """A wait of seconds (a slow step on process 0) neither breaks the
    client's connection nor reads a value twice."""
    zero, one = links
    threading.Timer(2.5, lambda: zero.tell("go0", b"on", Deadline(5), push=1)).start()
    assert one.receive("go0", Deadline(10), push=1) == b"on"
    one.send("x0", b"mine", Deadline(5), push=1)
    assert zero.hear("x0", Deadline(5), push=1) == [b"mine"]
    with pytest.raises(RendezvousTimeout, match="did not send 'go0' in time"):
        one.receive("go0", Deadline(0.3), push=1)


def test_a_failure_ends_the_other_sides_wait_at_once(links):
    zero, one = links
    zero.posted = 2
    zero.fail("SendError: the server refused", push=3)
    t = time.monotonic()
    with pytest.raises(GroupFailed, match="process 0 failed: SendError") as caught:
        one.receive("go2", Deadline(30), push=3)
    assert caught.value.posted == 2 and time.monotonic() - t < 5
    one.fail("RuntimeError: copies failed", push=4)
    with pytest.raises(GroupFailed, match="trainer process 1 failed: RuntimeError"):
        zero.hear("x0", Deadline(30), push=4)


@pytest.mark.parametrize("address", ["127.0.0.1", ":123", "127.0.0.1:0", "127.0.0.1:99999",
                                     "127.0.0.1:\uff10\uff11", "127.0.0.1: 80"])
def test_a_malformed_store_address_is_refused_in_one_sentence(address):
    with pytest.raises(ValueError, match="host:port"):
        open_link(address, 0, 2, Deadline(1))


@pytest.mark.parametrize("process, processes", [(2, 2), (-1, 2), (0, 1)])
def test_a_process_index_outside_the_group_is_refused(process, processes):
    with pytest.raises(ValueError, match="2 or more processes"):
        open_link(f"127.0.0.1:{free_port()}", process, processes, Deadline(1))


def test_process_0_keeps_the_store_until_every_other_process_read_why_the_connect_failed():
    address = f"127.0.0.1:{free_port()}"
    zero = open_link(address, 0, 3, Deadline(10))
    one, two = (open_link(address, p, 3, Deadline(10)) for p in (1, 2))
    zero.fail("RendezvousError: the server is not on ipc")
    with pytest.raises(GroupFailed, match="not on ipc"):
        one.receive("ranks", Deadline(5))
    threading.Timer(1.0, lambda: pytest.raises(GroupFailed, two.receive, "ranks",
                                               Deadline(5))).start()
    t = time.monotonic()
    zero.close()  # lingers for process 2 only, not for a key process 1 already read
    assert 0.8 < time.monotonic() - t < 4.0
    one.close()
    two.close()
