"""``IPCSender`` against vLLM 0.33.0's real ``ipc`` worker engine, on CPU.

Two tensor-parallel workers (``jax_sender.testing.vllm_ipc --cpu``) run
vLLM's ``IPCWeightTransferEngine`` behind vLLM's routes; the trainer's
handles, their pickle, the ref-counter file, the probe, the payloads and
every HTTP call are the real ones on both sides. Only the CUDA calls are
replaced, on both sides, by host shared memory (``support.ipc_fabric``):
the workers read the very bytes the trainer staged, and give each export
back in the trainer's ref-counter file as torch's receiver does. The
weights are checked by vLLM's own ``/weight_checker`` digests.
"""

import contextlib
import hashlib
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_sender import SendConfig, SendError, TransferError
from jax_sender._src.core.tensors.naming import Mapping
from jax_sender._src.core.tensors.plan import TensorMeta
from jax_sender._src.ipc.sender import open_ipc_sender
from jax_sender._src.ipc.staging import layout
from nccl_cffi.ipc import exported_bytes
from nccl_cffi.waiting import Deadline
from uniqueid import RendezvousError, VLLMClient
from uniqueid.ipc.join import check_ipc_server

from support import ROOT, on_tests_path
from support.ipc_fabric import FabricMemory, uuid_of
from support.vllm_children import ipc_fabric_host

CPU = jax.devices("cpu")[0]


@contextlib.contextmanager
def ipc_server(tmp_path, *args: str, gpus: str = "0,0", pickles: bool = True):
    """vLLM's ipc engine in one worker per entry of ``gpus``, on CPU; (url, log)."""
    log = tmp_path / "requests.jsonl"
    with ipc_fabric_host(log, gpus, *args, pickles=pickles) as url:
        yield url, log


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ipc_server(tmp_path_factory.mktemp("ipc")) as served:
        yield served


def sender_on(url: str, memory: FabricMemory, **config):
    return open_ipc_sender([VLLMClient(url)], {0: CPU}, mapping=Mapping(),
                           config=SendConfig(**config), memory=memory, strict_devices=False)


def tree(seed: int) -> dict:
    """Every wire dtype, a 0-d and an empty tensor, odd shapes, one larger
    than a 4 KiB buffer."""
    rng = np.random.default_rng(seed)
    f = lambda shape, dtype: jnp.asarray(rng.standard_normal(shape).astype(np.float32)  # noqa: E731
                                         .astype(dtype))
    return {
        "big": f((40, 33), np.float32),
        "a.bf16": f((7, 13), ml_dtypes.bfloat16), "a.fp16": f((33,), np.float16),
        "a.fp8": f((129,), ml_dtypes.float8_e4m3fn), "a.scalar": jnp.float32(seed + 0.5),
        "a.empty": jnp.zeros((0, 5), jnp.bfloat16),
        "b.i32": jnp.asarray(rng.integers(-2**31, 2**31 - 1, 11, dtype=np.int64).astype(np.int32)),
        "b.i8": jnp.asarray(rng.integers(-128, 127, 61).astype(np.int8)),
        "b.u8": jnp.asarray(rng.integers(0, 255, 17).astype(np.uint8)),
        "c.f32": f((5, 3, 2), np.float32),
    }


def digests(params: dict, ranks: int) -> dict[str, str]:
    return {f"dp0:pp0:pcp0:tp{r}:{n}": hashlib.sha256(np.asarray(a).tobytes()).hexdigest()
            for n, a in params.items() for r in range(ranks)}


def holds(sender, params: dict, ranks: int = 2) -> bool:
    """Every worker holds ``params`` exactly, by vLLM's own digests (a tensor
    another test pushed to the shared server may be there too)."""
    held = sender.session.clients[0].weight_checker("checksum")["checksums"]
    want = digests(params, ranks)
    return {k: held.get(k) for k in want} == want


def released(sender) -> None:
    sender.session.connection.comm.counters.wait(range(10_000), 10.0, "the test's exports")


@pytest.mark.parametrize("packed", [True, False])
def test_pushes_are_bit_exact_on_both_workers_and_release_every_export(server, packed):
    url, log = server
    memory = FabricMemory()
    with sender_on(url, memory, packed=packed, buffer_size_bytes=4096) as sender:
        conn = sender.session.connection
        assert conn.ranks == [uuid_of(0), uuid_of(0)] and conn.uuids == {0: uuid_of(0)}
        for seed in (1, 2):
            stats = sender.send(tree(seed), weight_version=f"v{seed}")
            assert holds(sender, tree(seed))
            released(sender)
        assert stats.chunks == (3 if packed else 1), stats
        assert sender.verify(tree(2)).ok and not sender.verify(tree(1)).ok
        changed = dict(tree(3), extra=jnp.arange(6, dtype=jnp.float32))
        del changed["big"]
        sender.send(changed)
        assert holds(sender, changed)
        sender.reconnect()
        sender.send(tree(4))
        assert sender.verify(tree(4)).ok
        name = sender.session.connection.comm.counters.name
    assert memory.alive() == [] and not os.path.exists(f"/dev/shm{name}")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[-1]["path"] == "/shutdown_weight_transfer_engine"


def test_the_unpacked_layout_gives_a_large_tensor_its_own_allocation_and_packs_small_ones():
    metas = [TensorMeta(name="w", dtype="float32", shape=(512, 512)),  # 1 MiB: its own
             TensorMeta(name="n1", dtype="float32", shape=(3,)),
             TensorMeta(name="e", dtype="bfloat16", shape=(0, 4)),
             TensorMeta(name="n2", dtype="bfloat16", shape=(700, 700)),  # 980,000 B: shared
             TensorMeta(name="v", dtype="bfloat16", shape=(2048, 300)),  # 1.2 MB: its own
             TensorMeta(name="n3", dtype="uint8", shape=(1_200_000 - 1,)),  # small, no room left
             TensorMeta(name="n4", dtype="uint8", shape=(5,))]
    placed = layout(metas)
    assert placed.pieces == (0, 1, 1, 1, 2, 3, 1)
    assert placed.chunk.offsets == (0, 0, 256, 256, 0, 0, 256 + 980_224)
    assert placed.sizes == (1 << 20, 256 + 980_224 + 256, 1_228_800, 1_200_128)
    assert placed.chunk.nbytes == sum(placed.sizes)
    for m, k, at in zip(metas, placed.pieces, placed.chunk.offsets):
        assert at % 256 == 0 and at + m.nbytes <= placed.sizes[k]


def test_unpacked_large_tensors_travel_in_allocations_of_their_own_reused_while_the_tree_holds(
        server):
    url, _ = server
    memory = FabricMemory()
    big = lambda seed, n: jnp.asarray(  # noqa: E731
        np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    with sender_on(url, memory, packed=False) as sender:
        for seed in (1, 2):  # three allocations (two tensors of 1 MiB or more, the small ones)
            params = dict(tree(seed), w1=big(seed, 1 << 18), w2=big(seed + 9, 300_000))
            sender.send(params)
            assert holds(sender, params)
            assert len(memory.alive()) == 3
        released(sender)
        params = dict(tree(3), w1=big(3, (1 << 18) + 1))  # one large tensor: two allocations
        sender.send(params)
        assert holds(sender, params) and len(memory.alive()) == 2
        assert len(memory.exported) == 1 + 3 + 2  # the connect's probe, then the pushes'
    assert memory.alive() == []


def test_an_asynchronous_push_survives_a_step_that_donates_the_arrays(server):
    url, _ = server
    with sender_on(url, FabricMemory(), packed=True, buffer_size_bytes=4096) as sender:
        params = tree(5)
        pending = sender.send(params, wait=False)
        step = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0, t), donate_argnums=0)
        jax.block_until_ready(step(params))
        pending.result(timeout=60)
        assert holds(sender, tree(5))


def test_a_worker_on_a_gpu_the_trainer_lacks_is_named_before_any_weights(tmp_path):
    with ipc_server(tmp_path, gpus="0,3") as (url, log):
        memory = FabricMemory()
        with pytest.raises(RendezvousError) as caught:
            sender_on(url, memory)
        message = str(caught.value)
        assert uuid_of(3) in message and uuid_of(0) in message and "\n" not in message
        assert memory.alive() == []
        paths = [json.loads(line)["path"] for line in log.read_text().splitlines()]
        assert "/update_weights" in paths and paths[-1] == "/shutdown_weight_transfer_engine"


@pytest.mark.parametrize("args, pickles, words", [
    (("--backend", "nccl"), True, "needs vLLM's ipc backend"),
    ((), False, "VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
])
def test_refused_before_the_server_is_touched(tmp_path, args, pickles, words):
    with ipc_server(tmp_path, *args, pickles=pickles) as (url, log):
        with pytest.raises(RendezvousError, match=words) as caught:
            sender_on(url, FabricMemory())
        assert "\n" not in str(caught.value)
        paths = {json.loads(line)["path"] for line in log.read_text().splitlines()}
        assert paths <= {"/server_info", "/get_world_size"}, paths


def test_a_passed_deadline_ends_the_server_check_before_any_request(server):
    url, log = server
    before = len(log.read_text().splitlines())
    with VLLMClient(url) as client, pytest.raises(RendezvousError, match="deadline passed"):
        check_ipc_server(client, Deadline(0))
    assert len(log.read_text().splitlines()) == before


def test_a_workers_load_failure_then_reconnect_and_an_exact_push(tmp_path):
    with ipc_server(tmp_path, "--fail-load-after", "3") as (url, _):
        with sender_on(url, FabricMemory(), packed=False) as sender:
            with pytest.raises(SendError, match="loading"):
                sender.send(tree(1))
            assert sender.broken
            sender.reconnect()
            sender.send(tree(2))
            assert holds(sender, tree(2))


def test_staging_larger_than_the_free_memory_is_refused_before_any_request(server):
    url, log = server
    with sender_on(url, FabricMemory(free=3 << 20), packed=False) as sender:
        before = len(log.read_text().splitlines())
        with pytest.raises(TransferError, match="needs 4.0 MiB on GPU 0, which has 3.0 MiB free"):
            sender.send({"w": jnp.zeros((1 << 19,), jnp.float32), "n": jnp.zeros(3)})
        assert len(log.read_text().splitlines()) == before
        sender.send(tree(6))
        assert sender.verify(tree(6)).ok


class Budget(FabricMemory):
    """A GPU of ``budget`` bytes: its free memory is what exports (rounded
    as CUDA's are) and ``taken`` (another tenant) leave; an export past it
    fails as ``cuMemAlloc`` does."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget, self.taken = budget, 0

    def free_bytes(self, device: int) -> int:
        held = sum(exported_bytes(b.nbytes) for b in self.exported if b._map is not None)
        return self.budget - self.taken - held

    def export(self, device: int, nbytes: int):
        if exported_bytes(nbytes) > self.free_bytes(device):
            raise MemoryError(f"out of memory exporting {nbytes} bytes")
        return super().export(device, nbytes)


class FailingAt(FabricMemory):
    """The exports numbered in ``failing`` (from 1: the connect's probe) fail
    as ``cuMemAlloc`` does when another tenant took the memory meanwhile."""

    def __init__(self, *failing: int):
        super().__init__()
        self.failing, self.calls = failing, 0

    def export(self, device: int, nbytes: int):
        self.calls += 1
        if self.calls in self.failing:
            raise MemoryError(f"out of memory exporting {nbytes} bytes")
        return super().export(device, nbytes)


def test_an_allocation_failing_midway_leaves_nothing_held_and_the_next_push_is_exact(server):
    url, _ = server
    memory = FailingAt(3, 7)
    large = lambda seed: jnp.asarray(  # noqa: E731
        np.random.default_rng(seed).standard_normal(1 << 18).astype(np.float32))
    grown = {"mid.w1": large(1), "mid.w2": large(2), "mid.n": jnp.arange(4.0)}
    with sender_on(url, memory, packed=False) as sender:
        for params in (grown, dict(grown, **{"mid.w3": large(3)})):  # the first push, a grown one
            with pytest.raises(SendError, match="before any weights were sent") as caught:
                sender.send(params)  # its second allocation fails
            assert "\n" not in str(caught.value) and "out of memory" in str(caught.value)
            assert memory.alive() == []  # the old allocations freed, none of the new kept
            sender.send(params)
            assert holds(sender, params) and len(memory.alive()) == len(params)
    assert memory.alive() == []


class StuckSync(FabricMemory):
    """The wait for the copies numbered in ``stuck`` (from 1) overruns its
    deadline, as a GPU busy past ``send_timeout_s`` makes it."""

    def __init__(self, *stuck: int):
        super().__init__()
        self.stuck = stuck

    def sync(self, device: int, timeout, check=None) -> None:
        super().sync(device, timeout, check)
        if self.syncs in self.stuck:
            raise TimeoutError(f"the copies on GPU {device} did not end within {timeout}s")


@pytest.mark.parametrize("packed, stuck", [(True, 1), (True, 2), (False, 1)])
def test_copies_past_their_deadline_end_the_push_and_its_exports_are_taken_back(
        server, packed, stuck):
    """The handles are encoded while the copies run: when the copies then
    fail, the round's exports (never posted) are taken back, so the next
    push neither waits for a release that cannot come nor loses a slot."""
    url, _ = server
    memory = StuckSync(stuck)
    params = {"late.w": jnp.arange(1200.0), "late.v": jnp.arange(900.0) - 1}
    with sender_on(url, memory, packed=packed, buffer_size_bytes=4096, send_timeout_s=5) as sender:
        with pytest.raises(SendError, match="did not end within") as caught:
            sender.send(params)
        counters = sender.session.connection.comm.counters
        assert counters.held(range(10_000)) == []  # nothing left counted
        free = len(counters._free) + len(counters._taken)
        sender.send(params)  # not held up by the failed round's exports
        assert holds(sender, params)
        released(sender)
        counters.settle()
        assert len(counters._free) == free == 10_000
    assert ("weights were sent" in str(caught.value)) == (stuck == 1)
    assert memory.alive() == []


def test_the_free_memory_check_counts_what_the_staging_holds_now(server):
    """A push that reallocates smaller gives memory back; a later larger
    one is checked against what is free then, before any request."""
    url, log = server
    memory = Budget(8 << 20)
    with sender_on(url, memory, packed=False) as sender:
        large = {"room.w1": jnp.ones((1 << 18,)), "room.w2": jnp.ones((1 << 18,))}
        sender.send(large)  # two allocations of 2 MiB
        sender.send({"room.n": jnp.arange(3.0)})  # one: the two freed
        memory.taken = 5 << 20  # 1 MiB free besides the 2 MiB held: 4 MiB do not fit
        before = len(log.read_text().splitlines())
        with pytest.raises(TransferError, match="free"):
            sender.send(large)
        assert len(log.read_text().splitlines()) == before
        memory.taken = 0
        sender.send(large)
        assert holds(sender, large)
    assert memory.alive() == []


def test_the_clients_colocation_routes_are_vllms_own(server):
    """/sleep, /wake_up (tags), /is_sleeping and /server_info through vLLM's
    own routers: what the client sends is what they read."""
    url, log = server
    with VLLMClient(url) as client:
        info = client.server_info()
        assert info["vllm_config"]["weight_transfer_config"]["backend"] == "ipc"
        assert info["vllm_env"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] is True
        assert client.sleep(level=1, mode="wait")["level"] == 1
        assert client.is_sleeping()
        assert client.wake_up(["weights"]) is False  # the KV cache still sleeps
        assert client.wake_up(["kv_cache"]) is True and not client.is_sleeping()
        client.sleep(level=0)
        assert not client.is_sleeping()
        client.sleep(level=2)
        assert client.wake_up() is True  # no tags: everything
        for bad in (dict(level=3), dict(level=True), dict(mode="later")):
            with pytest.raises(ValueError):
                client.sleep(**bad)
        with pytest.raises(ValueError):
            client.wake_up("weights")
    calls = [json.loads(line) for line in log.read_text().splitlines()][-10:]
    assert [(c["path"], c["query"], c["status"]) for c in calls] == [
        ("/server_info", "config_format=json", 200),
        ("/sleep", "level=1&mode=wait", 200), ("/is_sleeping", "", 200),
        ("/wake_up", "tags=weights", 200), ("/wake_up", "tags=kv_cache", 200),
        ("/is_sleeping", "", 200), ("/sleep", "level=0&mode=abort", 200),
        ("/is_sleeping", "", 200), ("/sleep", "level=2&mode=abort", 200), ("/wake_up", "", 200)]


TWO_DEVICES = r"""
import hashlib, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_sender import SendConfig
from jax_sender._src.core.tensors.naming import Mapping
from jax_sender._src.ipc.sender import open_ipc_sender
from uniqueid import VLLMClient
from support.ipc_fabric import FabricMemory, uuid_of
devs = jax.devices()
assert len(devs) == 2, devs
memory = FabricMemory()
sender = open_ipc_sender([VLLMClient(sys.argv[1])], {0: devs[0], 1: devs[1]}, mapping=Mapping(),
                         config=SendConfig(packed=sys.argv[2] == "packed", buffer_size_bytes=4096),
                         memory=memory, strict_devices=True)
conn = sender.session.connection
assert conn.ranks == [uuid_of(0), uuid_of(1)] and conn.uuids == {0: uuid_of(0), 1: uuid_of(1)}
full = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8)
params = {"sharded": jax.device_put(full, NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))),
          "on1": jax.device_put(jnp.arange(5, dtype=jnp.int32), devs[1]),
          "on0": jnp.ones((3, 3), jnp.bfloat16)}
sender.send(params)
held = conn.client.weight_checker("checksum")["checksums"]
for name, a in params.items():
    digest = hashlib.sha256(np.asarray(a).tobytes()).hexdigest()
    assert [held[f"dp0:pp0:pcp0:tp{r}:{name}"] for r in (0, 1)] == [digest] * 2, name
assert sender.verify(params).ok
assert len({b.device for b in memory.exported if b.nbytes > 256}) == 2  # a buffer on each GPU
sender.close()
assert memory.alive() == []
print("OK")
"""


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_one_process_with_two_gpus_feeds_the_worker_on_each(tmp_path, mode):
    """A worker on each of the trainer's two devices reads its own device's
    buffer, filled from that device's copy (a sharded array gathered on
    device); one payload for both (their GPUs differ)."""
    with ipc_server(tmp_path, gpus="0,1") as (url, _):
        env = on_tests_path(dict(os.environ, JAX_PLATFORMS="cpu",
                                 XLA_FLAGS="--xla_force_host_platform_device_count=2"))
        out = subprocess.run([__import__("sys").executable, "-c", TWO_DEVICES, url, mode],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
