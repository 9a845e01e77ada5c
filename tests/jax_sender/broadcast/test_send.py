"""The whole ``send`` on CPU: route order, the update in flight while the
broadcasts run, metadata reuse, asynchronous pushes, packing by XLA.
The transport is in memory (``support.servers.memory_link``) and the servers are an
independent rendition of vLLM's (``support.servers.memory_server``); everything
else is the library's own. Failures: ``test_failures.py``."""

import json
import os
import subprocess
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender import (
    LoadPlan,
    Mapping,
    MetadataError,
    PendingSend,
    SendConfig,
    TensorMeta,
    describe,
)

from support import ROOT, child
from support.concurrency import together, wait_for
from support.pushes import (
    SMALL,
    calls,
    every_dtype,
    expected,
    held,
    params,
    pushed,
    slow_step,
    torch_layout,
)
from support.servers.memory_link import memory_sender


@pytest.mark.parametrize("packed", [True, False])
def test_a_push_is_exact_and_follows_the_route_order(packed):
    sender, (server,), caster = memory_sender(SendConfig(packed=packed, buffer_size_bytes=4096))
    stats = sender.send(params(), weight_version="v1", pause="keep")
    assert server.routes() == ["/get_world_size", "/is_paused", "/weight_info",
                               "/init_weight_transfer_engine", "/pause",
                               "/start_weight_update", "/update_weights",
                               "/finish_weight_update", "/resume"]
    assert held(server) == expected(params()) and server.weight_version == "v1"
    assert stats.tensors == 5 and stats.bytes == sum(len(b) for b in expected(params()).values())
    # /update_weights was in flight during every broadcast: each one ends only
    # once the worker took it inside that call (as NCCL's does), and each was
    # issued before the call was answered.
    (update,) = calls(server, "/update_weights")
    assert caster.sent and all(t <= update.answered for _, _, t in caster.sent)
    assert stats.returned_s > 0 and not sender.broken


def test_connect_tells_every_server_its_rank_offset_and_the_world():
    """Through the real ``uniqueid.connect``: two servers of 2 workers each
    are asked their world size, and told one id, offsets 1 and 3, world 5,
    and the config's wire geometry; the join is made as rank 0 of 5."""
    config = SendConfig(buffer_size_bytes=4096, num_buffers=3)
    sender, (a, b), _ = memory_sender(config, servers=2, workers=2)
    b_info = b.init_infos[-1]
    a_info = a.init_infos[-1]
    assert a_info["nccl_unique_id_b64"] == b_info["nccl_unique_id_b64"]
    assert (a_info["rank_offset"], b_info["rank_offset"]) == (1, 3)
    assert a_info["world_size"] == b_info["world_size"] == 5
    assert (a_info["packed"], a_info["packed_buffer_size_bytes"],
            a_info["packed_num_buffers"]) == (True, 4096, 3)
    (join,) = sender.session.route.joiner.joins
    assert (join["world_size"], join["rank"]) == (5, 0)


def test_update_s_is_the_update_call_itself_inside_transfer_s():
    """``update_s`` times ``/update_weights`` inside its own thread, as vLLM's
    torch engine is timed: at least what the server took to answer, at most
    the protocol's ``transfer_s`` (which adds the handoffs between threads)."""
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.05)
    stats = sender.send(params())
    (update,) = calls(server, "/update_weights")
    assert update.answered - update.arrived <= stats.update_s <= stats.transfer_s


def test_the_largest_tensors_go_first_and_metadata_is_reused():
    sender, (server,), caster = memory_sender(SMALL)
    sender.send(params(0))
    assert caster.sent[0][1] == 64 * 48 * 2  # embed, larger than the buffer, alone and first
    first = calls(server, "/update_weights")[0]
    assert first.body["update_info"]["names"][0] == "embed"
    sender.send(params(1))
    assert held(server) == expected(params(1))
    assert sender.send(params(2)).reused_metadata
    assert held(server) == expected(params(2))
    last = calls(server, "/update_weights")[-1]
    assert last.body["update_info"] == {"names": [], "dtype_names": [], "shapes": []}


def test_after_reconnect_the_first_push_sends_its_metadata_again():
    """vLLM forgets metadata when its engine is re-initialised: a sender that
    reused it after ``reconnect()`` would leave the workers with nothing to
    cut the chunks by (the memory server refuses empty lists then)."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params(0))
    assert sender.send(params(1)).reused_metadata
    sender.reconnect()
    assert pushed(server) == []
    stats = sender.send(params(2))
    assert not stats.reused_metadata and held(server) == expected(params(2))


def test_one_broadcast_feeds_two_servers():
    sender, servers, _ = memory_sender(SMALL, servers=2)
    sender.send(params(3))
    for s in servers:
        assert held(s) == expected(params(3))
        assert pushed(s) == ["/start_weight_update", "/update_weights",
                             "/finish_weight_update"]


def test_a_tree_that_changes_between_pushes_is_described_again():
    """A push of the same structure, shapes, dtypes and placement as the one
    before reuses its description; any change is described again and its
    metadata goes on the wire."""
    sender, (server,), _ = memory_sender(SMALL)
    base = params()
    sender.send(base)
    assert sender.send(params(1)).reused_metadata
    for change in ({"head": jnp.ones((41, 40), jnp.float16)},        # a shape
                   {"head": base["head"].astype(jnp.float32)},      # a dtype
                   {"head": np.ones((3, 40), np.float16)}):         # host data
        tree = dict(base, **change)
        assert not sender.send(tree).reused_metadata
        assert held(server) == expected(tree)
        assert server.store["head"].shape == np.shape(change["head"])
    assert not sender.send(base).reused_metadata  # the first description, again
    assert held(server) == expected(base)


def test_update_is_posted_once_the_arrays_are_computed_and_start_does_not_wait():
    """The readiness wait runs beside ``/start_weight_update``; the workers
    get ``/update_weights`` (and sit in NCCL) only once the arrays exist."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params())
    step = slow_step()
    tree = step(params(1))  # dispatched: seconds of CPU work before it exists
    leaf = tree["head"]
    out: list = []
    pushing = threading.Thread(target=lambda: out.append(sender.send(tree)))
    pushing.start()
    wait_for(lambda: server.routes()[-1] == "/start_weight_update")
    assert server.routes()[-1] == "/start_weight_update" and not leaf.is_ready()
    while True:  # the last instant the arrays were seen not computed yet
        t = time.monotonic()
        if leaf.is_ready():
            break
        not_ready_at = t
        time.sleep(0.005)
    pushing.join(30)
    assert calls(server, "/update_weights")[-1].arrived > not_ready_at
    assert out and held(server) == expected(params(1))


def test_metadata_that_disagrees_is_refused_before_any_http_call():
    sender, (server,), _ = memory_sender(SMALL)
    declared = [TensorMeta("embed", "bfloat16", (64, 48))]
    with pytest.raises(MetadataError, match="metadata declares 1 tensors but 5"):
        sender.send(params(), metadata=declared)
    assert pushed(server) == [] and not sender.broken


def test_load_plan_subsets_pass_and_strangers_are_refused_before_any_http_call():
    plan = LoadPlan(describe(params(), Mapping())[0])
    sender, (server,), _ = memory_sender(SMALL, load_plan=plan)
    sender.send({"head": params()["head"]})
    with pytest.raises(MetadataError, match=r"'head' sent as \(float32, \[40, 40\]\) was "
                                            r"declared at init as \(float16, \[40, 40\]\)"):
        sender.send({"head": jnp.zeros((40, 40), jnp.float32)})
    with pytest.raises(MetadataError, match="'c' sent as .* was not declared"):
        sender.send({"c": jnp.zeros(1, jnp.float32)})
    assert pushed(server).count("/update_weights") == 1 and not sender.broken


def test_an_asynchronous_push_returns_at_once_and_survives_donation():
    """The next step donates and overwrites the parameters right after
    send(wait=False) returns: the push still delivers them as they were."""
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.05)
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 0 + 1, p), donate_argnums=0)
    sender.send(params(3), wait=False).result(timeout=20)  # compiles its copies
    before = len(caster.sent)
    p = params(4)
    want = expected(p)
    t = time.perf_counter()
    pending = sender.send(p, wait=False)
    returned = time.perf_counter() - t
    assert isinstance(pending, PendingSend) and not pending.done()
    p = step(p)  # the old buffers are donated, then overwritten
    jax.block_until_ready(p)
    stats = pending.result(timeout=20)
    assert held(server) == want
    assert returned < 0.05 * (len(caster.sent) - before) and stats.returned_s < stats.total_s


@pytest.mark.parametrize("wait", [True, False])
def test_xla_packs_transformed_chunks_bit_exact_in_every_dtype(wait):
    """With a transform (blocking) or a snapshot (asynchronous), each chunk is
    transformed and packed by one jitted call; the bytes are torch's layout."""
    sender, (server,), caster = memory_sender(SMALL, mapping=Mapping(transform=torch_layout))
    for seed in (0, 1):  # the second push reuses the compiled packers
        out = sender.send(every_dtype(seed), wait=wait)
        if not wait:
            out.result(timeout=20)
        assert held(server) == expected(every_dtype(seed), torch_layout)
    assert caster.passes == ["xla", "xla"]
    assert server.store["a.w"].shape == (40, 24)  # (out, in), as torch's Linear holds it


@pytest.mark.parametrize("bound, value", [("MAX_TENSORS", 2), ("MAX_PACKED", 3)])
def test_chunks_of_too_many_tensors_are_packed_by_copies(bound, value, monkeypatch):
    """Past ``MAX_TENSORS`` tensors a chunk, or ``MAX_PACKED`` in a push's
    chunks of several, XLA's calls would cost more to compile than the push."""
    monkeypatch.setattr(f"jax_sender._src.broadcast.packing.{bound}", value)
    sender, (server,), caster = memory_sender(SMALL, mapping=Mapping(transform=torch_layout))
    sender.send(every_dtype(2))
    sender.send(every_dtype(3), wait=False).result(timeout=20)
    assert caster.passes == ["copies", "copies"]
    assert held(server) == expected(every_dtype(3), torch_layout)


def test_asynchronous_pushes_write_their_chunks_into_the_same_buffers():
    """The first asynchronous push of a layout copies its arrays (its chunks'
    calls compile on the push's thread); each one after writes its chunks of
    several tensors in place into the buffers the push before it used
    (donated, not reallocated), and still carries its own bytes; another
    layout frees them, and gets buffers of its own from its second push."""
    sender, (server,), _ = memory_sender(SMALL)
    pointers = []
    for seed in (1, 2, 3, 4):
        sender.send(params(seed), wait=False).result(timeout=20)
        assert held(server) == expected(params(seed))
        pointers.append({k: a.unsafe_buffer_pointer() for k, a in sender._staging.items()})
    assert pointers[0] == {} and pointers[1] and pointers[1] == pointers[2] == pointers[3]
    other = {"layer": {"w": jnp.ones((30, 30), jnp.float32), "b": jnp.arange(9, dtype=jnp.int8)}}
    staged = []
    for _ in range(2):
        sender.send(other, wait=False).result(timeout=20)
        assert held(server)["layer.w"] == expected(other)["layer.w"]
        staged.append([a.nbytes for a in sender._staging.values()])
    assert staged == [[], [3600 + 9]]


@pytest.mark.parametrize("transform", [None, torch_layout])
@pytest.mark.parametrize("way", ["xla", "copies", "grouped copies"])
def test_the_first_asynchronous_push_of_a_layout_survives_donation(way, transform, monkeypatch):
    """The first asynchronous push of a layout has no compiled chunk calls to
    snapshot with: it copies the arrays (no compiling on the trainer's
    thread), then packs the copies on its own thread, by XLA (compiling its
    calls there, for the next push), or, past ``MAX_PACKED`` tensors, by
    copies (``grouped``: arrays of one shape copied by one jitted call). The
    step right after donates and overwrites the parameters: the push still
    delivers them as they were."""
    if way != "xla":
        monkeypatch.setattr("jax_sender._src.broadcast.packing.MAX_PACKED", 3)
    if way == "grouped copies":
        monkeypatch.setattr("jax_sender._src.core.snapshot.COPY_GROUP", 2)
    mapping = Mapping() if transform is None else Mapping(transform=transform)
    sender, (server,), caster = memory_sender(SMALL, mapping=mapping, delay_s=0.02)
    p = dict(params(4), same=[jnp.full((6, 4), i, jnp.float32) for i in range(5)])
    want = expected(p, transform)
    pending = sender.send(p, wait=False)
    assert isinstance(pending, PendingSend) and sender._staging == {}
    p = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0 + 1, t), donate_argnums=0)(p)
    jax.block_until_ready(p)
    pending.result(timeout=20)
    assert held(server) == want and caster.passes == ["xla" if way == "xla" else "copies"]


def test_the_first_asynchronous_push_compiles_before_any_worker_waits_for_it():
    """Its chunks' calls compile on the push's own thread (the trainer has
    gone on), before its ``/update_weights``: no worker waits in NCCL while
    XLA compiles. The second push snapshots with those calls."""
    compiled: list[float] = []

    def count(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(time.monotonic())

    sender, (server,), caster = memory_sender(SMALL)
    p, then = {"probe": params(5)}, {"probe": params(6)}  # names no other test compiled
    jax.block_until_ready((p, then))
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        sender.send(p, wait=False).result(timeout=20)
        first = len(compiled)
        sender.send(then, wait=False).result(timeout=20)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    (update, _) = calls(server, "/update_weights")
    assert compiled and all(t < update.arrived for t in compiled)
    assert len(compiled) == first and held(server) == expected(then)
    assert caster.passes == ["xla", "xla"] and sender._staging


@pytest.mark.parametrize("way", ["xla", "copies", "unpacked"])
def test_a_finished_asynchronous_push_holds_none_of_its_copies(way, monkeypatch):
    """The push forgets its snapshot's copies as its threads finish with
    them, before they report: a copy freed later, by whichever daemon thread
    drops the push last, may be freed while the interpreter exits, which
    aborts the process ("FATAL: exception not rethrown"). The push object
    itself is kept here: its copies are gone all the same."""
    from jax_sender._src.core import snapshot
    if way == "copies":
        monkeypatch.setattr("jax_sender._src.broadcast.packing.MAX_PACKED", 3)
    made: list = []
    real = snapshot.copies

    def recording(arrays, device):
        out = real(arrays, device)
        made.extend(weakref.ref(a) for a in out)
        return out

    monkeypatch.setattr("jax_sender._src.core.snapshot.copies", recording)
    sender, (server,), caster = memory_sender(SendConfig(packed=way != "unpacked",
                                                         buffer_size_bytes=4096))
    kept, run = [], sender.session.run

    def keeping(ticket, push, **kwargs):
        kept.append(push)
        return run(ticket, push, **kwargs)

    monkeypatch.setattr(sender.session, "run", keeping)
    sender.send(params(1), wait=False).result(timeout=20)
    assert held(server) == expected(params(1)) and kept and made
    assert wait_for(lambda: all(r() is None for r in made), 5), caster.passes


@pytest.mark.parametrize("tensors, nbytes, chunks", [(2000, 65536, 16), (20_000, 16, 1)])
def test_the_first_asynchronous_push_of_many_tensors_holds_the_trainer_briefly(
        tensors, nbytes, chunks):
    """Its snapshot compiles nothing per tensor on the trainer's thread (one
    jitted call per chunk took 95 s for the 2,000 tensors, against 0.75 s
    for a blocking push, and minutes and gigabytes for the 20,000): it
    returns within a small multiple of a blocking push of the same tree, and
    adds to the process's memory no more than docs/pushing.md says (one copy
    of the arrays, 8 KiB a tensor), beyond what the blocking push adds. In a
    child process, so that nothing compiled or allocated before counts."""
    argv, env = child("children.first_push", str(tensors), str(nbytes), str(chunks), env=dict(os.environ))
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    first, blocking = got["async"], got["blocking"]
    assert first["chunks"] == blocking["chunks"] == chunks
    assert first["returned_s"] <= 3 * blocking["returned_s"] + 2, got
    assert first["added_rss"] <= blocking["added_rss"] + got["bytes"] + 8192 * tensors + (64 << 20), got


def test_an_unpacked_asynchronous_push_sends_its_per_tensor_snapshot():
    sender, (server,), caster = memory_sender(SendConfig(packed=False), delay_s=0.01)
    p = params(8)
    want = expected(p)
    pending = sender.send(p, wait=False)
    p = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0, t), donate_argnums=0)(p)
    assert pending.result(timeout=20).tensors == 5 and held(server) == want
    assert caster.passes == ["tensors"] and len(caster.sent) == 5


def test_a_send_while_one_is_in_flight_waits_for_it():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.02)
    first = sender.send(params(5), wait=False)
    sender.send(params(6))
    assert first.done() and first.result().bytes
    assert held(server) == expected(params(6))
    assert pushed(server).count("/start_weight_update") == 2


def test_sends_from_two_threads_take_turns():
    """One sender, two threads pushing at once: each push runs whole, one
    after the other (never two update sessions at once), both land."""
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.01)

    def push(seed: int) -> None:
        for _ in range(3):
            sender.send(params(seed))

    errors = together(push, [(1,), (2,)], 60)
    assert not errors and not sender.broken
    assert pushed(server) == ["/start_weight_update", "/update_weights",
                              "/finish_weight_update"] * 6
    assert held(server) in (expected(params(1)), expected(params(2)))


def test_a_push_talks_http_on_the_http_loop_and_broadcasts_on_the_nccl_thread():
    """Every HTTP call of a push, to any number of servers, is made on the
    process's one HTTP loop (``vllm-http``: one thread, not one per server
    or call); the broadcasts run on the NCCL thread."""
    sender, servers, caster = memory_sender(SMALL, servers=3)
    seen = []
    for client in sender.session.clients:
        exchange = client._pool.exchange

        async def watched(head, *a, exchange=exchange, **k):
            target = head.split(b" ")[1].decode()  # the request line: method, target, version
            seen.append((target, threading.current_thread().name))
            return await exchange(head, *a, **k)

        client._pool.exchange = watched
    put = caster._put
    caster._put = lambda *a: (seen.append(("broadcast", threading.current_thread().name)),
                              put(*a))[1]
    sender.send(params())
    routes = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert sorted(s for s in seen if s[0] != "broadcast") == [
        (r, "vllm-http") for r in sorted(routes) for _ in servers]
    assert {s for s in seen if s[0] == "broadcast"} == {("broadcast", "jax-sender-nccl")}
    assert all(held(s) == expected(params()) for s in servers)


def test_staging_bound_too_small_falls_back_to_a_blocking_push():
    """The bound is the snapshot's: a first push's copies of the arrays
    (10,441 bytes here), a later one's chunks and copies (as many)."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, staging_bytes=10_440))
    stats = sender.send(params(7), wait=False)
    assert not isinstance(stats, PendingSend)  # it ran to the end before returning
    assert held(server) == expected(params(7))
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, staging_bytes=10_441))
    pending = [sender.send(params(seed), wait=False) for seed in (7, 8)]
    assert all(isinstance(p, PendingSend) for p in pending) and sender._staging
    pending[1].result(timeout=20)
    assert held(server) == expected(params(8))


def test_verify_compares_vllms_checksums_on_every_worker_of_every_server():
    sender, (a, b), _ = memory_sender(SMALL, servers=2, workers=2)
    p = params(9)
    sender.send(p)
    check = sender.verify(p)
    assert check.ok and sorted(check.matched) == sorted(expected(p)) and not check.unchecked
    b.store["layer.w"] = b.store["layer.w"] + 1  # silent corruption on one server's workers
    del a.store["head"]  # a name one server no longer reports (fused, say)
    del b.store["head"]
    check = sender.verify(p)
    assert not check.ok and check.mismatched == ("layer.w",) and check.unchecked == ("head",)


def stacked_name(path):
    """A scanned model's mapping: ``stack`` holds 3 layers on axis 1."""
    if path[-1] == "stack":
        return tuple(f"model.layers.{i}.w" for i in range(3))
    if path[-1] == "rope_cache":
        return ()  # deliberately not sent
    return {"bias": "model.bias"}[path[-1]]


def stacked_transform(path, x):
    if path[-1] == "stack":
        return tuple(x[:, i].T.astype(jnp.bfloat16) for i in range(x.shape[1]))
    return x


def stacked_tree(seed: int) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    return {"stack": jax.random.normal(k[0], (24, 3, 40), jnp.float32),
            "bias": jax.random.normal(k[1], (40,), jnp.float32),
            "rope_cache": jnp.ones((8, 8), jnp.float32)}


def stacked_expected(tree) -> dict:
    """Written from the layout, not from the mapping's code path."""
    stack = np.asarray(tree["stack"])
    out = {f"model.layers.{i}.w": np.asarray(jnp.asarray(stack[:, i].T).astype(jnp.bfloat16))
           for i in range(3)}
    out["model.bias"] = np.asarray(tree["bias"])
    return {k: v.tobytes() for k, v in out.items()}


@pytest.mark.parametrize("packed, wait, max_tensors", [
    (True, True, 256), (True, False, 256), (True, True, 1), (False, True, 256), (False, False, 256)])
def test_one_leaf_becomes_several_tensors_in_every_mode(packed, wait, max_tensors, monkeypatch):
    """A one-to-many mapping (MaxText's scanned layers): each layer of the
    stacked leaf lands under its own name, bit-exact, whether XLA packs the
    chunks, copies do, the push is asynchronous or unpacked; a leaf mapped to
    no name is not sent; a leaf the mapping does not know is refused first."""
    monkeypatch.setattr("jax_sender._src.broadcast.packing.MAX_TENSORS", max_tensors)
    config = SendConfig(packed=packed, buffer_size_bytes=4096)
    sender, (server,), _ = memory_sender(config, mapping=Mapping(stacked_name, stacked_transform))
    for seed in (0, 1):
        out = sender.send(stacked_tree(seed), wait=wait)
        if not wait:
            out.result(timeout=20)
        assert held(server) == stacked_expected(stacked_tree(seed))
    with pytest.raises(MetadataError, match="no checkpoint name for the leaf at 'extra'"):
        sender.send(dict(stacked_tree(2), extra=jnp.ones(3)))
    assert pushed(server).count("/start_weight_update") == 2


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("wait", [True, False])
def test_arrays_on_a_mesh_with_explicit_axes_land(packed, wait):
    """``jax.make_mesh`` makes Explicit axes: such an array cannot meet an
    unsharded chunk buffer in one jitted call, so the sender takes its one
    shard (the same buffer) instead; through a transform, packed by XLA or
    not, blocking or not, it lands bit-exact."""
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.make_mesh((1,), ("x",))
    tree = {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
                                NamedSharding(mesh, PartitionSpec("x"))),
            "b": jax.device_put(jnp.ones(8, jnp.float32), NamedSharding(mesh, PartitionSpec()))}
    sender, (server,), caster = memory_sender(SendConfig(packed=packed, buffer_size_bytes=4096),
                                              mapping=Mapping(transform=lambda p, x: x.T))
    out = sender.send(tree, wait=wait)
    if not wait:
        out.result(timeout=20)
    assert held(server) == {"w": np.arange(64, dtype=np.float32).reshape(8, 8).T.tobytes(),
                            "b": np.ones(8, np.float32).tobytes()}
    assert caster.passes == (["xla"] if packed else ["tensors"])


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_the_pause_mode_asked_for_is_the_one_the_servers_get(mode):
    """``keep`` freezes requests and ``abort`` drops them: a push that asked
    for one must not do the other to the servers' clients."""
    sender, servers, _ = memory_sender(SMALL, servers=2)
    sender.send(params(), pause=mode)
    for server in servers:
        (pause,) = calls(server, "/pause")
        assert pause.query == f"mode={mode}" and pushed(server)[0] == "/pause"
        assert not server.paused
