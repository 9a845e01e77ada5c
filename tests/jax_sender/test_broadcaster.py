"""``Broadcaster.produced`` on CPU: its buffers, its window and its reuse.

The real ``Broadcaster`` runs here over a stand-in for the CUDA driver and
the communicator (this machine has no GPU): a broadcast reads its bytes
when launched and again when it completes, which is when its event is
waited for. A buffer written while its broadcast is still in flight shows
up as bytes that changed in between; a buffer never reused shows up as a
new address.
"""

from __future__ import annotations

import ctypes
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender._src import broadcaster as packer
from jax_sender._src.packing import write_chunk
from jax_sender._src.plan import Chunk, TensorMeta, plan_chunks


class FakeComm:
    """Broadcasts that complete when an event recorded after them is waited for."""

    device = 0

    def __init__(self):
        self.launched: list[tuple[int, bytes]] = []  # (address, bytes at launch)
        self.completed = 0
        self.changed: list[int] = []  # broadcasts whose bytes changed in flight

    def launch_broadcast(self, ptr, count, dtype, root, stream, timeout):
        self.launched.append((ptr, ctypes.string_at(ptr, count)))

    def wait_event(self, event, timeout, what, check=None):
        for i in range(self.completed, event.mark):
            ptr, data = self.launched[i]
            if ctypes.string_at(ptr, len(data)) != data:
                self.changed.append(i)
        self.completed = max(self.completed, event.mark)

    def in_flight(self) -> int:
        return len(self.launched) - self.completed


class FakeEvent:
    def __init__(self, comm: FakeComm):
        self.comm, self.mark = comm, 0

    def record(self, stream) -> FakeEvent:
        self.mark = len(self.comm.launched)
        return self

    def done(self) -> bool:
        return self.comm.completed >= self.mark

    def elapsed_s(self, later) -> float:
        return 0.0

    def close(self) -> None:
        pass


@pytest.fixture
def broadcaster(monkeypatch):
    comm = FakeComm()
    stream = types.SimpleNamespace(handle=0, wait_event=lambda e: None, close=lambda: None)

    def poll_until(done, timeout, *, check=lambda: None, on_timeout):
        while not done():
            check()

    fake = types.SimpleNamespace(Stream=lambda device: stream,
                                 Event=lambda device, timing=False: FakeEvent(comm),
                                 use_device=lambda device: None, poll_until=poll_until)
    monkeypatch.setattr(packer, "cuda", fake)
    b = packer.Broadcaster(comm, jax.devices("cpu")[0], 4096, 2)
    yield b, comm
    b.close()


def layer(seed: int) -> list[jax.Array]:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(k[0], (24, 16), jnp.float32),    # 1.5 KiB
            jax.random.normal(k[1], (40, 20), jnp.bfloat16),   # 1.6 KiB
            jax.random.normal(k[2], (300,), jnp.float32)]      # 1.2 KiB: closes its chunk


def transpose(path, x):
    return x.T if x.ndim == 2 else x


def push(b: packer.Broadcaster, comm: FakeComm, arrays: list[jax.Array], transform
         ) -> list[tuple[int, Chunk]]:
    """``arrays`` (``transform`` applied) through ``produced`` with reuse, in
    chunks of 4 KiB, a lone tensor broadcast from the transform's output as
    the sender does; checks each broadcast's bytes and the buffers alive;
    returns each chunk's address with the chunk."""
    metas = [TensorMeta(f"t{i}", str(a.dtype), transform(None, a).shape)
             for i, a in enumerate(arrays)]
    paths = [(m.name,) for m in metas]
    chunks = plan_chunks(metas, 4096)
    alive = []

    def make(k, spare):
        alive.append(comm.in_flight() + len(b._spares) + 1)
        if chunks[k].single:
            return transform(None, arrays[chunks[k].start])
        return write_chunk(chunks[k], metas, paths, arrays, transform, jax.devices("cpu")[0],
                           spare)

    start = len(comm.launched)
    b.produced(chunks, make, 0, timeout=10, check=lambda: None, reuse=True)
    sent = comm.launched[start:]
    want = [np.concatenate([np.asarray(transform(None, a)).reshape(-1).view(np.uint8)
                            for a in arrays[c.start:c.stop]]).tobytes() for c in chunks]
    assert [data for _, data in sent] == want
    assert max(alive) <= b.num_buffers
    return [(ptr, c) for (ptr, _), c in zip(sent, chunks)]


def test_produced_reuses_its_buffers_never_while_they_are_read(broadcaster):
    """Six chunks of three tensors each (transposed), pushed three times:
    every broadcast carries its chunk's bytes, none changes while in flight,
    at most ``num_buffers`` chunk buffers are ever alive, and the later
    pushes write into the first push's buffers, not new ones."""
    b, comm = broadcaster
    addresses = []
    for seed in range(3):
        sent = push(b, comm, [a for i in range(6) for a in layer(10 * seed + i)], transpose)
        assert len(sent) == 6 and not any(c.single for _, c in sent)
        addresses.append({ptr for ptr, _ in sent})
    assert comm.changed == []
    assert len(addresses[0]) == b.num_buffers  # six chunks through two buffers
    assert addresses[1] == addresses[2] == addresses[0]


def test_produced_with_chunks_of_every_kind_stays_exact_and_bounded(broadcaster):
    """A tensor alone in its chunk first (broadcast from its own array, never
    reused), full chunks, then a short last one, pushed three times: bytes
    exact, nothing changed in flight, at most ``num_buffers`` alive, and
    the full chunks' buffers carried from push to push."""
    b, comm = broadcaster
    seen = []
    for seed in range(3):
        arrays = [jax.random.normal(jax.random.PRNGKey(seed), (2000,), jnp.float32),
                  *[a for i in range(3) for a in layer(10 * seed + i)],
                  jnp.arange(5, dtype=jnp.int8)]
        sent = push(b, comm, arrays, lambda path, x: x)
        chunks = [c for _, c in sent]
        assert chunks[0].single and chunks[-1].nbytes < chunks[1].nbytes
        seen.append({ptr for ptr, c in sent if c.nbytes == chunks[1].nbytes})
    assert comm.changed == [] and seen[1] & seen[2]
