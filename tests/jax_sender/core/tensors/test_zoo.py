"""The ready mappings of jax_sender._src.core.tensors.zoo, held against the trainers' own code.

Tunix: a tiny random Hugging Face checkpoint, loaded by Tunix's own
``create_model_from_safe_tensors``; the mapping applied to
``nnx.state(model, nnx.Param)`` must give that checkpoint back, name for name
and byte for byte (only where ``tunix`` imports: ``pip install google-tunix``).

MaxText: the mapping applied to tiny random MaxText trees must give what
MaxText's own to_huggingface code gives, kept in tests/support/zoo_golden/
by tests/support/make_zoo_golden.py (numpy and jax only: runs everywhere).

The mappings are applied here by a local helper that does what the core does
with a one-to-many mapping (names from ``name``, tensor i of the transform's
tuple jitted alone), so these tests do not depend on the core's version.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sender import (
    MAXTEXT_LLAMA31,
    MAXTEXT_QWEN3,
    TUNIX_LLAMA3,
    TUNIX_QWEN2,
    TUNIX_QWEN3,
    Mapping,
    MetadataError,
    flatten,
    maxtext_llama31,
    maxtext_qwen3,
    tunix_qwen3,
)

from support import make_zoo_golden as golden
from support.pushes import assert_same_tensors
from support.tiny_tunix import EXPERTS, hf_checkpoint, tunix_model

GOLDEN = os.path.join(os.path.dirname(golden.__file__), "zoo_golden")


def apply(mapping: Mapping, tree) -> dict[str, np.ndarray]:
    """``{name: tensor}`` as the core would send them: every leaf named, a
    tuple of names matched by a tuple of tensors of the same length (each
    jitted alone), ``()`` sent as nothing; the metadata ``jax.eval_shape``
    gives matches what runs; no name twice."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in flatten(tree):
        names = mapping.name(path)
        spec = jax.eval_shape(lambda x, path=path: mapping.transform(path, x), leaf)
        if isinstance(names, str):
            tensors = [jax.jit(lambda x, path=path: mapping.transform(path, x))(leaf)]
            specs, names = [spec], (names,)
        else:
            assert isinstance(spec, tuple) and len(spec) == len(names), (path, names)
            tensors = [jax.jit(lambda x, path=path, i=i: mapping.transform(path, x)[i])(leaf)
                       for i in range(len(names))]
            specs = list(spec)
        for name, tensor, s in zip(names, tensors, specs):
            assert (tensor.shape, tensor.dtype) == (s.shape, s.dtype), name
            assert name not in out, f"{name} named twice"
            out[name] = np.asarray(tensor)
    return out


# -- MaxText, against its own hooks (golden files) ---------------------------------

def _maxtext_mapping(case: str) -> Mapping:
    family, scanned, *_ = golden.CASES[case]
    factory = maxtext_llama31 if family == "llama31" else maxtext_qwen3
    if scanned:
        return factory(num_layers=golden.DIMS["layers"])
    return MAXTEXT_LLAMA31 if family == "llama31" else MAXTEXT_QWEN3


@pytest.mark.parametrize("case", sorted(golden.CASES))
def test_maxtext_matches_its_own_hooks(case):
    want = golden.load(os.path.join(GOLDEN, f"{case}.npz"))
    tree = golden.maxtext_tree(case)
    assert_same_tensors(apply(_maxtext_mapping(case), tree), want)


@pytest.mark.parametrize("case", ["llama31_scanned", "qwen3_unscanned"])
def test_maxtext_path_forms(case):
    """Without the top ``params`` key, and as an NNX state's ``value`` leaves:
    the same names, and the same tensors' metadata, leaf for leaf."""
    mapping, tree = _maxtext_mapping(case), golden.maxtext_tree(case)

    def described(t):
        return [(mapping.name(path), jax.eval_shape(lambda x, p=path: mapping.transform(p, x), leaf))
                for path, leaf in flatten(t)]

    want = described(tree)
    assert described(tree["params"]) == want
    assert described(jax.tree.map(lambda x: {"value": x}, tree)) == want


@pytest.mark.parametrize("case", sorted(golden.CASES))
def test_golden_files_are_what_the_script_makes(case):
    want = golden.load(os.path.join(GOLDEN, f"{case}.npz"))
    assert_same_tensors({k: np.asarray(v) for k, v in golden.maxtext_to_hf(case).items()}, want)


def test_maxtext_layer_count_and_layouts():
    d = golden.DIMS
    tree = golden.maxtext_tree("llama31_scanned")["params"]
    q = tree["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert q.shape == (d["embed"], d["layers"], d["heads"], d["head_dim"])
    got = apply(maxtext_llama31(num_layers=d["layers"]), tree)
    assert got["model.layers.2.self_attn.q_proj.weight"].shape == (d["heads"] * d["head_dim"], d["embed"])
    assert got["model.layers.0.self_attn.o_proj.weight"].shape == (d["embed"], d["heads"] * d["head_dim"])
    assert got["lm_head.weight"].shape == (d["vocab"], d["embed"])


def test_maxtext_scanned_needs_the_layer_count():
    tree = golden.maxtext_tree("qwen3_scanned")
    path = ("params", "decoder", "layers", "self_attention", "query", "kernel")
    with pytest.raises(MetadataError, match=r"maxtext_qwen3\(num_layers=N\)"):
        MAXTEXT_QWEN3.name(path)
    leaf = tree["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    wrong = maxtext_qwen3(num_layers=golden.DIMS["layers"] + 1)
    assert len(wrong.name(path)) == golden.DIMS["layers"] + 1
    with pytest.raises(MetadataError, match="stacked on axis 1"):
        jax.eval_shape(lambda x: wrong.transform(path, x), leaf)
    with pytest.raises(MetadataError, match="positive int"):
        maxtext_qwen3(num_layers=0)


def test_maxtext_refuses_moe_and_unknown_leaves():
    with pytest.raises(MetadataError, match="mixture-of-experts"):
        MAXTEXT_QWEN3.name(("params", "decoder", "layers_0", "moe_block", "wi_0"))
    with pytest.raises(KeyError):
        MAXTEXT_QWEN3.name(("params", "decoder", "layers_0", "self_attention", "out", "bias"))
    with pytest.raises(KeyError):  # Llama has no q/k norms
        MAXTEXT_LLAMA31.name(("params", "decoder", "layers_0", "self_attention", "query_norm", "scale"))
    with pytest.raises(KeyError):
        MAXTEXT_LLAMA31.name(("opt_state", "mu", "token_embedder", "embedding"))


def test_maxtext_dtype_casts_after_the_hooks():
    d = golden.DIMS
    tree = golden.maxtext_tree("llama31_scanned")
    want = golden.load(os.path.join(GOLDEN, "llama31_scanned.npz"))
    got = apply(maxtext_llama31(num_layers=d["layers"], dtype=jnp.bfloat16), tree)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == jnp.bfloat16
        assert got[name].tobytes() == w.astype(jnp.bfloat16).tobytes(), name


def test_through_the_core_when_it_splits_leaves():
    """The same tensors through the core's own naming (where it already takes
    one-to-many mappings: ``Mapping.apply``), else skipped."""
    from jax_sender._src.core.tensors import naming
    if not hasattr(Mapping, "apply"):
        pytest.skip("the core does not take one-to-many mappings yet")
    case = "llama31_scanned"
    want = golden.load(os.path.join(GOLDEN, f"{case}.npz"))
    mapping = _maxtext_mapping(case)
    got = {name: np.asarray(mapping.apply(path, leaf))
           for name, path, leaf in naming.named_arrays(golden.maxtext_tree(case), mapping)}
    assert_same_tensors(got, want)


# -- Tunix's naming, without Tunix ----------------------------------------------

def test_tunix_paths_by_hand():
    assert TUNIX_QWEN3.name(("layers", "3", "attn", "q_proj", "w", "value")) == \
        "model.layers.3.self_attn.q_proj.weight"
    assert TUNIX_QWEN3.name(("embedder", "input_embedding")) == "model.embed_tokens.weight"
    assert TUNIX_QWEN2.name(("layers", "0", "attn", "k_bias", "value")) == \
        "model.layers.0.self_attn.k_proj.bias"
    w = jnp.arange(12 * 4 * 8, dtype=jnp.float32).reshape(12, 4, 8)  # [embed, heads, head_dim]
    q = TUNIX_LLAMA3.transform(("layers", "0", "attn", "q_proj", "w", "value"), w)
    np.testing.assert_array_equal(q, np.asarray(w).reshape(12, 32).T)
    o = TUNIX_LLAMA3.transform(("layers", "0", "attn", "o_proj", "w", "value"), w.transpose(1, 2, 0))
    np.testing.assert_array_equal(o, np.asarray(w).reshape(12, 32))


def test_tunix_refusals():
    for mapping, path in [
        (TUNIX_LLAMA3, ("layers", "0", "attn", "q_bias", "value")),  # a Qwen2 leaf
        (TUNIX_LLAMA3, ("layers", "0", "attn", "q_norm", "w", "value")),  # a Qwen3 leaf
        (TUNIX_QWEN2, ("layers", "0", "attn", "q_norm", "w", "value")),
        (TUNIX_QWEN3, ("layers", "0", "attn", "q_proj", "w_lora_a", "value")),  # LoRA
        (TUNIX_QWEN3, ("layers", "x", "attn", "q_proj", "w", "value")),
    ]:
        with pytest.raises(KeyError):
            mapping.name(path)
    with pytest.raises(MetadataError, match=r"tunix_qwen3\(num_experts=N\)"):
        TUNIX_QWEN3.name(("layers", "0", "mlp", "gate_proj", "value"))
    with pytest.raises(MetadataError, match="mixture-of-experts"):
        TUNIX_LLAMA3.name(("layers", "0", "mlp", "router", "kernel", "value"))
    moe = tunix_qwen3(num_experts=3)
    path = ("layers", "0", "mlp", "up_proj", "value")
    assert moe.name(path) == tuple(f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(3))
    with pytest.raises(MetadataError, match="num_experts"):
        jax.eval_shape(lambda x: moe.transform(path, x), jnp.zeros((4, 12, 20)))


def test_tunix_moe_experts_each_transposed_then_cast():
    """With ``dtype``, each expert of a stacked leaf goes as its own
    ``[out, in]``, cast after the transpose."""
    x = jnp.arange(3 * 4 * 5, dtype=jnp.float32).reshape(3, 4, 5) / 7  # [experts, in, out]
    path = ("layers", "1", "mlp", "down_proj", "value")
    out = tunix_qwen3(num_experts=3, dtype=jnp.bfloat16).transform(path, x)
    assert len(out) == 3
    for e, t in enumerate(out):
        assert t.dtype == jnp.bfloat16 and t.shape == (5, 4)
        np.testing.assert_array_equal(np.asarray(t), np.asarray(x[e].T.astype(jnp.bfloat16)))


# -- Tunix, against its own loader ------------------------------------------------

@pytest.mark.parametrize("mode", ["optimized", "original"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family,mapping", [("llama3", TUNIX_LLAMA3), ("qwen2", TUNIX_QWEN2),
                                            ("qwen3", TUNIX_QWEN3)], ids=["llama3", "qwen2", "qwen3"])
def test_tunix_gives_back_the_checkpoint(tmp_path, family, mapping, tied, mode):
    pytest.importorskip("tunix")
    pytest.importorskip("safetensors.numpy")
    from flax import nnx
    checkpoint = hf_checkpoint(family=family, tied=tied)
    model = tunix_model(tmp_path, checkpoint, family=family, tied=tied, mode=mode)
    state = nnx.state(model, nnx.Param)
    assert ("lm_head" in state) is not tied
    assert_same_tensors(apply(mapping, state), checkpoint)


def test_tunix_bfloat16_and_pure_dict(tmp_path):
    pytest.importorskip("tunix")
    pytest.importorskip("safetensors.numpy")
    from flax import nnx
    checkpoint = hf_checkpoint(1, dtype=jnp.bfloat16)
    model = tunix_model(tmp_path, checkpoint)
    state = nnx.state(model, nnx.Param)
    assert_same_tensors(apply(TUNIX_QWEN3, state), checkpoint)
    assert_same_tensors(apply(TUNIX_QWEN3, state.to_pure_dict()), checkpoint)


def test_tunix_qwen3_moe_gives_back_the_checkpoint(tmp_path):
    pytest.importorskip("tunix")
    pytest.importorskip("safetensors.numpy")
    from flax import nnx
    checkpoint = hf_checkpoint(2, moe=True)
    model = tunix_model(tmp_path, checkpoint, moe=True)
    state = nnx.state(model, nnx.Param)
    assert_same_tensors(apply(tunix_qwen3(num_experts=EXPERTS), state), checkpoint)
    with pytest.raises(MetadataError, match="num_experts"):
        apply(TUNIX_QWEN3, state)
