"""``Broadcaster`` on CPU: every mode's bytes, its slots, its window, the
completion of a failed pass, and what it frees.

The real ``Broadcaster`` runs here over ``support.fake_gpu``: a stand-in
for the CUDA streams, events and copies, and for the communicator, that
follows CUDA's ordering rules and schedules the work the two extreme ways
CUDA allows (every test runs under both):

* **early**: a broadcast starts at its launch and reads its bytes then and
  again when it ends, so a slot written while it is in flight shows up;
* **late**: nothing runs until something waits for it, so a broadcast
  launched before its copies, a source freed before its copy ran, or
  scratch bytes freed under a pending copy, leave wrong bytes.

Device memory is valid while the JAX array that owns it lives (the
stand-in refuses reads and writes elsewhere), so the tests also see what
the broadcaster keeps alive and for how long. The bytes each broadcast must
carry are computed here with numpy, independently of the library: the
turn's arrays concatenated and cut at ``plan_chunks``'s boundaries (packed),
each array's own bytes (one tensor at a time), or ``fill``'s.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender._src.broadcast.packing import write_chunk
from jax_sender._src.core import broadcaster as packer
from jax_sender._src.core.broadcaster import UINT8, parts_of
from jax_sender._src.core.tensors.plan import Chunk, TensorMeta, plan_chunks
from nccl_cffi import NCCL_TYPES

from support.fake_gpu import RECEIVED, FakeComm, FakeGPU

CPU = jax.devices("cpu")[0]
BUFFER = 4096
NUM_BUFFERS = 2


class Boom(Exception):
    """A transform (or XLA) failing partway through a pass."""


def no_check() -> None:
    pass


def make_rig(monkeypatch, *, late: bool, rank: int = 0) -> tuple[packer.Broadcaster, FakeGPU]:
    """A real ``Broadcaster`` (4 KiB buffers, two of them) over a stand-in GPU;
    the scratch arena XLA allocates is registered as device memory."""
    gpu = FakeGPU(late=late, rank=rank)
    monkeypatch.setattr(packer, "cuda", gpu.cuda())
    ensure = packer.Arena.ensure

    def registered(self, capacity):
        ensure(self, capacity)
        if self._array is not None:
            gpu.memory.add(self._array)

    monkeypatch.setattr(packer.Arena, "ensure", registered)
    return packer.Broadcaster(FakeComm(gpu), CPU, BUFFER, NUM_BUFFERS), gpu


@pytest.fixture(params=["early", "late"])
def rig(request, monkeypatch):
    b, gpu = make_rig(monkeypatch, late=request.param == "late")
    yield b, gpu
    b.close()


# -- the data: a turn of tensors, its transform, the bytes expected ------------------

def normal(seed: int, shape: tuple[int, ...], dtype) -> jax.Array:
    """Random values made by numpy (no XLA compile per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def layer(seed: int) -> list[jax.Array]:
    return [normal(seed, (24, 16), jnp.float32),    # 1.5 KiB
            normal(seed + 1, (40, 20), jnp.bfloat16),   # 1.6 KiB
            normal(seed + 2, (300,), jnp.float32)]      # 1.2 KiB: closes its chunk


def turn(seed: int) -> list[jax.Array]:
    """Chunks of every kind at 4 KiB: a tensor larger than the buffer first
    (its own chunk), full chunks of three tensors, another large tensor in
    the middle (larger than both slots together), and a short last chunk
    holding an odd-sized and an empty tensor."""
    return [normal(1000 + seed, (3000,), jnp.float32),                      # 12000 B
            *layer(10 * seed), *layer(10 * seed + 4),
            normal(2000 + seed, (2500,), jnp.float32),                      # 10000 B
            *layer(10 * seed + 7), *layer(10 * seed + 11),
            jnp.arange(5, dtype=jnp.int8), jnp.zeros((0,), jnp.float32),
            jnp.arange(3, dtype=jnp.bfloat16)]


def flip(path, x):
    """The transform: new arrays that only the broadcaster holds."""
    return x.T if x.ndim == 2 else x[::-1]


def np_flip(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T if a.ndim == 2 else a[::-1])


def wire_bytes(arrays: list[jax.Array]) -> list[bytes]:
    """Each array's bytes after the transform, computed with numpy."""
    return [np_flip(np.asarray(a)).tobytes() for a in arrays]


def cut(arrays: list[jax.Array], chunks: list[Chunk]) -> list[bytes]:
    """What vLLM's packed consumer expects: the turn's bytes end to end, cut
    at the chunk boundaries."""
    blob, out, at = b"".join(wire_bytes(arrays)), [], 0
    for c in chunks:
        out.append(blob[at:at + c.nbytes])
        at += c.nbytes
    assert at == len(blob)
    return out


def metas_of(arrays: list[jax.Array]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", str(a.dtype), flip(None, a).shape) for i, a in enumerate(arrays)]


class Source:
    """``get(i)`` as a push gives tensors to the broadcaster: tensor ``i``
    transformed (a temporary nothing else holds), ready, registered as
    device memory; raises ``Boom`` at ``fail_at``. ``alive()``: the indices
    of the temporaries handed out that are still alive."""

    def __init__(self, gpu: FakeGPU, arrays: list[jax.Array], fail_at: int | None = None):
        self.gpu, self.arrays, self.fail_at = gpu, arrays, fail_at
        self.handed: list[tuple[int, weakref.ref]] = []
        self.pointers: dict[int, int] = {}

    def __call__(self, i: int) -> jax.Array:
        if i == self.fail_at:
            raise Boom(f"the transform of tensor {i} failed")
        out = flip(None, self.arrays[i]).block_until_ready()
        self.gpu.memory.add(out)
        self.handed.append((i, weakref.ref(out)))
        self.pointers[i] = int(out.unsafe_buffer_pointer())
        return out

    def alive(self) -> list[int]:
        return [i for i, ref in self.handed if ref() is not None]


# -- packed: copies into slots ----------------------------------------------------------

@pytest.mark.parametrize("temporaries", [True, False])
def test_packed_sends_the_turns_bytes_cut_at_plan_chunks_boundaries(rig, temporaries):
    """Two passes of a turn with chunks of every kind: each broadcast is a
    ``uint8`` one of its chunk's bytes, on the NCCL stream; a tensor alone
    in its chunk goes from its own buffer (no copy), the k-th chunk of
    several from slot k mod 2; never more than two broadcasts in flight (and
    two at times: the copies of one chunk overlap the broadcast of the
    last); nothing written under a broadcast in flight, in either pass. With
    ``temporaries`` each chunk's tensors are freed once copied (the host
    waits for the copy, so only the chunk at hand is ever alive, besides
    lone tensors whose own broadcast is in flight); without, the host never
    waits for a copy. Nothing is kept after a pass. Every launch and wait
    is bounded by the call's timeout."""
    b, gpu = rig
    for seed in range(2):
        packed_pass(b, gpu, turn(seed), temporaries)
    gpu.synchronize()
    assert gpu.problems == []
    assert b.comm.timeouts and set(b.comm.timeouts) == {10}


def packed_pass(b: packer.Broadcaster, gpu: FakeGPU, arrays: list[jax.Array],
                temporaries: bool) -> None:
    """One ``packed`` pass over ``arrays`` and the checks of the test above."""
    metas = metas_of(arrays)
    chunks = plan_chunks(metas, BUFFER)
    multi = [c for c in chunks if not c.single]
    assert len(multi) == 5 and sum(c.single for c in chunks) == 2
    source = Source(gpu, arrays)
    start, waits = len(gpu.broadcasts), len(gpu.host_waits)
    alive_at_launch: list[tuple[list[int], list[int]]] = []  # (alive, chunks in flight)
    gpu.on_launch = lambda _: alive_at_launch.append((source.alive(), [
        x.index - start for x in gpu.broadcasts[start:-1] if not x.done]))
    b.packed(metas, chunks, source, 0, timeout=10, check=no_check, temporaries=temporaries)
    sent = gpu.broadcasts[start:]
    assert [s.data for s in sent] == cut(arrays, chunks)
    assert [(s.count, s.dtype, s.root, s.stream) for s in sent] == \
        [(c.nbytes, UINT8, 0, b.nccl_stream.handle) for c in chunks]
    slot = max(c.nbytes for c in multi)
    k = 0
    for s, c in zip(sent, chunks):
        if c.single:
            assert s.ptr == source.pointers[c.start]
        else:
            assert s.ptr == b.arena.ptr + (k % NUM_BUFFERS) * slot
            k += 1
    assert max(s.in_flight for s in sent) == NUM_BUFFERS
    copy_waits = gpu.host_waits[waits:].count("packing copy")
    if temporaries:
        assert copy_waits == len(multi)
        for (alive, flying), c in zip(alive_at_launch, chunks):
            lone = {chunks[j].start for j in flying if chunks[j].single}
            assert set(alive) <= set(range(c.start, c.stop)) | lone
    else:
        assert copy_waits == 0
    assert source.alive() == [] and gpu.in_flight() == 0
    assert b.launched == len(chunks)
    assert b.link_bytes == sum(c.nbytes for c in chunks[1:]) and b.link_s == gpu.elapsed_s


# -- produced: chunks XLA writes ---------------------------------------------------------

def transpose(path, x):
    return x.T if x.ndim == 2 else x


def identity(path, x):
    return x


def push(b: packer.Broadcaster, gpu: FakeGPU, arrays: list[jax.Array], transform
         ) -> list[tuple[int, Chunk]]:
    """``arrays`` (``transform`` applied) through ``produced`` with reuse, in
    chunks of 4 KiB, a lone tensor broadcast from the transform's output as
    the sender does; checks each broadcast's bytes and the buffers alive;
    returns each chunk's address with the chunk."""
    metas = [TensorMeta(f"t{i}", str(a.dtype), transform(None, a).shape)
             for i, a in enumerate(arrays)]
    paths = [(m.name,) for m in metas]
    chunks = plan_chunks(metas, BUFFER)
    alive = []

    def make(k, spare):
        alive.append(gpu.in_flight() + len(b._spares) + 1)
        if chunks[k].single:
            return gpu.memory.add(transform(None, arrays[chunks[k].start]))
        return gpu.memory.add(write_chunk(chunks[k], metas, paths, arrays, transform, CPU, spare))

    start = len(gpu.broadcasts)
    b.produced(chunks, make, 0, timeout=10, check=no_check, reuse=True)
    sent = gpu.broadcasts[start:]
    want = [np.concatenate([np.asarray(transform(None, a)).reshape(-1).view(np.uint8)
                            for a in arrays[c.start:c.stop]]).tobytes() for c in chunks]
    assert [s.data for s in sent] == want
    assert [(s.count, s.dtype) for s in sent] == [(c.nbytes, UINT8) for c in chunks]
    assert max(alive) <= b.num_buffers
    return [(s.ptr, c) for s, c in zip(sent, chunks)]


def test_produced_reuses_its_buffers_never_while_they_are_read(rig):
    """Six chunks of three tensors each (transposed), pushed three times:
    every broadcast carries its chunk's bytes, none changes while in flight,
    at most ``num_buffers`` chunk buffers are ever alive, and the later
    pushes write into the first push's buffers, not new ones."""
    b, gpu = rig
    addresses = []
    for seed in range(3):
        sent = push(b, gpu, [a for i in range(6) for a in layer(10 * seed + 3 * i)], transpose)
        assert len(sent) == 6 and not any(c.single for _, c in sent)
        addresses.append({ptr for ptr, _ in sent})
    gpu.synchronize()
    assert gpu.problems == []
    assert len(addresses[0]) == b.num_buffers  # six chunks through two buffers
    assert addresses[1] == addresses[2] == addresses[0]


def test_produced_with_chunks_of_every_kind_stays_exact_and_bounded(rig):
    """A tensor alone in its chunk first (broadcast from its own array, never
    reused), full chunks, then a short last one, pushed three times: bytes
    exact, nothing changed in flight, at most ``num_buffers`` alive, and
    the full chunks' buffers carried from push to push."""
    b, gpu = rig
    seen = []
    for seed in range(3):
        arrays = [normal(seed, (2000,), jnp.float32),
                  *[a for i in range(3) for a in layer(10 * seed + 3 * i)],
                  jnp.arange(5, dtype=jnp.int8)]
        sent = push(b, gpu, arrays, identity)
        chunks = [c for _, c in sent]
        assert chunks[0].single and chunks[-1].nbytes < chunks[1].nbytes
        seen.append({ptr for ptr, c in sent if c.nbytes == chunks[1].nbytes})
    gpu.synchronize()
    assert gpu.problems == [] and seen[1] & seen[2]


# -- unpacked: one broadcast per tensor --------------------------------------------------

def test_unpacked_sends_each_tensor_from_its_buffer_in_its_own_dtype(rig):
    """Twenty tensors of five dtypes: each broadcast goes from the tensor's
    own buffer, with its element count and its ``ncclDataType_t``, and
    carries its bytes; the tensor is kept until its broadcast ended (the
    stand-in refuses freed memory), then freed; up to eight broadcasts in
    flight, never more (the window of ``max(num_buffers, 8)``). Every launch
    and wait is bounded by the call's timeout."""
    b, gpu = rig
    shapes = [((7, 3), jnp.float32), ((11,), jnp.bfloat16), ((13,), jnp.int8),
              ((5,), jnp.int32), ((4, 6), jnp.float16)]
    arrays = [normal(i, *shapes[i % 5]) for i in range(20)]
    metas = metas_of(arrays)
    source = Source(gpu, arrays)
    gpu.rank = 1  # this rank is the root
    b.unpacked(metas, source, 1, timeout=10, check=no_check)
    sent = gpu.broadcasts
    assert [s.data for s in sent] == wire_bytes(arrays)
    assert [(s.ptr, s.count, s.dtype, s.root) for s in sent] == \
        [(source.pointers[i], m.numel, NCCL_TYPES[m.dtype][0], 1) for i, m in enumerate(metas)]
    assert max(s.in_flight for s in sent) == 8
    assert source.alive() == []
    gpu.synchronize()
    assert gpu.problems == []
    assert b.comm.timeouts and set(b.comm.timeouts) == {10}


# -- scratch: bytes that carry no weights ---------------------------------------------------

def test_scratch_on_the_root_sends_each_part_from_scratch_bytes(rig):
    """Parts of several dtypes and sizes: each broadcast goes from the
    scratch arena (large enough for the largest part), with the part's count
    and type code, two in flight at most."""
    b, gpu = rig
    arrays = turn(3)
    parts = parts_of(metas_of(arrays), None) + [(9000, UINT8, 9000)]
    b.scratch(parts, 0, timeout=10, check=no_check)
    sent = gpu.broadcasts
    assert [(s.count, s.dtype, s.nbytes) for s in sent] == parts
    assert {s.ptr for s in sent} == {b.arena.ptr} and b.arena.capacity >= 12000
    assert max(s.in_flight for s in sent) == NUM_BUFFERS
    gpu.synchronize()
    assert gpu.problems == []


def test_scratch_off_the_root_receives_into_the_scratch_arena(monkeypatch):
    """Another rank's turn: every broadcast is received into the arena (the
    stand-in writes what arrives there), never into freed memory."""
    b, gpu = make_rig(monkeypatch, late=True, rank=0)
    parts = [(100, NCCL_TYPES["float32"][0], 400), (3000, UINT8, 3000)]
    b.scratch(parts, 1, timeout=10, check=no_check)
    assert [(s.ptr, s.count, s.dtype, s.root) for s in gpu.broadcasts] == \
        [(b.arena.ptr, 100, 7, 1), (b.arena.ptr, 3000, UINT8, 1)]
    assert set(np.asarray(b.arena._array)[:3000].tolist()) == {RECEIVED}
    assert gpu.problems == []
    b.close()


def test_scratch_with_fill_sends_fills_arrays(rig):
    """With ``fill``, part ``k`` goes from ``fill(k)``'s buffer (patches a
    sparse loader needs), with the part's count and type; each is kept
    until its broadcast ended, then freed."""
    b, gpu = rig
    arrays = turn(4)[:6]
    metas = metas_of(arrays)
    parts = parts_of(metas, None)
    fills = Source(gpu, arrays)
    b.scratch(parts, 0, timeout=10, check=no_check, fill=fills)
    sent = gpu.broadcasts
    assert [s.data for s in sent] == wire_bytes(arrays)
    assert [(s.ptr, s.count, s.dtype) for s in sent] == \
        [(fills.pointers[k], count, code) for k, (count, code, _) in enumerate(parts)]
    assert fills.alive() == []
    gpu.synchronize()
    assert gpu.problems == []


# -- complete: the rest of a pass that failed -----------------------------------------------

def failed_pass(b: packer.Broadcaster, gpu: FakeGPU, kind: str, arrays: list[jax.Array]
                ) -> tuple[list, list[bytes]]:
    """Run a pass of ``kind`` over ``arrays`` that raises partway (a
    transform failing); the parts the workers expect of it, and the bytes of
    each."""
    metas = metas_of(arrays)
    chunks = plan_chunks(metas, BUFFER)
    if kind == "unpacked":
        with pytest.raises(Boom):
            b.unpacked(metas, Source(gpu, arrays, fail_at=5), 0, timeout=10, check=no_check)
        return parts_of(metas, None), wire_bytes(arrays)
    if kind == "produced":
        paths = [(m.name,) for m in metas]

        def make(k, spare):
            if k == 4:
                raise Boom("XLA failed")
            c = chunks[k]
            out = flip(None, arrays[c.start]) if c.single else \
                write_chunk(c, metas, paths, arrays, flip, CPU, spare)
            return gpu.memory.add(out)

        with pytest.raises(Boom):
            b.produced(chunks, make, 0, timeout=10, check=no_check, reuse=True)
    else:  # packed: in the middle of a chunk of several (copies pending), or at a lone tensor
        fail_at = {"packed": 5, "packed, a lone tensor": 7}[kind]
        with pytest.raises(Boom):
            b.packed(metas, chunks, Source(gpu, arrays, fail_at=fail_at), 0, timeout=10,
                     check=no_check)
    return parts_of(metas, chunks), cut(arrays, chunks)


@pytest.mark.parametrize("kind", ["packed", "packed, a lone tensor", "produced", "unpacked"])
def test_complete_sends_exactly_the_parts_not_launched_once_all_else_ended(rig, kind):
    """After a pass that raised partway, ``complete`` sends exactly the parts
    not launched yet, with each part's count and type, from scratch bytes;
    before its first broadcast every copy and every broadcast of the failed
    pass has ended (the scratch arena grows here, freeing the slots those
    copies wrote into). The broadcasts the failed pass launched carried
    their right bytes."""
    b, gpu = rig
    arrays = turn(7)
    parts, expected = failed_pass(b, gpu, kind, arrays)
    done = b.launched
    assert 0 < done < len(parts)
    b.complete(parts, 0, timeout=10, check=no_check)
    sent = gpu.broadcasts
    assert [(s.count, s.dtype, s.nbytes) for s in sent] == parts
    assert (sent[done].in_flight, sent[done].pending_copies) == (1, 0)
    assert max(s.in_flight for s in sent) <= max(NUM_BUFFERS, 8 if kind == "unpacked" else 0)
    assert {s.ptr for s in sent[done:]} == {b.arena.ptr}
    assert b.arena.capacity >= max(n for _, _, n in parts[done:])
    gpu.synchronize()
    assert [s.data for s in sent[:done]] == expected[:done]
    assert gpu.problems == []


def test_complete_with_fill_sends_fill_of_each_remaining_part(rig):
    """With ``fill``, the remaining part ``k`` (numbered in the whole pass)
    goes from ``fill(k)``: what a sparse loader needs to finish its round."""
    b, gpu = rig
    arrays = turn(8)
    parts, _ = failed_pass(b, gpu, "unpacked", arrays)
    done = b.launched
    fills = Source(gpu, arrays)
    b.complete(parts, 0, timeout=10, check=no_check, fill=fills)
    rest = gpu.broadcasts[done:]
    assert [s.data for s in rest] == wire_bytes(arrays)[done:]
    assert [(s.ptr, s.count, s.dtype) for s in rest] == \
        [(fills.pointers[done + j], *parts[done + j][:2]) for j in range(len(rest))]
    gpu.synchronize()
    assert gpu.problems == []


# -- close ------------------------------------------------------------------------------------

def test_close_destroys_every_stream_and_event(monkeypatch):
    """After passes that left events in every place the broadcaster keeps
    them (in flight after a failure, pooled, per slot, the timing marks),
    ``close`` destroys every stream and every event it ever made, and gives
    the arena back."""
    b, gpu = make_rig(monkeypatch, late=True)
    arrays = turn(9)
    metas = metas_of(arrays)
    chunks = plan_chunks(metas, BUFFER)
    b.packed(metas, chunks, Source(gpu, arrays), 0, timeout=10, check=no_check)
    with pytest.raises(Boom):
        b.packed(metas, chunks, Source(gpu, arrays, fail_at=9), 0, timeout=10, check=no_check)
    assert gpu.in_flight() > 0  # the failed pass left broadcasts in flight
    b.close()
    assert [s.closed > 0 for s in gpu.streams] == [True, True]
    assert len(gpu.events) > 4 and all(e.closed > 0 for e in gpu.events)
    assert b.arena.capacity == 0 and b.arena.ptr == 0
