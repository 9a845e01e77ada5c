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


def soak(url: str, count: str) -> None:
    """``count`` pushes: GPU free memory, /dev/shm files and this process's
    fds flat after the first few; the last push exact."""
    import jax

    from jax_sender import IPCSender, SendConfig
    sender = IPCSender.connect(url, config=SendConfig(buffer_size_bytes=1 << 20))
    seen = []
    for i in range(int(count)):
        sender.send(tree(i % 7))
        if i in (5, int(count) - 1):
            seen.append((jax.devices()[0].memory_stats()["bytes_in_use"], len(shm()),
                         len(os.listdir("/proc/self/fd"))))
    exact(sender, tree((int(count) - 1) % 7), 2)
    sender.close()
    assert seen[0] == seen[1], seen
    print(f"OK ipc soak: {count} pushes, (JAX bytes, /dev/shm files, fds) {seen[0]} after 6 "
          f"and {seen[1]} after {count}")


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


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
