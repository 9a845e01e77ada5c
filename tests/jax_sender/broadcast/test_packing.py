"""XLA's packing of a chunk: words that hold exactly the bytes vLLM's consumer
reads; which pushes XLA packs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender._src.broadcast.packing import (
    as_units,
    chunk_packer,
    pack_chunk,
    packable,
    unit_of,
    writable,
    write_chunk,
)
from jax_sender._src.core.tensors.naming import identity
from jax_sender._src.core.tensors.plan import Chunk, TensorMeta, plan_chunks

DTYPES = ["int8", "uint8", "int32", "float16", "float32", "bfloat16", "float8_e4m3fn"]


def sample(dtype: str, shape=(3, 8), seed: int = 0) -> jax.Array:
    bits = np.random.default_rng(seed).integers(0, 256, size=np.prod(shape) * jnp.dtype(
        dtype).itemsize, dtype=np.uint8)
    return jnp.asarray(bits.view(jnp.dtype(dtype)).reshape(shape))


@pytest.mark.parametrize("unit", [jnp.uint8, jnp.uint16, jnp.uint32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_words_hold_the_bytes_in_memory_order(dtype, unit):
    x = sample(dtype)
    words = jax.jit(as_units, static_argnums=1)(x, unit)
    assert words.dtype == unit and np.asarray(words).tobytes() == np.asarray(x).tobytes()


def test_the_unit_is_the_widest_word_that_divides_every_tensor():
    meta = lambda dtype, *shape: TensorMeta("t", dtype, shape)  # noqa: E731
    assert unit_of([meta("bfloat16", 4096), meta("float32", 3)]) == jnp.uint32
    assert unit_of([meta("bfloat16", 4096), meta("bfloat16", 3)]) == jnp.uint16
    assert unit_of([meta("float32", 2), meta("int8", 7)]) == jnp.uint8
    assert unit_of([meta("bfloat16", 0)]) == jnp.uint32  # empty tensors divide anything


def test_a_packed_chunk_is_its_tensors_bytes_end_to_end():
    arrays = [sample("bfloat16", (5, 6), 1), sample("int8", (0, 3), 2), sample("float32", (7,), 3),
              sample("float8_e4m3fn", (9,), 4), sample("float16", (3,), 5)]
    metas = tuple(TensorMeta.of(f"t{i}", a) for i, a in enumerate(arrays))
    (chunk,) = plan_chunks(metas, 1 << 20)
    out = chunk_packer(tuple((m.name,) for m in metas), identity, metas)(arrays)
    assert out.dtype == jnp.uint8  # 9 + 3 float8s: 9 bytes, so bytes it is
    assert np.asarray(out).tobytes() == b"".join(np.asarray(a).tobytes() for a in arrays)
    assert out.nbytes == chunk.nbytes


def test_a_transform_that_disagrees_with_its_metadata_is_refused_while_tracing():
    from jax_sender import MetadataError
    metas = (TensorMeta("a", "float32", (3,)), TensorMeta("b", "bfloat16", (4,)))
    packer = chunk_packer((("a",), ("b",)), lambda p, x: x.astype(jnp.float32), metas)
    with pytest.raises(MetadataError, match=r"'b': the transform gave float32 \(4,\), but "
                                            r"bfloat16 \(4,\) was declared"):
        packer([jnp.zeros(3), jnp.zeros(4, jnp.bfloat16)])


def test_a_chunk_written_in_place_is_the_packed_chunk_in_the_buffer_it_was_given():
    """``write_chunk`` writes the same words as ``pack_chunk``, transform
    included, into the donated buffer it is handed when that buffer fits,
    and into a fresh one when it does not."""
    transpose = lambda path, x: x.T if x.ndim == 2 else x  # noqa: E731
    arrays = [sample("bfloat16", (6, 4), 1), sample("float32", (7,), 2),
              sample("float16", (3, 2), 3)]
    metas = tuple(TensorMeta(f"t{i}", str(a.dtype), transpose(None, a).shape)
                  for i, a in enumerate(arrays))
    (chunk,) = plan_chunks(metas, 1 << 20)
    paths = [(m.name,) for m in metas]
    device = jax.devices()[0]
    def end_to_end(xs):  # the chunk vLLM's consumer reads, written out here
        return b"".join(np.asarray(transpose(None, x)).tobytes() for x in xs)

    want = end_to_end(arrays)
    assert np.asarray(pack_chunk(chunk, metas, paths, arrays, transpose)).tobytes() == want
    first = write_chunk(chunk, metas, paths, arrays, transpose, device)
    assert np.asarray(first).tobytes() == want and writable(chunk, metas)
    where = first.unsafe_buffer_pointer()
    again = [sample("bfloat16", (6, 4), 4), *arrays[1:]]
    second = write_chunk(chunk, metas, paths, again, transpose, device, first)
    assert first.is_deleted() and second.unsafe_buffer_pointer() == where
    assert np.asarray(second).tobytes() == end_to_end(again) != want
    small = jnp.zeros(3, jnp.uint16)
    third = write_chunk(chunk, metas, paths, arrays, transpose, device, small)
    assert np.asarray(third).tobytes() == want and not small.is_deleted()


def test_only_chunks_of_several_tensors_with_int32_word_offsets_are_written_in_place():
    one = TensorMeta("a", "float32", (4,))
    assert not writable(Chunk(start=0, stop=1, nbytes=16, offsets=(0,)), [one])
    assert writable(Chunk(start=0, stop=2, nbytes=32, offsets=(0, 16)), [one, one])
    huge = [TensorMeta("a", "int8", (2**31,)), TensorMeta("b", "int8", (1,))]
    assert not writable(Chunk(start=0, stop=2, nbytes=2**31 + 1, offsets=(0, 2**31)), huge)


def test_xla_packs_a_push_only_while_its_calls_are_small_and_few():
    """Compiling a chunk's call costs tens of milliseconds a tensor (more
    than linearly in its tensors): at most ``MAX_TENSORS`` a chunk and
    ``MAX_PACKED`` in all; chunks of one tensor compile no call of their own."""
    def chunks(*sizes: int) -> list[Chunk]:
        out, at = [], 0
        for n in sizes:
            out.append(Chunk(start=at, stop=at + n, nbytes=4 * n, offsets=tuple(range(0, 4 * n, 4))))
            at += n
        return out

    assert packable(chunks(256, 256)) and packable(chunks(91)) and packable(chunks(*[25] * 20))
    assert not packable(chunks(257))
    assert not packable(chunks(256, 256, 2))
    assert packable(chunks(*[1] * 20_000, 256))
    assert packable([])
