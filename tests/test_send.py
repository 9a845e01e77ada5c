"""The whole ``send`` on CPU: route order, the update in flight while the
broadcasts run, failures on each route, metadata reuse, asynchronous pushes.
The transport is in memory (``memory_link.py``); everything else is real."""

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from memory_link import memory_sender

from jax_sender import (
    LoadPlan,
    MetadataError,
    PendingSend,
    SendConfig,
    SendError,
    SparseSender,
    TensorMeta,
    describe,
)
from jax_sender.naming import Mapping

SMALL = SendConfig(buffer_size_bytes=4096, num_buffers=2)


def params(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"embed": jax.random.normal(k[0], (64, 48), jnp.bfloat16),       # 6 KiB: its own chunk
            "layer": {"w": jax.random.normal(k[1], (16, 16), jnp.float32),
                      "b": jnp.arange(7, dtype=jnp.int8),
                      "n": jax.random.normal(k[2], (33,), jnp.bfloat16)},
            "head": jax.random.normal(k[3], (40, 40), jnp.float16)}


def held(server) -> dict:
    return {k: v.tobytes() for k, v in server.store.items()}


def expected(tree) -> dict:
    metas, sources = describe(tree, Mapping())
    return {m.name: np.asarray(a).tobytes() for m, (_, a) in zip(metas, sources)}


@pytest.mark.parametrize("packed", [True, False])
def test_a_push_is_exact_and_follows_the_route_order(packed):
    sender, (server,), caster = memory_sender(SendConfig(packed=packed, buffer_size_bytes=4096))
    stats = sender.send(params(), weight_version="v1", pause="keep")
    assert server.routes() == ["/pause", "/start_weight_update", "/update_weights",
                               "/finish_weight_update", "/resume"]
    assert held(server) == expected(params())
    assert stats.tensors == 5 and stats.bytes == sum(len(b) for b in expected(params()).values())
    # /update_weights was in flight during every broadcast: each one ends only
    # once the worker took it inside that call (as NCCL's does), and each was
    # issued before the call was answered.
    (_, _, answered), = [e for e in server.log if e[0] == "/update_weights"]
    assert caster.sent and all(t <= answered for _, _, t in caster.sent)
    assert stats.returned_s > 0 and not sender.broken


def test_update_s_is_the_update_call_itself_inside_transfer_s():
    """``update_s`` times ``/update_weights`` inside its own thread, as vLLM's
    torch engine is timed: at least what the server took to answer, at most
    the push thread's ``transfer_s`` (which adds the handoffs between threads)."""
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.05)
    stats = sender.send(params())
    (_, arrived, answered), = [e for e in server.log if e[0] == "/update_weights"]
    assert answered - arrived <= stats.update_s <= stats.transfer_s


def test_the_largest_tensors_go_first_and_metadata_is_reused():
    sender, (server,), caster = memory_sender(SMALL)
    sender.send(params(0))
    assert caster.sent[0][1] == 64 * 48 * 2  # embed, larger than the buffer, alone and first
    first = [e for e in server.log if e[0] == "/update_weights"]
    sender.send(params(1))
    assert held(server) == expected(params(1))
    assert sender.send(params(2)).reused_metadata
    assert held(server) == expected(params(2))
    assert len([e for e in server.log if e[0] == "/update_weights"]) == len(first) + 2


def test_one_broadcast_feeds_two_servers():
    sender, servers, _ = memory_sender(SMALL, servers=2)
    sender.send(params(3))
    for s in servers:
        assert held(s) == expected(params(3))
        assert s.routes() == ["/start_weight_update", "/update_weights",
                              "/finish_weight_update"]


def test_start_failing_on_the_second_server_finishes_the_first():
    sender, (a, b), caster = memory_sender(SMALL, servers=2)
    b.fail["/start_weight_update"] = 500
    with pytest.raises(SendError, match="injected failure of /start_weight_update") as e:
        sender.send(params())
    assert a.routes() == ["/start_weight_update", "/finish_weight_update"] and not a.active
    assert sender.broken and sender.connection.comm.aborted
    assert not caster.sent  # nothing went on the wire
    assert isinstance(e.value.__cause__, Exception)
    with pytest.raises(SendError, match="broken"):
        sender.send(params())


@pytest.mark.parametrize("route", ["/finish_weight_update", "/pause", "/update_weights"])
def test_a_failing_route_breaks_the_sender_with_a_send_error(route):
    sender, (server,), _ = memory_sender(SMALL)
    server.fail[route] = 500
    with pytest.raises(SendError, match=f"injected failure of {route}"):
        sender.send(params(), pause="abort")
    assert sender.broken and sender.connection.comm.aborted
    if route != "/pause":
        assert server.routes()[-1] == "/resume"  # a pause is always undone


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


def slow_step():
    """A jitted step that returns the tree it is given, but only after seconds
    of CPU work: its outputs exist well after it is dispatched."""
    a = jnp.full((1500, 1500), 0.01, jnp.float32)
    heavy = jax.jit(lambda a: jax.lax.fori_loop(0, 120, lambda i, x: jnp.tanh(x @ a), a))
    step = jax.jit(lambda t: jax.tree_util.tree_map(
        lambda x: x + (heavy(a)[0, 0] * 0).astype(x.dtype), t))
    jax.block_until_ready(step(params(1)))  # compiled
    return step


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
    deadline = time.monotonic() + 10
    while server.routes()[-1] != "/start_weight_update" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.routes()[-1] == "/start_weight_update" and not leaf.is_ready()
    while True:  # the last instant the arrays were seen not computed yet
        t = time.monotonic()
        if leaf.is_ready():
            break
        not_ready_at = t
        time.sleep(0.005)
    pushing.join(30)
    (_, arrived, _), = [e for e in server.log[-2:] if e[0] == "/update_weights"]
    assert arrived > not_ready_at
    assert out and held(server) == expected(params(1))

    # close() while a push waits for its arrays cancels it at once
    tree = step(params(2))
    pending = sender.send(tree, wait=False)
    while server.routes()[-1] != "/start_weight_update" and time.monotonic() < deadline + 30:
        time.sleep(0.005)
    t = time.monotonic()
    sender.close()
    assert time.monotonic() - t < 1.0 and not tree["head"].is_ready()
    with pytest.raises(SendError, match="cancelled"):
        pending.result(5)
    jax.block_until_ready(tree)  # XLA's work must not outlive the interpreter


def test_arrays_not_computed_within_the_deadline_fail_the_push_clearly():
    """The readiness wait has the push's deadline like every other wait: past
    it the push fails, before any ``/update_weights``, naming the fix."""
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096,
                                                    send_timeout_s=0.3))
    sender.send(params())
    tree = slow_step()(params(1))
    t = time.monotonic()
    with pytest.raises(SendError, match=r"not computed within 0.3s .*SendConfig.send_timeout_s"):
        sender.send(tree)
    assert time.monotonic() - t < 2.0 and not tree["head"].is_ready()
    assert sender.broken and sender.connection.comm.aborted
    assert server.routes()[3:] == ["/start_weight_update"]
    jax.block_until_ready(tree)  # XLA's work must not outlive the interpreter


def test_metadata_that_disagrees_is_refused_before_any_http_call():
    sender, (server,), _ = memory_sender(SMALL)
    declared = [TensorMeta("embed", "bfloat16", (64, 48))]
    with pytest.raises(MetadataError, match="metadata declares 1 tensors but 5"):
        sender.send(params(), metadata=declared)
    assert server.routes() == [] and not sender.broken


def test_load_plan_subsets_pass_and_strangers_are_refused_before_any_http_call():
    plan = LoadPlan(describe(params(), Mapping())[0])
    sender, (server,), _ = memory_sender(SMALL, load_plan=plan)
    sender.send({"head": params()["head"]})
    with pytest.raises(MetadataError, match=r"'head' sent as \(float32, \[40, 40\]\) was "
                                            r"declared at init as \(float16, \[40, 40\]\)"):
        sender.send({"head": jnp.zeros((40, 40), jnp.float32)})
    with pytest.raises(MetadataError, match="'c' sent as .* was not declared"):
        sender.send({"c": jnp.zeros(1, jnp.float32)})
    assert server.routes().count("/update_weights") == 1 and not sender.broken


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


def torch_layout(path, x):
    """What a Flax trainer's mapping does: kernels transposed, float32 cast to bfloat16."""
    if path[-1] in ("w", "head"):
        x = x.T
    return x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x


def every_dtype(seed: int = 0) -> dict:
    """One tensor of each wire dtype JAX holds, spread over several chunks of ``SMALL``."""
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    return {"a": {"w": jax.random.normal(k[0], (24, 40), jnp.float32),
                  "b": jax.random.randint(k[1], (37,), -128, 127, jnp.int8),
                  "u": jax.random.randint(k[2], (11,), 0, 255, jnp.int32).astype(jnp.uint8)},
            "f8": jax.random.normal(k[3], (300,), jnp.float32).astype(jnp.float8_e4m3fn),
            "i": jax.random.randint(k[4], (5, 3), -2**31, 2**31 - 1, jnp.int32),
            "head": jax.random.normal(k[5], (40, 40), jnp.float16)}


def transformed(tree, transform) -> dict:
    metas, sources = describe(tree, Mapping(transform=transform))
    return {m.name: np.asarray(transform(p, a)).tobytes() for m, (p, a) in zip(metas, sources)}


@pytest.mark.parametrize("wait", [True, False])
def test_xla_packs_transformed_chunks_bit_exact_in_every_dtype(wait):
    """With a transform (blocking) or a snapshot (asynchronous), each chunk is
    transformed and packed by one jitted call; the bytes are torch's layout."""
    sender, (server,), caster = memory_sender(SMALL, mapping=Mapping(transform=torch_layout))
    for seed in (0, 1):  # the second push reuses the compiled packers
        out = sender.send(every_dtype(seed), wait=wait)
        if not wait:
            out.result(timeout=20)
        assert held(server) == transformed(every_dtype(seed), torch_layout)
    assert caster.passes == ["xla", "xla"]
    assert server.store["a.w"].shape == (40, 24)  # (out, in), as torch's Linear holds it


def test_chunks_of_too_many_tensors_are_packed_by_copies(monkeypatch):
    monkeypatch.setattr("jax_sender.packing.MAX_TENSORS", 2)
    sender, (server,), caster = memory_sender(SMALL, mapping=Mapping(transform=torch_layout))
    sender.send(every_dtype(2))
    sender.send(every_dtype(3), wait=False).result(timeout=20)
    assert caster.passes == ["copies", "copies"]
    assert held(server) == transformed(every_dtype(3), torch_layout)


def test_asynchronous_pushes_write_their_chunks_into_the_same_buffers():
    """Each asynchronous push writes its chunks of several tensors in place
    into the buffers the push before it used (donated, not reallocated), and
    still carries its own bytes; another layout gets buffers of its own."""
    sender, (server,), _ = memory_sender(SMALL)
    pointers = []
    for seed in (1, 2, 3):
        sender.send(params(seed), wait=False).result(timeout=20)
        assert held(server) == expected(params(seed))
        pointers.append({k: a.unsafe_buffer_pointer() for k, a in sender._staging.items()})
    assert pointers[0] and pointers[0] == pointers[1] == pointers[2]
    other = {"layer": {"w": jnp.ones((30, 30), jnp.float32), "b": jnp.arange(9, dtype=jnp.int8)}}
    sender.send(other, wait=False).result(timeout=20)
    assert held(server)["layer.w"] == expected(other)["layer.w"]
    assert [a.nbytes for a in sender._staging.values()] == [3600 + 9]


def test_a_failed_asynchronous_push_never_lends_its_buffers_to_the_next():
    """A failed push's broadcasts may still read its buffers (a stuck NCCL
    call is abandoned, not freed): the next push writes into new ones."""
    sender, (server,), _ = memory_sender(SMALL)
    sender.send(params(1), wait=False).result(timeout=20)
    server.fail["/update_weights"] = 500
    with pytest.raises(SendError, match="injected failure"):
        sender.send(params(2), wait=False).result(timeout=20)
    assert sender._staging == {}
    del server.fail["/update_weights"]
    sender.reconnect()
    sender.send(params(3), wait=False).result(timeout=20)
    assert held(server) == expected(params(3)) and len(sender._staging) == 2


def test_an_unpacked_asynchronous_push_sends_its_per_tensor_snapshot():
    sender, (server,), caster = memory_sender(SendConfig(packed=False), delay_s=0.01)
    p = params(8)
    want = expected(p)
    pending = sender.send(p, wait=False)
    p = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0, t), donate_argnums=0)(p)
    assert pending.result(timeout=20).tensors == 5 and held(server) == want
    assert caster.passes == [] and len(caster.sent) == 5


def test_a_send_while_one_is_in_flight_waits_for_it():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.02)
    first = sender.send(params(5), wait=False)
    sender.send(params(6))
    assert first.done() and first.result().bytes
    assert held(server) == expected(params(6))
    assert server.routes().count("/start_weight_update") == 2


def test_an_nccl_call_that_never_returns_is_abandoned_not_freed():
    """A broadcast stuck inside an NCCL call (a peer gone while a connection
    is set up) holds the push's NCCL thread: the caller still gets a
    ``SendError`` past the deadline, the communicator is never aborted or
    freed under that call, and reconnect() forms a new group; if the call
    ever returns, the communicator is aborted then. (The worker, left
    inside its update, is the server's to recover: docs/failures.md.)"""
    sender, (server,), caster = memory_sender(SendConfig(buffer_size_bytes=4096,
                                                         send_timeout_s=0.2))
    sender.send(params(1))
    comm, release = sender.connection.comm, threading.Event()

    def stuck(*args, **kwargs):  # as a blocking NCCL call that never returns
        comm.in_call_since = time.monotonic()
        release.wait(30)

    caster.packed = stuck
    t = time.monotonic()
    with pytest.raises(SendError, match=r"an NCCL call did not return within 0.2\d*s .*"
                                        r"abandoned; call reconnect\(\)"):
        sender.send(params(2))
    assert time.monotonic() - t < 1.5
    assert sender.broken and not comm.aborted and [lane.busy for lane in sender._orphans] == [True]
    sender.reconnect()  # the old communicator is left to its stuck call
    assert not comm.aborted and not comm.destroyed
    assert not sender.broken and sender.connection.comm is not comm
    release.set()
    deadline = time.monotonic() + 5
    while not comm.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert comm.aborted and not sender.connection.comm.aborted


def test_a_blocking_push_talks_http_on_the_callers_thread():
    """A blocking send makes its HTTP calls itself, as vLLM's torch engine
    does (each handoff between threads costs a wake-up), except the
    ``/update_weights`` in flight while the broadcasts run; the broadcasts run
    on the NCCL thread."""
    sender, (server,), caster = memory_sender(SMALL)
    seen = []
    for name in ("start_weight_update", "update_weights", "finish_weight_update"):
        call = getattr(sender.clients[0], name)
        setattr(sender.clients[0], name, lambda *a, call=call, name=name: (
            seen.append((name, threading.current_thread().name)), call(*a))[1])
    put = caster._put
    caster._put = lambda *a: (seen.append(("broadcast", threading.current_thread().name)),
                              put(*a))[1]
    sender.send(params())
    me = threading.current_thread().name
    assert [s for s in seen if s[0] != "broadcast"] == [
        ("start_weight_update", me), ("update_weights", "vllm-update"),
        ("finish_weight_update", me)]
    assert {s for s in seen if s[0] == "broadcast"} == {("broadcast", "jax-sender-nccl")}
    assert held(server) == expected(params())


def test_close_cancels_a_push_in_flight():
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.3)
    pending = sender.send(params(), wait=False)
    time.sleep(0.1)
    sender.close()
    with pytest.raises(SendError, match=r"cancelled \(close\(\)\)"):
        pending.result(timeout=5)
    assert sender.connection.comm.aborted and caster.closed


def test_ctrl_c_during_a_blocking_send_aborts_and_close_still_works():
    """The blocking push runs on the caller's thread, so the KeyboardInterrupt
    lands in it: it propagates once the NCCL thread stopped and the
    communicator is aborted, and the sender closes cleanly afterwards."""
    sender, (server,), caster = memory_sender(SMALL, delay_s=0.3)
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sender.send(params(1))
    assert time.monotonic() - t < 2.0
    assert sender.connection.comm.aborted and "KeyboardInterrupt" in sender.broken
    sender.close()
    assert caster.closed


def test_ctrl_c_while_waiting_on_an_asynchronous_push_cancels_it():
    """As during a blocking send: the KeyboardInterrupt propagates, the push
    stops and aborts its communicator, and the sender refuses to push again
    before reconnect() (a worker left mid-update may need its server
    restarted, see docs/failures.md)."""
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.3)
    pending = sender.send(params(1), wait=False)
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        pending.result(timeout=20)
    assert time.monotonic() - t < 2.0
    assert pending.done() and sender.connection.comm.aborted
    assert "KeyboardInterrupt" in sender.broken
    with pytest.raises(SendError, match="call reconnect"):
        sender.send(params(2))
    assert server.routes().count("/start_weight_update") == 1


def test_reconnect_with_an_asynchronous_push_in_flight_lets_it_finish_first():
    sender, (server,), _ = memory_sender(SMALL, delay_s=0.05)
    pending = sender.send(params(1), wait=False)
    sender.reconnect()
    assert pending.done() and pending.result().tensors == 5
    sender.send(params(2), wait=False).result(timeout=20)
    assert held(server) == expected(params(2))


def test_staging_bound_too_small_falls_back_to_a_blocking_push():
    sender, (server,), _ = memory_sender(SendConfig(buffer_size_bytes=4096, staging_bytes=100))
    stats = sender.send(params(7), wait=False)
    assert not isinstance(stats, PendingSend)  # it ran to the end before returning
    assert held(server) == expected(params(7))


def test_a_group_sender_refuses_an_asynchronous_push_clearly():
    from jax_sender import TransferError
    from jax_sender.group import BroadcastPlan, TrainerGroup
    from jax_sender.sender import ProcessGroup
    sender, (server,), _ = memory_sender(SMALL)
    sender.route = ProcessGroup(TrainerGroup(BroadcastPlan.single(5), 0, 0, None, [], SMALL))
    with pytest.raises(TransferError, match="single-process sender"):
        sender.send(params(), wait=False)
    assert server.routes() == [] and not sender.broken


def test_a_hundred_failed_sends_and_reconnects_leave_threads_and_files_flat():
    """Each push broadcasts everything, then the worker's load fails (HTTP 500
    on /update_weights, the session dropped, as vLLM does): the communicator
    is aborted and reconnect() forms a new group. Threads and file
    descriptors must not pile up."""

    sender, (server,), caster = memory_sender(SMALL)
    server.fail["/update_weights"] = 500
    p = params(8)
    counts = []
    for _ in range(100):
        with pytest.raises(SendError, match="injected failure of /update_weights"):
            sender.send(p)
        assert sender.connection.comm.aborted and sender.broken
        sender.reconnect()
        assert not sender.broken and not sender._orphans
        counts.append((threading.active_count(), len(os.listdir("/proc/self/fd"))))
    # Flat after the first ten (earlier tests' servers may still be winding down).
    threads, files = counts[10]
    assert all(t <= threads and f <= files for t, f in counts[10:]), (counts[:3], counts[-3:])
    assert len(sender.route.formed) == 101 and all(c.comm.aborted for c in sender.route.formed[:-1])
    server.fail.clear()
    sender.send(p)
    assert held(server) == expected(p)


def test_verify_compares_vllms_checksums_with_the_trainers():
    sender, (server,), _ = memory_sender(SMALL)
    p = params(9)
    sender.send(p)
    check = sender.verify(p)
    assert check.ok and sorted(check.matched) == sorted(expected(p)) and not check.unchecked
    server.store["layer.w"] = server.store["layer.w"] + 1  # silent corruption on the worker
    del server.store["head"]  # a name the server reports no longer (fused, say)
    check = sender.verify(p)
    assert not check.ok and check.mismatched == ("layer.w",) and check.unchecked == ("head",)


def test_every_packages_errors_pickle_with_their_cause_text():
    """They cross process boundaries in multi-process trainers and harnesses."""
    import pickle

    from jax_sender import GatherTimeout, TransferError
    from uniqueid import RendezvousError, RendezvousTimeout, UniqueIdError, VLLMHTTPError
    http = VLLMHTTPError("/update_weights", 500, "worker 0 died", {"error": {}})
    back = pickle.loads(pickle.dumps(http))
    assert (back.route, back.status, back.message, str(back)) == (
        http.route, http.status, http.message, str(http))
    for err, root in ((http, RendezvousError), (RendezvousTimeout("late"), RendezvousError),
                      (UniqueIdError("bad id"), RendezvousError),
                      (SendError("failed"), TransferError), (MetadataError("no"), TransferError),
                      (GatherTimeout("gather"), TransferError)):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err) and isinstance(again, root)


def test_a_sparse_push_sends_only_what_changed_and_lands_bit_exact():
    """``SparseSender`` over the same core: patches against what the workers
    hold, exact; what vLLM's sparse loader would refuse is refused before any
    HTTP call; a failed push breaks it like any sender, and reconnect() mends it."""
    sender, (server,), caster = memory_sender(SendConfig(packed=False), kind=SparseSender)
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    v0 = {"w": jax.random.normal(k[0], (64, 64), jnp.bfloat16),
          "b": jax.random.normal(k[1], (100,), jnp.float32), "s": jnp.float16(2.5)}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, v0)
    first = sender.send(v0, zeros)  # the server starts from zeros
    assert held(server) == expected(v0) and first.tensors == 3
    v1 = dict(v0, w=v0["w"].at[3, 5].set(7.0).at[60, 1].set(-0.0))  # two elements, one a signed zero
    second = sender.send(v1, v0)
    assert held(server) == expected(v1)
    # per tensor two broadcasts (indices, values), zero-count ones too
    assert second.chunks == 6 and second.bytes == 2 * (4 + 2)
    assert server.routes()[-3:] == ["/start_weight_update", "/update_weights",
                                    "/finish_weight_update"]
    before = len(server.log)
    with pytest.raises(MetadataError, match="sparse worker loads only"):
        sender.send({"i": jnp.arange(3, dtype=jnp.int32)}, {"i": jnp.zeros(3, jnp.int32)})
    assert len(server.log) == before and not sender.broken
    server.fail["/update_weights"] = 500
    with pytest.raises(SendError, match="injected failure of /update_weights"):
        sender.send(v0, v1)
    assert sender.broken
    with pytest.raises(SendError, match="call reconnect"):
        sender.send(v0, v1)
    del server.fail["/update_weights"]
    sender.reconnect()
    sender.send(v0, v1)
    assert held(server) == expected(v0) and not sender.broken
    sender.close()
