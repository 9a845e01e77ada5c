"""The workers' side of ``m2n_fabric``: vLLM's M2N entry points that need a
GPU (nccl4py's communicator, ``nccl.m2n``'s handle and reshard, CUDA
streams), replaced by the fabric inside a vLLM worker process on CPU;
everything else of ``M2NWeightTransferEngine`` stays vLLM's own.

``install("HOST:PORT")`` runs in the worker before the engine is built
(``jax_sender.testing.vllm_m2n --plane support.children.m2n_fabric_worker:HOST:PORT``).
Imports torch and vLLM, never JAX.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import types
from typing import Any

import numpy as np

R = -1


def send_frame(conn: socket.socket, head: dict, data: bytes) -> None:
    raw = json.dumps({**head, "nbytes": len(data)}).encode()
    conn.sendall(struct.pack("!I", len(raw)) + raw + data)


def _exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            raise ConnectionError("the fabric's peer closed")
        out += part
    return bytes(out)


def recv_frame(conn: socket.socket) -> tuple[dict, bytes]:
    (n,) = struct.unpack("!I", _exactly(conn, 4))
    head = json.loads(_exactly(conn, n))
    return head, _exactly(conn, head["nbytes"])


def uid_key(raw: bytes) -> str:
    return raw.hex()




class _Link:
    """One connection to the fabric, one call at a time."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.conn = socket.create_connection((host, int(port)), timeout=60)
        self.lock = threading.Lock()

    def call(self, head: dict, data: bytes = b"") -> tuple[dict, bytes]:
        with self.lock:
            send_frame(self.conn, head, data)
            reply, out = recv_frame(self.conn)
        if not reply["ok"]:
            raise RuntimeError(f"fabric: {reply['error']}")
        return reply, out


class _Comm:
    """A worker's communicator on the fabric: what vLLM calls on nccl4py's."""

    def __init__(self, link: _Link, uid: str, rank: int, world: int):
        self.link, self.uid, self.rank, self.world = link, uid, rank, world
        self.bcast_seq = 0
        self.reshard_seq = 0
        link.call({"op": "join", "uid": uid, "rank": rank, "world": world})

    def broadcast(self, send: Any, recv: Any, root: int, stream: Any = None) -> None:
        import torch
        seq, self.bcast_seq = self.bcast_seq, self.bcast_seq + 1
        if self.rank == root:
            self.link.call({"op": "bcast_put", "uid": self.uid, "seq": seq},
                           send.contiguous().view(torch.uint8).numpy().tobytes())
            return
        _, data = self.link.call({"op": "bcast_get", "uid": self.uid, "seq": seq})
        recv.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def abort(self) -> None:
        self.link.call({"op": "abort", "uid": self.uid, "reason": "a worker aborted"})

    def destroy(self) -> None:
        pass


class Mesh:
    def __init__(self, dims: Any, start_rank: int = 0):
        self.dims, self.start_rank = tuple(dims), start_rank


class Replicate:
    pass


class Shard:
    def __init__(self, dim: int):
        self.dim = dim


def _codes(placements: Any) -> list[int]:
    return [R if isinstance(p, Replicate) else p.dim for p in placements]


def _block(shape: tuple[int, ...], mesh: Mesh, codes: list[int], index: int) -> tuple[slice, ...]:
    """The block rank ``index`` of ``mesh`` holds (row-major ranks)."""
    coords = (index // mesh.dims[1], index % mesh.dims[1])
    out = [slice(None)] * len(shape)
    for axis, dim in enumerate(codes):
        if dim != R:
            width = shape[dim] // mesh.dims[axis]
            out[dim] = slice(coords[axis] * width, (coords[axis] + 1) * width)
    return tuple(out)


def _bits(itemsize: int) -> tuple[np.dtype, Any]:
    """Integer types of ``itemsize`` bytes (numpy's, torch's): bytes copied as they are."""
    import torch
    return ({1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32),
             8: np.dtype(np.int64)}[itemsize],
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize])


def reshard(src: Any, dst: Any, comm: _Comm, stream: Any = None, *, src_mesh: Mesh,
            src_placements: Any, dst_mesh: Mesh, dst_placements: Any, handle: Any = None,
            **_: Any) -> None:
    """A destination rank's part of one reshard: every source block, the
    whole tensor, this rank's block of it (bit for bit)."""
    import torch
    seq, comm.reshard_seq = comm.reshard_seq, comm.reshard_seq + 1
    scodes, dcodes = _codes(src_placements), _codes(dst_placements)
    shape = list(dst.shape)
    for axis, dim in enumerate(dcodes):
        if dim != R:
            shape[dim] *= dst_mesh.dims[axis]
    bits, torch_bits = _bits(dst.element_size())
    whole = np.zeros(shape, bits)
    for index in range(src_mesh.dims[0] * src_mesh.dims[1]):
        reply, data = comm.link.call({"op": "get", "uid": comm.uid, "seq": seq,
                                      "rank": src_mesh.start_rank + index})
        where = _block(tuple(shape), src_mesh, scodes, index)
        _check(reply["desc"], whole[where].shape, src_mesh, scodes, dst_mesh, dcodes)
        whole[where] = np.frombuffer(data, bits).reshape(whole[where].shape)
    mine = np.ascontiguousarray(whole[_block(tuple(shape), dst_mesh, dcodes,
                                             comm.rank - dst_mesh.start_rank)])
    dst.view(torch_bits).copy_(torch.from_numpy(mine))
    comm.link.call({"op": "took", "uid": comm.uid, "seq": seq, "rank": comm.rank})


def _check(desc: dict, local: tuple[int, ...], src_mesh: Mesh, scodes: list[int],
           dst_mesh: Mesh, dcodes: list[int]) -> None:
    """What the trainer rank said it sent, against what vLLM's plan expects."""
    theirs = (tuple(desc["local_shape"]), tuple(desc["mesh"]), tuple(desc["placements"]),
              tuple(desc["dst_mesh"]), tuple(desc["dst_placements"]), desc["dst_start"])
    ours = (tuple(local), src_mesh.dims, tuple(scodes), dst_mesh.dims, tuple(dcodes),
            dst_mesh.start_rank)
    if theirs != ours:
        raise RuntimeError(f"fabric: the trainer described {desc['name']!r} as {theirs}, but "
                           f"vLLM's plan is {ours}")


class _Handle:
    @classmethod
    def create(cls, config: Any = None) -> _Handle:
        return cls()

    def destroy(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass


def install(address: str) -> None:
    """Point vLLM's M2N engine at the fabric: its communicator, handle,
    reshard and streams; the rest stays vLLM's."""
    import torch
    from vllm.distributed.weight_transfer import m2n_common, m2n_engine

    link = _Link(address)
    m2n = types.SimpleNamespace(Handle=_Handle, Config=lambda max_cta=None: None, Mesh=Mesh,
                                Replicate=Replicate, Shard=Shard, reshard=reshard)

    def runtime(m2n_module: Any, max_cta: Any) -> tuple[Any, int, Any]:
        return types.SimpleNamespace(), 0, _Handle.create()

    def communicator(nccl: Any, group: Any, unique_id: bytes | None) -> _Comm:
        return _Comm(link, uid_key(unique_id), group.rank, group.world_size)

    for module in (m2n_common, m2n_engine):
        module.import_m2n = lambda: m2n
        module.prepare_m2n_local_runtime = runtime
        module.create_m2n_communicator = communicator
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.accelerator.synchronize = lambda *a, **k: None
