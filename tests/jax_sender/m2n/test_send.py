"""``M2NSender`` against vLLM 0.33.0's real ``nccl_m2n`` worker engine, on CPU.

Two tensor-parallel workers (``jax_sender.testing.vllm_m2n --cpu``) run
vLLM's ``M2NWeightTransferEngine`` behind vLLM's routes, into a toy model
whose parameters carry vLLM's own tensor-parallel loaders; the metadata
store, the group and its agreements, the destination plan and every HTTP
call are the real ones on both sides. Only NCCL and ``libnccl_m2n`` are
replaced, by an in-memory fabric (``support.m2n_fabric``) whose reshard
checks what the trainer describes against vLLM's own plan. The weights
are checked by vLLM's own ``/weight_checker`` digests on every worker.
"""

import json
import queue
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_sender import Mapping, SendConfig, SendError, UpdateIncomplete
from jax_sender.testing.vllm_m2n import EXPECTED_DESTINATIONS, TOY

from support.m2n_fabric import Fabric, m2n_sender_on
from support.vllm_children import vllm_host


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dtype, _ in TOY:
        values = rng.standard_normal(shape).astype(np.float32)
        out[name] = jnp.asarray(values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    fabric = Fabric()
    log = tmp_path_factory.mktemp("m2n") / "requests.jsonl"
    with vllm_host("jax_sender.testing.vllm_m2n", "--cpu", "--gpus", "0,1", "--plane",
                   f"support.children.m2n_fabric_worker:{fabric.address}", log=log) as url:
        yield url, fabric, log
    fabric.close()


def _routes(log) -> list[tuple[str, int]]:
    return [(c["path"], c["status"]) for c in map(json.loads, log.read_text().splitlines())]


def test_vllms_engine_resolves_direct_and_fallback_shards_and_takes_exact_pushes(server):
    url, fabric, log = server
    params = _params(0)
    with m2n_sender_on(url, fabric, params) as sender:
        # vLLM's own resolution against the toy model's loaders, published to
        # the trainer over the data plane
        conn = sender.session.connection
        names = [p.name for p in conn.init_info.params]
        assert dict(zip(names, conn.destinations)) == EXPECTED_DESTINATIONS
        sender.send(params)
        result = sender.verify(params)
        assert result.ok and set(result.matched) == {n for n, *_ in TOY}, result
        # each worker got its block only where vLLM resolved a shard
        took = {d["name"]: d for d in fabric.reshards[-len(TOY):]}
        assert took["layers.0.mlp.up_proj.weight"]["dst_local_shape"] == [8, 8]
        assert took["embed_tokens.weight"]["dst_local_shape"] == [32, 8]
        second = _params(1)
        sender.send(second, weight_version="v2")
        assert sender.verify(second).ok and not sender.verify(params).ok
    paths = [p for p, _ in _routes(log)]
    assert paths.count("/init_weight_transfer_engine") == 1
    assert paths[-1] == "/shutdown_weight_transfer_engine"


def test_a_trainer_side_failure_completes_the_round_and_the_next_push_repairs_it(server):
    url, fabric, _ = server
    params = _params(2)
    boom = {"on": True}

    def transform(path, x):  # fails when run, not when traced (at connect)
        if boom["on"] and path[-1] == "norm.weight" and not isinstance(x, jax.core.Tracer):
            raise RuntimeError("the transform failed")
        return x

    with m2n_sender_on(url, fabric, params, mapping=Mapping(transform=transform)) as sender:
        with pytest.raises(UpdateIncomplete, match="the transform failed"):
            sender.send(params)
        # the rest of the round went from scratch bytes; the group is intact
        assert not sender.broken and sender.resharders[-1].passes[-1] == "complete"
        boom["on"] = False
        sender.send(params)
        assert sender.verify(params).ok


def test_reconnect_forms_a_new_group_with_the_same_server(server):
    url, fabric, log = server
    params = _params(3)
    with m2n_sender_on(url, fabric, params, config=SendConfig(init_timeout_s=60)) as sender:
        sender.send(params)
        sender.reconnect()
        fresh = _params(4)
        sender.send(fresh)
        assert sender.verify(fresh).ok
    assert [p for p, s in _routes(log) if p == "/init_weight_transfer_engine" and s == 200][-2:]


def test_a_push_the_workers_fail_leaves_the_same_server_ready_for_a_new_sender(server):
    """vLLM resolves a tensor its model lacks as "fallback"; its loader then
    fails inside the push. The push fails named and bounded, the sender is
    broken; closing it releases the server, which takes a new group and an
    exact push."""
    url, fabric, log = server
    params = dict(_params(5))
    params["lm_head.weight"] = jnp.ones((4, 8), jnp.float32)  # not in the toy model
    sender = m2n_sender_on(url, fabric, params, config=SendConfig(send_timeout_s=20))
    t = time.monotonic()
    with pytest.raises(SendError, match="update_weights"):
        sender.send(params)
    assert time.monotonic() - t < 60 and sender.broken
    sender.close()
    good = _params(6)
    with m2n_sender_on(url, fabric, good) as fresh:
        fresh.send(good)
        assert fresh.verify(good).ok
    assert ("/update_weights", 500) in _routes(log)


def test_two_trainer_ranks_each_send_their_block(server):
    """Two trainer ranks (in one process here) join as ranks 0 and 1: rank 1
    through rank 0's store and the shared id; both reshard every tensor."""
    url, fabric, _ = server
    params = {n: np.asarray(a) for n, a in _params(7).items()}  # host data: both hold all
    blobs = queue.Queue()

    def share(data, timeout):
        if data is not None:
            blobs.put(data)
            return data
        return blobs.get(timeout=timeout)

    made = {}

    def rank(p):
        made[p] = m2n_sender_on(url, fabric, params, process=p, processes=2, share=share)

    threads = [threading.Thread(target=rank, args=(p,)) for p in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert set(made) == {0, 1}, "a trainer rank did not join"
    assert made[1].session.connection.destinations == made[0].session.connection.destinations
    results = {}

    def push(p):
        try:
            results[p] = made[p].send(params)
        except BaseException as e:  # reported below
            results[p] = e

    pushes = [threading.Thread(target=push, args=(p,)) for p in (0, 1)]
    for th in pushes:
        th.start()
    for th in pushes:
        th.join(120)
    # both ended the same way: process 0 told process 1 the server finished
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    assert made[0].verify(params).ok
    sources = {d["rank"] for d in fabric.reshards[-2 * len(TOY):]}
    assert sources == {0, 1}
    for p in (1, 0):
        made[p].close()
