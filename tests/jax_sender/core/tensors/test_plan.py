"""Chunk planning against vLLM's rule, naming and transforms, refusal paths (no GPU)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_sender import (
    LLAMA,
    LoadPlan,
    Mapping,
    MetadataError,
    TensorMeta,
    describe,
    llama_name,
    named_arrays,
    plan_chunks,
)
from jax_sender._src.core.tensors.plan import WIRE_DTYPES, check_against, check_unique, wire_order
from jax_sender.demo.model import Config, init_params

from support.servers.memory_link import memory_sender

ITEMSIZE = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
            "float64": 8, "bfloat16": 2, "float8_e4m3fn": 1}


def vllm_consumer_chunks(meta, target):
    """A plain-Python rendition of packed_nccl_broadcast_consumer's loop (vLLM 0.33.0)."""
    it = iter(meta)
    out = []
    while True:
        names, size = [], 0
        try:
            while True:
                name, (shape, dtype) = next(it)
                tensor_size = math.prod(shape) * ITEMSIZE[dtype]
                names.append(name)
                size += tensor_size
                if size > target:
                    break
            out.append((names, size))
        except StopIteration:
            if names:
                out.append((names, size))
            break
    return out


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3)
metas_st = st.lists(st.tuples(shapes, st.sampled_from(WIRE_DTYPES)), min_size=0, max_size=40)


@settings(max_examples=400, deadline=None)
@given(metas_st, st.integers(1, 600))
def test_chunks_match_vllms_consumer(spec, buffer_size):
    metas = [TensorMeta(f"t{i}", dt, tuple(s)) for i, (s, dt) in enumerate(spec)]
    ours = plan_chunks(metas, buffer_size)
    theirs = vllm_consumer_chunks([(m.name, (list(m.shape), m.dtype)) for m in metas], buffer_size)
    assert [([m.name for m in metas[c.start:c.stop]], c.nbytes) for c in ours] == theirs
    for c in ours:  # offsets lay tensors end to end, no padding
        sizes = [m.nbytes for m in metas[c.start:c.stop]]
        assert list(c.offsets) == [sum(sizes[:i]) for i in range(len(sizes))]


def test_chunk_rule_edges():
    m = lambda n: TensorMeta("x", "uint8", (n,))  # noqa: E731
    # exactly the buffer does not close a chunk; one byte more does
    assert [(c.start, c.stop) for c in plan_chunks([m(4), m(4), m(1)], 8)] == [(0, 3)]
    assert [(c.start, c.stop) for c in plan_chunks([m(4), m(5), m(1)], 8)] == [(0, 2), (2, 3)]
    # a tensor larger than the buffer is never split and closes its chunk
    big = plan_chunks([m(20), m(1)], 8)
    assert [(c.start, c.stop, c.nbytes, c.single) for c in big] == [(0, 1, 20, True),
                                                                     (1, 2, 1, True)]
    assert plan_chunks([], 8) == []
    with pytest.raises(ValueError):
        plan_chunks([m(1)], 0)


def test_meta_of_arrays_and_refusals():
    assert TensorMeta.of("a", jnp.zeros((2, 3), jnp.bfloat16)) == TensorMeta("a", "bfloat16", (2, 3))
    assert TensorMeta.of("s", jnp.float32(1)).numel == 1
    assert TensorMeta.of("f8", jnp.zeros(3, jnp.float8_e4m3fn)).nbytes == 3
    for bad in (jnp.zeros(2, jnp.float8_e5m2), jnp.zeros(2, bool), np.zeros(2, np.complex64),
                jnp.zeros(2, jnp.uint32)):
        with pytest.raises(MetadataError, match="cannot take"):
            TensorMeta.of("bad", bad)


def test_metadata_disagreements_are_named():
    a = [TensorMeta("a", "float32", (2,)), TensorMeta("b", "bfloat16", (3,))]
    check_against(a, list(a))
    with pytest.raises(MetadataError, match="index 1: declared 'b' bfloat16"):
        check_against(a, [a[0], TensorMeta("b", "float16", (3,))])
    with pytest.raises(MetadataError, match="declares 2 tensors but 1"):
        check_against(a, a[:1])
    with pytest.raises(MetadataError, match="appears twice"):
        check_unique([a[0], a[0]])


def test_llama_mapping_on_a_real_flax_model():
    cfg = Config(vocab=64, hidden=16, intermediate=24, layers=2, heads=4, kv_heads=2, head_dim=4)
    params = init_params(cfg)
    named = named_arrays(params, LLAMA)
    names = [n for n, _, _ in named]
    assert len(names) == len(set(names)) == 3 + 2 * 11
    expect = {"model.embed_tokens.weight": (64, 16), "lm_head.weight": (64, 16),
              "model.norm.weight": (16,),
              "model.layers.1.self_attn.q_proj.weight": (16, 16),
              "model.layers.1.self_attn.k_proj.weight": (8, 16),
              "model.layers.0.self_attn.o_proj.weight": (16, 16),
              "model.layers.0.self_attn.q_norm.weight": (4,),
              "model.layers.0.mlp.gate_proj.weight": (24, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 24),
              "model.layers.0.input_layernorm.weight": (16,),
              "model.layers.0.post_attention_layernorm.weight": (16,)}
    shapes = {n: jax.eval_shape(lambda a, p=p: LLAMA.transform(p, a), a).shape
              for n, p, a in named}
    for name, shape in expect.items():
        assert shapes[name] == shape, name
    # the transposed kernel is torch's (out, in): y = x @ W.T
    (_, path, k), = [t for t in named if t[0] == "model.layers.0.mlp.down_proj.weight"]
    assert np.array_equal(np.asarray(LLAMA.transform(path, k)), np.asarray(k).T)


def test_llama_name_rejects_unknown_paths():
    with pytest.raises(MetadataError, match="no Llama/Qwen checkpoint name"):
        llama_name(("mystery", "kernel"))
    with pytest.raises(MetadataError, match="unexpected leaf 'weird'"):
        llama_name(("layers_0", "mlp", "up_proj", "weird"))


def test_pairs_keep_their_names_and_custom_mappings():
    pairs = [("x.weight", jnp.ones((2, 2))), ("y.bias", jnp.zeros(3))]
    assert [(n, p) for n, p, _ in named_arrays(pairs)] == [("x.weight", ("x.weight",)),
                                                           ("y.bias", ("y.bias",))]
    assert [n for n, _, _ in named_arrays(iter(pairs))] == ["x.weight", "y.bias"]
    m = Mapping(name=lambda p: "/".join(p))
    assert [n for n, _, _ in named_arrays({"a": {"b": jnp.ones(1)}}, m)] == ["a/b"]


def test_describe_uses_transformed_metadata_and_refuses_bad_dtypes():
    cfg = Config(vocab=32, hidden=8, intermediate=12, layers=1, heads=2, kv_heads=1, head_dim=4)
    metas, _ = describe(init_params(cfg), LLAMA)
    by = {m.name: m for m in metas}
    assert by["model.layers.0.mlp.up_proj.weight"] == TensorMeta(
        "model.layers.0.mlp.up_proj.weight", "bfloat16", (12, 8))
    cast = Mapping(transform=lambda p, a: a.astype(jnp.float32))
    assert {m.dtype for m in describe({"w": jnp.ones(2, jnp.bfloat16)}, cast)[0]} == {"float32"}
    # Non-JAX leaves are described as what JAX will turn them into (a Python
    # float: float32 with no x64); a float64 host array JAX would narrow is refused.
    assert [m.dtype for m in describe({"n": np.ones(2, np.float32), "s": 1.5}, Mapping())[0]] \
        == ["float32", "float32"]
    with pytest.raises(MetadataError, match="is float64, which JAX turns into float32"):
        describe({"n": np.ones(2)}, Mapping())
    with pytest.raises(MetadataError, match="cannot take"):
        describe({"w": jnp.ones(2, jnp.uint32)}, Mapping())
    with pytest.raises(MetadataError, match="nothing to send"):
        describe({}, Mapping())
    with pytest.raises(MetadataError, match="appears twice"):
        describe([("w", jnp.ones(1)), ("w", jnp.ones(1))], Mapping())


def test_load_plan_checks_like_vllms_manifest():
    """Subsets pass; an undeclared tensor or another dtype/shape is refused with
    vLLM's message, before any HTTP call (describing is the first step of ``send``)."""
    params = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones(4, jnp.float32)}
    plan = LoadPlan(describe(params, Mapping())[0])
    assert plan.to_payload() == [["a", "bfloat16", [2, 3]], ["b", "float32", [4]]]
    assert LoadPlan.from_payload(plan.to_payload()).metas == plan.metas
    sender, _, _ = memory_sender(load_plan=plan)
    assert [m.name for m in sender._descriptions.of({"b": jnp.zeros(4, jnp.float32)})[0]] == ["b"]
    with pytest.raises(MetadataError, match=r"'b' sent as \(float32, \[5\]\) was declared at "
                                            r"init as \(float32, \[4\]\); with use_load_plan"):
        sender._descriptions.of({"b": jnp.zeros(5, jnp.float32)})
    with pytest.raises(MetadataError, match="'c' sent as .* was not declared"):
        sender._descriptions.of({"c": jnp.zeros(1, jnp.float32)})
    with pytest.raises(MetadataError, match="triples"):
        LoadPlan.from_payload([["a", "bfloat16"]])
    with pytest.raises(MetadataError, match="appears twice"):
        LoadPlan.from_payload([["a", "int8", [1]], ["a", "int8", [1]]])


def test_misaligned_packed_layout_is_refused_up_front():
    from jax_sender._src.core.tensors.plan import check_alignment
    metas = [TensorMeta("odd", "uint8", (3,)), TensorMeta("f", "float32", (2,))]
    with pytest.raises(MetadataError, match="'f' .* at byte 3 .* multiple of 4"):
        check_alignment(metas, plan_chunks(metas, 1 << 20))
    aligned = [metas[1], metas[0]]
    check_alignment(aligned, plan_chunks(aligned, 1 << 20))
    # a chunk boundary resets the offset: after a closing tensor, alignment starts over
    split = [TensorMeta("big", "uint8", (9,)), TensorMeta("f", "float32", (2,))]
    check_alignment(split, plan_chunks(split, 8))


def test_wire_order_sends_tensors_larger_than_the_buffer_first():
    metas = [TensorMeta("embed", "bfloat16", (600,)), TensorMeta("l0", "bfloat16", (10,)),
             TensorMeta("l1", "bfloat16", (10,)), TensorMeta("head", "bfloat16", (700,))]
    assert wire_order(metas, 1000) == [0, 3, 1, 2]  # the push ends on small tensors
    assert wire_order(metas, 4096) == [0, 1, 2, 3]  # nothing larger: checkpoint order


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(ITEMSIZE)), st.integers(0, 40)),
                min_size=1, max_size=12), st.integers(1, 200))
def test_wire_order_is_a_permutation_that_vllms_consumer_can_view(specs, buffer_size):
    metas = [TensorMeta(f"t{i}", d, (n,)) for i, (d, n) in enumerate(specs)]
    order = wire_order(metas, buffer_size)
    assert sorted(order) == list(range(len(metas)))
    ordered = [metas[i] for i in order]
    theirs = vllm_consumer_chunks([(m.name, ((m.numel,), m.dtype)) for m in ordered],
                                  buffer_size)
    ours = plan_chunks(ordered, buffer_size)
    assert len(theirs) == len(ours)
    for (names, _), c in zip(theirs, ours):
        assert names == [m.name for m in ordered[c.start:c.stop]]
        for m, off in zip(ordered[c.start:c.stop], c.offsets):
            assert off % ITEMSIZE[m.dtype] == 0, (m, off)
