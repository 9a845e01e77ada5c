"""Our trainer ranks and vLLM 0.33.0's own ``nccl_m2n`` workers in one
metadata group: rank 0 hosts ``StoreServer``, more trainer ranks join with
``StoreClient``, and each worker is a child process running vLLM's own
``StatelessProcessGroup`` (torch's ``TCPStore`` client) and vLLM's own
``check_*_agreement`` in its engine's order (``support/children/vllm_m2n_rank.py``).
Both sides must pass together, or fail together with the same sentence, and
no rank is left waiting on ours."""

import datetime
import json
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

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
from uniqueid.m2n.join import WORKERS_LEAVE_S
from uniqueid.m2n.metadata import GroupError, GroupTimeout, MetadataGroup
from uniqueid.m2n.plan import validate_transfer_plan

from support import nothing_listens
from support.vllm_children import Child, interpreter, wait_until

HOST = "127.0.0.1"
STARTUP = 120.0  # a child imports torch and vLLM on a loaded machine
MARGIN = 5.0
UID = bytes(range(128))
STEPS = ["source", "data", "runtime", "placements", "complete"]


def plan(trainers):
    """The source plan (wire dicts) over ``trainers`` ranks, and the workers'
    destination placements over a (1, 2) mesh."""
    params = [
        {"name": "embed", "dtype_name": "bfloat16", "shape": [8, 4], "src_mesh_dims": [trainers, 1],
         "src_placements": [0, -1]},
        {"name": "norm", "dtype_name": "float32", "shape": [4], "src_mesh_dims": [trainers, 1],
         "src_placements": None},
        {"name": "proj", "dtype_name": "int8", "shape": [2, 6, 4], "src_mesh_dims": [trainers, 1],
         "src_placements": [1, -1]},
    ]
    return params, [[-1, 0], None, [-1, 2]]


def worker_spec(trainers, **changes):
    params, placements = plan(trainers)
    spec = {"params": params, "uid_hex": UID.hex(), "dst_dims": [1, 2], "rank_offset": trainers,
            "placements": placements, "steps": STEPS}
    return {**spec, **changes}


class Pool:
    """Warm worker processes (torch and vLLM imported once each): a job
    takes one; one whose job did not end (left waiting on a rank that never
    comes, or exited) is killed and replaced, importing in the background."""

    def __init__(self, size):
        self.idle = [Child("vllm_m2n_rank.py", stdin=True) for _ in range(size)]
        self.warm = set()

    def take(self):
        child = self.idle.pop(0)
        if child not in self.warm:
            assert child.next(STARTUP)["step"] == "ready"
            self.warm.add(child)
        return child

    def give_back(self, worker):
        if worker.done.is_set() and worker.child.proc.poll() is None:
            self.idle.append(worker.child)
        else:
            worker.child.kill()
            self.idle.append(Child("vllm_m2n_rank.py", stdin=True))

    def close(self):
        for child in self.idle:
            child.kill()


class Worker:
    """One job on a pool process (a worker's, or plans to validate); its
    reports by step."""

    def __init__(self, child, request):
        self.child = child
        self.reports = {}
        self.rows = Future()  # the hex rows it would broadcast, once it reaches that step
        self.done = threading.Event()  # its job ended and the process serves the next
        self.over = threading.Event()  # that, or the process ended
        self.joined = threading.Event()
        child.proc.stdin.write(json.dumps(request) + "\n")
        child.proc.stdin.flush()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self):
        while (line := self.child.lines.get()) is not None and line["step"] != "end":
            self.reports[line["step"]] = line
            if line["step"] == "joined":
                self.joined.set()
            if line["step"] == "placements" and "ok" in line:
                self.rows.set_result(line["ok"])
        if line is not None:
            self.done.set()
        self.over.set()

    def finished(self, timeout=STARTUP):
        assert self.over.wait(timeout), f"worker did not finish: {self.reports}, " \
                                        f"{''.join(self.child.stderr)[-2000:]}"
        return self.reports


@pytest.fixture(scope="module")
def pool():
    interpreter()
    p = Pool(2)
    yield p
    p.close()


@pytest.fixture
def cluster(pool):
    """Start a group: rank 0 hosted here, ``trainers - 1`` more of our
    ranks, and vLLM workers at ranks ``trainers``... (each with its spec)."""
    made = {"groups": [], "workers": []}

    def start(trainers, specs, world_size=None):
        world_size = world_size or trainers + len(specs)
        host = MetadataGroup.host(HOST, world_size)
        made["groups"].append(host)
        for i, spec in enumerate(specs):
            job = {"host": HOST, "port": host.store.port, "rank": trainers + i, "world_size": world_size,
                   "spec": spec}
            made["workers"].append(Worker(pool.take(), job))
        ours = [host] + [MetadataGroup.join(HOST, host.store.port, r, world_size, deadline=Deadline(10))
                         for r in range(1, trainers)]
        made["groups"] += ours[1:]
        return ours, made["workers"]

    yield start
    for g in reversed(made["groups"]):
        g.close()  # a worker still waiting on the store now fails at once
    for w in made["workers"]:
        w.over.wait(10)
        pool.give_back(w)


def trainer(group, trainers, rows, deadline=STARTUP, local=None):
    """Our trainer rank, in the engine's order; the first worker's rows
    decoded as the lead's sender decodes what NCCL delivers."""
    params, _ = plan(trainers)
    wire = [M2NWireParam.from_dict(p) for p in params]
    d = Deadline(deadline)
    digest = check_source_plan_agreement(group, wire, d)
    check_data_plane_agreement(group, UID, d)
    check_runtime_ready_agreement(group, local, d)
    placements = decode_destination_placements(bytes.fromhex(rows.result(deadline)), len(wire))
    complete = check_complete_plan_agreement(group, digest, M2NMesh(dims=(1, 2), start_rank=trainers),
                                             placements, d)
    return digest, placements, complete


def on_all(groups, fn):
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(fn, g) for g in groups]
        return [f.exception() or f.result() for f in futures]


@pytest.mark.parametrize("trainers", [1, 2])
def test_all_four_agreements_pass_with_vllms_workers(cluster, trainers):
    ours, workers = cluster(trainers, [worker_spec(trainers)] * 2)
    results = on_all(ours, lambda g: trainer(g, trainers, workers[0].rows))
    params, placements = plan(trainers)
    digest = source_plan_digest([M2NWireParam.from_dict(p) for p in params])
    expected_rows = [None if p is None else tuple(p) for p in placements]
    for w in workers:
        reports = w.finished()
        assert [reports[s].get("error") for s in STEPS] == [None] * len(STEPS), reports
        assert reports["source"]["ok"] == digest  # vLLM's digest of vLLM's params is ours
        assert reports["complete"]["ok"] == results[0][2]
    assert results == [(digest, expected_rows, results[0][2])] * trainers


def test_a_worker_that_never_joins_is_named_within_our_deadline(cluster):
    ours, (worker,) = cluster(1, [worker_spec(1)], world_size=3)
    assert worker.joined.wait(STARTUP)
    start = time.monotonic()
    with pytest.raises(GroupTimeout) as caught:
        trainer(ours[0], 1, worker.rows, deadline=4.0)
    assert time.monotonic() - start < 4.0 + MARGIN
    assert str(caught.value).startswith(
        "group rank 2 did not publish its record of the source-plan agreement within 4 s; 2 of 3 ranks "
        "joined the store: check that every rank")


def test_a_worker_that_leaves_mid_way_is_named_within_our_deadline(cluster):
    ours, workers = cluster(1, [worker_spec(1), worker_spec(1, steps=["source", "exit"])])
    d = Deadline(STARTUP)
    wire = [M2NWireParam.from_dict(p) for p in plan(1)[0]]
    digest = check_source_plan_agreement(ours[0], wire, d)
    assert workers[1].finished()["source"]["ok"] == digest  # then it left, its socket closed
    start = time.monotonic()
    with pytest.raises(GroupTimeout, match="^group rank 2 did not publish its record of the data-plane "
                                           "agreement within 3 s"):
        check_data_plane_agreement(ours[0], UID, Deadline(3.0))
    assert time.monotonic() - start < 3.0 + MARGIN


def test_a_worker_that_arrives_after_the_group_was_given_up_leaves_at_once(pool):
    """The trainer gives the group up before the workers reach its store (a
    worker slow to take the init, a deadline too short). Refused by a
    closed port, torch's client would retry for over ten minutes (vLLM's
    300 s timeout, twice, and a backoff), holding its server; the given-up
    store (as the M2N join leaves it) answers the handshake and closes at
    the join, so vLLM's own ``StatelessProcessGroup.create`` fails there,
    at once; once every rank is accounted for, the store stops listening."""
    host = MetadataGroup.host(HOST, 3)
    wire = [M2NWireParam.from_dict(p) for p in plan(1)[0]]
    with pytest.raises(GroupTimeout, match="1 of 3 ranks joined the store"):
        check_source_plan_agreement(host, wire, Deadline(1.0))
    port = host.store.port
    host.close(turn_away_s=WORKERS_LEAVE_S)
    workers = [pool.take() for _ in range(2)]  # warm: torch and vLLM imported
    start = time.monotonic()
    jobs = [Worker(child, {"host": HOST, "port": port, "rank": 1 + i, "world_size": 3,
                           "spec": worker_spec(1)}) for i, child in enumerate(workers)]
    try:
        for job in jobs:
            assert job.finished()["joined"]["error"].startswith("DistNetworkError"), job.reports
        assert time.monotonic() - start < 30.0  # a closed port: 631 s, measured
        wait_until(lambda: nothing_listens(HOST, port), 10, "the store still listens")
    finally:
        for job in jobs:
            pool.give_back(job)
        host.close()


def test_a_worker_with_another_plan_fails_every_rank_with_vllms_sentence(cluster):
    other = plan(1)[0]
    other[1] = {**other[1], "shape": [5]}
    ours, workers = cluster(1, [worker_spec(1), worker_spec(1, params=other)])
    with pytest.raises(AgreementError) as caught:
        trainer(ours[0], 1, workers[0].rows)
    expected = ("nccl_m2n source preflight rejected before NCCL init: rank 2: source digest disagrees "
                "with rank 0")
    assert str(caught.value) == expected
    for w in workers:
        assert w.finished()["source"]["error"] == f"RuntimeError: {expected}"


def test_errors_on_both_sides_fail_every_rank_together(cluster):
    spec = worker_spec(1, runtime_error="RuntimeError: CUDA error: out of memory")
    ours, workers = cluster(1, [worker_spec(1), spec])
    with pytest.raises(AgreementError) as caught:
        trainer(ours[0], 1, workers[0].rows, local="ImportError: no nccl.m2n here")
    expected = ("nccl_m2n local runtime preflight failed before NCCL init: rank 0: ImportError: no "
                "nccl.m2n here; rank 2: RuntimeError: CUDA error: out of memory")
    assert str(caught.value) == expected
    for w in workers:
        assert w.finished()["runtime"]["error"] == f"RuntimeError: {expected}"


def test_an_invalid_envelope_from_a_trainer_rank_fails_every_rank(cluster):
    ours, workers = cluster(2, [worker_spec(2)] * 2)
    wire = [M2NWireParam.from_dict(p) for p in plan(2)[0]]

    def rank(g):
        if g.rank == 1:
            return g.all_gather_obj({"phase": "source"}, Deadline(STARTUP))
        return check_source_plan_agreement(g, wire, Deadline(STARTUP))

    results = on_all(ours, rank)
    expected = ("nccl_m2n source preflight rejected before NCCL init: rank 1: invalid source preflight "
                "envelope")
    assert str(results[0]) == expected
    for w in workers:
        assert w.finished()["source"]["error"] == f"RuntimeError: {expected}"


def test_a_record_that_is_not_plain_data_is_refused_here_and_fails_vllm_too(cluster):
    ours, workers = cluster(2, [worker_spec(2)] * 2)
    ours[1].store.set("broadcast_from/1/0", pickle.dumps(datetime.date(2020, 1, 1)))
    wire = [M2NWireParam.from_dict(p) for p in plan(2)[0]]
    with pytest.raises(GroupError, match=r"^group rank 1 sent a record of the source-plan agreement that "
                                         r"is not plain data \(it names the global datetime.date\)"):
        check_source_plan_agreement(ours[0], wire, Deadline(STARTUP))
    for w in workers:
        assert w.finished()["source"]["error"] == (
            "RuntimeError: nccl_m2n source preflight rejected before NCCL init: rank 1: invalid source "
            "preflight envelope")


def test_vllms_placement_rows_decode_to_what_the_workers_resolved(cluster):
    """Rows as vLLM's own ``publish_destination_placements`` writes them
    (every kind of row); a row it would not write is refused."""
    placements = [[-1, 0], None, [1, -1], [-1, 2], None]
    ours, (worker,) = cluster(1, [worker_spec(1, placements=placements, steps=["placements"])], world_size=2)
    raw = bytes.fromhex(worker.rows.result(STARTUP))
    assert decode_destination_placements(raw, 5) == [None if p is None else tuple(p) for p in placements]
    assert raw[2:4] == bytes([0xFE, 0xFE])  # REPLICATE - 1, int8
    with pytest.raises(ValueError, match="never sends"):
        decode_destination_placements(raw[:2] + bytes([0xFE, 0x00]) + raw[4:], 5)


def plan_case(trainers=1, dst_dims=(1, 2), change=None, placements=None):
    params, rows = plan(trainers)
    if change:
        params[change[0]] = {**params[change[0]], **change[1]}
    return {"params": params, "dst_dims": list(dst_dims), "rank_offset": trainers,
            "placements": rows if placements is None else placements}


def ours(case):
    try:
        validate_transfer_plan([M2NWireParam.from_dict(p) for p in case["params"]],
                               M2NMesh(dims=tuple(case["dst_dims"]), start_rank=case["rank_offset"]),
                               [None if r is None else tuple(r) for r in case["placements"]])
        return "ok"
    except Exception as e:  # noqa: BLE001 - compared with vLLM's
        return f"{type(e).__name__}: {e}"


def test_the_complete_plan_check_says_what_vllms_says(pool):
    """``uniqueid.m2n.plan.validate_transfer_plan`` against vLLM's own, plan
    by plan: the same verdict in the same words."""
    cases = [
        plan_case(),
        plan_case(trainers=2),
        plan_case(change=(1, {"dtype_name": "complex64"})),
        plan_case(change=(1, {"shape": [2, 2, 2, 2]})),
        plan_case(change=(0, {"src_placements": [2, -1]})),
        plan_case(trainers=2, change=(1, {"shape": [3], "src_placements": [0, -1]})),
        plan_case(change=(1, {"shape": [5]}), placements=[[-1, 0], [-1, 0], [-1, 2]]),
        plan_case(dst_dims=(1, 128), change=(0, {"shape": [256, 4]})),  # fan-out 128 > 64
        plan_case(trainers=64, change=(0, {"shape": [256, 4]})),  # fan-in 32 > 16
        plan_case(placements=[[-1, 0]]),
        plan_case(placements=[[-1, -1], None, None]),
        plan_case(placements=[[0, -1], None, [-1, 1]]),
    ]
    worker = Worker(pool.take(), {"plans": cases})
    try:
        theirs = worker.finished()["validate"]["ok"]
    finally:
        pool.give_back(worker)
    assert [ours(case) for case in cases] == theirs
    assert theirs[0] == theirs[1] == "ok" and all(t != "ok" for t in theirs[2:-1]), theirs
