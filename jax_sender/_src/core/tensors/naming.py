"""From a JAX pytree to the ``(checkpoint name, array)`` list vLLM loads.

A *mapping* is two functions of the pytree path (a tuple of string keys):
``name(path)`` gives the Hugging Face name vLLM's ``load_weights`` expects,
``transform(path, array)`` turns the Flax layout into torch's (Dense kernels
are ``(in, out)``, torch's Linear weights ``(out, in)``) or casts the dtype.
Transforms are traced with ``jax.eval_shape`` first, so the metadata sent to
the workers is known before anything runs on the GPU.

One leaf may become several tensors (MaxText stacks the layers of a
scanned model on one axis): ``name(path)`` then gives a tuple of names and
``transform(path, array)`` a tuple of arrays, and tensor *i* is
``transform(path, array)[i]``, jitted once per shape so that XLA computes
only that part; its path is the leaf's with a ``Part(i)`` at the end.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax

from ..errors import MetadataError

Path = tuple[Any, ...]  # str keys, and a ``Part`` last for one of a leaf's several tensors


@dataclass(frozen=True)
class Part:
    """Tensor ``index`` of the several a one-to-many mapping makes of a leaf.

    Attributes:
        index: its position in ``name(path)``'s tuple.
    """

    index: int

    def __str__(self) -> str:
        return f"#{self.index}"


def key_str(entry: Any) -> str:
    """One pytree path entry as a string (dict key, attribute, or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree: Any) -> list[tuple[Path, Any]]:
    """(path, leaf) pairs in the pytree's deterministic order.

    Args:
        tree: any JAX pytree.

    Returns:
        One ``(path, leaf)`` per leaf, the path a tuple of strings (dict
        keys, attribute names, and indices as strings).
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(key_str(k) for k in path), leaf) for path, leaf in leaves]


def dotted(path: Path) -> str:
    """The default checkpoint name: the path's keys joined by dots.

    Args:
        path: a pytree path.

    Returns:
        E.g. ``"layers_0.mlp.kernel"``.
    """
    return ".".join(map(str, path))


def identity(_: Path, array: Any) -> Any:
    """The default transform: ``array`` unchanged.

    Args:
        _: the pytree path (unused).
        array: the leaf.

    Returns:
        ``array`` itself.
    """
    return array


@dataclass(frozen=True)
class Mapping:
    """Pytree path -> checkpoint name, and an optional per-tensor transform.

    Attributes:
        name: ``name(path)``, the checkpoint name vLLM loads for a leaf
            (default: the path joined by dots).
        transform: ``transform(path, array)``, the array to send for a leaf,
            e.g. transposed or cast; traced with ``jax.eval_shape`` to learn
            its metadata (default: the array unchanged).
    """

    name: Callable[[Path], str | tuple[str, ...]] = dotted
    transform: Callable[[Path, Any], Any] = identity

    def apply(self, path: Path, array: Any) -> Any:
        """The tensor to send for ``path``: ``transform(path, array)``, or,
        for a path ending in ``Part(i)``, its part *i* (jitted once per shape).

        Args:
            path: a tensor's path (as ``named_arrays`` gives it).
            array: the leaf.

        Returns:
            The transformed array.
        """
        if path and isinstance(path[-1], Part):
            return _part_of(self.transform, path[:-1], path[-1].index)(array)
        return self.transform(path, array)


@functools.lru_cache(maxsize=4096)
def _part_of(transform: Callable[[Path, Any], Any], path: Path,
             index: int) -> Callable[[Any], Any]:
    """Part ``index`` of ``transform(path, x)``, jitted: XLA computes that part alone."""
    return jax.jit(lambda x: transform(path, x)[index])


def _is_pairs(obj: Any) -> bool:
    """Whether ``obj`` is ``(name, array)`` pairs: 2-tuples whose first items
    are names, not arrays or subtrees. A name that is not a non-empty str is
    refused here, not turned into a pytree path (``[(1, x)]`` would
    otherwise push tensors named ``0.0`` and ``0.1``).

    Raises:
        MetadataError: pairs with a name that is not a non-empty str.
    """
    if not (isinstance(obj, (list, tuple)) and obj and all(
            isinstance(p, tuple) and len(p) == 2 and _scalar(p[0]) for p in obj)):
        return False
    for name, _ in obj:
        if not isinstance(name, str) or not name:
            raise MetadataError(f"(name, array) pairs need non-empty str names, got {name!r}: "
                                "pass the checkpoint name vLLM loads, e.g. "
                                "'model.layers.0.mlp.up_proj.weight'")
    return True


def _scalar(x: Any) -> bool:
    """Not an array and not a subtree: what only a name could be."""
    return not hasattr(x, "shape") and not isinstance(x, (dict, list, tuple))


def named_arrays(params: Any, mapping: Mapping = Mapping()) -> list[tuple[str, Path, Any]]:
    """``(name, path, array)`` for a pytree, or for an iterable of ``(name, array)``.

    Pairs keep their names (the path is ``(name,)`` for the transform); a
    pytree's names come from ``mapping.name``.

    Args:
        params: a pytree of arrays, or an iterable of ``(name, array)`` pairs.
        mapping: names the pytree's leaves (its transform is not applied).

    Returns:
        One ``(name, path, array)`` per tensor, in tree or pair order.

    Raises:
        MetadataError: pairs with a name that is not a non-empty str, or a
            leaf the mapping has no name for (its ``name`` raised
            ``KeyError``, or ``llama_name``'s own error).
    """
    if isinstance(params, Iterator):
        params = list(params)
    if _is_pairs(params):
        return [(name, (name,), arr) for name, arr in params]
    out = []
    for path, leaf in flatten(params):
        names = _names(mapping, path)
        if isinstance(names, str):
            out.append((names, path, leaf))
        else:  # one-to-many (or none: a leaf deliberately not sent)
            out += [(n, (*path, Part(i)), leaf) for i, n in enumerate(names)]
    return out


def _names(mapping: Mapping, path: Path) -> str | tuple[str, ...]:
    """``mapping.name(path)``, checked: a leaf the mapping does not know, or
    several names with no transform to make several tensors, is refused."""
    try:
        names = mapping.name(path)
    except KeyError as e:
        raise MetadataError(f"the mapping has no checkpoint name for the leaf at "
                            f"{dotted(path)!r} ({e}): map it, or leave it out of the "
                            "tree you send") from None
    if not isinstance(names, str):
        names = tuple(names)
        if names and mapping.transform is identity:
            raise MetadataError(f"the mapping names {len(names)} tensors for the leaf at "
                                f"{dotted(path)!r} but has no transform to make them")
    return names


# -- Llama / Qwen-style decoders ---------------------------------------------
# The Flax layout of jax_sender.demo.model (and of most Flax ports):
#   embed_tokens/embedding, layers_{i}/{self_attn,mlp}/{proj}/kernel,
#   layers_{i}/{input,post_attention}_layernorm/scale, norm/scale, lm_head/kernel,
#   layers_{i}/self_attn/{q,k}_norm/scale (Qwen3).

_LAYER = re.compile(r"layers_(\d+)")


def llama_name(path: Path) -> str:
    """Hugging Face name for a Llama/Qwen2/Qwen3 Flax parameter path.

    Args:
        path: the parameter's path in the Flax tree (a leading ``"params"``
            is skipped), as laid out above.

    Returns:
        The checkpoint name, e.g. ``"model.layers.0.self_attn.q_proj.weight"``.

    Raises:
        MetadataError: a path outside that layout.
    """
    parts = [p for p in path if p != "params"]
    if parts[:1] == ["embed_tokens"]:
        return "model.embed_tokens.weight"
    if parts[:1] == ["lm_head"]:
        return "lm_head.weight"
    if parts[:1] == ["norm"]:
        return "model.norm.weight"
    m = _LAYER.fullmatch(parts[0]) if parts else None
    if m is None:
        raise MetadataError(f"no Llama/Qwen checkpoint name for parameter path {dotted(path)!r}")
    leaf = {"kernel": "weight", "scale": "weight", "bias": "bias"}.get(parts[-1])
    if leaf is None:
        raise MetadataError(f"unexpected leaf {parts[-1]!r} in {dotted(path)!r}")
    return ".".join(["model", "layers", m.group(1), *parts[1:-1], leaf])


def llama_transform(path: Path, array: Any) -> Any:
    """Dense kernels ``(in, out)`` -> torch ``(out, in)``; everything else unchanged.

    Args:
        path: the parameter's path; a last key ``"kernel"`` marks a kernel.
        array: the parameter.

    Returns:
        ``array.T`` for a kernel, else ``array``.
    """
    if path[-1] == "kernel":
        return array.T
    return array


LLAMA = Mapping(name=llama_name, transform=llama_transform)
