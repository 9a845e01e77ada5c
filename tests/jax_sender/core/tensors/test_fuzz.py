"""Fuzzing what a push sends: ``describe``, the chunk plan, the declared-metadata check.

Every expectation is written out here: names are the dotted paths of a
tree walked in JAX's order (dict keys sorted, sequences in order), dtypes
and shapes are those the arrays were made with (or what a transform makes of
them, by its rule), and chunk cuts come from the independent memory server's
``cut_chunks``. The wire payloads' fuzz is ``tests/uniqueid/test_fuzz.py``.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sender import Mapping, MetadataError, TensorMeta, describe, plan_chunks
from jax_sender._src.core.tensors.plan import WIRE_DTYPES, check_against, check_alignment

from support.servers.memory_server import cut_chunks

ITEMSIZE = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
            "float64": 8, "bfloat16": 2, "float8_e4m3fn": 1}
# How a leaf is made -> (the leaf, the dtype name the workers are told).
# JAX runs without 64-bit types: host float64 and int64 arrays, which it
# would narrow, are refused (None), naming the fix.
MAKERS = {
    "jax float32": (lambda s: jnp.zeros(s, jnp.float32), "float32"),
    "jax bfloat16": (lambda s: jnp.zeros(s, jnp.bfloat16), "bfloat16"),
    "jax float16": (lambda s: jnp.zeros(s, jnp.float16), "float16"),
    "jax int8": (lambda s: jnp.zeros(s, jnp.int8), "int8"),
    "jax uint8": (lambda s: jnp.zeros(s, jnp.uint8), "uint8"),
    "jax int32": (lambda s: jnp.zeros(s, jnp.int32), "int32"),
    "jax float8": (lambda s: jnp.zeros(s, jnp.float8_e4m3fn), "float8_e4m3fn"),
    "numpy bfloat16": (lambda s: np.zeros(s, ml_dtypes.bfloat16), "bfloat16"),
    "numpy int8": (lambda s: np.zeros(s, np.int8), "int8"),
    "numpy float64": (lambda s: np.zeros(s, np.float64), None),
    "numpy int64": (lambda s: np.zeros(s, np.int64), None),
}
dims = st.lists(st.integers(0, 5), max_size=3).map(tuple)
keys = st.text("abcxyz_019", min_size=1, max_size=4)  # no ".": every path names one leaf
leaf_specs = st.tuples(st.sampled_from(sorted(MAKERS)), dims)
trees = st.recursive(
    leaf_specs,
    lambda inner: (st.dictionaries(keys, inner, min_size=1, max_size=3)
                   | st.lists(inner, min_size=1, max_size=3)
                   | st.lists(inner, min_size=1, max_size=2).map(tuple)),
    max_leaves=8)


def build(spec):
    """The tree of arrays a spec describes."""
    if isinstance(spec, dict):
        return {k: build(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [build(v) for v in spec]
    if isinstance(spec, tuple) and not (len(spec) == 2 and isinstance(spec[0], str)):
        return tuple(build(v) for v in spec)
    maker, shape = spec
    return MAKERS[maker][0](shape)


def walk(spec, path=()):
    """(dotted name, dtype name, shape) per leaf, in JAX's order."""
    if isinstance(spec, dict):
        return [m for k in sorted(spec) for m in walk(spec[k], (*path, k))]
    if isinstance(spec, (list, tuple)) and not (len(spec) == 2 and isinstance(spec[0], str)):
        return [m for i, v in enumerate(spec) for m in walk(v, (*path, str(i)))]
    maker, shape = spec
    return [(".".join(path), MAKERS[maker][1], shape)]


def torch_rule(dtype: str, shape: tuple) -> tuple[str, tuple]:
    """What ``to_torch`` below makes of a leaf: 2-D transposed, float32 as bfloat16."""
    return ("bfloat16" if dtype == "float32" else dtype,
            shape[::-1] if len(shape) == 2 else shape)


def to_torch(path, x):
    x = x.T if x.ndim == 2 else x
    return x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(keys, trees, min_size=1, max_size=3) | st.lists(trees, min_size=1,
                                                                        max_size=3),
       st.booleans())
def test_a_tree_describes_to_its_arrays_names_dtypes_and_shapes_in_tree_order(spec, transformed):
    want = walk(spec)
    tree = build(spec)
    mapping = Mapping(transform=to_torch) if transformed else Mapping()
    if any(d is None for _, d, _ in want):
        with pytest.raises(MetadataError, match="jax_enable_x64"):
            describe(tree, mapping)
        return
    if transformed:
        want = [(n, *torch_rule(d, s)) for n, d, s in want]
    metas, sources = describe(tree, mapping)
    assert [(m.name, m.dtype, m.shape) for m in metas] == want
    assert [".".join(p) for p, _ in sources] == [n for n, _, _ in want]  # the same order
    assert all(m.nbytes == int(np.prod(m.shape)) * ITEMSIZE[m.dtype] for m in metas)


dtype_names = st.sampled_from(["float32", "bfloat16", "int8", "int32", "float16", "bool",
                               "complex64", "uint32", "float8_e4m3fn"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), st.tuples(dims, dtype_names)), max_size=6))
def test_pairs_describe_to_their_own_metadata_or_are_refused(spec):
    """Random names, shapes and dtypes (some not on vLLM's wire): refused exactly
    when nothing is given, a name is empty or repeated, or a dtype cannot travel."""
    names = [n for n, _ in spec]
    refuse = (not spec or "" in names or len(set(names)) < len(names)
              or any(d not in WIRE_DTYPES for _, (_, d) in spec))
    pairs = [(name, jnp.zeros(shape, dtype)) for name, (shape, dtype) in spec]
    if refuse:
        with pytest.raises(MetadataError):
            describe(pairs, Mapping())
        return
    metas, _ = describe(pairs, Mapping())
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        (n, d, s) for n, (s, d) in spec]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WIRE_DTYPES), dims), max_size=12), st.integers(1, 64))
def test_chunks_are_cut_like_vllms_consumer_and_misalignment_is_refused(spec, buffer_size):
    """The cut is the memory server's (vLLM's rule, written from its code);
    a tensor at an offset its dtype cannot be viewed at is refused, any other
    layout passes."""
    metas = [TensorMeta(f"t{i}", d, s) for i, (d, s) in enumerate(spec)]
    sizes = [int(np.prod(s)) * ITEMSIZE[d] for d, s in spec]
    chunks = plan_chunks(metas, buffer_size)
    cuts = cut_chunks(sizes, buffer_size)
    assert [list(range(c.start, c.stop)) for c in chunks] == cuts
    assert [c.nbytes for c in chunks] == [sum(sizes[i] for i in cut) for cut in cuts]
    misaligned = any(sum(sizes[j] for j in cut[:k]) % ITEMSIZE[spec[i][0]]
                     for cut in cuts for k, i in enumerate(cut))
    if misaligned:
        with pytest.raises(MetadataError, match="not a multiple of"):
            check_alignment(metas, chunks)
    else:
        check_alignment(metas, chunks)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=4), st.sampled_from(WIRE_DTYPES), dims), max_size=5),
       st.lists(st.tuples(st.text(max_size=4), st.sampled_from(WIRE_DTYPES), dims), max_size=5))
def test_declared_metadata_check_is_exact(declared, actual):
    d = [TensorMeta(n, t, tuple(s)) for n, t, s in declared]
    a = [TensorMeta(n, t, tuple(s)) for n, t, s in actual]
    if d == a:
        check_against(d, a)
    else:
        with pytest.raises(MetadataError):
            check_against(d, a)
