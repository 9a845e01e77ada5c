"""The colocated push on one GPU: trainer and vLLM's workers share it.

``python benches/ipc.py --out benches/ipc-h200.json [--reps 5]`` (one GPU;
vLLM 0.33.0's tree in ``.vllm/``). For each workload (``qwen3-8b``, 16.4 GB
of bfloat16 in 399 tensors; ``1gb``, the first 1 GB of four of its layers),
in one run, each row the median of ``--reps`` pushes after a warm-up:

* ``ours packed`` / ``ours unpacked``: ``IPCSender`` into vLLM 0.33.0's real
  ``IPCWeightTransferEngine`` (``jax_sender.testing.vllm_ipc``, one worker
  on the same GPU), packed in a ``--buffer`` buffer (2 GiB);
* ``torch packed`` / ``torch unpacked``: vLLM's own torch trainer
  (``IPCTrainerWeightTransferEngine`` over vLLM's ``HTTPVLLMWeightSyncClient``)
  into the same server;
* ``broadcast (socket fold)``: today's ``WeightSender`` into vLLM's NCCL
  engine on the same GPU, each rank its own NCCL host over loopback sockets
  (``JAX_SENDER_SHARE_GPUS=1``, which the bench sets: JAX then allocates on
  demand beside the server), packed, 1 GiB x 2;
* ``floor``: one device-to-device copy of the same bytes, tensor by tensor,
  into an exported buffer (what the IPC push cannot do without).

Every row is ``send()``'s (or ``send_weights()``'s) whole wall time: the
update protocol, the copies, vLLM's load. The server keeps each pushed
tensor (a clone, as a model's loader copies), so its memory holds the
workload once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procs import emit, one, run_role, vllm_env  # noqa: E402
from workloads import GiB, workload  # noqa: E402

WORKLOADS = {"qwen3-8b": "qwen3-8b", "1gb": "layers4"}
SCRIPT = os.path.abspath(__file__)


def _spec(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """Workload ``name``'s (name, shape) per bfloat16 tensor: ``qwen3-8b``
    whole, ``1gb`` the first 1 GB of four of its layers."""
    spec = workload(WORKLOADS[name])
    if name != "1gb":
        return spec
    kept, total = [], 0
    for n, shape in spec:
        kept.append((n, shape))
        total += 2 * math.prod(shape)
        if total >= 1e9:
            break
    return kept


def _pairs(name: str) -> list:
    """Workload ``name`` as random bfloat16 JAX arrays on the GPU, computed."""
    import jax
    import jax.numpy as jnp
    spec = _spec(name)
    keys = jax.random.split(jax.random.PRNGKey(0), len(spec))
    pairs = [(n, jax.random.normal(k, s, jnp.bfloat16)) for (n, s), k in zip(spec, keys)]
    jax.block_until_ready([a for _, a in pairs])
    return pairs


def _timed(push: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        push()
        out.append(time.perf_counter() - t)
    return out[1:]


def role_ours(url: str, name: str, mode: str, reps: str, buffer: str) -> None:
    """``IPCSender`` pushes of workload ``name``, with their phases; then how
    long the workers' release of a push's exports lags its end."""
    from jax_sender import IPCSender, SendConfig
    pairs = _pairs(name)
    stats = []
    with IPCSender.connect(url, config=SendConfig(packed=mode == "packed",
                                                  buffer_size_bytes=int(buffer))) as sender:
        walls = _timed(lambda: stats.append(sender.send(pairs)), int(reps))
        counters, lag = sender.session.connection.comm.counters, []
        for _ in range(3):
            sender.send(pairs)
            t = time.perf_counter()
            counters.wait(range(10_000), 60.0, "the bench's exports")
            lag.append(time.perf_counter() - t)
        assert sender.verify(pairs[:4]).ok
    s = stats[1:]
    emit({"row": f"ours {mode}", "wall": walls, "bytes": s[0].bytes, "chunks": s[0].chunks,
          "start": [x.start_s for x in s], "transfer": [x.transfer_s for x in s],
          "update": [x.update_s for x in s], "host": [x.host_s for x in s],
          "finish": [x.finish_s for x in s], "release_lag": lag})


def role_torch(url: str, name: str, mode: str, reps: str, buffer: str) -> None:
    """vLLM's own torch IPC trainer pushes of workload ``name``, each HTTP call timed."""
    import shim
    shim.load()
    from functools import cached_property

    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerInitInfo,
        IPCTrainerWeightTransferEngine,
    )
    torch.cuda.set_device(0)
    pairs = [(n, torch.randn(s, dtype=torch.bfloat16, device="cuda")) for n, s in _spec(name)]

    class Source(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in pairs]

        def iter_full(self):
            yield from pairs

    phases: dict[str, list[float]] = {"start": [], "update": [], "finish": []}

    class Timed(HTTPVLLMWeightSyncClient):
        def _post(self, path, json=None):
            t = time.perf_counter()
            super()._post(path, json)
            key = path.split("_")[0] if path.split("_")[0] in phases else None
            if key:
                phases[key].append(time.perf_counter() - t)

    client = Timed(url)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=mode == "packed", packed_buffer_size_bytes=int(buffer)),
        client=client, source=Source())
    walls = _timed(engine.send_weights, int(reps))
    engine.shutdown()
    client.shutdown_weight_transfer_engine()
    emit({"row": f"torch {mode}", "wall": walls,
          "bytes": sum(t.numel() * t.element_size() for _, t in pairs),
          **{k: v[-int(reps):] for k, v in phases.items()}})


def role_socket(url: str, name: str, reps: str) -> None:
    """Today's broadcast over the socket fold, packed 1 GiB x 2."""
    from jax_sender import SendConfig, WeightSender
    pairs = _pairs(name)
    with WeightSender.connect(url, config=SendConfig(buffer_size_bytes=GiB)) as sender:
        walls = _timed(lambda: sender.send(pairs), int(reps))
        stats = sender.send(pairs)
    emit({"row": "broadcast (socket fold)", "wall": walls, "bytes": stats.bytes})


def role_floor(name: str, reps: str) -> None:
    """One device-to-device copy of every tensor into an exported buffer."""
    from nccl_cffi.ipc import CudaIPC
    pairs = _pairs(name)
    total = sum(a.nbytes for _, a in pairs)
    memory = CudaIPC()
    buffer = memory.export(0, total)

    def copy() -> None:
        at = buffer.ptr
        for _, a in pairs:
            memory.copy(0, at, a.unsafe_buffer_pointer(), a.nbytes)
            at += a.nbytes
        memory.sync(0, 600)
    walls = _timed(copy, int(reps))
    buffer.free()
    memory.close()
    emit({"row": "floor: one D2D copy", "wall": walls, "bytes": total})


def _shown(rows: list[dict], new: list[dict], name: str) -> list[dict]:
    """``rows`` and ``new`` (of workload ``name``), each new row printed as it comes."""
    for r in new:
        print(json.dumps(dict(r, workload=name)), flush=True)
    return rows + [dict(r, workload=name) for r in new]


def _run(args: argparse.Namespace) -> list[dict]:
    from jax_sender.testing.harness import VLLMServer, gpu_env
    os.environ.setdefault("JAX_SENDER_SHARE_GPUS", "1")  # every role on the one GPU
    rows, tmp = [], os.environ.get("TMPDIR", "/tmp")
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    for name in args.workloads:
        rows = _shown(rows, one("role_floor", name, str(args.reps), script=SCRIPT), name)
        with VLLMServer("0", output=f"{tmp}/ipc-server.out", requests=f"{tmp}/ipc.jsonl",
                        ipc=True, env=env) as url:
            for mode in ("packed", "unpacked"):
                rows = _shown(rows, one("role_ours", url, name, mode, str(args.reps),
                                        str(args.buffer), script=SCRIPT), name)
                rows = _shown(rows, one("role_torch", url, name, mode, str(args.reps),
                                        str(args.buffer), script=SCRIPT,
                                        env=dict(vllm_env(), **env)), name)
        if args.no_socket:
            continue
        with VLLMServer("1", output=f"{tmp}/nccl-server.out",
                        requests=f"{tmp}/nccl.jsonl") as url:
            rows = _shown(rows, one("role_socket", url, name, str(args.reps), script=SCRIPT,
                                    env={k: v for k, v in gpu_env("0").items()
                                         if k.startswith("NCCL")}), name)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: median wall, GB/s, x the floor."""
    out = ["| workload | row | median s | GB/s | x floor |", "| --- | --- | --- | --- | --- |"]
    floors = {r["workload"]: statistics.median(r["wall"]) for r in rows if "floor" in r["row"]}
    for r in rows:
        m = statistics.median(r["wall"])
        out.append(f"| {r['workload']} ({r['bytes'] / 1e9:.2f} GB) | {r['row']} | {m:.4f} | "
                   f"{r['bytes'] / m / 1e9:.1f} | {m / floors[r['workload']]:.1f} |")
    return "\n".join(out)


def main() -> None:
    if run_role(sys.argv, {k: v for k, v in globals().items() if k.startswith("role_")}):
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--buffer", type=int, default=2 * GiB,
                    help="the packed buffer, ours and torch's (torch's refuses a tensor "
                         "larger: qwen3-8b's embedding is 1.24 GB)")
    ap.add_argument("--workloads", nargs="+", default=["1gb", "qwen3-8b"])
    ap.add_argument("--no-socket", action="store_true",
                    help="skip the socket-fold row (its own server; the slowest)")
    args = ap.parse_args()
    rows = _run(args)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
