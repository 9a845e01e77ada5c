"""The JSON bodies of vLLM's weight-transfer routes, as small dataclasses.

``to_payload`` builds exactly what vLLM 0.33.0 reads: JSON booleans and
integers (never strings), ``packed`` always sent (the worker defaults to
false), and no key the server does not know unless a feature needs it
(0.33.0 answers an unknown key with HTTP 500). ``from_payload`` parses with
vLLM's own rules, for the reference receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .codec import UniqueId, check_rendezvous_mode

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2


def _need_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _need_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _same_length(info: Any, *keys: str) -> None:
    """vLLM's check that every per-tensor list is as long as ``names``."""
    n = len(info.names)
    for key in keys:
        if len(getattr(info, key)) != n:
            raise ValueError(f"`{key}` should be of the same size as `names`: "
                             f"got {len(getattr(info, key))} and {n}")


def _need_tensor_lists(info: Any) -> None:
    """``names`` and ``dtype_names`` lists of str, ``shapes`` a list of lists
    of ints >= 0: vLLM's dataclasses do not check, and anything else would
    be sent back as another payload (``[[1.5]]`` as ``[[1]]``) or fail later."""
    for key in ("names", "dtype_names"):
        value = getattr(info, key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"`{key}` must be a list of str, got {value!r}")
    if not isinstance(info.shapes, list):
        raise TypeError(f"`shapes` must be a list of lists of ints >= 0, got {info.shapes!r}")
    for shape in info.shapes:
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise TypeError(f"`shapes` must be lists of ints >= 0, got {shape!r}")


def _tensor_lists(info: Any) -> dict[str, Any]:
    """The ``names``, ``dtype_names`` and ``shapes`` keys of an update payload."""
    return {"names": list(info.names), "dtype_names": list(info.dtype_names),
            "shapes": [[int(d) for d in s] for s in info.shapes]}


def _construct(cls, payload: dict[str, Any], what: str, engine: str = "NCCLWeightTransferEngine"):
    """``cls(**payload)`` with vLLM's error for unknown or missing keys (the
    first unknown key in the payload's order, as Python names it)."""
    if not isinstance(payload, dict):
        raise ValueError(f"Invalid {what} for {engine}: expected an object")
    known = {f.name for f in fields(cls)}
    unknown = [k for k in payload if k not in known]
    if unknown:
        raise ValueError(
            f"Invalid {what} for {engine}: {cls.__name__}.__init__() got "
            f"an unexpected keyword argument '{unknown[0]}'")
    try:
        return cls(**payload)
    except TypeError as e:
        raise ValueError(f"Invalid {what} for {engine}: {e}") from e


@dataclass(kw_only=True)
class InitInfo:
    """``init_info`` of ``POST /init_weight_transfer_engine`` (unique-id path).

    Attributes:
        nccl_unique_id_b64: the group's id (``UniqueId.to_b64``); None or ""
            on vLLM's master-address path. Left out of ``repr``.
        rank_offset: the group rank of this server's first worker (the
            ranks before it: the trainer's, and earlier servers' workers).
        world_size: every rank of the group, trainer's and workers'.
        packed: the workers receive packed chunks (vLLM's packed mode).
        packed_buffer_size_bytes: the chunk size both sides cut by.
        packed_num_buffers: the chunks in flight at once.
        use_load_plan: ship ``metadata`` at init [newer vLLM; 0.33.0 refuses it].
        metadata: with ``use_load_plan``, ``[name, dtype_name, shape]`` of
            every tensor the workers may receive.
        master_address, master_port: vLLM's other rendezvous path, which
            ``from_payload`` accepts as the worker does; None here.

    Raises:
        UniqueIdError: both rendezvous paths or neither, or an id vLLM
            would refuse.
        TypeError: an int or bool field of another type.
        ValueError: ``rank_offset`` below 1, ``world_size`` below 2 or not
            above ``rank_offset``, a buffer size or count below 1, or
            ``use_load_plan`` without ``metadata``.
    """

    nccl_unique_id_b64: str = field(repr=False)
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    use_load_plan: bool = False
    metadata: list[list[Any]] | None = None
    master_address: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        _ = self.unique_id  # validates mode and id
        _need_int("rank_offset", self.rank_offset, 1)
        _need_int("world_size", self.world_size, 2)
        if self.world_size <= self.rank_offset:
            raise ValueError(
                f"world_size {self.world_size} leaves no inference workers after "
                f"rank_offset {self.rank_offset} trainer ranks")
        _need_bool("packed", self.packed)
        _need_int("packed_buffer_size_bytes", self.packed_buffer_size_bytes, 1)
        _need_int("packed_num_buffers", self.packed_num_buffers, 1)
        _need_bool("use_load_plan", self.use_load_plan)
        if self.use_load_plan and not self.metadata:
            raise ValueError("use_load_plan needs the metadata of every tensor sent")

    @property
    def unique_id(self) -> UniqueId | None:
        """The id ``nccl_unique_id_b64`` carries, decoded; None on the
        master-address path. Raises ``UniqueIdError`` as ``check_rendezvous_mode``."""
        return check_rendezvous_mode(nccl_unique_id_b64=self.nccl_unique_id_b64,
                                     master_address=self.master_address,
                                     master_port=self.master_port)

    def to_payload(self) -> dict[str, Any]:
        """The JSON object vLLM reads as ``init_info``.

        Returns:
            A dict of JSON types: the rendezvous keys in use, the group and
            wire geometry, and ``use_load_plan``/``metadata`` only when set.
        """
        # Only the rendezvous mode in use, as vLLM's trainer sends it.
        mode = ({"nccl_unique_id_b64": self.nccl_unique_id_b64} if self.nccl_unique_id_b64
                else {"master_address": self.master_address, "master_port": self.master_port})
        out = {
            **mode,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }
        if self.use_load_plan:  # [newer] keys, only when the user asks for the plan
            out["use_load_plan"] = True
            out["metadata"] = self.metadata
        return out

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> InitInfo:
        """Parse like vLLM's worker: unknown keys and bad ids are errors.

        Args:
            payload: the ``init_info`` object; ``packed`` defaults to false,
                as the worker's does.

        Returns:
            The parsed ``InitInfo``.

        Raises:
            ValueError: not a JSON object, an unknown key, or a field missing
                or invalid (vLLM's message).
        """
        info = dict(payload) if isinstance(payload, dict) else payload
        if isinstance(info, dict):
            info.setdefault("packed", False)  # the worker's default
            info.setdefault("nccl_unique_id_b64", None)
        return _construct(cls, info, "init_info")

    def __repr__(self) -> str:
        return (f"InitInfo(rank_offset={self.rank_offset}, world_size={self.world_size}, "
                f"packed={self.packed}, packed_buffer_size_bytes={self.packed_buffer_size_bytes}, "
                f"packed_num_buffers={self.packed_num_buffers}, use_load_plan={self.use_load_plan})")


@dataclass
class UpdateInfo:
    """``update_info`` of ``POST /update_weights`` (dense ``nccl`` backend).

    All three lists empty means "same as the previous call".

    Attributes:
        names: the checkpoint name of each tensor, in broadcast order.
        dtype_names: each tensor's torch dtype name, e.g. ``"bfloat16"``.
        shapes: each tensor's shape.
        src: the group rank that broadcasts [newer vLLM]; left out of the
            payload when 0, so 0.33.0 servers can read it.

    Raises:
        ValueError: lists of different lengths, or a negative ``src``.
        TypeError: ``src`` is not an int.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    src: int = 0

    def __post_init__(self) -> None:
        _same_length(self, "dtype_names", "shapes")
        _need_tensor_lists(self)
        _need_int("src", self.src, 0)

    @property
    def reuse(self) -> bool:
        """Whether this asks for the previous call's tensors again (no names listed)."""
        return not self.names

    def to_payload(self) -> dict[str, Any]:
        """The JSON object vLLM reads as ``update_info``.

        Returns:
            A dict of JSON types; ``src`` only when it is not 0.
        """
        out = _tensor_lists(self)
        if self.src:  # [newer]; omitted when 0 so 0.33.0 servers can read it
            out["src"] = self.src
        return out

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> UpdateInfo:
        """Parse like vLLM's worker.

        Args:
            payload: the ``update_info`` object.

        Returns:
            The parsed ``UpdateInfo``.

        Raises:
            ValueError: not a JSON object, an unknown key, or an invalid field
                (vLLM's message).
        """
        return _construct(cls, payload, "update_info")


@dataclass
class SparseUpdateInfo:
    """``update_info`` of ``POST /update_weights`` for the ``sparse_nccl`` backend.

    Per tensor, ``num_updates_list[i]`` changed elements follow as two
    broadcasts: int32 flat indices, then the values in ``dtype_names[i]``.
    There is no metadata reuse: every call lists its tensors.

    Attributes:
        names: the checkpoint name of each tensor, in broadcast order.
        dtype_names: each tensor's torch dtype name (its values' dtype).
        shapes: each tensor's shape.
        num_updates_list: each tensor's count of changed elements.

    Raises:
        ValueError: lists of different lengths, an empty
            ``num_updates_list``, or a negative count.
        TypeError: a count that is not an int.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    num_updates_list: list[int]

    def __post_init__(self) -> None:
        _same_length(self, "dtype_names", "shapes")
        if not self.num_updates_list:
            raise ValueError("`num_updates_list` cannot be empty for sparse updates")
        _same_length(self, "num_updates_list")
        # vLLM's own checks end with the counts' signs: a payload it refuses
        # there is refused here in its words, before the stricter list checks.
        for k in self.num_updates_list:
            _need_int("num_updates_list entries", k, -2**63)
        if any(k < 0 for k in self.num_updates_list):
            raise ValueError("Sparse `num_updates_list` entries must be non-negative")
        _need_tensor_lists(self)

    def to_payload(self) -> dict[str, Any]:
        """The JSON object vLLM reads as ``update_info``.

        Returns:
            A dict of JSON types.
        """
        return {**_tensor_lists(self),
                "num_updates_list": [int(k) for k in self.num_updates_list]}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> SparseUpdateInfo:
        """Parse like vLLM's worker.

        Args:
            payload: the ``update_info`` object.

        Returns:
            The parsed ``SparseUpdateInfo``.

        Raises:
            ValueError: not a JSON object, an unknown key, or a field missing
                or invalid (vLLM's message).
        """
        return _construct(cls, payload, "update_info", "SparseNCCLWeightTransferEngine")
