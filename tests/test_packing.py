"""XLA's packing of a chunk: words that hold exactly the bytes vLLM's consumer reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender.naming import identity
from jax_sender.packing import as_units, chunk_packer, unit_of
from jax_sender.plan import TensorMeta, plan_chunks

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
