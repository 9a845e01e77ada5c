"""Trainer processes of the colocated (CUDA IPC) GPU tests, on the GPU the
server's workers use: ``python -m support.children.ipc_scenarios NAME ARGS``.

Each prints ``OK ...`` and exits 0, or raises. The push loads no NCCL
(checked: this package's libnccl loader never ran).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the workers share the GPU


def tree(seed: int, *, extra: bool = False) -> list:
    """Every wire dtype, a 0-d and an empty tensor, odd shapes, one tensor
    larger than a 1 MiB buffer (a chunk of its own)."""
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.PRNGKey(seed), 10)
    f = lambda i, s, d: (jax.random.normal(k[i], s) * 3).astype(d)  # noqa: E731
    pairs = [
        ("embed.weight", f(0, (1024, 768), jnp.bfloat16)),
        ("a.fp32", f(1, (5, 3, 2), jnp.float32)),
        ("a.fp64", f(2, (7,), jnp.float64) if jax.config.jax_enable_x64 else f(2, (7,), jnp.float32)),
        ("a.i32", jnp.arange(11, dtype=jnp.int32) * 1000003 + seed),
        ("a.scalar", jnp.float32(seed + 0.5)),
        ("a.bf16", f(3, (7, 13), jnp.bfloat16)),
        ("a.fp16", f(4, (33,), jnp.float16)),
        ("a.empty", jnp.zeros((0, 5), jnp.bfloat16)),
        ("b.big", f(5, (600, 1000), jnp.float32)),
        ("b.tail", f(6, (3,), jnp.bfloat16)),
        ("a.fp8", f(7, (129,), jnp.float8_e4m3fn)),
        ("a.int8", jax.random.randint(k[8], (61,), -128, 127).astype(jnp.int8)),
        ("a.uint8", jax.random.randint(k[9], (17,), 0, 255).astype(jnp.uint8)),
    ]
    if extra:
        pairs.append(("c.new", f(9, (4, 4), jnp.float32)))
    return pairs


def digests(pairs, ranks: int) -> dict[str, str]:
    import hashlib

    import numpy as np
    return {f"dp0:pp0:pcp0:tp{r}:{n}": hashlib.sha256(np.asarray(a).tobytes()).hexdigest()
            for n, a in pairs for r in range(ranks)}


def exact(sender, pairs, ranks: int) -> None:
    """vLLM's checksums of every worker's copy match the pushed arrays, and
    ``verify`` agrees; every export is released."""
    client = sender.session.clients[0]
    held = client.weight_checker("checksum")["checksums"]
    want = digests(pairs, ranks)
    wrong = [k for k, v in want.items() if held.get(k) != v]
    assert not wrong, wrong[:5]
    check = sender.verify(pairs)
    assert check.ok and len(check.matched) == len(pairs), check
    sender.session.connection.comm.counters.wait(range(10_000), 10.0, "the pushes' buffers")


def shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("jax_vllm_")}


def push(url: str, mode: str, ranks: str) -> None:
    """Packed or unpacked into vLLM's IPC engine: two versions, a changed
    tree, a push after ``reconnect()``, an asynchronous push under donation;
    bit-exact by vLLM's checksums every time; nothing held, nothing left."""
    import jax

    from jax_sender import IPCSender, SendConfig
    n, before = int(ranks), shm()
    sender = IPCSender.connect(url, config=SendConfig(packed=mode == "packed",
                                                      buffer_size_bytes=1 << 20))
    conn = sender.session.connection
    assert len(conn.ranks) == n and len(set(conn.ranks)) == 1, conn.ranks
    from nccl_cffi import library
    assert library._lib is None, "the IPC path loaded libnccl"
    for seed in (1, 2):
        stats = sender.send(tree(seed), weight_version=f"v{seed}")
        exact(sender, tree(seed), n)
    changed = tree(3, extra=True)[1:]
    sender.send(changed)
    exact(sender, changed, n)
    sender.reconnect()
    sender.send(tree(4))
    exact(sender, tree(4), n)
    params = dict(tree(5))
    pending = sender.send(params, wait=False)
    step = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0, t), donate_argnums=0)
    jax.block_until_ready(step(params))  # donates and overwrites what was pushed
    pending.result(timeout=120)
    exact(sender, tree(5), n)
    sender.close()
    assert shm() == before, shm() - before
    print(f"OK ipc {mode} -> {n} workers on one GPU: 6 pushes bit-exact, no NCCL, every "
          f"export released, /dev/shm clean; last blocking push {stats}")


def load_fails(url: str, mode: str) -> None:
    """A worker's load fails once mid-push: ``SendError``; the same server
    then takes ``reconnect()`` and an exact push, and a fresh sender too."""
    from jax_sender import IPCSender, SendConfig, SendError
    config = SendConfig(packed=mode == "packed", buffer_size_bytes=1 << 20)
    sender = IPCSender.connect(url, config=config)
    try:
        sender.send(tree(1))
        raise AssertionError("the load failure was not reported")
    except SendError as e:
        assert "loading" in str(e) and sender.broken, e
    sender.reconnect()
    sender.send(tree(2))
    exact(sender, tree(2), 2)
    sender.close()
    with IPCSender.connect(url, config=config) as fresh:
        fresh.send(tree(3))
        exact(fresh, tree(3), 2)
    print(f"OK ipc {mode}: a worker's load failure, then reconnect() and a fresh sender, "
          "both bit-exact")


def _server_side(pid: int) -> tuple[int, int]:
    """The server's processes (``pid`` and its descendants): their open fds,
    and their GPU memory in MiB (``nvidia-smi``)."""
    import subprocess
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    fds = sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids if os.path.isdir(f"/proc/{p}"))
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    mib = sum(int(m) for line in out.splitlines() for p, m in [line.split(", ")]
              if int(p) in pids)
    return fds, mib


def soak(url: str, count: str, server_pid: str) -> None:
    """``count`` pushes: on the trainer's side JAX's bytes, /dev/shm files
    and fds, on the server's its processes' fds and GPU memory, all flat
    from the 6th push to the last; the last push exact."""
    import jax

    from jax_sender import IPCSender, SendConfig
    sender = IPCSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    seen = []
    for i in range(int(count)):
        sender.send(tree(i % 7))
        if i in (5, int(count) - 1):
            sender.session.connection.comm.counters.wait(range(10_000), 10.0, "the pushes")
            seen.append((jax.devices()[0].memory_stats()["bytes_in_use"], len(shm()),
                         len(os.listdir("/proc/self/fd")), *_server_side(int(server_pid))))
    exact(sender, tree((int(count) - 1) % 7), 2)
    sender.close()
    assert seen[0] == seen[1], seen
    print(f"OK ipc soak: {count} pushes; (trainer JAX bytes, /dev/shm files, trainer fds, "
          f"server fds, server GPU MiB) {seen[0]} after 6 and {seen[1]} after {count}")


def _many(seed: int, gb: float) -> list:
    """``gb`` of bfloat16 in 256 KiB tensors: with a 1 MiB buffer, a push of
    one round per four tensors, thousands of rounds (seconds long)."""
    import jax
    import jax.numpy as jnp
    n = int(gb * 1e9 / (256 << 10))
    block = jax.random.normal(jax.random.PRNGKey(seed), (n, 128 << 10), jnp.bfloat16)
    return [(f"many.{i}", block[i]) for i in range(n)]


def ctrl_c(url: str, times: str) -> None:
    """Ctrl-C once (the push ends on the server, then ``KeyboardInterrupt``;
    the sender pushes on) or twice (aborted at once; ``reconnect()``) into a
    push of 1 MiB chunks; then exact pushes, and nothing left after close."""
    import signal
    import threading

    import jax

    from jax_sender import IPCSender, SendConfig
    before = shm()
    sender = IPCSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    pairs = _many(7, 1.0)
    jax.block_until_ready(pairs)
    for delay in [0.3, 0.4][:int(times)]:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    try:
        sender.send(pairs)
        raise AssertionError("the push ended before the Ctrl-C: make it larger")
    except KeyboardInterrupt as e:
        took, msg = time.monotonic() - t, str(e)
    if times == "1":
        assert not sender.broken and "ended on the servers first" in msg, (msg, sender.broken)
        exact(sender, pairs, 2)
    else:
        assert sender.broken, msg
        sender.reconnect()
    del pairs
    sender.send(tree(8))
    exact(sender, tree(8), 2)
    sender.close()
    assert shm() == before, shm() - before
    print(f"OK ipc {times} Ctrl-C: KeyboardInterrupt after {took:.2f} s ({msg}); then exact, "
          "/dev/shm clean")


def killed_mid_push(url: str) -> None:
    """Push once, then start a push of thousands of rounds, say so, and be
    killed inside it (it would print ``PUSH ENDED`` if it were not)."""
    import jax

    from jax_sender import IPCSender, SendConfig
    sender = IPCSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    sender.send(tree(1))
    pairs = _many(9, 4.0)
    jax.block_until_ready(pairs)
    print("INSIDE THE PUSH", flush=True)
    sender.send(pairs)
    print("PUSH ENDED", flush=True)


def fresh_push(url: str) -> None:
    """A new trainer on the server a killed one left mid-push: connect and an exact push."""
    from jax_sender import IPCSender, SendConfig
    t = time.monotonic()
    with IPCSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20)) as sender:
        took = time.monotonic() - t
        sender.send(tree(2))
        exact(sender, tree(2), 2)
    print(f"OK after a killed trainer: connect in {took:.2f} s and an exact push")


def refused(url: str, why: str) -> None:
    """Refused before the server is touched (``why``: the words to find)."""
    from jax_sender import IPCSender
    from uniqueid import RendezvousError
    t0 = time.monotonic()
    try:
        IPCSender.connect(url)
        raise AssertionError("connect did not refuse")
    except RendezvousError as e:
        assert why in str(e) and "\n" not in str(e), e
        print(f"OK refused in {time.monotonic() - t0:.2f} s: {e}")


def torch_contract() -> None:
    """Ours against torch's own producer on this GPU: the 15 arguments of
    ``reduce_tensor`` field by field (types, size, stride, dtype, the handle's
    format), the GPU UUID as torch prints it, the ref-counter file's size."""
    import base64
    import pickle

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from nccl_cffi.ipc import Exported, gpu_uuid
    from uniqueid.ipc.counters import FILE_BYTES, RefCounters
    from uniqueid.ipc.handles import RebuildArgs, pickled
    t = torch.arange(24, dtype=torch.bfloat16, device="cuda:0").reshape(4, 6)
    theirs = reduce_tensor(t)[1]
    counters, buffer = RefCounters(), Exported(1 << 20, 0)
    mine = RebuildArgs(shape=(4, 6), dtype="bfloat16", itemsize=2, device=0,
                       handle=buffer.handle, offset=512, counter=counters.name,
                       slot=counters.take(1)[0])
    ours = pickle.loads(base64.b64decode(pickled(mine.to_tuple())))
    assert [type(x) for x in ours] == [type(x) for x in theirs], (ours, theirs)
    assert (ours[0], ours[1], ours[2], ours[4], ours[5]) == (theirs[0], theirs[1], theirs[2],
                                                             theirs[4], theirs[5])
    assert len(ours[7]) == len(theirs[7]) == 66 and ours[7][:2] == theirs[7][:2], theirs[7][:2]
    assert len(ours[13]) == len(theirs[13]) == 64
    assert os.path.getsize("/dev/shm" + theirs[11].decode()) == FILE_BYTES
    assert str(torch.cuda.get_device_properties(0).uuid) == gpu_uuid(0)
    counters.close()
    buffer.free()
    print(f"OK torch's reduce_tensor and ours agree field by field (torch {torch.__version__}, "
          f"handle format {theirs[7][:2]!r}, uuid {gpu_uuid(0)})")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
