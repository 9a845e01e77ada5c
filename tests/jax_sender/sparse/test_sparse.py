"""Sparse patches: bit-exact against a dense push, lossy only when asked, and
nothing vLLM's sparse loader would refuse after the transfer (no GPU)."""

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sender import MetadataError
from jax_sender._src.core.tensors.plan import TensorMeta
from jax_sender._src.sparse.patches import (
    SPARSE_DTYPES,
    Patch,
    apply,
    check_patch,
    count_changed,
    count_changes,
    diff,
)
from jax_sender._src.sparse.sender import _Patches
from uniqueid import SparseUpdateInfo

DTYPES = {"bfloat16": (jnp.bfloat16, np.uint16), "float16": (jnp.float16, np.uint16),
          "float32": (jnp.float32, np.uint32), "float64": (jnp.float64, np.uint64)}


def _from_bits(bits: np.ndarray, dtype) -> jax.Array:
    return jnp.asarray(bits.view(np.dtype(dtype)))


def test_every_sparse_dtype_is_covered():
    assert sorted(DTYPES) == sorted(SPARSE_DTYPES)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(DTYPES)), st.sampled_from([0, 1, 7, 96, 300]), st.data())
def test_patch_reproduces_every_bit(dtype_name, n, data):
    """Random bit patterns (NaN payloads, -0.0, infinities included), random
    changes: exact, or refused up front when a changed value is NaN. float64
    runs with 64-bit types on, as a trainer sending float64 would."""
    with jax.enable_x64(dtype_name == "float64"):
        _patch_reproduces_every_bit(dtype_name, n, data)


def _patch_reproduces_every_bit(dtype_name, n, data):
    dtype, bits = DTYPES[dtype_name]
    width = np.iinfo(bits).max
    old_bits = np.array(data.draw(st.lists(st.integers(0, width), min_size=n, max_size=n)),
                        dtype=bits)
    new_bits = old_bits.copy()
    for i in data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)):
        new_bits[i] = data.draw(st.integers(0, width))
    shape = (n,) if n % 3 else (3, n // 3)
    old = _from_bits(old_bits, dtype).reshape(shape)
    new = _from_bits(new_bits, dtype).reshape(shape)
    changed = old_bits != new_bits
    with np.errstate(invalid="ignore"):  # signalling NaN payloads warn in isnan
        nan = np.isnan(new_bits.view(np.dtype(dtype)))
    if nan[changed].any():
        with pytest.raises(MetadataError, match="NaN"):
            count_changed("w", old, new)
        with pytest.raises(MetadataError, match="NaN"):
            diff("w", old, new)
        return
    patch = diff("w", old, new)
    assert patch.indices.dtype == jnp.int32 and patch.values.dtype == new.dtype
    assert patch.count == count_changed("w", old, new) == int(np.sum(changed))
    assert patch.indices.shape[0] >= patch.count  # padded to a power of two
    sent = np.asarray(patch.indices)[:patch.count]  # what goes on the wire
    assert sorted(sent.tolist()) == np.flatnonzero(changed).tolist()
    check_patch(TensorMeta.of("w", new), patch)  # what vLLM's loader would accept
    out = apply(old, patch)
    assert out.dtype == np.dtype(dtype)  # float64 stays float64
    assert np.array_equal(np.asarray(out).view(bits), np.asarray(new).view(bits))
    assert not patch.lossy


def test_signed_zero_counts_and_unchanged_nan_stays():
    old = jnp.array([0.0, np.nan, 1.0], jnp.float32)
    new = jnp.asarray(np.array([0x80000000, 0x7FC00000, 0x3F800001], np.uint32).view(np.float32))
    patch = diff("w", old, new)
    assert np.asarray(patch.indices)[:patch.count].tolist() == [0, 2]
    assert np.array_equal(np.asarray(apply(old, patch)).view(np.uint32),
                          np.asarray(new).view(np.uint32))


def test_what_vllms_sparse_loader_refuses_is_refused_first():
    """Integers cannot hold the NaN sentinel, float8 has no CUDA index_copy_ in
    vLLM 0.33.0, a NaN value reads as "keep"."""
    for dtype in (jnp.int8, jnp.float8_e4m3fn):  # no NaN / no CUDA index_copy_ in vLLM
        with pytest.raises(MetadataError, match="sparse worker loads only"):
            diff("x", jnp.zeros(3, dtype), jnp.ones(3, dtype))
    with pytest.raises(MetadataError, match="1 changed elements are NaN"):
        diff("w", jnp.zeros(3, jnp.bfloat16), jnp.array([0, np.nan, 0], jnp.bfloat16))
    meta = TensorMeta("w", "float32", (4,))
    good = Patch("w", (4,), jnp.array([3, 0], jnp.int32), jnp.ones(2, jnp.float32), 2)
    check_patch(meta, good)
    for indices, values in [([1, 1], [1.0, 2.0]), ([4], [1.0]), ([-1], [1.0]),
                            ([2], [np.nan])]:
        bad = Patch("w", (4,), jnp.array(indices, jnp.int32), jnp.array(values, jnp.float32),
                    len(indices))
        with pytest.raises(ValueError, match="NaN values, out-of-range indices, or duplicate"):
            check_patch(meta, bad)
    with pytest.raises(TypeError, match="floating dtype"):
        check_patch(TensorMeta("i", "int32", (4,)), good)
    with pytest.raises(RuntimeError, match="index_copy_cuda"):
        check_patch(TensorMeta("f8", "float8_e4m3fn", (4,)), good)


def test_tolerance_is_lossy_and_says_so():
    old = jnp.zeros(6, jnp.bfloat16)
    new = jnp.array([0, 1e-4, -1e-4, 0.5, -2, 5e-4], jnp.bfloat16)
    patch = diff("w", old, new, tolerance=1e-3)
    assert patch.lossy and np.asarray(patch.indices)[:patch.count].tolist() == [3, 4]


def test_sizes_and_refusals():
    old = jnp.zeros((4, 4), jnp.bfloat16)
    patch = diff("w", old, old.at[1, 2].set(3))
    assert patch.count == 1
    assert np.asarray(patch.indices)[:patch.count].tolist() == [6]
    with pytest.raises(MetadataError, match="same layout"):
        diff("w", old, jnp.zeros((4, 4), jnp.float32))


def test_counts_of_many_tensors_and_the_nan_refusal_name_the_tensor():
    old = [jnp.zeros(n, jnp.float32) for n in (5, 7, 9)]
    new = [old[0].at[1].set(2), old[1], old[2].at[jnp.array([0, 8])].set(1)]
    names = ["a", "b", "c"]
    assert count_changes(list(zip(names, old, new))) == [1, 0, 2]
    new[1] = new[1].at[3].set(jnp.nan)
    with pytest.raises(MetadataError, match="'b': 1 changed elements are NaN"):
        count_changes(list(zip(names, old, new)))


def test_counting_never_holds_the_whole_tree():
    """Pairs made as they are counted (a transform's outputs) are dropped once
    counted: making pair i, pair i - 2 is gone (Python still holds the last one)."""
    made = []

    def pairs():
        for i in range(5):
            assert i < 2 or made[i - 2]() is None, f"pair {i - 2} still held"
            new = jnp.full(8, float(i)).at[:i].set(-1.0)
            made.append(weakref.ref(new))
            yield f"w{i}", jnp.full(8, float(i)), new

    assert count_changes(pairs()) == [0, 1, 2, 3, 4]


def test_patches_are_made_ahead_only_within_their_budget():
    """A push's patches are built ahead of their broadcasts while the ones
    not yet handed over fit the budget; the one a broadcast needs always is."""
    old = [jnp.zeros(100, jnp.float32) for _ in range(4)]
    new = [o.at[jnp.arange(i, 100, 10)].set(i + 1.0) for i, o in enumerate(old)]  # 10 each
    metas = [TensorMeta(f"w{i}", "float32", (100,)) for i in range(4)]
    each = 16 * (4 + 4)  # 10 changes, padded to 16 int32 indices + 16 float32 values
    made = []

    def get_new(i):
        made.append(i)
        return new[i]

    patches = _Patches(metas, [10] * 4, old.__getitem__, get_new, None, budget=2 * each + 1)
    first = patches.ready(0)
    assert made == [0, 1]
    np.testing.assert_array_equal(apply(old[0], first), new[0])
    patches.take(0)
    patches.ready(1)
    assert made == [0, 1, 2]
    for i in (1, 2):
        np.testing.assert_array_equal(apply(old[i], patches.take(i)), new[i])
    patches.ready(3)
    assert made == [0, 1, 2, 3]
    tight = _Patches(metas, [10] * 4, old.__getitem__, new.__getitem__, None, budget=0)
    np.testing.assert_array_equal(apply(old[2], tight.ready(2)), new[2])  # 0 to 2, past it


def test_sparse_update_info_follows_vllms_rules():
    info = SparseUpdateInfo(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], [1, 0])
    assert SparseUpdateInfo.from_payload(info.to_payload()) == info
    for bad, match in [
        (dict(names=["a"], dtype_names=["float32"], shapes=[[1]], num_updates_list=[]),
         "cannot be empty"),
        (dict(names=["a"], dtype_names=["float32"], shapes=[[1]], num_updates_list=[1, 2]),
         "same size as `names`"),
        (dict(names=["a"], dtype_names=["float32"], shapes=[[1]], num_updates_list=[-1]),
         "Sparse `num_updates_list` entries must be non-negative"),
        (dict(names=["a"], dtype_names=["float32"], shapes=[[1]], num_updates_list=[1],
              src=1), "unexpected keyword argument 'src'"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            SparseUpdateInfo.from_payload(bad)
