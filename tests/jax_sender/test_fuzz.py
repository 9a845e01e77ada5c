"""Fuzzing the payload builders and parsers: bad input is a clean exception, never a crash.

A payload that parses must also survive its own round trip, so the trainer
never sends what the reference receiver (vLLM's rules) would refuse.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jax_sender import Mapping, MetadataError, TensorMeta, describe, plan_chunks
from jax_sender._src.plan import WIRE_DTYPES, check_against, check_alignment
from uniqueid import InitInfo, UniqueId, UpdateInfo

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
VALID_UID = UniqueId.mint().to_b64()
init_keys = st.sampled_from(["nccl_unique_id_b64", "rank_offset", "world_size", "packed",
                             "packed_buffer_size_bytes", "packed_num_buffers", "use_load_plan",
                             "metadata", "master_address", "master_port", "src", "extra"])
init_values = json_values | st.just(VALID_UID) | st.integers(0, 5)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(init_keys, init_values, max_size=8) | json_values)
@example({"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
          "world_size": 2})  # TCP mode: its payload must carry the address, not a null id
def test_init_info_parse_never_crashes(payload):
    try:
        info = InitInfo.from_payload(payload)
    except (ValueError, TypeError):
        return
    again = InitInfo.from_payload(info.to_payload())
    assert (again.rank_offset, again.world_size, again.packed) == (
        info.rank_offset, info.world_size, info.packed)


update_values = json_values | st.lists(st.sampled_from(WIRE_DTYPES), max_size=3) | st.lists(
    st.lists(st.integers(0, 9), max_size=3), max_size=3)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(["names", "dtype_names", "shapes", "src", "packed"]),
                       update_values, max_size=5) | json_values)
def test_update_info_parse_never_crashes(payload):
    try:
        info = UpdateInfo.from_payload(payload)
    except (ValueError, TypeError):
        return
    assert len(info.names) == len(info.dtype_names) == len(info.shapes)


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=4), st.lists(json_values, max_size=4),
       st.lists(json_values, max_size=4), json_values)
def test_update_info_builder_refuses_or_round_trips(names, dtypes, shapes, src):
    try:
        info = UpdateInfo(names=names, dtype_names=dtypes, shapes=shapes, src=src)
        payload = info.to_payload()
    except (ValueError, TypeError):
        return
    assert UpdateInfo.from_payload(payload).names == names


dims = st.lists(st.integers(0, 6), max_size=3)
arrays = st.tuples(dims, st.sampled_from(["float32", "bfloat16", "int8", "int32", "float16",
                                          "bool", "complex64", "uint32"]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), arrays), max_size=6), st.integers(1, 64))
def test_describe_and_plan_refuse_cleanly(spec, buffer_size):
    """Random names, shapes and dtypes (some not on vLLM's wire): metadata or MetadataError."""
    pairs = [(name, jnp.zeros(shape, dtype)) for name, (shape, dtype) in spec]
    try:
        metas, _ = describe(pairs, Mapping())
        chunks = plan_chunks(metas, buffer_size)
        check_alignment(metas, chunks)
    except MetadataError:
        return
    assert [m.name for m in metas] == [n for n, _ in spec]
    assert all(m.dtype in WIRE_DTYPES for m in metas)
    assert sum(c.nbytes for c in chunks) == sum(m.nbytes for m in metas)


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


@given(st.binary(max_size=200))
def test_unique_id_from_raw_bytes(raw):
    if len(raw) == 128:
        assert UniqueId(raw).to_b64()
    else:
        with pytest.raises(ValueError):
            UniqueId(raw)


def test_numpy_scalars_are_not_json_ints():
    """A numpy int is not an int to vLLM's JSON: the builder refuses it up front."""
    with pytest.raises(TypeError):
        UpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2]], src=np.int64(1))
