"""Rank processes for the GPU tests: ``python -m support.children.gpu_scenarios NAME ARGS``.

Each runs on the one GPU its parent put in CUDA_VISIBLE_DEVICES, prints
``OK ...`` and exits 0, or raises (non-zero exit) with the reason.
"""

from __future__ import annotations

import os
import sys
import threading
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def nccl_pair(rank: str, uid_b64: str, blocking: str) -> None:
    """Init from one id (blocking or not), all_reduce and broadcast of JAX arrays,
    all called from a fresh thread (no current CUDA context) that still has
    none after every call: the library never moves a caller's thread."""
    import jax.numpy as jnp
    import numpy as np
    from cuda.bindings import driver

    from nccl_cffi import Communicator, cuda, group
    from uniqueid import UniqueId

    r = int(rank)
    block = blocking == "1"
    arrays = {dtype: (jnp.arange(1000, dtype=dtype) * (r + 1),
                      jnp.zeros(1000, dtype).block_until_ready(),
                      (jnp.arange(777, dtype=dtype) + 5) if r == 0 else jnp.zeros(777, dtype))
              for dtype in (jnp.float32, jnp.bfloat16)}
    buf = jnp.full(64, 7 if r == 0 else 0, jnp.int32).block_until_ready()
    calls = []

    def unchanged(after: str) -> None:
        err, ctx = driver.cuCtxGetCurrent()
        assert int(ctx) == 0, f"{after} left a CUDA context current on the caller's thread"
        calls.append(after)

    def work() -> None:
        unchanged("nothing")
        comm = Communicator.init_rank(2, UniqueId.from_b64(uid_b64).raw, r, 0, blocking=block,
                                      timeout=120)
        unchanged("init_rank")
        assert (comm.count(), comm.user_rank(), comm.cu_device()) == (2, r, 0)
        stream = cuda.Stream(0)
        unchanged("Stream")
        for x, out, y in arrays.values():
            comm.all_reduce(x, out, stream=stream)
            unchanged("all_reduce")
            comm.wait(stream, 60)
            unchanged("wait")
            comm.broadcast(y, root=0, stream=stream)
            unchanged("broadcast")
            comm.wait(stream, 60)
        with group(comm):  # send/recv in a group
            if r == 0:
                comm.send(buf, peer=1, stream=stream)
            else:
                comm.recv(buf, peer=0, stream=stream)
        unchanged("send/recv")
        comm.wait(stream, 60)
        stream.close()
        unchanged("Stream.close")
        comm.destroy()
        unchanged("destroy")

    failed = []
    t = threading.Thread(target=lambda: _capture(work, failed))
    t.start()
    t.join(200)
    assert not t.is_alive(), "the pair's thread did not finish"
    if failed:
        raise failed[0]
    # Checked here: JAX's own reads may leave a context current on the thread they run on.
    for dtype, (_, out, y) in arrays.items():
        assert np.array_equal(np.asarray(out), np.asarray(jnp.arange(1000, dtype=dtype) * 3))
        assert np.array_equal(np.asarray(y), np.asarray(jnp.arange(777, dtype=dtype) + 5))
    assert int(np.asarray(buf).sum()) == 7 * 64
    print(f"OK rank {r} blocking={block}; no context left current after {len(calls)} calls")


def _capture(fn, into: list) -> None:
    try:
        fn()
    except BaseException as e:
        into.append(e)


def init_timeout(seconds: str, blocking: str = "0") -> None:
    """An init whose peer never arrives: a timeout at the deadline. Non-blocking:
    the communicator is aborted and no thread is left. Blocking: the init
    thread is abandoned (a daemon; NCCL cannot abort an init in progress)."""
    from nccl_cffi import Communicator, InvalidUsageError, NcclTimeoutError, get_unique_id
    limit, block = float(seconds), blocking == "1"
    before = threading.active_count()
    t = time.monotonic()
    try:
        Communicator.init_rank(2, get_unique_id(), 0, 0, timeout=limit, blocking=block)
    except NcclTimeoutError as e:
        took = time.monotonic() - t
        assert ("abandoned" if block else "communicator aborted") in str(e), e
    else:
        raise AssertionError("init with an absent peer returned")
    assert limit <= took <= limit + 1.0, took
    left = [th for th in threading.enumerate() if th is not threading.main_thread()]
    if block:
        assert all(th.daemon for th in left), left
    else:
        assert threading.active_count() == before, threading.enumerate()
    comm = Communicator(None, nranks=2, rank=0, device=0, blocking=False)
    try:
        comm.broadcast(0x1000, count=1, dtype="uint8", root=0)
    except InvalidUsageError:
        pass
    else:
        raise AssertionError("a collective on a closed communicator did not raise")
    print(f"OK blocking={block}: timed out after {took:.2f}s (limit {limit}s), "
          f"threads left {[th.name for th in left]}")


def library_pick() -> None:
    """In a JAX process, the wheel's libnccl is used even if another is mapped."""
    import jax
    import jax.numpy as jnp

    import nccl_cffi
    jnp.ones(4).block_until_ready()
    jax.devices()
    before = _mapped_nccl()
    info = nccl_cffi.library_info()
    after = _mapped_nccl()
    assert "nvidia/nccl/lib" in info.path, info
    assert info.path in after, (info.path, after)
    print(f"OK using {info}; mapped before load: {sorted(before)}; after: {sorted(after)}")


def _mapped_nccl() -> set[str]:
    with open("/proc/self/maps") as f:
        return {os.path.realpath(line.split()[-1]) for line in f if "libnccl" in line}


def _test_tensors(seed: int):
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.PRNGKey(seed), 8)
    f = lambda i, s, d: (jax.random.normal(k[i], s) * 3).astype(d)  # noqa: E731
    # Odd shapes, laid out so that every tensor sits at an offset divisible by
    # its dtype size in its chunk (vLLM's packed consumer needs that).
    return [
        ("embed.weight", f(0, (1024, 768), jnp.bfloat16)),        # 1.5 MiB > 1 MiB buffer
        ("a.fp32", f(3, (5, 3, 2), jnp.float32)),
        ("a.i32", jnp.arange(11, dtype=jnp.int32) * 1000003),
        ("a.scalar", jnp.float32(seed + 0.5)),
        ("a.bf16", f(1, (7, 13), jnp.bfloat16)),
        ("a.fp16", f(2, (33,), jnp.float16)),
        ("a.empty", jnp.zeros((0, 5), jnp.bfloat16)),
        ("b.big", f(6, (600, 1000), jnp.float32)),                 # closes its chunk
        ("b.tail", f(7, (3,), jnp.bfloat16)),
        ("a.fp8", f(4, (129,), jnp.float8_e4m3fn)),
        ("a.int8", jax.random.randint(k[5], (61,), -128, 127).astype(jnp.int8)),
    ]


def _checksums(pairs, ranks: int) -> dict[str, str]:
    import hashlib

    import numpy as np
    return {f"dp0:pp0:pcp0:tp{r}:{n}": hashlib.sha256(np.asarray(a).tobytes()).hexdigest()
            for n, a in pairs for r in range(ranks)}


def send(url: str, mode: str, ranks: str, repeat: str = "1") -> None:
    """Sender -> server at ``url``: two versions, metadata reuse, bit-exact checks."""
    import jax

    from jax_sender import SendConfig, WeightSender
    packed = mode == "packed"
    n = int(ranks)
    sender = WeightSender.connect(url, config=SendConfig(packed=packed,
                                                         buffer_size_bytes=1 << 20))
    client = sender.session.clients[0]
    dev = jax.devices()[0]
    base = dev.memory_stats()["bytes_in_use"]
    peaks = []
    for i in range(int(repeat)):
        pairs = _test_tensors(i)
        stats = sender.send(pairs, weight_version=f"v{i}")
        assert stats.reused_metadata == (i > 0), stats
        if i < 2 or i == int(repeat) - 1:
            ans = client.weight_checker("compare", baseline=_checksums(pairs, n))
            assert ans["match"], ans["mismatches"][:5]
            assert client.weight_info()["weight_version"] == f"v{i}"
            check = sender.verify(pairs)
            assert check.ok and len(check.matched) == len(pairs), check
        del pairs
        peaks.append(dev.memory_stats()["bytes_in_use"] - base)
    largest = 600 * 1000 * 4
    bound = 2 * (1 << 20) + largest
    extra = max(peaks)
    assert extra <= bound + (1 << 20), (extra, bound)
    assert peaks[-1] <= peaks[min(1, len(peaks) - 1)] + (1 << 16), peaks[:3] + peaks[-3:]
    sender.close()
    print(f"OK {mode} -> {n} receiver(s), {repeat} sends, bit-exact; sender extra memory "
          f"after sends: first {peaks[0]} B, last {peaks[-1]} B, max {extra} B "
          f"(bound {bound} B); last: {stats}")


def _flax_to_torch(path, x):
    """A trainer's transform: 2-D arrays transposed, float32 cast to bfloat16."""
    import jax.numpy as jnp
    x = x.T if x.ndim == 2 else x
    return x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x


def async_donation(url: str) -> None:
    """send(wait=False), then at once a step that donates the parameters and
    overwrites them: the push still delivers them as they were when sent.
    Then the same through a transform (its chunks packed by XLA), and two
    blocking pushes with it (the second writes its chunks into the buffers
    the first broadcast)."""
    import jax

    from jax_sender import Mapping, PendingSend, SendConfig, WeightSender
    from jax_sender._src.core.tensors.naming import identity
    step = jax.jit(lambda xs: [(x * 0 + 7).astype(x.dtype) for x in xs], donate_argnums=0)
    for transform in (identity, _flax_to_torch):
        sender = WeightSender.connect(url, mapping=Mapping(transform=transform),
                                      config=SendConfig(buffer_size_bytes=1 << 20))
        for i in range(3):
            pairs = _test_tensors(20 + i)
            want = _checksums([(n, transform((n,), a)) for n, a in pairs], 1)  # as sent
            wait = transform is not identity and i >= 1
            t = time.perf_counter()
            pending = sender.send(pairs, weight_version=f"v{i}", wait=wait)
            returned = time.perf_counter() - t
            assert isinstance(pending, PendingSend) != wait, pending
            arrays = step([a for _, a in pairs])  # donated: their memory is reused at once
            assert all(a.is_deleted() for _, a in pairs if a.size)
            jax.block_until_ready(arrays)
            stats = pending if wait else pending.result(timeout=120)
            ans = sender.session.clients[0].weight_checker("compare", baseline=want)
            assert ans["match"], (transform.__name__, i, ans["mismatches"][:5])
            del pairs, arrays
        sender.close()
        print(f"OK {transform.__name__}: pushes followed at once by a donating step, "
              f"bit-exact; the last returned after {returned * 1e3:.1f} ms, its push took "
              f"{stats.total_s * 1e3:.1f} ms")


def async_many(url: str) -> None:
    """The first ``send(wait=False)`` of 2,000 tensors (more than XLA packs:
    the arrays are copied, 1,800 of one shape by a jitted copy 64 at a
    time, 200 of ten shapes by ``jax.device_put``), then at once a step that
    donates and overwrites every array: the push is bit-exact, and it
    returned within a small multiple of a blocking push of the same tree.
    Twice, the second push snapshotting the same way."""
    import jax
    import numpy as np

    from jax_sender import PendingSend, WeightSender
    rng = np.random.default_rng(0)
    shapes = [(64, 128)] * 1800 + [(i + 1, 24) for i in range(10)] * 20
    donate = jax.jit(lambda x: x * 0 + 7, donate_argnums=0)  # one compile per shape
    sender = WeightSender.connect(url)
    held = []
    for i in range(2):
        pairs = [(f"t.{j}", jax.device_put(rng.standard_normal(shape, np.float32)))
                 for j, shape in enumerate(shapes)]  # from the host: nothing compiled per shape
        want = _checksums(pairs, 1)
        t = time.perf_counter()
        pending = sender.send(pairs, weight_version=f"v{i}", wait=False)
        held.append(time.perf_counter() - t)
        assert isinstance(pending, PendingSend), pending
        arrays = [donate(a) for _, a in pairs]
        assert all(a.is_deleted() for _, a in pairs)
        jax.block_until_ready(arrays)
        stats = pending.result(timeout=120)
        ans = sender.session.clients[0].weight_checker("compare", baseline=want)
        assert ans["match"], (i, ans["mismatches"][:5])
        del pairs, arrays
    pairs = [(f"t.{j}", jax.device_put(rng.standard_normal(shape, np.float32)))
             for j, shape in enumerate(shapes)]
    t = time.perf_counter()
    sender.send(pairs)
    blocking = time.perf_counter() - t
    assert held[0] <= 3 * blocking + 2, (held, blocking)
    sender.close()
    print(f"OK 2,000 tensors: send(wait=False) then a donating step, bit-exact twice; they "
          f"returned after {held[0] * 1e3:.1f} and {held[1] * 1e3:.1f} ms (a blocking push: "
          f"{blocking * 1e3:.1f} ms), the second push took {stats.total_s * 1e3:.1f} ms")


def vllm_refused(url: str) -> None:
    """vLLM 0.33.0 refuses a key it does not know while we sit in ncclCommInitRank."""
    from uniqueid import RendezvousError, connect
    t = time.monotonic()
    try:
        connect(url, timeout=120, use_load_plan=True, metadata=[["w", "float32", [1]]])
    except RendezvousError as e:
        took, msg = time.monotonic() - t, str(e)
        assert "use_load_plan" in msg, msg
    else:
        raise AssertionError("vLLM 0.33.0 accepted use_load_plan")
    assert took < 10, took
    conn = connect(url, timeout=120)
    conn.close()
    print(f"OK refused in {took:.2f}s: {msg[:200]}...; reconnect with a fresh id worked")


def too_large(url: str) -> None:
    """world_size larger than the workers: a timeout error, not a hang."""
    from uniqueid import RendezvousTimeout, connect
    t = time.monotonic()
    try:
        connect(url, workers=2, timeout=8)
    except RendezvousTimeout as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("connect with a too-large world returned")
    assert took <= 8 + 1, took  # the whole call within its deadline
    print(f"OK timed out in {took:.2f}s (deadline 8s): {msg[:300]}")


def _expect_send_error(sender, pairs, limit: float) -> tuple[float, str]:
    """``send`` must raise ``SendError`` within ``limit`` s and leave the group aborted."""
    from jax_sender import SendError
    t = time.monotonic()
    try:
        sender.send(pairs)
    except SendError as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("the send did not fail")
    assert took < limit, (took, msg)
    assert sender.broken and sender.session.connection.comm.state != "open", sender.broken
    return took, msg


def killed(mode: str, what: str, receivers: str = "1") -> None:
    """The receivers (the workers, or the whole server) are SIGKILLed mid-transfer."""
    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    server = ReferenceServer([str(g + 1) for g in range(int(receivers))], load_delay=1.0)
    url = server.start()
    try:
        sender = WeightSender.connect(url, config=SendConfig(
            packed=mode == "packed", buffer_size_bytes=1 << 20, send_timeout_s=30.0))
        pairs = _test_tensors(0)
        kill = server.kill_workers if what == "workers" else server.kill_worker_group
        threading.Timer(2.5, kill).start()  # the receiver sleeps in its 3rd load
        took, msg = _expect_send_error(sender, pairs, 2.5 + 10)
        sender.close()
    finally:
        server.stop()
    assert not [t for t in threading.enumerate() if not t.daemon and t is not
                threading.main_thread()], threading.enumerate()
    print(f"OK {mode} -> {receivers}: {what} killed at 2.5s, SendError after {took:.2f}s: {msg[:300]}")


def stalled(mode: str) -> None:
    """The receiver stops taking part but its HTTP call stays open: only the
    per-wait deadline can end the send."""
    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    with ReferenceServer(["1"], load_delay=600.0) as url:
        sender = WeightSender.connect(url, config=SendConfig(
            packed=mode == "packed", buffer_size_bytes=1 << 20, send_timeout_s=5.0))
        took, msg = _expect_send_error(sender, _test_tensors(0), 5 + 3)
        assert "within 5.0s" in msg, msg
        assert took >= 5.0, took
        sender.close()
    print(f"OK {mode}: stalled receiver, SendError after {took:.2f}s (deadline 5s): {msg[:300]}")


def load_fails(mode: str) -> None:
    """load_weights raises mid-stream: the send fails, reconnect(), the next push is exact."""
    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    with ReferenceServer(["1"], fail_load_after=3) as url:
        sender = WeightSender.connect(url, config=SendConfig(packed=mode == "packed",
                                                             buffer_size_bytes=1 << 20))
        pairs = _test_tensors(1)
        took, msg = _expect_send_error(sender, pairs, 20)
        assert "injected load_weights failure" in msg, msg
        t = time.monotonic()
        sender.reconnect()
        recovered = time.monotonic() - t
        stats = sender.send(pairs, weight_version="after")
        assert not stats.reused_metadata
        ans = sender.session.clients[0].weight_checker("compare", baseline=_checksums(pairs, 1))
        assert ans["match"], ans["mismatches"][:5]
        assert sender.session.clients[0].weight_info()["weight_version"] == "after"
        sender.close()
    print(f"OK {mode}: failed after {took:.2f}s ({msg[:160]}); reconnect {recovered:.2f}s; "
          f"next push bit-exact")


def refused(mode: str) -> None:
    """The worker refuses ``/update_weights`` before any collective (HTTP 500)
    while the trainer broadcasts: the send fails on that answer, long before
    its deadline, instead of waiting in NCCL for a peer that never comes."""
    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    with ReferenceServer(["1"], refuse_updates=1) as url:
        # Only the HTTP answer can end the send early.
        sender = WeightSender.connect(url, config=SendConfig(
            packed=mode == "packed", buffer_size_bytes=1 << 20, send_timeout_s=120.0))
        pairs = _test_tensors(2)
        took, msg = _expect_send_error(sender, pairs, 20)
        assert "injected refusal" in msg, msg
        sender.reconnect()
        sender.send(pairs, weight_version="after")
        ans = sender.session.clients[0].weight_checker("compare", baseline=_checksums(pairs, 1))
        assert ans["match"], ans["mismatches"][:5]
        sender.close()
    print(f"OK {mode}: update refused before any collective, SendError after {took:.2f}s "
          f"(deadline 120s): {msg[:200]}; after reconnect the next push is bit-exact")


def interrupted(mode: str) -> None:
    """Two Ctrl-Cs (SIGINT) while the sender waits on a stalled receiver: the
    first would let the push end (it cannot: the receiver sleeps), the
    second aborts at once."""
    import signal

    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    with ReferenceServer(["1"], load_delay=600.0) as url:
        sender = WeightSender.connect(url, config=SendConfig(packed=mode == "packed",
                                                             buffer_size_bytes=1 << 20))
        pairs = _test_tensors(0)
        for at in (2.0, 2.5):
            threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT)).start()
        t = time.monotonic()
        try:
            sender.send(pairs)
        except KeyboardInterrupt as e:
            took, msg = time.monotonic() - t, str(e)
        else:
            raise AssertionError("send returned through two Ctrl-Cs")
        assert took < 2.5 + 1.0, took
        assert "second Ctrl-C" in msg and "Ctrl-C" in sender.broken, (msg, sender.broken)
        assert sender.session.connection.comm.state != "open"
        sender.close()
    left = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    assert not left, left
    print(f"OK {mode}: Ctrl-C at 2.0s and 2.5s, KeyboardInterrupt out of send() after "
          f"{took:.2f}s, communicator aborted, no non-daemon thread left")


# -- trainer-side failures against vLLM 0.33.0's real engine -------------------
# Each fails the way a user would, checks the error and its time, then shows
# the same server process taking a fresh connect and a bit-exact push.

def _fresh_push(url: str, seed: int) -> str:
    """A new sender on ``url``: a push, checked by ``verify``; closed."""
    from jax_sender import SendConfig, WeightSender
    with WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20,
                                                     init_timeout_s=60)) as fresh:
        pairs = _test_tensors(seed)
        fresh.send(pairs, weight_version=f"fresh-{seed}")
        check = fresh.verify(pairs)
        assert check.ok and len(check.matched) == len(pairs), check
    return f"fresh connect + bit-exact push of {len(pairs)} tensors"


def _verified(sender, pairs) -> None:
    check = sender.verify(pairs)
    assert check.ok and len(check.matched) == len(pairs), check


def _fails_once(victim: str, at: int):
    """A transform that raises the ``at``-th time it meets ``victim`` as a real
    array (not while traced): a trainer-side failure after the push started."""
    import jax
    seen = [0]

    def transform(path, x):
        if path[-1] == victim and not isinstance(x, jax.core.Tracer):
            seen[0] += 1
            if seen[0] == at:
                raise RuntimeError(f"the transform of {victim} failed")
        return x
    return transform


def recover_wrong_device(url: str) -> str:
    """connect(device=7) on a one-GPU host: refused before anything is posted."""
    from jax_sender import TransferError, WeightSender
    t = time.monotonic()
    try:
        WeightSender.connect(url, device=7)
    except TransferError as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("connect(device=7) worked")
    assert took < 10 and "7" in msg and "\n" not in msg, (took, msg)
    return f"TransferError in {took:.2f}s: {msg}"


def recover_bad_version(url: str) -> str:
    """A weight_version that is not a str: refused before /start_weight_update."""
    from jax_sender import MetadataError, SendConfig, WeightSender
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    pairs = _test_tensors(1)
    try:
        sender.send(pairs, weight_version=7)
    except MetadataError as e:
        msg = str(e)
    else:
        raise AssertionError("weight_version=7 was sent")
    sender.send(pairs, weight_version="7")
    _verified(sender, pairs)
    sender.close()
    return f"MetadataError: {msg}; the same sender's next push bit-exact"


def recover_transform(url: str, mode: str) -> str:
    """A transform raising mid-push: the update is completed and finished on
    the server; the same sender's next push sends everything and repairs it;
    reconnect() works too."""
    from jax_sender import Mapping, SendConfig, UpdateIncomplete, WeightSender
    from jax_sender._src.broadcast import packing
    packing.MAX_TENSORS = 1  # packed: chunks by copies, where the transform runs eagerly
    config = SendConfig(packed=mode == "packed", buffer_size_bytes=1 << 20)
    sender = WeightSender.connect(url, config=config,
                                  mapping=Mapping(transform=_fails_once("a.bf16", at=2)))
    pairs = _test_tensors(2)
    sender.send(pairs)
    t = time.monotonic()
    try:
        sender.send(pairs, weight_version="broken")
    except UpdateIncomplete as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("the failing transform went unnoticed")
    assert took < 30 and not sender.broken, (took, sender.broken)
    assert sender.session.clients[0].weight_info()["weight_version"] != "broken"
    stats = sender.send(pairs)
    assert not stats.reused_metadata
    _verified(sender, pairs)
    sender.reconnect()
    sender.send(pairs)
    _verified(sender, pairs)
    sender.close()
    return (f"UpdateIncomplete in {took:.2f}s ({msg[:120]}...); the next push repaired it; "
            "reconnect() and a push")


def recover_not_ready(url: str) -> str:
    """The arrays not computed within send_timeout_s: the session is finished
    with nothing in it; the same sender pushes them once they are."""
    import jax
    import jax.numpy as jnp

    from jax_sender import SendConfig, SendError, WeightSender
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20,
                                                         send_timeout_s=1.0))
    pairs = _test_tensors(3)
    sender.send(pairs)
    names, xs = [n for n, _ in pairs], [x for _, x in pairs]
    a = jnp.full((16384, 16384), 1e-4, jnp.float32)

    def chain(a):  # straight-line (a while loop on GPU would block the dispatch itself)
        y = a
        for _ in range(24):
            y = jnp.tanh(jnp.matmul(y, a, precision=jax.lax.Precision.HIGHEST))
        return y[0, 0]

    spin = jax.jit(chain)
    after = jax.jit(lambda xs, d: [x + (d * 0).astype(x.dtype) for x in xs])
    t = time.monotonic()
    jax.block_until_ready(after(xs, spin(a)))  # compiled, and how long a step takes
    step = time.monotonic() - t
    late = list(zip(names, after(xs, spin(a))))  # dispatched: seconds of GPU work to come
    t = time.monotonic()
    try:
        sender.send(late)
    except SendError as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError(f"the arrays were ready after all (a step takes {step:.2f}s)")
    assert 1.0 <= took < 3.0 and not sender.broken and "before any weights" in msg, (took, msg)
    jax.block_until_ready(late)
    assert sender.send(late).reused_metadata
    _verified(sender, late)
    sender.close()
    return (f"SendError in {took:.2f}s (a step of {step:.2f}s): {msg[:160]}...; the next push "
            "bit-exact")


def recover_threads(url: str) -> str:
    """send() from two threads at once on one sender: they take turns."""
    from jax_sender import SendConfig, WeightSender

    from support.concurrency import together
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))

    def push(seed: int) -> None:
        for _ in range(3):
            sender.send(_test_tensors(seed))

    errors = together(push, [(4,), (5,)], 120)
    assert not errors and not sender.broken, errors
    sender.send(_test_tensors(6))
    _verified(sender, _test_tensors(6))
    sender.close()
    return "six pushes from two threads took turns, all ended"


def _big(seed: int, gb: float):
    import jax
    import jax.numpy as jnp
    n = int(gb * 1e9 / 2 / 16 / (1 << 20))  # 16 tensors of bfloat16
    keys = jax.random.split(jax.random.PRNGKey(seed), 16)
    return [(f"big.{i}", jax.random.normal(k, (n, 1 << 20), jnp.bfloat16)) for i, k in enumerate(keys)]


def recover_ctrl_c(url: str) -> str:
    """Ctrl-C 0.4 s into a 1.6 GB push: the push ends on the server, then
    KeyboardInterrupt; the sender pushes on, no reconnect."""
    import signal

    import jax

    from jax_sender import SendConfig, WeightSender
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=256 << 20))
    pairs = _big(7, 1.6)
    jax.block_until_ready(pairs)
    threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    try:
        sender.send(pairs)
    except KeyboardInterrupt as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("the push ended before the Ctrl-C: make it larger")
    assert not sender.broken and "ended on the servers first" in msg, (msg, sender.broken)
    _verified(sender, pairs)
    del pairs
    small = _test_tensors(8)
    sender.send(small)
    _verified(sender, small)
    sender.close()
    return f"KeyboardInterrupt after {took:.2f}s, once the 1.6 GB push had ended bit-exact"


def recover_ctrl_c_twice(url: str) -> str:
    """Two Ctrl-Cs into a 1.6 GB push: aborted at once; reconnect() then
    either forms a new group or names the server as stuck, within its deadline."""
    import signal

    import jax

    from jax_sender import SendConfig, WeightSender
    from uniqueid import ServerStuck
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=256 << 20,
                                                         reconnect_timeout_s=60))
    pairs = _big(9, 1.6)
    jax.block_until_ready(pairs)
    for at in (0.3, 0.4):
        threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    try:
        sender.send(pairs)
    except KeyboardInterrupt as e:
        took, msg = time.monotonic() - t, str(e)
    assert took < 0.4 + 3.0 and "second Ctrl-C" in msg and sender.broken, (took, msg)
    t = time.monotonic()
    try:
        sender.reconnect()
        outcome = "reconnect() formed a new group"
    except ServerStuck as e:
        outcome = f"reconnect() named the server stuck: {e}"
    assert time.monotonic() - t < 60 + 5
    sender.close()
    return f"KeyboardInterrupt after {took:.2f}s; {outcome}"


def recover_open_session(url: str) -> str:
    """A session left open on the server: reconnect() finishes it first
    (vLLM refuses to shut down during one)."""
    from jax_sender import SendConfig, WeightSender
    sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    sender.session.clients[0].start_weight_update()
    sender.reconnect()
    pairs = _test_tensors(10)
    sender.send(pairs)
    _verified(sender, pairs)
    sender.close()
    return "reconnect() finished the open session and formed a new group; push bit-exact"


def recovery(url: str, case: str, *args: str) -> None:
    """One trainer-side failure against ``url``, then a fresh connect and a
    bit-exact push to the same server (skipped where a restart is named)."""
    what = globals()[f"recover_{case}"](url, *args)
    fresh = "" if "stuck" in what else "; " + _fresh_push(url, 11)
    print(f"OK {case}: {what}{fresh}")


def _m2n_tree(seed: int) -> dict:
    """``vllm_m2n``'s toy model as JAX arrays on this GPU."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from jax_sender.testing.vllm_m2n import TOY
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal(shape).astype(np.float32).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)) for name, shape, dtype, _ in TOY}


def m2n(url: str, seed: str) -> None:
    """Into vLLM's real ``nccl_m2n`` engine (two TP workers): refusals before
    any server call; the real rendezvous (store, agreements, NCCL init, the
    destination plan broadcast by the first worker); a push, exact by vLLM's
    digests, or, where every rank shares one GPU as its own NCCL host, the
    library's refusal (M2N needs NVLink peers or GPU-initiated networking)
    ending within its deadline; then the server released for the next
    trainer process (the test runs this twice, one process after the other)."""
    from jax_sender import M2NSender, MetadataError, SendConfig, SendError, TransferError
    from jax_sender.testing.vllm_m2n import EXPECTED_DESTINATIONS
    params = _m2n_tree(int(seed))
    try:
        M2NSender.connect(url, params, device=7)
    except TransferError as e:
        assert "\n" not in str(e), e
    else:
        raise AssertionError("device 7 was accepted")
    sender = M2NSender.connect(url, params, config=SendConfig(init_timeout_s=120,
                                                              send_timeout_s=30))
    conn = sender.session.connection
    got = dict(zip((p.name for p in conn.init_info.params), conn.destinations))
    assert got == EXPECTED_DESTINATIONS, got
    try:
        sender.send(params, pause="bogus")
    except MetadataError:
        pass
    else:
        raise AssertionError("pause='bogus' was accepted")
    t = time.monotonic()
    try:
        sender.send(params)
        check = sender.verify(params)
        assert check.ok and len(check.matched) == len(params), check
        pushed = f"push bit-exact by vLLM's digests ({len(params)} tensors)"
    except SendError as e:
        assert os.environ.get("JAX_SENDER_SHARE_GPUS"), f"the push failed without shared GPUs: {e}"
        pushed = f"push refused on a shared GPU in {time.monotonic() - t:.1f}s: {e}"
    sender.close()
    print(f"OK m2n: destinations {got}; {pushed}; the server released")
    sys.stdout.flush()
    os._exit(0)  # a reshard abandoned inside the library must not hold the exit


# -- a trainer killed mid-push (test_gpu.py kills it) ---------------------------

def killed_mid_push(url: str) -> None:
    """Push once, then start a push whose transform never returns for
    ``b.big`` (unpacked: the lane transforms each tensor right before its
    broadcast, after ``/update_weights`` was posted), so vLLM's worker waits
    inside NCCL for it; say so, and wait to be killed."""
    import jax

    from jax_sender import Mapping, SendConfig, WeightSender
    stop = {"on": False}

    def transform(path, x):
        if stop["on"] and path[-1] == "b.big" and not isinstance(x, jax.core.Tracer):
            print("INSIDE THE PUSH", flush=True)
            time.sleep(3600)
        return x

    sender = WeightSender.connect(url, config=SendConfig(packed=False, send_timeout_s=600),
                                  mapping=Mapping(transform=transform))
    pairs = _test_tensors(12)
    sender.send(pairs)
    stop["on"] = True
    sender.send(pairs)


def stuck_connect(url: str) -> None:
    """A fresh connect to the server a killed trainer left inside NCCL:
    ``ServerStuck`` naming it and the restart within seconds, not the init's
    deadline (nothing is posted)."""
    import jax

    from jax_sender import SendConfig, WeightSender
    from uniqueid import ServerStuck
    from uniqueid.rendezvous import ENGINE_ANSWER_S
    jax.devices()  # JAX's start is not connect's
    t = time.monotonic()
    try:
        WeightSender.connect(url, config=SendConfig(init_timeout_s=60))
    except ServerStuck as e:
        took, msg = time.monotonic() - t, str(e)
    else:
        raise AssertionError("connect to a server left inside NCCL worked")
    assert took < ENGINE_ANSWER_S + 5 and url in msg and "restart that server" in msg, (took, msg)
    assert "\n" not in msg
    print(f"OK ServerStuck in {took:.2f}s: {msg}")


def fresh_push(url: str) -> None:
    """A connect and a bit-exact push (the server restarted)."""
    print(f"OK {_fresh_push(url, 13)}")


def load_plan(url: str) -> None:
    """use_load_plan: subsets go through bit-exact; anything else is refused by
    the sender before any HTTP call, and by the worker before any collective."""
    from jax_sender import MetadataError, SendConfig, WeightSender
    from uniqueid import UpdateInfo, VLLMHTTPError
    pairs = _test_tensors(2)
    sender = WeightSender.connect(url, load_plan=pairs,
                                  config=SendConfig(buffer_size_bytes=1 << 20))
    assert sender.session.info.use_load_plan and len(sender.session.info.metadata) == len(pairs)
    subset = pairs[:4]
    sender.send(subset)
    ans = sender.session.clients[0].weight_checker("compare", baseline=_checksums(subset, 1))
    assert ans["match"], ans["mismatches"][:5]
    try:
        sender.send(pairs[:1] + [("extra", pairs[1][1])])
    except MetadataError as e:
        assert "was not declared" in str(e), e
    else:
        raise AssertionError("a tensor outside the plan was sent")
    assert not sender.broken  # refused up front: the group is intact
    client = sender.session.clients[0]
    client.start_weight_update()
    try:
        client.update_weights(UpdateInfo(["extra"], ["float32"], [[2]]).to_payload())
    except VLLMHTTPError as e:
        assert e.status == 500 and "was not declared" in e.message, e
    else:
        raise AssertionError("the worker accepted a tensor outside the plan")
    # The worker refused before any collective, so the group is still in step.
    # (Another subset: a reuse round would read the metadata the worker saw last.)
    sender.send(pairs[:3])
    ans = client.weight_checker("compare", baseline=_checksums(subset, 1))
    assert ans["match"], ans["mismatches"][:5]
    sender.close()
    print("OK load plan: subset bit-exact, outside tensors refused by sender and worker")


def sparse(url: str) -> None:
    """sparse_nccl at ``url``: patches against the previous weights, bit-exact
    like a dense push; unchanged tensors are zero-count broadcasts; what vLLM's
    loader would refuse after the transfer is refused before it."""
    import jax
    import jax.numpy as jnp

    from jax_sender import MetadataError, SparseSender
    from jax_sender._src.sparse.patches import SPARSE_DTYPES
    from nccl_cffi.dtypes import dtype_name
    sender = SparseSender.connect(url)
    client = sender.session.clients[0]
    v0 = [(n, a) for n, a in _test_tensors(3) if dtype_name(a.dtype) in SPARSE_DTYPES]
    zeros = [(n, jnp.zeros_like(a)) for n, a in v0]
    first = sender.send(v0, zeros)  # both receivers start from zeros
    assert client.weight_checker("compare", baseline=_checksums(v0, 1))["match"]
    key = jax.random.PRNGKey(9)
    v1 = []
    for n, a in v0:  # ~1% of the elements of the large tensors; none of "b.tail"
        key, k = jax.random.split(key)
        mask = (jax.random.uniform(k, a.shape) < 0.01) & (n != "b.tail")
        v1.append((n, jnp.where(mask, (a.astype(jnp.float32) + 1).astype(a.dtype), a)))
    second = sender.send(v1, v0)
    ans = client.weight_checker("compare", baseline=_checksums(v1, 1))
    assert ans["match"], ans["mismatches"][:5]
    dense = sum(a.nbytes for _, a in v1)
    assert second.bytes < dense / 10, (second.bytes, dense)
    fp16 = dict(v1)["a.fp16"]
    for name, old, new, why in [
            ("a.i32", jnp.zeros(3, jnp.int32), jnp.arange(3, dtype=jnp.int32),
             "sparse worker loads only"),
            ("a.fp8", jnp.zeros(3, jnp.float8_e4m3fn), jnp.ones(3, jnp.float8_e4m3fn),
             "sparse worker loads only"),
            ("a.fp16", fp16, fp16.at[0].set(jnp.nan), "are NaN")]:
        try:
            sender.send([(name, new)], [(name, old)])
        except MetadataError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"sent a sparse update vLLM would refuse: {why}")
    assert not sender.broken  # refused up front: the group is intact
    third = sender.send(v0, v1)
    assert client.weight_checker("compare", baseline=_checksums(v0, 1))["match"]
    sender.close()
    print(f"OK sparse: first push {first.bytes} B, 1% push {second.bytes} B "
          f"(dense {dense} B), back {third.bytes} B, all bit-exact; int, float8 and NaN "
          "refused first")


def servers(mode: str, *urls: str) -> None:
    """Several independent servers join one communicator; one broadcast feeds all."""
    from jax_sender import SendConfig, WeightSender
    sender = WeightSender.connect(list(urls), config=SendConfig(packed=mode == "packed",
                                                                buffer_size_bytes=1 << 20))
    offsets = [i.rank_offset for i in sender.session.connection.init_infos]
    assert offsets == list(range(1, len(urls) + 1)), offsets
    for v in range(2):
        pairs = _test_tensors(10 + v)
        sender.send(pairs, weight_version=f"v{v}")
        for c in sender.session.clients:
            ans = c.weight_checker("compare", baseline=_checksums(pairs, 1))
            assert ans["match"], (c.base_url, ans["mismatches"][:5])
            assert c.weight_info()["weight_version"] == f"v{v}"
    sender.close()
    print(f"OK {mode}: {len(urls)} servers at rank offsets {offsets}, one broadcast, bit-exact")


def _group_values(layout: str, version: int) -> dict:
    """Each trainer process builds the same host values, so every check is exact."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(version)
    shapes = ({"s0.a": ((1024, 768), jnp.bfloat16), "s0.b": ((33,), np.float32),
               "s1.a": ((512, 1000), jnp.bfloat16), "s1.b": ((7, 13), np.float32)}
              if layout == "stages" else
              {"f.a": ((1024, 768), jnp.bfloat16), "f.b": ((64, 3), np.float32),
               "f.c": ((6,), np.float32)})
    return {n: (rng.standard_normal(s) * 3).astype(d) for n, (s, d) in shapes.items()}


def group(process: str, nproc: str, port: str, url: str, layout: str, mode: str,
          workers: str) -> None:
    """One of ``nproc`` trainer processes of a multi-process JAX job (one GPU
    each) pushing to the server at ``url`` (``workers`` workers). ``stages``:
    each process owns part of the parameters and broadcasts them in its own
    turn; ``fsdp``: every parameter is sharded over all, process 0
    broadcasts, the others only gather."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(nproc),
                               process_id=int(process), initialization_timeout=120)
    from jax_sender import SendConfig, WeightSender
    devices = sorted(jax.devices(), key=lambda d: d.id)

    def place(name, value):
        devs = devices if layout == "fsdp" else [devices[int(name[1]) % len(devices)]]
        spec = PartitionSpec("d") if layout == "fsdp" and name != "f.c" else PartitionSpec()
        sharding = NamedSharding(Mesh(np.array(devs), ("d",)), spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx],
                                            dtype=value.dtype)

    sender = None
    for version in range(2):
        values = _group_values(layout, version)
        params = {n: place(n, v) for n, v in values.items()}
        pairs = sorted(params.items())
        if sender is None:
            sender = WeightSender.connect_group(url, pairs, device=0, config=SendConfig(
                packed=mode == "packed", buffer_size_bytes=1 << 20, init_timeout_s=120))
            expected = tuple(range(len(devices))) if layout == "stages" else (0,)
            assert sender.session.route.group.plan.group == expected, sender.session.route.group.plan
            assert sender.session.info.rank_offset == len(expected), sender.session.info
        stats = sender.send(pairs, weight_version=f"v{version}")
        assert stats.reused_metadata == (version == 1) or sender.session.connection is None, stats
        if int(process) == 0:
            client = sender.session.clients[0]
            ans = client.weight_checker("compare",
                                        baseline=_checksums(sorted(values.items()), int(workers)))
            assert ans["match"], ans["mismatches"][:5]
    role = ("broadcaster" if sender.session.connection else "gathers only")
    sender.close()
    print(f"OK {layout} {mode}: process {process} ({role}), group "
          f"{sender.session.route.group.plan.group}, two versions bit-exact on {workers} workers")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def failed_sends(count: str) -> None:
    """``count`` sends that the worker refuses, each followed by ``reconnect()``
    (a new communicator, new streams, events and slots): threads, file
    descriptors, JAX's device bytes and the device's free memory (which
    counts NCCL's own buffers) stay flat; a last send is bit-exact."""
    import jax
    from cuda.bindings import driver

    from jax_sender import SendConfig, WeightSender
    from jax_sender.testing.harness import ReferenceServer
    n = int(count)
    dev = jax.devices()[0]
    pairs = _test_tensors(4)
    with ReferenceServer(["1"], refuse_updates=n) as url:
        sender = WeightSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20,
                                                             send_timeout_s=60.0))
        seen = []
        for i in range(n):
            _expect_send_error(sender, pairs, 30)
            sender.reconnect()
            free = driver.cuMemGetInfo()[1]
            seen.append((threading.active_count(), len(os.listdir("/proc/self/fd")),
                         dev.memory_stats()["bytes_in_use"], free))
            if i == 0:
                print(f"after the first: threads, fds, JAX bytes, device free = {seen[0]}")
        sender.send(pairs, weight_version="after")
        ans = sender.session.clients[0].weight_checker("compare", baseline=_checksums(pairs, 1))
        assert ans["match"], ans["mismatches"][:5]
        sender.close()
    settled = min(10, n - 1)  # after pools and caches have warmed up
    (t0, f0, m0, free0), (t1, f1, m1, free1) = seen[settled], seen[-1]
    assert t1 <= t0 and f1 <= f0 + 2, (seen[settled], seen[-1])
    assert m1 - m0 <= 1 << 20, (m0, m1)
    assert free0 - free1 <= 64 << 20, (free0, free1)
    print(f"OK {n} refused sends + reconnects: after {settled + 1}: threads {t0}, fds {f0}, "
          f"JAX bytes {m0}, device free {free0 / 2**30:.3f} GiB; after {n}: threads {t1}, "
          f"fds {f1}, JAX bytes {m1}, device free {free1 / 2**30:.3f} GiB; last send bit-exact")


def many_sends(url: str, mode: str, count: str) -> None:
    """``count`` sends of a ~100 MB model, each checked bit-exact; memory stays flat."""
    import jax
    import jax.numpy as jnp

    from jax_sender import SendConfig, WeightSender
    sender = WeightSender.connect(url, config=SendConfig(packed=mode == "packed",
                                                         buffer_size_bytes=16 << 20))
    keys = jax.random.split(jax.random.PRNGKey(0), 24)
    base_pairs = [(f"layer{i}.w", jax.random.normal(k, (1024, 2048), jnp.bfloat16))
                  for i, k in enumerate(keys)]
    bump = jax.jit(lambda a, i: a + i.astype(a.dtype))
    dev = jax.devices()[0]
    client = sender.session.clients[0]
    mem, rss = [], []
    for i in range(int(count)):
        pairs = [(n, bump(a, jnp.int32(i))) for n, a in base_pairs]
        sender.send(pairs, weight_version=f"v{i}")
        ans = client.weight_checker("compare", baseline=_checksums(pairs, 1))
        assert ans["match"], (i, ans["mismatches"][:5])
        del pairs
        mem.append(dev.memory_stats()["bytes_in_use"])
        rss.append(_rss())
    nbytes = sum(a.nbytes for _, a in base_pairs)
    settled = 10  # after caches and pools have warmed up
    assert mem[-1] - mem[settled] <= 1 << 20, (mem[settled], mem[-1])
    assert rss[-1] - rss[settled] <= 64 << 20, (rss[settled], rss[-1])
    sender.close()
    print(f"OK {mode}: {count} sends of {nbytes / 1e6:.0f} MB, all bit-exact; device bytes in "
          f"use after send {settled + 1}: {mem[settled]}, after the last: {mem[-1]}; host RSS "
          f"after send {settled + 1}: {rss[settled] / 2**20:.1f} MiB, after the last: "
          f"{rss[-1] / 2**20:.1f} MiB")


# -- a Tunix model tree through TUNIX_QWEN3 ----------------------------------------

def tunix_qwen3(url: str, mode: str) -> None:
    """A Tunix Qwen3 tree pushed through ``TUNIX_QWEN3``, twice (the second
    reusing the metadata): each worker holds the Hugging Face tensors written
    out by hand, byte for byte, and ``verify()`` agrees."""
    from jax_sender import TUNIX_QWEN3, SendConfig, WeightSender

    from support.tiny_tunix import hugging_face, qwen3_state
    sender = WeightSender.connect(url, mapping=TUNIX_QWEN3, config=SendConfig(
        packed=mode == "packed", buffer_size_bytes=1 << 16))
    client = sender.session.clients[0]
    for i in range(2):
        tree = qwen3_state(i)
        stats = sender.send(tree, weight_version=f"tunix-{i}")
        assert stats.reused_metadata == (i > 0), stats
        want = _checksums(hugging_face(tree).items(), 1)
        ans = client.weight_checker("compare", baseline=want)
        ours = [name for name in ans["mismatches"] if name in want]  # the server is shared
        assert not ours, ours[:5]
        check = sender.verify(tree)
        assert check.ok and len(check.matched) == len(want), check
    sender.close()
    print(f"OK {mode}: a Tunix Qwen3 tree as {len(want)} Hugging Face tensors, twice, "
          f"bit-exact on vLLM's worker; last: {stats}")


def tunix_grpo_step(url: str) -> None:
    """One step of Tunix's own GRPO learner on a tiny Qwen3 whose rollout is
    ``VLLMServerRollout``: samples from a loopback completions server, and the
    learner's ``sync_weights`` pushes the trained actor into vLLM's engine at
    ``url``. vLLM's checksums must be those of the checkpoint before the step
    and of the trained actor (written out by hand) after it."""
    import functools
    import tempfile

    from flax import nnx

    from jax_sender import TUNIX_QWEN3, WeightSender
    from jax_sender.integrations.tunix import VLLMServerRollout

    from support.servers.completions_server import CompletionsServer
    from support.tiny_tunix import (
        EOS,
        V,
        build_cluster,
        grpo_step,
        hf_checkpoint,
        hugging_face,
        tunix_model,
    )
    sender = WeightSender.connect(url, mapping=TUNIX_QWEN3)
    client = sender.session.clients[0]
    completions = CompletionsServer(vocab_size=V, eos_id=EOS)
    checkpoint = hf_checkpoint(5)
    try:
        with tempfile.TemporaryDirectory() as folder:
            actor = tunix_model(folder, checkpoint)
        engine = functools.partial(VLLMServerRollout, completions.url, sender=sender)
        cluster = build_cluster(actor, engine, max_tokens_to_generate=4, temperature=1.0,
                                max_prompt_length=8)
        cluster.sync_weights()
        cluster.rollout.wait_for_push()
        ans = client.weight_checker("compare", baseline=_checksums(checkpoint.items(), 1))
        assert ans["match"], ans["mismatches"][:5]
        grpo_step(cluster)
        cluster.rollout.wait_for_push()
        state = nnx.state(cluster.actor_trainer.model, nnx.Param)
        trained = hugging_face(state)
        changed = [n for n in trained if trained[n].tobytes() != checkpoint[n].tobytes()]
        assert len(changed) > len(trained) // 2, changed
        ans = client.weight_checker("compare", baseline=_checksums(trained.items(), 1))
        assert ans["match"], ans["mismatches"][:5]
        check = sender.verify(state)
        assert check.ok and len(check.matched) == len(trained), check
        version = cluster.rollout.weight_version
        cluster.rollout.close()
    finally:
        completions.close()
        sender.close()
    print(f"OK: one GRPO step; {len(changed)} of {len(trained)} tensors trained, pushed as "
          f"{version!r}, bit-exact on vLLM's worker")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
