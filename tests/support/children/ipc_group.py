"""One trainer process of an IPC group on CPU, for ``ipc/test_group.py``:
``python -m support.children.ipc_group SCENARIO PROCESS URL STORE MODE``.

Process ``p`` exports from stand-in GPU ``p`` (``support.ipc_fabric``), the
server has a worker on GPU 0 and one on GPU 1, so each worker reads the
other process's buffer or this one's. Each prints ``OK ...`` and exits 0,
or raises.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_sender import SendConfig, SendError, UpdateIncomplete
from jax_sender._src.core.tensors.naming import Mapping
from jax_sender._src.ipc.sender import open_ipc_sender
from nccl_cffi.waiting import Deadline
from uniqueid import RendezvousError, VLLMClient
from uniqueid.ipc.group import open_link

from support.ipc_fabric import FabricMemory

CPU = jax.devices("cpu")[0]


def tree(seed: int) -> dict:
    """Several dtypes, a 0-d and an empty tensor; larger than a 4 KiB buffer."""
    rng = np.random.default_rng(seed)
    return {"g.big": jnp.asarray(rng.standard_normal((40, 33)).astype(np.float32)),
            "g.fp16": jnp.asarray(rng.standard_normal(77).astype(np.float16)),
            "g.i32": jnp.asarray(rng.integers(-9, 9, 13).astype(np.int32)),
            "g.zero_d": jnp.float32(seed), "g.empty": jnp.zeros((0, 3), jnp.float32)}


class CopyFails(FabricMemory):
    """While ``failing``, the copies fail, as on a GPU fault."""

    failing = False

    def sync(self, device: int, timeout, check=None) -> None:
        super().sync(device, timeout, check)
        if self.failing:
            raise RuntimeError(f"an illegal memory access on GPU {device}")


def sender(process: int, url: str, store: str, mode: str, memory: FabricMemory,
           timeout: float = 60.0):
    config = SendConfig(packed=mode == "packed", buffer_size_bytes=4096, init_timeout_s=timeout,
                        send_timeout_s=20)
    link = open_link(store, process, 2, Deadline(timeout))
    return open_ipc_sender([VLLMClient(url)] if process == 0 else [], {process: CPU},
                           mapping=Mapping(), config=config, memory=memory,
                           strict_devices=True, link=link)


def exact(s, params: dict) -> None:
    """Process 0: both workers hold ``params`` (vLLM's digests)."""
    result = s.verify(params)
    assert result.ok, result


def push(process: int, url: str, store: str, mode: str) -> None:
    """Two pushes of a changing tree, a reconnect, a third; both workers exact."""
    memory = FabricMemory()
    with sender(process, url, store, mode, memory) as s:
        for seed in (1, 2):
            stats = s.send(tree(seed))
            if process == 0:
                exact(s, tree(seed))
        s.reconnect()
        s.send(tree(3))
        if process == 0:
            exact(s, tree(3))
    assert memory.alive() == []
    print(f"OK pushed, {stats.chunks} chunk(s) each")


def copy_fails(process: int, url: str, store: str, mode: str) -> None:
    """Process 1's copies fail in its second push: both raise, naming it on
    process 0; the third push is exact on the same connection."""
    memory = CopyFails()
    with sender(process, url, store, mode, memory) as s:
        s.send(tree(1))
        memory.failing = process == 1
        try:
            s.send(tree(2))
        except SendError as e:
            why = str(e)
        else:
            raise AssertionError("the push went through")
        memory.failing = False
        assert ("trainer process 1 failed" in why) if process == 0 else ("illegal" in why), why
        s.send(tree(3))
        if process == 0:
            exact(s, tree(3))
    print("OK", why)


def other_tree(process: int, url: str, store: str, mode: str) -> None:
    """Process 1 pushes other tensors: refused on process 0 before any update
    of that push, then a push of one tree is exact."""
    with sender(process, url, store, mode, FabricMemory()) as s:
        try:
            s.send(tree(1) if process == 0 else {"other": jnp.ones(3)})
        except SendError as e:
            why = str(e)
            assert not isinstance(e, UpdateIncomplete), why  # on both: nothing was loaded
        else:
            raise AssertionError("the push went through")
        assert "pushes other tensors" in why and "keep their weights" in why, why
        s.send(tree(4))
        if process == 0:
            exact(s, tree(4))
    print("OK", why)


def alone(process: int, url: str, store: str, mode: str) -> None:
    """Process 1 never comes: process 0's connect ends at its deadline,
    naming it, and leaves the server released."""
    try:
        sender(0, url, store, mode, FabricMemory(), timeout=5.0)
    except RendezvousError as e:
        print("OK", e)
    else:
        raise AssertionError("the group formed without process 1")


if __name__ == "__main__":
    name, process, url, store, mode = sys.argv[1:6]
    {"push": push, "copy_fails": copy_fails, "other_tree": other_tree,
     "alone": alone}[name](int(process), url, store, mode)
