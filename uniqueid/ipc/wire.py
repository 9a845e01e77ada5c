"""The JSON bodies of vLLM 0.33.0's ``ipc`` weight-transfer backend.

``init_info``: ``{"packed": bool}`` and nothing else (no rendezvous: the
workers map the trainer's memory by the handles each update carries).
``update_info``: the tensor lists, ``ipc_handles_pickled`` (see
``handles.py``) and, packed, ``tensor_sizes`` (each tensor's bytes in the
chunk, in order); or a list of such payloads indexed by global worker rank
(``dp_index * world_size + rank``) where workers need payloads of their own
(two workers on one GPU each count their own export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire import _need_bool, _need_tensor_lists, _same_length, _tensor_lists


@dataclass(frozen=True, kw_only=True)
class IPCInitInfo:
    """``init_info`` for the ``ipc`` backend.

    Attributes:
        packed: chunks in one exported buffer (True), or each tensor exported
            on its own (False).
    """

    packed: bool

    def __post_init__(self) -> None:
        _need_bool("packed", self.packed)

    def to_payload(self) -> dict[str, Any]:
        """The body's ``init_info``.

        Returns:
            ``{"packed": bool}``.
        """
        return {"packed": self.packed}


@dataclass(frozen=True, kw_only=True)
class IPCUpdateInfo:
    """``update_info`` for the ``ipc`` backend (one worker's, or every
    worker's alike).

    Attributes:
        names: checkpoint names, in the buffer's order.
        dtype_names: torch's dtype names.
        shapes: each tensor's shape.
        ipc_handles_pickled: base64 of the pickled handles (``handles.pickled``).
        tensor_sizes: packed: each tensor's bytes in the chunk; unpacked: None.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles_pickled: str
    tensor_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        _need_tensor_lists(self)
        _same_length(self, "dtype_names", "shapes")
        if self.tensor_sizes is not None:
            _same_length(self, "tensor_sizes")
        if not isinstance(self.ipc_handles_pickled, str):
            raise TypeError("ipc_handles_pickled must be base64 text")

    def to_payload(self) -> dict[str, Any]:
        """The body's ``update_info`` (``tensor_sizes`` only when packed).

        Returns:
            The payload.
        """
        out = _tensor_lists(self)
        out["ipc_handles_pickled"] = self.ipc_handles_pickled
        if self.tensor_sizes is not None:
            out["tensor_sizes"] = [int(n) for n in self.tensor_sizes]
        return out
