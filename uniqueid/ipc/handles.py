"""Torch's CUDA IPC producer contract, without torch: the arguments of
``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and the pickle
vLLM's ``ipc`` engine reads them from.

vLLM 0.33.0's ``IPCWeightTransferEngine`` takes, per ``/update_weights``,
``ipc_handles_pickled``: standard base64 of a pickle of ``{gpu_uuid: args}``
(packed: one dict for the chunk's buffer) or a list of such dicts (unpacked:
one per tensor), where ``args`` are the 15 arguments torch's
``reduce_tensor`` gives for a CUDA tensor. A worker looks up its own GPU's
UUID, sets ``args[6]`` to its device, and calls ``rebuild_cuda_tensor``.

Why written by hand: the pickle names torch's classes and dtypes
(``torch.Tensor``, ``torch.Size``, ``torch.storage.TypedStorage``,
``torch.bfloat16``, ...), and Python's pickler writes a global only after
importing it to check it resolves, which would need torch. The encoder here
writes the same protocol-4 opcodes for the few types the payload holds;
the receiver's ``pickle.loads`` builds torch's own objects from them.

The arguments, as torch 2.11 to 2.14 order them (``RebuildArgs``):

==  ======================  ===============================================
 #  field                   here
==  ======================  ===============================================
 0  tensor class            ``torch.Tensor``
 1  size                    ``torch.Size`` of the tensor's shape
 2  stride                  C-order strides, in elements
 3  tensor offset           0 (each storage starts at its tensor)
 4  storage class           ``torch.storage.TypedStorage``
 5  dtype                   ``torch.<name>``
 6  device                  the trainer's ordinal (the worker overwrites it)
 7  storage handle          ``0x02 'c'`` + the 64-byte ``cudaIpcMemHandle_t``
                            of the allocation (torch's handle format 2)
 8  storage size            bytes
 9  storage offset          bytes into the allocation
10  requires_grad           False
11  ref-counter file        bytes, the file's name in ``/dev/shm``
12  ref-counter slot        which int64 of the file this export counts on
13  event handle            64 zero bytes: no IPC event (the trainer syncs
                            its copies before the update is posted)
14  event_sync_required     False
==  ======================  ===============================================
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

# torch's CUDA IPC handle format 2 for memory from cudaMalloc/cuMemAlloc
# (``c10/cuda/CUDACachingAllocator.cpp``: version byte, then 'c'), followed
# by the allocation's 64-byte ``cudaIpcMemHandle_t``.
HANDLE_VERSION = b"\x02c"
IPC_HANDLE_BYTES = 64
EVENT_HANDLE = bytes(64)  # no event: ``event_sync_required`` is False


@dataclass(frozen=True)
class Global:
    """A module-level name the receiver's unpickler resolves (``torch.Size``)."""

    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """``callable(*args)`` when unpickled (how ``torch.Size`` pickles)."""

    callable: Global
    args: tuple[Any, ...]


TENSOR = Global("torch", "Tensor")
SIZE = Global("torch", "Size")
TYPED_STORAGE = Global("torch.storage", "TypedStorage")


@dataclass(frozen=True, kw_only=True)
class RebuildArgs:
    """One export: a tensor of ``shape`` and ``dtype`` at ``offset`` bytes
    into the allocation whose IPC handle is ``handle``, counted on slot
    ``slot`` of the ref-counter file ``counter``.

    Attributes:
        shape: the tensor's shape.
        dtype: torch's name of its dtype (``"bfloat16"``, ``"uint8"``, ...).
        itemsize: bytes per element.
        device: the trainer's CUDA ordinal (each worker sets its own).
        handle: the allocation's 64-byte ``cudaIpcMemHandle_t``.
        offset: bytes from the allocation's start to the tensor's first byte.
        counter: the ref-counter file's name (``/...``, in ``/dev/shm``).
        slot: the int64 slot of that file this export counts on.
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    device: int
    handle: bytes
    offset: int
    counter: str
    slot: int

    def __post_init__(self) -> None:
        if len(self.handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got "
                             f"{len(self.handle)}")
        if self.offset % self.itemsize:
            raise ValueError(f"offset {self.offset} is not a multiple of {self.dtype}'s "
                             f"{self.itemsize} bytes (torch views it there)")

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (its storage's size)."""
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_tuple(self) -> tuple[Any, ...]:
        """The 15 arguments of ``rebuild_cuda_tensor``, in torch's order.

        Returns:
            The tuple, with ``Global``/``Reduce`` where torch's objects go.
        """
        return (TENSOR, Reduce(SIZE, (tuple(self.shape),)), _strides(self.shape), 0,
                TYPED_STORAGE, Global("torch", self.dtype), self.device,
                HANDLE_VERSION + self.handle, self.nbytes, self.offset, False,
                self.counter.encode("ascii"), self.slot, EVENT_HANDLE, False)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides of ``shape``, in elements, as torch gives a contiguous tensor's."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def pickled(obj: Any) -> str:
    """``obj`` as vLLM's ``ipc_handles_pickled`` carries it: standard base64
    of a protocol-4 pickle.

    Strings, bytes and globals are written once and fetched from the memo
    after (as Python's pickler does): an unpacked push names torch's classes,
    its dtype, a GPU's UUID, the ref-counter file and often a handle in every
    export, and each repeat would cost the worker a lookup (a global is an
    import) and the payload its bytes.

    Args:
        obj: dicts, lists, tuples, str, bytes, int, bool, ``Global`` and
            ``Reduce`` (what the handles hold).

    Returns:
        The base64 text.

    Raises:
        TypeError: a value of another type.
    """
    writer = _Writer()
    writer.write(obj)
    writer.out += b"."  # STOP
    return base64.b64encode(bytes(writer.out)).decode("ascii")


class _Writer:
    """The protocol-4 opcodes of one pickle, with its memo."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x04")  # PROTO 4
        self.memo: dict[tuple[type, Any], int] = {}

    def write(self, obj: Any) -> None:
        if obj is True or obj is False:
            self.out += b"\x88" if obj else b"\x89"  # NEWTRUE / NEWFALSE
        elif isinstance(obj, int):
            _write_int(self.out, obj)
        elif isinstance(obj, (str, bytes, Global)):
            self._once(obj)
        elif isinstance(obj, Reduce):
            self.write(obj.callable)
            self.write(obj.args)
            self.out += b"R"  # REDUCE
        else:
            self._container(obj)

    def _once(self, obj: str | bytes | Global) -> None:
        """``obj`` from the memo if written before, else written and memoized."""
        key = (type(obj), obj)
        at = self.memo.get(key)
        if at is not None:
            self.out += b"h" + bytes([at]) if at < 256 else b"j" + struct.pack("<I", at)
            return  # BINGET / LONG_BINGET
        if isinstance(obj, Global):
            _write_text(self.out, obj.module)
            _write_text(self.out, obj.name)
            self.out += b"\x93"  # STACK_GLOBAL
        else:
            _write_text(self.out, obj)
        self.out += b"\x94"  # MEMOIZE: the unpickler's next index, as ours
        self.memo[key] = len(self.memo)

    def _container(self, obj: Any) -> None:
        if isinstance(obj, tuple):
            self.out += b"("  # MARK
            for item in obj:
                self.write(item)
            self.out += b"t"  # TUPLE
        elif isinstance(obj, list):
            self.out += b"]("  # EMPTY_LIST, MARK
            for item in obj:
                self.write(item)
            self.out += b"e"  # APPENDS
        elif isinstance(obj, dict):
            self.out += b"}("  # EMPTY_DICT, MARK
            for key, value in obj.items():
                self.write(key)
                self.write(value)
            self.out += b"u"  # SETITEMS
        else:
            raise TypeError(f"cannot pickle {type(obj).__name__} for vLLM's IPC handles")


def _write_int(out: bytearray, n: int) -> None:
    if 0 <= n < 256:
        out += b"K" + bytes([n])  # BININT1
    elif -2**31 <= n < 2**31:
        out += b"J" + struct.pack("<i", n)  # BININT
    else:
        raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _write_text(out: bytearray, value: str | bytes) -> None:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    short = len(raw) < 256
    if isinstance(value, str):
        out += (b"\x8c" + bytes([len(raw)])) if short else (b"X" + struct.pack("<I", len(raw)))
    else:
        out += (b"C" + bytes([len(raw)])) if short else (b"B" + struct.pack("<I", len(raw)))
    out += raw
