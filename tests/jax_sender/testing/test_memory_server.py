"""The independent receiver (``support.servers.memory_server``) against vLLM 0.33.0's rules.

These drive the server by hand: HTTP calls with ``httpx`` and broadcasts put on
the wire from a thread, as a sender's broadcaster would. The expected chunk
cuts, messages and session outcomes are written out here from vLLM's code, not
computed with the library, so the send tests that use this server cannot
agree with a wrong library rule.
"""

from __future__ import annotations

import base64
import hashlib
import queue
import threading

import httpx
import ml_dtypes
import numpy as np
import pytest

from support.concurrency import wait_for
from support.servers.memory_server import MemoryServer, cut_chunks

UID = base64.b64encode(bytes(range(128))).decode()


def init_info(**kw) -> dict:
    return {"nccl_unique_id_b64": UID, "rank_offset": 1, "world_size": 2, **kw}


def meta(arrays: dict[str, np.ndarray]) -> dict:
    return {"names": list(arrays), "dtype_names": [a.dtype.name for a in arrays.values()],
            "shapes": [list(a.shape) for a in arrays.values()]}


class Sender:
    """A broadcaster on a thread: puts each broadcast on the wire and, like NCCL,
    waits until it is taken before the next; stops when ``stop`` is called
    (the HTTP answer came), so a refused transfer leaves the rest untaken."""

    def __init__(self, wire: queue.Queue, chunks: list[bytes], root: int = 0):
        self.wire, self.taken, self.done = wire, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(chunks, root), daemon=True)
        self.thread.start()

    def _run(self, chunks: list[bytes], root: int) -> None:
        for data in chunks:
            event = threading.Event()
            self.wire.put((root, data, event))
            while not event.wait(0.01):
                if self.done.is_set():
                    return
            self.taken += 1

    def stop(self) -> int:
        self.done.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        return self.taken


@pytest.fixture
def wire():
    return queue.Queue()


@pytest.fixture
def make(wire):
    servers: list[MemoryServer] = []
    clients: list[httpx.Client] = []

    def make(**kw) -> tuple[MemoryServer, httpx.Client]:
        server = MemoryServer(wire, **kw)
        client = httpx.Client(base_url=server.url, timeout=30)
        servers.append(server)
        clients.append(client)
        return server, client

    yield make
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def push(client: httpx.Client, wire: queue.Queue, update: dict, chunks: list[bytes],
         root: int = 0) -> tuple[httpx.Response, int]:
    """One ``/update_weights`` while ``chunks`` are broadcast; the answer and how
    many broadcasts the server took."""
    sender = Sender(wire, chunks, root)
    r = client.post("/update_weights", json={"update_info": update})
    return r, sender.stop()


def error(r: httpx.Response) -> str:
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == r.status_code
    return r.json()["error"]["message"]


def open_session(client: httpx.Client, **info) -> None:
    assert client.post("/init_weight_transfer_engine", json={"init_info": init_info(**info)}).json() \
        == {"message": "Weight transfer initialized"}
    assert client.post("/start_weight_update").json() == {"message": "Weight update started"}


# ---- packed chunking (packed_tensor.py: packed_nccl_broadcast_consumer) ----

def test_chunk_rule_closes_only_strictly_past_the_buffer():
    assert cut_chunks([4, 4], 8) == [[0, 1]]  # exactly equal: stays open
    assert cut_chunks([4, 4, 4, 4], 8) == [[0, 1, 2], [3]]  # 12 > 8 closes after the third
    assert cut_chunks([4, 5, 4], 8) == [[0, 1], [2]]
    assert cut_chunks([20, 4], 8) == [[0], [1]]  # larger than the buffer: a chunk alone
    assert cut_chunks([3, 20, 1], 8) == [[0, 1], [2]]  # never split, closes after it
    assert cut_chunks([], 8) == []
    assert cut_chunks([4, 4, 1, 0], 8) == [[0, 1, 2], [3]]  # a last empty tensor still broadcasts


def test_packed_push_cut_at_the_boundaries(make, wire):
    server, client = make()
    open_session(client, packed=True, packed_buffer_size_bytes=8)
    a = np.arange(2, dtype=np.float32)  # 8 bytes: total == 8, the chunk stays open
    b = np.array([7], np.float32)  # 12 > 8: closes the first chunk
    c = np.arange(3, dtype=np.float32) + 10  # 12 bytes, larger than the buffer: alone
    d = np.array([1, 2, 3], np.int8)  # the rest
    arrays = {"a": a, "b": b, "c": c, "d": d}
    chunks = [a.tobytes() + b.tobytes(), c.tobytes(), d.tobytes()]
    r, taken = push(client, wire, meta(arrays), chunks)
    assert (r.status_code, r.json(), taken) == (200, {"message": "Weights updated"}, 3)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(server.store[name], arr)
        assert server.store[name].dtype == arr.dtype
    assert server.active


def test_packed_push_cut_by_another_rule_is_refused(make, wire):
    server, client = make()
    open_session(client, packed=True, packed_buffer_size_bytes=8)
    a, b = np.arange(2, dtype=np.float32), np.array([7], np.float32)
    # closing when the total reaches the buffer (>=) sends a alone: not vLLM's cut
    r, taken = push(client, wire, meta({"a": a, "b": b}), [a.tobytes(), b.tobytes()])
    assert r.status_code == 500 and taken == 1
    assert "a broadcast of 8 bytes, expected 12" in error(r)
    assert not server.active  # a failed update drops the session


def test_packed_misaligned_offset_refused_as_torch_does(make, wire):
    server, client = make()
    open_session(client, packed=True, packed_buffer_size_bytes=1 << 20)
    a, b = np.array([1], np.int8), np.array([2.5], np.float32)
    r, taken = push(client, wire, meta({"a": a, "b": b}), [a.tobytes() + b.tobytes()])
    assert r.status_code == 500 and taken == 1
    assert ("self.storage_offset() must be divisible by 4 to view Byte as Float "
            "(different element sizes), but got 1") in error(r)
    assert not server.active and "b" not in server.store


def test_packed_bfloat16_and_float8_at_aligned_offsets(make, wire):
    server, client = make()
    open_session(client, packed=True)  # the 1 GiB default buffer: one chunk
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
              "h": np.array([1.5, -2], ml_dtypes.bfloat16),
              "q": np.array([0.5, 1, 2], ml_dtypes.float8_e4m3fn)}
    r, taken = push(client, wire, meta(arrays), [b"".join(a.tobytes() for a in arrays.values())])
    assert r.status_code == 200 and taken == 1
    for name, arr in arrays.items():
        assert server.store[name].dtype == arr.dtype
        assert server.store[name].tobytes() == arr.tobytes()


# ---- unpacked (nccl_engine.py: receive_weights) ----

def test_unpacked_one_broadcast_per_tensor(make, wire):
    server, client = make()
    open_session(client)  # packed defaults to False
    arrays = {"x": np.arange(4, dtype=np.int64).reshape(2, 2), "s": np.array(3.0, np.float64),
              "e": np.zeros((0, 3), np.float16)}
    r, taken = push(client, wire, meta(arrays), [a.tobytes() for a in arrays.values()])
    assert r.status_code == 200 and taken == 3
    for name, arr in arrays.items():
        assert server.store[name].shape == arr.shape
        np.testing.assert_array_equal(server.store[name], arr)


def test_root_must_be_the_updates_src(make, wire):
    server, client = make()
    open_session(client, rank_offset=2, world_size=3)
    a = np.ones(2, np.float32)
    r, _ = push(client, wire, {**meta({"a": a}), "src": 1}, [a.tobytes()], root=1)
    assert r.status_code == 200
    assert client.post("/start_weight_update").status_code == 500  # still active
    r, _ = push(client, wire, meta({"a": a}), [a.tobytes()], root=1)  # src 0 expected
    assert r.status_code == 500 and "from root 1, expected root 0" in error(r)
    client.post("/start_weight_update")
    r, _ = push(client, wire, {**meta({"a": a}), "src": 2}, [])  # not a sender rank
    assert r.status_code == 500 and "src must be a sender rank in [0, 2), got 2" in error(r)


# ---- metadata reuse ----

def test_empty_lists_reuse_the_previous_metadata(make, wire):
    server, client = make()
    open_session(client, packed=True, packed_buffer_size_bytes=4)
    a, b = np.array([1, 2], np.float32), np.array([3], np.int32)
    assert push(client, wire, meta({"a": a, "b": b}), [a.tobytes(), b.tobytes()])[0].status_code == 200
    empty = {"names": [], "dtype_names": [], "shapes": []}
    r, taken = push(client, wire, empty, [(a + 1).tobytes(), (b + 1).tobytes()])
    assert r.status_code == 200 and taken == 2
    np.testing.assert_array_equal(server.store["a"], a + 1)
    r, taken = push(client, wire, {}, [(a + 2).tobytes(), (b + 2).tobytes()])  # all three defaulted
    assert r.status_code == 200 and taken == 2
    np.testing.assert_array_equal(server.store["b"], b + 2)


@pytest.mark.parametrize("forget", ["reinit", "shutdown"])
def test_reuse_after_reinit_or_shutdown_refused(make, wire, forget):
    server, client = make()
    open_session(client)
    a = np.ones(3, np.float32)
    assert push(client, wire, meta({"a": a}), [a.tobytes()])[0].status_code == 200
    assert client.post("/finish_weight_update").status_code == 200
    if forget == "shutdown":
        assert client.post("/shutdown_weight_transfer_engine").json() == \
            {"message": "Weight transfer shut down"}
        assert not server.initialized
        client.post("/start_weight_update")
        r, taken = push(client, wire, {}, [a.tobytes()])
        assert r.status_code == 500 and taken == 0
        assert "NCCL weight transfer not initialized" in error(r)
        assert not server.active
    assert client.post("/init_weight_transfer_engine", json={"init_info": init_info()}).status_code == 200
    assert server.initialized and len(server.init_infos) == 2
    client.post("/start_weight_update")
    r, taken = push(client, wire, {"names": [], "dtype_names": [], "shapes": []}, [a.tobytes()])
    assert r.status_code == 500 and taken == 0
    assert "no earlier update since init_weight_transfer_engine" in error(r)
    assert not server.active


# ---- session rules (v1/worker/gpu_worker.py) ----

def test_session_refusals(make, wire):
    server, client = make()
    a = np.ones(1, np.float32)
    r = client.post("/update_weights", json={"update_info": meta({"a": a})})
    assert r.status_code == 500
    assert error(r) == ("Call to collective_rpc method failed: "
                        "start_weight_update must be called before update_weights.")
    assert r.json()["error"]["type"] == "InternalServerError"
    r = client.post("/finish_weight_update")
    assert r.status_code == 500 and "without a matching start_weight_update" in error(r)
    # start needs no init (the engine is configured at launch) ...
    assert client.post("/start_weight_update").status_code == 200
    r = client.post("/start_weight_update")
    assert r.status_code == 500 and "while a weight update is already active" in error(r)
    # ... but an update does, and its failure drops the session
    r, taken = push(client, wire, meta({"a": a}), [a.tobytes()])
    assert r.status_code == 500 and taken == 0 and "not initialized" in error(r)
    assert not server.active
    assert client.post("/finish_weight_update").status_code == 500


def test_shutdown_refused_while_active(make, wire):
    server, client = make()
    open_session(client)
    r = client.post("/shutdown_weight_transfer_engine")
    assert r.status_code == 500 and error(r) == (
        "Call to collective_rpc method failed: "
        "Cannot release a trainer connection during a weight update")
    assert server.initialized and server.active
    assert client.post("/finish_weight_update", json={"weight_version": "v1"}).json() == \
        {"message": "Weight update finished"}
    assert client.post("/shutdown_weight_transfer_engine").status_code == 200
    assert not server.initialized and server.weight_version == "v1"


def test_failing_update_takes_the_bytes_then_drops_the_session(make, wire):
    server, client = make()
    open_session(client)
    server.fail["/update_weights"] = 500
    a, b = np.ones(2, np.float32), np.zeros(3, np.int8)
    r, taken = push(client, wire, meta({"a": a, "b": b}), [a.tobytes(), b.tobytes()])
    assert r.status_code == 500 and taken == 2
    assert "injected failure of /update_weights" in error(r)
    assert not server.active
    assert client.post("/finish_weight_update").status_code == 500


def test_workers_wrap_errors_like_the_multiproc_executor(make):
    _, client = make(workers=2)
    r = client.post("/finish_weight_update")
    assert error(r).startswith("Call to collective_rpc method failed: Worker failed with error "
                               "'finish_weight_update called without a matching")


# ---- init_info (nccl_common.py: NCCLWeightTransferInitInfo, base.py: parse_init_info) ----

@pytest.mark.parametrize("info, message", [
    (init_info(use_tcp=True),
     "Invalid init_info for NCCLWeightTransferEngine: NCCLWeightTransferInitInfo.__init__() "
     "got an unexpected keyword argument 'use_tcp'"),
    ({"nccl_unique_id_b64": UID},
     "missing 2 required keyword-only arguments: 'rank_offset' and 'world_size'"),
    (init_info(nccl_unique_id_b64=base64.urlsafe_b64encode(bytes([251] * 128)).decode()),
     "not valid standard base64"),
    (init_info(nccl_unique_id_b64=UID.rstrip("=")), "not valid standard base64"),
    (init_info(nccl_unique_id_b64=base64.b64encode(bytes(64)).decode()),
     "must decode to 128 bytes, got 64"),
    (init_info(master_address="127.0.0.1"), "not both"),
    ({"rank_offset": 1, "world_size": 2}, "need nccl_unique_id_b64, or both"),
    (init_info(packed="false"), "packed must be a bool"),
    (init_info(world_size=1), "NCCL error: invalid argument"),
    (init_info(rank_offset=0), "rank_offset must be >= 1"),
])
def test_init_info_refused(make, info, message):
    server, client = make()
    r = client.post("/init_weight_transfer_engine", json={"init_info": info})
    assert r.status_code == 500 and message in error(r)
    assert not server.initialized and server.init_infos == [info]


def test_init_info_accepts_null_rendezvous_fields(make):
    server, client = make()
    info = init_info(master_address=None, master_port=None, packed=True, packed_num_buffers=3)
    assert client.post("/init_weight_transfer_engine", json={"init_info": info}).status_code == 200
    assert server.initialized and server.packed and server.packed_buffer_size_bytes == 1 << 30


def test_update_info_refused(make, wire):
    server, client = make()
    open_session(client)
    r, _ = push(client, wire, {**meta({"a": np.ones(1)}), "packed": True}, [])
    assert r.status_code == 500 and ("Invalid update_info for NCCLWeightTransferEngine: "
                                     "NCCLWeightTransferUpdateInfo.__init__() got an unexpected "
                                     "keyword argument 'packed'") in error(r)
    client.post("/start_weight_update")
    r, _ = push(client, wire, {"names": ["a"], "dtype_names": [], "shapes": [[1]]}, [])
    assert "`dtype_names` should be of the same size as `names`: got 0 and 1" in error(r)
    assert r.status_code == 500 and not server.active
    r = client.post("/update_weights", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.update_info"


# ---- sparse (sparse_nccl_engine.py, checkpoint_weight_patch.py) ----

def test_sparse_patches(make, wire):
    server, client = make(sparse=True)
    open_session(client)
    up = {"names": ["w", "v"], "dtype_names": ["float32", "bfloat16"], "shapes": [[2, 3], [4]],
          "num_updates_list": [2, 1]}
    chunks = [np.array([0, 5], np.int32).tobytes(), np.array([1.5, -2], np.float32).tobytes(),
              np.array([3], np.int32).tobytes(), np.array([4], ml_dtypes.bfloat16).tobytes()]
    r, taken = push(client, wire, up, chunks)
    assert r.status_code == 200 and taken == 4
    np.testing.assert_array_equal(server.store["w"], [[1.5, 0, 0], [0, 0, -2]])
    assert server.store["v"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(server.store["v"].astype(np.float32), [0, 0, 0, 4])
    # a second patch changes only its positions
    up2 = {**up, "names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]], "num_updates_list": [1]}
    r, _ = push(client, wire, up2, [np.array([1], np.int32).tobytes(), np.array([9], np.float32).tobytes()])
    assert r.status_code == 200
    np.testing.assert_array_equal(server.store["w"], [[1.5, 9, 0], [0, 0, -2]])


@pytest.mark.parametrize("indices, values, dtype, message", [
    ([0, 0], [1, 2], "float32", "duplicate indices"),
    ([6], [1], "float32", "out-of-range indices"),
    ([1], [np.nan], "float32", "NaN values"),
    ([1], [3], "int32", "require a floating dtype"),
])
def test_sparse_refusals_after_every_broadcast(make, wire, indices, values, dtype, message):
    server, client = make(sparse=True)
    open_session(client)
    up = {"names": ["w"], "dtype_names": [dtype], "shapes": [[2, 3]], "num_updates_list": [len(indices)]}
    chunks = [np.array(indices, np.int32).tobytes(), np.array(values, dtype).tobytes()]
    r, taken = push(client, wire, up, chunks)
    assert r.status_code == 500 and taken == 2 and message in error(r)
    assert "w" not in server.store and not server.active


def test_sparse_update_info_rules(make, wire):
    server, client = make(sparse=True)
    open_session(client)
    r, _ = push(client, wire, {"names": [], "dtype_names": [], "shapes": []}, [])
    assert ("Invalid update_info for SparseNCCLWeightTransferEngine: SparseNCCLWeightTransferUpdateInfo"
            ".__init__() missing 1 required positional argument: 'num_updates_list'") in error(r)
    client.post("/start_weight_update")
    r, _ = push(client, wire, {"names": [], "dtype_names": [], "shapes": [], "num_updates_list": []}, [])
    assert "`num_updates_list` cannot be empty for sparse updates" in error(r)
    client.post("/start_weight_update")
    r, _ = push(client, wire, {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]],
                               "num_updates_list": [-1]}, [])
    assert "entries must be non-negative" in error(r)


# ---- weight_checker, the other routes ----

def test_checksums_for_two_workers(make, wire):
    server, client = make(workers=2)
    assert client.get("/get_world_size").json() == {"world_size": 2}
    open_session(client, world_size=3)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert push(client, wire, meta({"a": a}), [a.tobytes()])[0].status_code == 200
    digest = hashlib.sha256(a.tobytes()).hexdigest()
    sums = client.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert sums == {"dp0:pp0:pcp0:tp0:a": digest, "dp0:pp0:pcp0:tp1:a": digest}
    assert client.post("/weight_checker", json={"action": "compare", "baseline": sums}).json() == \
        {"match": True, "mismatches": []}
    assert client.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    np.testing.assert_array_equal(server.store["a"], np.zeros((2, 3), np.float32))
    assert client.post("/weight_checker", json={"action": "compare", "baseline": sums}).json() == \
        {"match": False, "mismatches": sorted(sums)}
    r = client.post("/weight_checker", json={"action": "compare"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"


def test_engine_routes(make):
    server, client = make()
    assert client.get("/weight_info").json() == {"weight_version": "default"}
    assert client.get("/is_paused").json() == {"is_paused": False}
    assert client.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert server.paused and client.get("/is_paused").json() == {"is_paused": True}
    r = client.post("/pause", params={"mode": "drain"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.mode"
    assert client.post("/resume").json() == {"status": "resumed"} and not server.paused
    assert client.get("/pause").status_code == 405
    assert client.post("/nope").status_code == 404
    assert server.routes() == ["/weight_info", "/is_paused", "/pause", "/is_paused", "/pause",
                               "/resume", "/pause", "/nope"]


# ---- the log, hold, concurrency ----

def test_held_route_logged_on_arrival_and_released(make):
    server, client = make()
    server.hold["/start_weight_update"] = gate = threading.Event()
    answers: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answers.append(client.post("/start_weight_update")))
    t.start()
    assert wait_for(lambda: "/start_weight_update" in server.routes())
    held = server.log[0]
    assert held.answered is None and held.status is None and not server.active
    with httpx.Client(base_url=server.url, timeout=10) as other:  # others are not blocked
        assert other.get("/is_paused").json() == {"is_paused": False}
    assert server.routes() == ["/start_weight_update", "/is_paused"] and held.answered is None
    gate.set()
    t.join(10)
    assert answers[0].status_code == 200 and server.active
    assert held.status == 200 and held.answered >= server.log[1].answered >= held.arrived


def test_routes_after_each_call_include_it_in_order(make, wire):
    server, client = make()
    open_session(client)
    a = np.ones(1, np.float32)
    push(client, wire, meta({"a": a}), [a.tobytes()])
    assert server.routes() == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights"]
    assert all(c.status == 200 and c.answered is not None for c in server.log)
    assert server.log[2].body == {"update_info": meta({"a": a})}


def test_is_paused_answers_while_an_update_waits_for_broadcasts(make, wire):
    server, client = make()
    open_session(client)
    a = np.ones(4, np.float32)
    answers: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answers.append(
        client.post("/update_weights", json={"update_info": meta({"a": a})})))
    t.start()
    assert wait_for(lambda: "/update_weights" in server.routes())
    with httpx.Client(base_url=server.url, timeout=10) as other:  # nothing on the wire yet
        assert other.get("/is_paused").json() == {"is_paused": False}
        assert other.post("/pause").json() == {"status": "paused"}
    assert not answers and server.log[2].answered is None
    sender = Sender(wire, [a.tobytes()])
    t.join(10)
    assert sender.stop() == 1 and answers[0].status_code == 200
    assert server.routes() == ["/init_weight_transfer_engine", "/start_weight_update",
                               "/update_weights", "/is_paused", "/pause"]
