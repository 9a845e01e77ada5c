"""What a push sends, described before anything is sent, and got onto the
sender's device when it is sent.

``describe`` turns a pytree (or ``(name, array)`` pairs) into the metadata
the workers are told and the source arrays, checking everything a worker
would otherwise fail on mid-stream; transforms are traced with
``jax.eval_shape``, so nothing runs on the GPU. ``Descriptions`` keeps the
last answer for the next push of the same structure: a push of many small
tensors otherwise spends more time describing them than sending them.
Both senders share these plain functions.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ..errors import MetadataError
from ..group import gather, ready
from .naming import Mapping, dotted, identity, named_arrays
from .plan import WIRE_DTYPES, LoadPlan, TensorMeta, check_unique

Get = Callable[[int], jax.Array]


class Sources(Sequence[tuple[Any, Any]]):
    """(path, array) per tensor, held as two lists (``paths``, ``arrays``),
    and whether every array is known to be on the sender's device alone
    (``local``; None: not known, look).

    Why two lists, not a list of pairs: a push of 20,000 arrays would make
    20,000 new tuples each time, and the garbage collector's passes they set
    off cost most of the time making them took."""

    def __init__(self, paths: list[Any], arrays: list[Any], *, local: bool | None = None):
        self.paths, self.arrays, self.local = paths, arrays, local

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.paths[i], self.arrays[i]))
        return self.paths[i], self.arrays[i]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(self.paths, self.arrays)


def describe(params: Any, mapping: Mapping) -> tuple[list[TensorMeta], Sources]:
    """Metadata of what ``params`` would send, and per tensor (path, source array).

    Args:
        params: a pytree of arrays, or ``(name, array)`` pairs.
        mapping: names the leaves and transforms them (``naming.Mapping``).

    Returns:
        The metadata (after the transform) and the sources, in tree order.

    Raises:
        MetadataError: anything the workers could not take (no name, a
            duplicate name, a dtype vLLM cannot receive, an empty tree).
    """
    metas, paths, arrays = [], [], []
    traced = mapping.transform is not identity
    for name, path, arr in named_arrays(params, mapping):
        if not isinstance(name, str) or not name:
            raise MetadataError(f"parameter at {path} has no checkpoint name")
        if not name.isascii():  # the cheap look; the full one only where it may fail
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise MetadataError(f"the checkpoint name {ascii(name)} cannot travel as JSON "
                                    "text (it is not valid Unicode)") from None
        if not isinstance(arr, jax.Array):
            _check_host_dtype(path, arr)
        # Tracing is skipped for JAX arrays with no transform (others are
        # traced, which gives the dtype JAX will turn them into).
        out = (_traced(mapping, path, arr) if traced or not isinstance(arr, jax.Array)
               else arr)
        metas.append(TensorMeta.of(name, out))
        paths.append(path)
        arrays.append(arr)
    if not metas:
        raise MetadataError("nothing to send: the parameter tree has no arrays")
    check_unique(metas)
    return metas, Sources(paths, arrays)


def _check_host_dtype(path: Any, arr: Any) -> None:
    """Refuse a host array (numpy) whose dtype JAX would narrow on its way to
    the device: with ``jax_enable_x64`` off (JAX's default), int64 becomes
    int32 and float64 float32, silently, so ``[2**40, 7]`` would arrive as
    ``[0, 7]``. Refused rather than sent around JAX: a transform could not
    see the 64-bit values either, and with x64 on JAX keeps them, and they
    are sent exactly (int64 and float64 are wire dtypes of vLLM)."""
    dtype = getattr(arr, "dtype", None)
    if dtype is None:  # a Python number: JAX's own width is all it has
        return
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return
    kept = jax.dtypes.canonicalize_dtype(dtype)
    if kept != dtype and dtype.name in WIRE_DTYPES:  # others: refused as not a wire dtype
        raise MetadataError(
            f"the host array at {dotted(path)!r} is {dtype}, which JAX turns into {kept} while "
            "jax_enable_x64 is off, changing any value that does not fit: enable it "
            "(jax.config.update('jax_enable_x64', True)) to send the array exactly, or cast "
            f"it to {kept} yourself")


def _traced(mapping: Mapping, path: Any, arr: Any) -> Any:
    """The shape and dtype the mapping makes of ``arr``, without running it."""
    try:
        return jax.eval_shape(lambda a: mapping.apply(path, a), arr)
    except OverflowError:  # a Python int past JAX's default integer
        raise MetadataError(f"the value at {dotted(path)!r} is the Python int {arr}, which does "
                            "not fit JAX's default integer (int32 while jax_enable_x64 is off): "
                            "pass a numpy array of the dtype to send") from None
    except (TypeError, ValueError, IndexError) as e:  # a reshape or slice that cannot fit
        raise MetadataError(f"the mapping's transform cannot take the leaf at "
                            f"{dotted(path)!r} ({getattr(arr, 'dtype', '?')} "
                            f"{tuple(getattr(arr, 'shape', ()))}): {e}") from None


def structure(params: Any) -> tuple[Any, list[Any]] | None:
    """A key for ``describe``'s answer, and the leaves; None when there is no
    cheap key (host data). The key is the tree's structure (or the names),
    and each leaf's aval (shape, dtype) and sharding (placement): JAX shares
    one aval object among arrays of a shape and dtype, so two keys compare
    by identity there, the shardings by value."""
    if isinstance(params, (list, tuple)) and params and isinstance(params[0], tuple):
        names = tuple(p[0] for p in params)
        leaves = [p[1] for p in params]
        tree: Any = names
    else:
        leaves, tree = jax.tree_util.tree_flatten(params)
    try:
        avals = tuple(map(_aval, leaves))
        shardings = tuple(map(_sharding, leaves))
    except AttributeError:  # not JAX arrays
        return None
    return (tree, avals, shardings), leaves


_aval = operator.attrgetter("aval")
_sharding = operator.attrgetter("sharding")


def alone_on(array: Any, device: jax.Device) -> bool:
    """A JAX array on ``device`` alone, with no mesh around it."""
    return (isinstance(array, jax.Array) and isinstance(array.sharding, SingleDeviceSharding)
            and array.sharding.device_set == {device})


def unmeshed(arrays: Sequence[jax.Array], device: jax.Device) -> list[jax.Array]:
    """``arrays`` (each on ``device`` alone) with no mesh around them. Why:
    one on a one-device mesh with Explicit axes (as ``jax.make_mesh`` makes
    them) cannot meet an unsharded buffer in a jitted call. Its one shard is
    the whole array, as a view of the same buffer: nothing is copied."""
    return [a if isinstance(a.sharding, SingleDeviceSharding) else a.addressable_data(0)
            for a in arrays]


def on_device(sources: Sources, device: jax.Device) -> bool:
    """Every source a JAX array on ``device`` alone (nothing to gather or move).
    Known without a look at each array for what ``Descriptions.of`` returned."""
    if sources.local is not None:
        return sources.local
    dev = {device}
    return all(isinstance(a, jax.Array) and a.sharding.device_set == dev
               for a in sources.arrays)


def addressable(sources: Sources) -> bool:
    """Every source a JAX array this process can wait for (none to gather)."""
    return all(isinstance(a, jax.Array) and a.is_fully_addressable for a in sources.arrays)


@dataclass(frozen=True, kw_only=True)
class _Kept:
    key: Any
    metas: list[TensorMeta]
    paths: list[Any]
    local: bool
    leaf_of: list[int] | None  # each tensor's leaf, where not one tensor per leaf in order


class Descriptions:
    """``describe``, checked against a load plan, with the last answer kept
    for the next push of the same key (``structure``).

    Args:
        mapping: names and transforms.
        device: the sender's JAX device.
        load_plan: what the workers were told at init, or None.
    """

    def __init__(self, mapping: Mapping, device: jax.Device, load_plan: LoadPlan | None):
        self.mapping, self.device, self.load_plan = mapping, device, load_plan
        self._kept: _Kept | None = None

    def of(self, params: Any) -> tuple[list[TensorMeta], Sources]:
        """``describe(params)``, from the kept answer when the key matches.

        Raises:
            MetadataError: as ``describe``, or a tensor outside the load plan.
        """
        found = structure(params)
        kept = self._kept
        if found is not None and kept is not None and found[0] == kept.key:
            leaves = found[1]
            arrays = leaves if kept.leaf_of is None else [leaves[j] for j in kept.leaf_of]
            return kept.metas, Sources(kept.paths, arrays, local=kept.local)
        metas, sources = describe(params, self.mapping)
        if self.load_plan is not None:
            self.load_plan.check(metas)
        if found is not None:
            self._kept = _Kept(key=found[0], metas=metas, paths=sources.paths,
                               local=on_device(sources, self.device),
                               leaf_of=_leaf_of(sources.arrays, found[1]))
        return metas, sources


def _leaf_of(arrays: list[Any], leaves: list[Any]) -> list[int] | None:
    """Each tensor's position among the tree's leaves; None when they are the
    leaves themselves, in order (every mapping but a one-to-many one)."""
    if len(arrays) == len(leaves) and all(a is b for a, b in zip(arrays, leaves)):
        return None
    first = {id(a): j for j, a in reversed(list(enumerate(leaves)))}
    return [first[id(a)] for a in arrays]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """How a source array becomes the tensor on the wire: transformed, on
    the sender's device, checked against its metadata.

    Attributes:
        mapping: names and transforms.
        device: the sender's JAX device.
        wait_timeout_s: the deadline of a wait that moves so many bytes
            (``SendConfig.wait_timeout_s``), for the gathers.
    """

    mapping: Mapping
    device: jax.Device
    wait_timeout_s: Callable[[int], float]

    def materialize(self, path: Any, arr: Any) -> jax.Array:
        """The transformed array on the device, dispatched, not waited for: a
        parameter sharded over several processes is gathered with its other
        owners first; one elsewhere or sharded is moved (one full copy)."""
        if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
            arr = ready(gather(arr), self.wait_timeout_s(arr.nbytes), f"the gather of {path}")
        if not alone_on(arr, self.device):
            arr = jax.device_put(arr, self.device)
        if self.mapping.transform is identity:
            return arr
        out = self.mapping.apply(path, arr)
        if not alone_on(out, self.device):
            out = jax.device_put(out, self.device)
        return out

    def checked(self, metas: Sequence[TensorMeta], sources: Sources, i: int) -> jax.Array:
        """Tensor ``i`` materialized and checked against its metadata (not waited for)."""
        arr = self.materialize(*sources[i])
        metas[i].check(arr)
        return arr

    def getter(self, metas: Sequence[TensorMeta], sources: Sources) -> tuple[Get, bool]:
        """Tensor ``i`` on the device, ready and checked; and whether what it
        returns may be a temporary (then a packed push keeps it only until
        it is copied)."""
        if self.mapping.transform is identity and on_device(sources, self.device):
            # the caller's arrays as they are, one readiness wait for all
            return sources.arrays.__getitem__, False
        return lambda i: self.checked(metas, sources, i).block_until_ready(), True


# Up to this many arrays, a push looks whether they are all computed before
# it hands a readiness wait to a thread (a look is far cheaper than a
# thread's handoff; see docs/benchmarks.md).
LOOK_FIRST = 64


def readiness(sources: Sources) -> Callable[[], None] | None:
    """The wait until the source arrays are computed, or None when a look
    shows they are. A look also refuses a deleted (donated) array, before
    anything is sent: jaxlib's ``is_ready`` on one crashes the process; past
    ``LOOK_FIRST`` arrays, the wait itself fails on it, before any
    ``/update_weights``.

    Raises:
        MetadataError: a deleted array among the first ``LOOK_FIRST``.
    """
    arrays = sources.arrays
    if len(arrays) <= LOOK_FIRST:
        for path, a in sources:
            if a.is_deleted():
                raise MetadataError(f"the array at {dotted(path)!r} was deleted (donated to a "
                                    "step?): send the step's outputs, not its donated inputs")
        if all(a.is_ready() for a in arrays):
            return None
    return functools.partial(jax.block_until_ready, arrays)
