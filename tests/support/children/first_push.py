"""How long the first push of a tree of many tensors holds the trainer, and
what it adds to the process's memory, asynchronous against blocking, on
CPU over the in-memory link (``memory_link``). Run in a child process, so
that no earlier compilation or allocation of the test run counts:

    python -m support.children.first_push TENSORS BYTES CHUNKS [--transform]

``TENSORS`` float32 tensors of ``BYTES`` each, cut into about ``CHUNKS``
packed chunks. First a fresh sender's ``send(wait=False)`` of the tree
(its first push: the time until it returns, the push's end, the peak
resident memory it added), then another fresh sender's blocking ``send``
of the same tree; both pushes checked bit-exact. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time


def _reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def tree(n: int, nbytes: int, seed: int) -> dict:
    import jax.numpy as jnp
    return {f"t{i:06d}": jnp.full((nbytes // 4,), i + seed, jnp.float32) for i in range(n)}


def main(argv: list[str]) -> None:
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp

    from jax_sender import Mapping, SendConfig

    from support.pushes import expected, held
    from support.servers.memory_link import memory_sender

    n, nbytes, chunks = map(int, argv[:3])
    mapping = Mapping(transform=lambda p, x: x * 2) if "--transform" in argv else Mapping()
    config = SendConfig(buffer_size_bytes=max(n * nbytes // chunks - 1, 1), send_timeout_s=600)
    p = tree(n, nbytes, 0)
    jax.block_until_ready(p)
    want = expected(p, None if mapping.transform is Mapping().transform
                    else lambda path, x: x * 2)
    jnp.zeros(1).block_until_ready()  # JAX's own start-up is no push's
    out = {"tensors": n, "bytes": n * nbytes}
    for wait in (False, True):
        sender, (server,), _ = memory_sender(config, mapping=mapping)
        _reset_peak()
        base = _rss("VmRSS")
        t = time.perf_counter()
        pending = sender.send(p, wait=wait)
        returned = time.perf_counter() - t
        stats = pending if wait else pending.result(timeout=600)
        key = "blocking" if wait else "async"
        out[key] = {"returned_s": returned, "total_s": time.perf_counter() - t,
                    "chunks": stats.chunks, "added_rss": _rss("VmHWM") - base}
        assert held(server) == want, key
        sender.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
