"""Ready mappings for the trainers people use: Tunix (Flax NNX) and MaxText.

Each is a :class:`~jax_sender._src.core.tensors.naming.Mapping` from the trainer's own
parameter tree to the Hugging Face checkpoint names vLLM's ``load_weights``
takes, with the transforms that undo the trainer's layout::

    sender = WeightSender.connect(url, mapping=TUNIX_QWEN3)
    sender.send(nnx.state(model, nnx.Param))

**Tunix** (``google-tunix``; ``tunix/models/{llama3,qwen2,qwen3}``): every
family has one NNX layout, read from ``nnx.state(model, nnx.Param)``
(a path ends in ``value``; a plain dict from ``to_pure_dict()`` is taken too)::

    embedder.input_embedding          [vocab, embed]
    layers.{i}.attn.q_proj.w          [embed, heads, head_dim]
    layers.{i}.attn.{k,v}_proj.w      [embed, kv_heads, head_dim]
    layers.{i}.attn.o_proj.w          [heads, head_dim, embed]
    layers.{i}.attn.{q,k,v}_bias      [heads * head_dim]            (Qwen2)
    layers.{i}.attn.{q,k}_norm.w      [head_dim]                    (Qwen3)
    layers.{i}.mlp.{gate,up}_proj.kernel  [embed, ffn]
    layers.{i}.mlp.down_proj.kernel   [ffn, embed]
    layers.{i}.mlp.router.kernel      [embed, experts]              (Qwen3-MoE)
    layers.{i}.mlp.{gate,up}_proj     [experts, embed, ffn]         (Qwen3-MoE)
    layers.{i}.mlp.down_proj          [experts, ffn, embed]         (Qwen3-MoE)
    layers.{i}.{input,post_attention}_layernorm.w  [embed]
    final_norm.w                      [embed]
    lm_head.w                         [embed, vocab]  (absent when tied)

The transforms are the exact inverse of Tunix's own loader table
(``params._get_key_and_transform_mapping``: transpose, then reshape), so a
model loaded from a checkpoint gives that checkpoint back, bit for bit.
An MoE layer's expert weights are one leaf for all experts: the mapping
splits it into one tensor per expert, and so needs the expert count
(``tunix_qwen3(num_experts=...)``). LoRA adapters (``nnx.LoRAParam``, a kind
of ``nnx.Param``) have no checkpoint name: leave them out
(``nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))``) or merge them
first.

**MaxText** (Linen parameter tree, ``state.params``; a leading ``params``
key and a trailing ``value`` are skipped)::

    token_embedder.embedding                          [vocab, embed]
    decoder.layers_{i}.self_attention.query.kernel    [embed, heads, head_dim]
    decoder.layers_{i}.self_attention.{key,value}.kernel  [embed, kv_heads, head_dim]
    decoder.layers_{i}.self_attention.out.kernel      [heads, head_dim, embed]
    decoder.layers_{i}.self_attention.{query,key,value}.bias  [heads, head_dim]  (Qwen2.5)
    decoder.layers_{i}.self_attention.{query,key}_norm.scale  [head_dim]     (Qwen3)
    decoder.layers_{i}.mlp.{wi_0,wi_1}.kernel         [embed, ffn]
    decoder.layers_{i}.mlp.wo.kernel                  [ffn, embed]
    decoder.layers_{i}.{pre,post}_self_attention_layer_norm.scale  [embed]
    decoder.decoder_norm.scale                        [embed]
    decoder.logits_dense.kernel                       [embed, vocab]  (absent when
                                                      logits_via_embedding)

With ``scan_layers`` (MaxText's default) ``layers_{i}`` is one ``layers``
subtree whose leaves hold every layer stacked on axis 1
(``param_scan_axis``): ``query.kernel`` is ``[embed, layers, heads, head_dim]``,
a norm scale ``[embed, layers]``. Each such leaf becomes one tensor per layer,
so the mapping needs the layer count: ``maxtext_llama31(num_layers=32)``.
The transforms are MaxText's own ``to_huggingface`` hooks
(``maxtext/checkpoint_conversion/utils/param_mapping.py``,
``LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN`` and ``QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN``
with ``saving_to_hf=True``): Llama's query kernel is multiplied by
``sqrt(head_dim)`` (in float32) and its query and key kernels' RoPE pairs
go from MaxText's interleaved order to Hugging Face's halves; Qwen's only
reshape and transpose. Mixture-of-experts blocks (``moe_block``) are refused.

Every transform is jnp code that depends only on the array's shape and
dtype, so the core can trace it with ``jax.eval_shape`` and jit it (for a
one-to-many leaf, part by part). ``dtype=`` on a factory casts every tensor
(e.g. ``jnp.bfloat16`` to send half the bytes of a float32 master copy).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import MetadataError
from .naming import Mapping, Path, dotted

__all__ = [
    "MAXTEXT_LLAMA31", "MAXTEXT_QWEN3", "TUNIX_LLAMA3", "TUNIX_QWEN2", "TUNIX_QWEN3",
    "maxtext_llama31", "maxtext_qwen3", "tunix_llama3", "tunix_qwen2", "tunix_qwen3",
]

Fn = Callable[[Any], Any]


# -- layout transforms (pure jnp, shape-driven) ---------------------------------

def _keep(x: Any) -> Any:
    return x


def _t(x: Any) -> Any:
    """A Dense kernel ``[in, out]`` -> torch's ``[out, in]``."""
    return x.T


def _heads_in(x: Any) -> Any:
    """``[embed, heads, head_dim]`` -> ``[heads * head_dim, embed]`` (q/k/v)."""
    return x.reshape(x.shape[0], -1).T


def _heads_out(x: Any) -> Any:
    """``[heads, head_dim, embed]`` -> ``[embed, heads * head_dim]`` (o)."""
    return x.reshape(-1, x.shape[-1]).T


def _flat(x: Any) -> Any:
    """A ``[heads, head_dim]`` bias -> ``[heads * head_dim]``."""
    return x.reshape(-1)


def _rope_halves(x: Any) -> Any:
    """RoPE pairs from MaxText's interleaved ``(x0, y0, x1, y1, ...)`` on the
    last axis to Hugging Face's halves ``(x0, x1, ..., y0, y1, ...)``
    (MaxText's ``adjust_rope``, saving to HF)."""
    return jnp.concatenate((x[..., ::2], x[..., 1::2]), axis=x.ndim - 1)


def _llama_query(x: Any) -> Any:
    """MaxText's Llama query kernel ``[embed, heads, head_dim]``: undo its
    ``1/sqrt(head_dim)`` (scaled in float32, as MaxText's ``scale_query_layer``
    does), RoPE halves, then ``[heads * head_dim, embed]``."""
    scale = np.float32(np.sqrt(x.shape[-1]))
    x = (x.astype(jnp.float32) * scale).astype(x.dtype)
    return _heads_in(_rope_halves(x))


def _llama_key(x: Any) -> Any:
    return _heads_in(_rope_halves(x))


def _cast(fn: Fn, dtype: Any) -> Fn:
    if dtype is None:
        return fn
    return lambda x: fn(x).astype(dtype)


# -- a table mapping ----------------------------------------------------------------

_LAYERS_I = re.compile(r"layers_(\d+)")


class _Table:
    """``name`` and ``transform`` of one family, from rule tables.

    A rule is ``(hf name or suffix, fn)``; ``resolve(path)`` gives the names
    (a str, or a tuple for a leaf split into several tensors) and the
    function of the leaf that makes them (a tuple for a tuple of names).
    """

    def __init__(self, family: str, resolve: Callable[[Path], tuple[Any, Fn]]):
        self.family = family
        self._resolve = resolve

    def name(self, path: Path) -> str | tuple[str, ...]:
        return self._resolve(path)[0]

    def transform(self, path: Path, array: Any) -> Any:
        return self._resolve(path)[1](array)

    def mapping(self) -> Mapping:
        return Mapping(name=self.name, transform=self.transform)

    def __repr__(self) -> str:
        return f"<{self.family} mapping>"


def _unmapped(family: str, path: Path, hint: str = "") -> KeyError:
    return KeyError(f"{dotted(path)!r} is not a {family} parameter{hint}")


def _strip_value(path: Path) -> tuple[str, ...]:
    """The path without NNX's trailing ``value`` (``nnx.State``'s leaves)."""
    return tuple(path[:-1]) if path and path[-1] == "value" else tuple(path)


# -- Tunix ----------------------------------------------------------------------------

_TUNIX_TOP: dict[tuple[str, ...], tuple[str, Fn]] = {
    ("embedder", "input_embedding"): ("model.embed_tokens.weight", _keep),
    ("final_norm", "w"): ("model.norm.weight", _keep),
    ("lm_head", "w"): ("lm_head.weight", _t),
}

_TUNIX_LAYER: dict[tuple[str, ...], tuple[str, Fn]] = {
    ("attn", "q_proj", "w"): ("self_attn.q_proj.weight", _heads_in),
    ("attn", "k_proj", "w"): ("self_attn.k_proj.weight", _heads_in),
    ("attn", "v_proj", "w"): ("self_attn.v_proj.weight", _heads_in),
    ("attn", "o_proj", "w"): ("self_attn.o_proj.weight", _heads_out),
    ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", _t),
    ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", _t),
    ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", _t),
    ("input_layernorm", "w"): ("input_layernorm.weight", _keep),
    ("post_attention_layernorm", "w"): ("post_attention_layernorm.weight", _keep),
}

_TUNIX_QWEN2_LAYER = {
    ("attn", "q_bias"): ("self_attn.q_proj.bias", _keep),
    ("attn", "k_bias"): ("self_attn.k_proj.bias", _keep),
    ("attn", "v_bias"): ("self_attn.v_proj.bias", _keep),
}

_TUNIX_QWEN3_LAYER = {
    ("attn", "q_norm", "w"): ("self_attn.q_norm.weight", _keep),
    ("attn", "k_norm", "w"): ("self_attn.k_norm.weight", _keep),
}

_TUNIX_EXPERTS = {("mlp", "gate_proj"): "gate_proj", ("mlp", "up_proj"): "up_proj",
                  ("mlp", "down_proj"): "down_proj"}


def _experts(num: int, fn: Fn, path: Path) -> Fn:
    """``[experts, in, out]`` -> ``fn`` of each expert's ``[in, out]``."""
    def split(x: Any) -> tuple[Any, ...]:
        if x.ndim != 3 or x.shape[0] != num:
            raise MetadataError(f"{dotted(path)!r} has shape {tuple(x.shape)}, not "
                                f"[{num} experts, in, out]: build the mapping with the "
                                "model's num_experts")
        return tuple(fn(x[e]) for e in range(num))
    return split


def _tunix(family: str, extra: dict[tuple[str, ...], tuple[str, Fn]], *,
           moe: bool = False, num_experts: int | None = None, dtype: Any = None) -> Mapping:
    layer_rules = {**_TUNIX_LAYER, **extra}
    if moe:
        layer_rules[("mlp", "router", "kernel")] = ("mlp.gate.weight", _t)

    def resolve(path: Path) -> tuple[Any, Fn]:
        parts = _strip_value(path)
        if parts in _TUNIX_TOP:
            hf, fn = _TUNIX_TOP[parts]
            return hf, _cast(fn, dtype)
        if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
            prefix, rest = f"model.layers.{int(parts[1])}.", parts[2:]
            if rest in layer_rules:
                hf, fn = layer_rules[rest]
                return prefix + hf, _cast(fn, dtype)
            if moe and rest in _TUNIX_EXPERTS:
                if num_experts is None:
                    raise MetadataError(
                        f"{dotted(path)!r} holds a mixture-of-experts layer's experts, one "
                        f"tensor each: build the mapping with {family.lower()}"
                        "(num_experts=N) (the model config's num_experts)")
                proj = _TUNIX_EXPERTS[rest]
                names = tuple(f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(num_experts))
                return names, _experts(num_experts, _cast(_t, dtype), path)
            if not moe and (rest in _TUNIX_EXPERTS or rest == ("mlp", "router", "kernel")):
                raise MetadataError(f"{dotted(path)!r} is a mixture-of-experts weight, which "
                                    f"{family} has no mapping for: use tunix_qwen3(num_experts=N) "
                                    "for Qwen3-MoE")
        raise _unmapped(family, path)

    return _Table(family, resolve).mapping()


def tunix_llama3(*, dtype: Any = None) -> Mapping:
    """The mapping for Tunix's Llama 3 (``tunix.models.llama3``), tied or not.

    Args:
        dtype: cast every tensor to this dtype (default: keep the model's).

    Returns:
        The mapping; ``TUNIX_LLAMA3`` is ``tunix_llama3()``.
    """
    return _tunix("TUNIX_LLAMA3", {}, dtype=dtype)


def tunix_qwen2(*, dtype: Any = None) -> Mapping:
    """The mapping for Tunix's Qwen2 / Qwen2.5 (``tunix.models.qwen2``): q/k/v biases.

    Args:
        dtype: cast every tensor to this dtype (default: keep the model's).

    Returns:
        The mapping; ``TUNIX_QWEN2`` is ``tunix_qwen2()``.
    """
    return _tunix("TUNIX_QWEN2", _TUNIX_QWEN2_LAYER, dtype=dtype)


def tunix_qwen3(*, num_experts: int | None = None, dtype: Any = None) -> Mapping:
    """The mapping for Tunix's Qwen3 (``tunix.models.qwen3``): q/k norms, and
    Qwen3-MoE's router and experts when ``num_experts`` is given.

    Args:
        num_experts: the config's ``num_experts``, for an MoE model (each
            layer's stacked experts go as one tensor per expert,
            ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``);
            without it an expert leaf is refused.
        dtype: cast every tensor to this dtype (default: keep the model's).

    Returns:
        The mapping; ``TUNIX_QWEN3`` is ``tunix_qwen3()``.
    """
    if num_experts is not None and (not isinstance(num_experts, int) or num_experts < 1):
        raise MetadataError(f"num_experts must be a positive int, got {num_experts!r}")
    return _tunix("TUNIX_QWEN3", _TUNIX_QWEN3_LAYER, moe=True, num_experts=num_experts,
                  dtype=dtype)


# -- MaxText ----------------------------------------------------------------------------

_MAXTEXT_TOP: dict[tuple[str, ...], tuple[str, Fn]] = {
    ("token_embedder", "embedding"): ("model.embed_tokens.weight", _keep),
    ("decoder", "decoder_norm", "scale"): ("model.norm.weight", _keep),
    ("decoder", "logits_dense", "kernel"): ("lm_head.weight", _t),
}

_MAXTEXT_LAYER: dict[tuple[str, ...], tuple[str, Fn]] = {
    ("self_attention", "query", "kernel"): ("self_attn.q_proj.weight", _heads_in),
    ("self_attention", "key", "kernel"): ("self_attn.k_proj.weight", _heads_in),
    ("self_attention", "value", "kernel"): ("self_attn.v_proj.weight", _heads_in),
    ("self_attention", "out", "kernel"): ("self_attn.o_proj.weight", _heads_out),
    ("mlp", "wi_0", "kernel"): ("mlp.gate_proj.weight", _t),
    ("mlp", "wi_1", "kernel"): ("mlp.up_proj.weight", _t),
    ("mlp", "wo", "kernel"): ("mlp.down_proj.weight", _t),
    ("pre_self_attention_layer_norm", "scale"): ("input_layernorm.weight", _keep),
    ("post_self_attention_layer_norm", "scale"): ("post_attention_layernorm.weight", _keep),
}

_MAXTEXT_LLAMA_LAYER = {
    **_MAXTEXT_LAYER,
    ("self_attention", "query", "kernel"): ("self_attn.q_proj.weight", _llama_query),
    ("self_attention", "key", "kernel"): ("self_attn.k_proj.weight", _llama_key),
}

_MAXTEXT_QWEN_LAYER = {
    **_MAXTEXT_LAYER,
    ("self_attention", "query_norm", "scale"): ("self_attn.q_norm.weight", _keep),
    ("self_attention", "key_norm", "scale"): ("self_attn.k_norm.weight", _keep),
    ("self_attention", "query", "bias"): ("self_attn.q_proj.bias", _flat),
    ("self_attention", "key", "bias"): ("self_attn.k_proj.bias", _flat),
    ("self_attention", "value", "bias"): ("self_attn.v_proj.bias", _flat),
}


def _scanned(num_layers: int, fn: Fn, path: Path) -> Fn:
    """A leaf stacked on axis 1 (``param_scan_axis``) -> ``fn`` of each layer."""
    def split(x: Any) -> tuple[Any, ...]:
        if x.ndim < 2 or x.shape[1] != num_layers:
            raise MetadataError(f"{dotted(path)!r} has shape {tuple(x.shape)}, not "
                                f"{num_layers} layers stacked on axis 1: build the mapping "
                                "with the model's num_layers (base_num_decoder_layers)")
        return tuple(fn(jax.lax.index_in_dim(x, i, axis=1, keepdims=False))
                     for i in range(num_layers))
    return split


def _maxtext(family: str, factory: str, layer_rules: dict[tuple[str, ...], tuple[str, Fn]], *,
             num_layers: int | None, dtype: Any) -> Mapping:
    if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
        raise MetadataError(f"num_layers must be a positive int, got {num_layers!r}")

    def resolve(path: Path) -> tuple[Any, Fn]:
        parts = _strip_value(path)
        if parts[:1] == ("params",):
            parts = parts[1:]
        if parts in _MAXTEXT_TOP:
            hf, fn = _MAXTEXT_TOP[parts]
            return hf, _cast(fn, dtype)
        if len(parts) >= 3 and parts[0] == "decoder":
            rest = parts[2:]
            if "moe_block" in rest:
                raise MetadataError(f"{dotted(path)!r} is a mixture-of-experts weight: "
                                    f"{family} maps dense models only")
            m = _LAYERS_I.fullmatch(parts[1])
            if m is not None and rest in layer_rules:
                hf, fn = layer_rules[rest]
                return f"model.layers.{int(m.group(1))}.{hf}", _cast(fn, dtype)
            if parts[1] == "layers" and rest in layer_rules:
                if num_layers is None:
                    raise MetadataError(
                        f"{dotted(path)!r} holds scanned layers (stacked on axis 1), one "
                        f"tensor each: build the mapping with {factory}(num_layers=N)")
                hf, fn = layer_rules[rest]
                names = tuple(f"model.layers.{i}.{hf}" for i in range(num_layers))
                return names, _scanned(num_layers, _cast(fn, dtype), path)
        raise _unmapped(family, path)

    return _Table(family, resolve).mapping()


def maxtext_llama31(*, num_layers: int | None = None, dtype: Any = None) -> Mapping:
    """The mapping for MaxText's Llama 3 / 3.1 (``decoder_block: llama2``).

    Args:
        num_layers: the model's layer count, needed for scanned layers
            (``scan_layers=True``): each stacked leaf goes as one tensor per
            layer. Unscanned trees (``layers_{i}``) need none.
        dtype: cast every tensor to this dtype (default: keep the model's).

    Returns:
        The mapping; ``MAXTEXT_LLAMA31`` is ``maxtext_llama31()`` (unscanned).
    """
    return _maxtext("MAXTEXT_LLAMA31", "maxtext_llama31", _MAXTEXT_LLAMA_LAYER,
                    num_layers=num_layers, dtype=dtype)


def maxtext_qwen3(*, num_layers: int | None = None, dtype: Any = None) -> Mapping:
    """The mapping for MaxText's dense Qwen3 (and Qwen2.5: q/k/v biases).

    Args:
        num_layers: the model's layer count, needed for scanned layers
            (``scan_layers=True``): each stacked leaf goes as one tensor per
            layer. Unscanned trees (``layers_{i}``) need none.
        dtype: cast every tensor to this dtype (default: keep the model's).

    Returns:
        The mapping; ``MAXTEXT_QWEN3`` is ``maxtext_qwen3()`` (unscanned).
    """
    return _maxtext("MAXTEXT_QWEN3", "maxtext_qwen3", _MAXTEXT_QWEN_LAYER,
                    num_layers=num_layers, dtype=dtype)


TUNIX_LLAMA3 = tunix_llama3()
TUNIX_QWEN2 = tunix_qwen2()
TUNIX_QWEN3 = tunix_qwen3()
MAXTEXT_LLAMA31 = maxtext_llama31()
MAXTEXT_QWEN3 = maxtext_qwen3()
