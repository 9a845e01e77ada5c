"""An asynchronous push's snapshot: private copies, in order, one per
distinct array, compiling nothing per array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender._src.core import snapshot
from jax_sender._src.core.snapshot import copies

DTYPES = ["int8", "uint8", "int32", "float16", "float32", "bfloat16", "float8_e4m3fn"]


def sample(dtype: str, shape=(3, 8), seed: int = 0) -> jax.Array:
    bits = np.random.default_rng(seed).integers(0, 256, size=np.prod(shape) * jnp.dtype(
        dtype).itemsize, dtype=np.uint8)
    return jnp.asarray(bits.view(jnp.dtype(dtype)).reshape(shape))


@pytest.mark.parametrize("runtime_copies", [True, False])
def test_copies_are_private_in_order_and_one_per_distinct_array(runtime_copies, monkeypatch):
    """Each copy holds its array's bytes in a buffer of its own (a later step
    may donate the array), in the caller's order; an array given twice (a
    leaf that makes several tensors) is copied once; a copy is committed to
    its device exactly when its array is (so a call compiled for the copies
    runs the arrays too). Arrays of one shape go ``COPY_GROUP`` at a time;
    the rest through ``jax.device_put``, or, where the runtime would not
    copy on the same device, a jitted copy each."""
    monkeypatch.setattr(snapshot, "COPY_GROUP", 2)
    monkeypatch.setattr(snapshot, "puts_copy", lambda device: runtime_copies)
    same = [jnp.full((3, 2), i, jnp.float32) for i in range(5)]
    others = [sample(d, (4,), i) for i, d in enumerate(DTYPES)]
    device = jax.devices()[0]
    pinned = jax.device_put(jnp.arange(6.0).reshape(3, 2), device)
    arrays = [*same, *others, same[1], pinned]
    out = copies(arrays, device)
    assert [np.asarray(c).tobytes() for c in out] == [np.asarray(a).tobytes() for a in arrays]
    assert [(c.shape, c.dtype) for c in out] == [(a.shape, a.dtype) for a in arrays]
    theirs = {a.unsafe_buffer_pointer() for a in arrays}
    assert not theirs & {c.unsafe_buffer_pointer() for c in out}
    assert len({c.unsafe_buffer_pointer() for c in out}) == len(arrays) - 1
    assert out[len(same) + len(others)] is out[1]
    assert [c.committed for c in out] == [a.committed for a in arrays] and pinned.committed


def test_jax_device_put_copies_on_the_same_cpu_device():
    """What ``copies`` counts on here: jaxlib's runtime copies an array
    already on the device when asked not to alias it."""
    assert snapshot.puts_copy(jax.devices()[0])


def test_copies_compile_nothing_per_array():
    """One jitted call per shape many arrays share (compiled once), none for
    the rest: 300 arrays of 300 shapes and 200 of one shape, no more than one
    compilation (none once that shape's call exists)."""
    compiled = []

    def count(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    arrays = [jax.device_put(np.full(i + 1, i, np.float32)) for i in range(300)]  # no compiling
    arrays += [jax.device_put(np.full((7, 5), i, jnp.bfloat16)) for i in range(200)]
    jax.block_until_ready(arrays)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        first = copies(arrays, jax.devices()[0])
        again = copies(arrays, jax.devices()[0])
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert len(compiled) <= 1, compiled
    assert np.asarray(again[-1]).tobytes() == np.asarray(first[-1]).tobytes()
