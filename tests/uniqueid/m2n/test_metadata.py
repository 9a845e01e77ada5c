"""The metadata group and the M2N agreements among our own ranks (threads
over a loopback store): vLLM's keys, waits that end by their deadline and
name who did not arrive, plain-data unpickling, a rank's error failing every
rank, and the destination rows. Against vLLM's own code: test_m2n_vllm.py."""

import datetime
import os
import pickle
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nccl_cffi.waiting import Deadline
from uniqueid.m2n.agreement import (
    AgreementError,
    M2NMesh,
    M2NWireParam,
    check_complete_plan_agreement,
    check_data_plane_agreement,
    check_runtime_ready_agreement,
    check_source_plan_agreement,
    decode_destination_placements,
    source_plan_digest,
)
from uniqueid.m2n.metadata import GroupError, GroupTimeout, MetadataGroup, plain_loads

MARGIN = 3.0
PARAMS = [M2NWireParam(name="w", dtype_name="bfloat16", shape=(4, 6), src_mesh_dims=(1, 1),
                       src_placements=None),
          M2NWireParam(name="b", dtype_name="float32", shape=(8,), src_mesh_dims=(1, 1),
                       src_placements=(0, -1))]


@pytest.fixture
def groups():
    """A group of 3 of our ranks: 0 hosts, 1 and 2 join."""
    made = []

    def make(world_size=3, joined=3):
        host = MetadataGroup.host("127.0.0.1", world_size)
        made.append(host)
        others = [MetadataGroup.join("127.0.0.1", host.store.port, r, world_size, deadline=Deadline(10))
                  for r in range(1, joined)]
        made.extend(others)
        return [host, *others]

    yield make
    for g in reversed(made):
        g.close()


def on_all(groups, fn):
    """``fn(group)`` on every rank at once; each rank's result or exception."""
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(fn, g) for g in groups]
        return [f.exception() or f.result() for f in futures]


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/uniqueid-boom",))


@pytest.mark.parametrize("obj,why", [
    (datetime.date(2020, 1, 1), "global datetime.date"),
    (Boom(), "global posix.system"),
    ({1, 2}, "holds a set"),
    ([bytearray(b"x")], "holds a bytearray"),
])
def test_a_record_that_is_not_plain_data_is_refused_before_any_of_it_runs(obj, why):
    with pytest.raises(ValueError, match=why):
        plain_loads(pickle.dumps(obj, protocol=5))
    assert not os.path.exists("/tmp/uniqueid-boom")


def test_plain_data_loads_as_vllm_pickled_it_and_garbage_is_refused():
    record = {"phase": "source", "digest": "ab", "error": None, "n": [1, 2.5, True, (b"\x00", "x")]}
    assert plain_loads(pickle.dumps(record)) == record
    cycle = []
    cycle.append(cycle)
    assert plain_loads(pickle.dumps(cycle))[0][0] is not None
    for data in (b"", b"garbage", pickle.dumps(record)[:-3]):
        with pytest.raises(ValueError, match="not a pickle"):
            plain_loads(data)


def test_the_keys_and_counters_are_vllms(groups):
    g0, g1, g2 = groups()
    assert on_all([g0, g1, g2], lambda g: g.all_gather_obj(g.rank * 10, Deadline(10))) == [[0, 10, 20]] * 3
    assert on_all([g0, g1, g2], lambda g: g.broadcast_obj("x" if g.rank == 1 else None, 1, Deadline(10))) \
        == ["x"] * 3
    g0.send_obj({"a": 1}, 2)
    g1.send_obj({"b": 2}, 2)  # vLLM's recv key ignores the source: this one lands on send_to/2/0 too
    assert g2.recv_obj(0, Deadline(5)) == {"b": 2}
    keys = {k.decode() for k in g0.store._table.data}
    assert keys == {"init/", "/broadcast_from/0/0", "/broadcast_from/1/0", "/broadcast_from/2/0",
                    "/broadcast_from/1/1", "/send_to/2/0"}
    assert g0.store.joined() == 3
    assert (g1.broadcast_send_counter, g2.broadcast_recv_src_counter) == (2, {0: 1, 1: 2, 2: 0})


def test_an_all_gather_names_every_rank_missing_within_its_deadline(groups):
    g0, g1 = groups(world_size=4, joined=2)
    start = time.monotonic()
    results = on_all([g0, g1], lambda g: g.all_gather_obj("r", Deadline(1.5), what="record of the test"))
    assert time.monotonic() - start < 1.5 + MARGIN
    for error in results:
        assert isinstance(error, GroupTimeout)
        assert str(error).startswith("group rank 2 and group rank 3 did not publish their record of the "
                                     "test within 1.5 s; 2 of 4 ranks joined the store: check that")


def test_a_rank_that_sends_what_is_not_plain_data_is_named(groups):
    g0, g1, _ = groups()
    g1.store.set("broadcast_from/1/0", pickle.dumps(datetime.date(2020, 1, 1)))
    with pytest.raises(GroupError, match=r"^group rank 1 sent a broadcast that is not plain data \(it names "
                                         r"the global datetime.date\)"):
        g0.broadcast_obj(None, 1, Deadline(5))


def test_what_a_rank_published_expires_as_vllms_does(groups):
    g0, g1, _ = groups()
    g0.data_expiration_seconds = 0.0
    g0.send_obj(1, 1)
    time.sleep(0.01)
    g0.send_obj(2, 1)
    assert not g0.store.check(["send_to/1/0"]) and g0.store.check(["send_to/1/1"])


def test_the_store_closing_under_a_wait_is_a_group_error_not_a_hang(groups):
    g0, g1, _ = groups()
    threading.Timer(0.5, g0.close).start()
    start = time.monotonic()
    with pytest.raises(GroupError, match="store failed while group rank 1 waited for group rank 0"):
        g1.recv_obj(0, Deadline(30))
    assert time.monotonic() - start < 0.5 + MARGIN


# ---- the agreements among our ranks ----

def agree(g, *, local=None, uid=b"\x01" * 128, rows=None):
    d = Deadline(20)
    digest = check_source_plan_agreement(g, PARAMS, d, local_error=local if g.rank == 1 else None)
    check_data_plane_agreement(g, uid, d)
    check_runtime_ready_agreement(g, None, d)
    mesh = M2NMesh(dims=(2, 1), start_rank=1)
    return digest, check_complete_plan_agreement(g, digest, mesh, rows or [None, (-1, 0)], d)


def test_the_agreements_pass_and_agree_on_every_rank(groups):
    results = on_all(groups(), agree)
    assert results[0][0] == source_plan_digest(PARAMS)
    assert results == [results[0]] * 3


def test_one_ranks_error_fails_every_rank_with_the_same_sentence(groups):
    results = on_all(groups(), lambda g: agree(g, local="RuntimeError: no such device\nsecond line"))
    expected = ("nccl_m2n source preflight rejected before NCCL init: rank 1: RuntimeError: no such "
                "device second line")
    assert [str(r) for r in results] == [expected] * 3
    assert all(isinstance(r, AgreementError) and r.errors == ["rank 1: RuntimeError: no such device\n"
                                                               "second line"] for r in results)


def test_a_rank_joining_another_nccl_group_fails_the_data_plane_agreement(groups):
    results = on_all(groups(), lambda g: agree(g, uid=b"\x02" * 128 if g.rank == 2 else b"\x01" * 128))
    assert all(str(r).endswith("rank 2: NCCL data-plane identity disagrees") for r in results)


def test_a_plan_given_as_wire_dicts_is_checked_and_a_bad_one_fails_every_rank(groups):
    assert source_plan_digest([p.to_dict() for p in PARAMS]) == source_plan_digest(PARAMS)
    bad = [PARAMS[0].to_dict(), {**PARAMS[1].to_dict(), "shape": [0]}]
    results = on_all(groups(), lambda g: check_source_plan_agreement(
        g, bad if g.rank == 2 else PARAMS, Deadline(20)))
    assert [str(r) for r in results] == [
        "nccl_m2n source preflight rejected before NCCL init: rank 2: ValueError: parameter 'b' shape "
        "must contain positive integers"] * 3


def test_the_wire_param_refuses_what_vllms_refuses():
    good = PARAMS[1].to_dict()
    assert M2NWireParam.from_dict(good) == PARAMS[1]
    for change, message in [({"shape": [8, True]}, "positive integers"),
                            ({"name": ""}, "must not be empty"),
                            ({"src_placements": [0, 1]}, "shards both"),
                            ({"src_mesh_dims": [0, 1]}, "mesh dims"),
                            ({"extra": 1}, r"unexpected \['extra'\]")]:
        with pytest.raises((ValueError, TypeError), match=message):
            M2NWireParam.from_dict({**good, **change})


# ---- the destination rows ----

def rows(*pairs):
    return b"".join(struct.pack("<bb", *p) for p in pairs)


def test_the_rows_vllm_sends_decode():
    assert decode_destination_placements(rows((-2, -2), (-1, 0), (2, -1)), 3) == [None, (-1, 0), (2, -1)]
    assert decode_destination_placements(b"", 0) == []


@pytest.mark.parametrize("data,n,message", [
    (rows((-2, 0)), 1, "vLLM never sends"),
    (rows((-1, -1)), 1, "fully replicated"),
    (rows((0, 1)), 1, "shards both"),
    (rows((-3, 0)), 1, "invalid placement code -3"),
    (rows((-1, 3)), 1, "vLLM never sends"),
    (rows((-1, 0)), 2, "expected 4"),
])
def test_a_row_vllm_would_not_send_is_refused(data, n, message):
    with pytest.raises(ValueError, match=message):
        decode_destination_placements(data, n)
