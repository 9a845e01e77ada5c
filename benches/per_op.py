"""Where an unpacked send's time goes: the per-broadcast cost of a non-blocking
communicator against a blocking one, next to the raw 1 GiB baseline.

    python benches/per_op.py [--reps 5]  # >= 2 GPUs

GPU 0 broadcasts the ``qwen3-8b`` tensor sizes (399 bf16 broadcasts, one per
tensor, as an unpacked send does) to GPU 1 through this project's binding,
from one pre-allocated buffer, at most 8 in flight; the receiver is a
blocking communicator, as vLLM's is. No HTTP, no JAX packing, no vLLM:
only the NCCL calls and the waits around them. The sender's communicator is

- non-blocking: NCCL 2.28 launches each call from a thread of its own and
  answers ``ncclInProgress``, and the next call must wait for that thread;
- blocking, as ``WeightSender`` uses it: the call launches in the caller's
  thread.

Each row: median and best of ``--reps`` after one warm-up, GB/s, the ratio
to raw, and the sender's host time per broadcast inside ``broadcast()``
(the NCCL call plus, when non-blocking, the wait for its launch).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import deque

from procs import emit, given_ids, mint_uid, need_gpus, ranks, roles_of, run_role
from workloads import GiB, workload

WINDOW = 8


def _pass(comm, ptr: int, counts: list[int], stream, events: list) -> tuple[float, float]:
    """One pass over ``counts``; (its seconds, seconds spent inside ``broadcast``)."""
    from nccl_cffi import cuda
    inflight: deque = deque()
    in_call = 0.0
    t0 = time.perf_counter()
    for n in counts:
        if len(inflight) >= WINDOW:
            ev = inflight.popleft()
            comm.wait_event(ev, 60, "broadcast")
            events.append(ev)
        t = time.perf_counter()
        comm.broadcast(ptr, count=n, dtype="bfloat16", root=0, stream=stream, timeout=60)
        in_call += time.perf_counter() - t
        inflight.append((events.pop() if events else cuda.Event(comm.device)).record(stream))
    comm.wait(stream, 60)
    events.extend(inflight)
    return time.perf_counter() - t0, in_call


def role_rank(rank: str, reps: str) -> None:
    import jax.numpy as jnp

    from nccl_cffi import Communicator, cuda
    from uniqueid import UniqueId, warm_up
    counts = [math.prod(s) for _, s in workload("qwen3-8b")]
    buf = jnp.zeros((2 * max(counts),), jnp.uint8).block_until_ready()
    ptr, stream, events = int(buf.unsafe_buffer_pointer()), cuda.Stream(0), []
    flag = jnp.zeros((1,), jnp.float32).block_until_ready()
    out = {}
    for label, uid in given_ids().items():
        blocking = rank == "1" or label == "blocking"
        comm = Communicator.init_rank(2, UniqueId.from_b64(uid).raw, int(rank), 0,
                                      blocking=blocking, timeout=120)
        warm_up(comm, 60)
        rows = []
        for _ in range(int(reps) + 1):
            comm.all_reduce(flag, stream=stream, timeout=60)  # both ranks start together
            comm.wait(stream, 60)
            rows.append(_pass(comm, ptr, counts, stream, events))
        out[label] = rows[1:]
        comm.destroy()
    emit(dict(out, bytes=2 * sum(counts), ops=len(counts)))


def report(raw: list[float], data: dict) -> str:
    raw_gbs = GiB / statistics.median(raw) / 1e9
    lines = ["| sender communicator | median ms | best ms | median GB/s | ratio to raw "
             "| host us per broadcast() |", "| --- | --- | --- | --- | --- | --- |",
             f"| raw ncclBroadcast 1 GiB (baseline) | {statistics.median(raw) * 1e3:.2f} "
             f"| {min(raw) * 1e3:.2f} | {raw_gbs:.1f} | 1.00 | |"]
    for label in ("non-blocking", "blocking"):
        total = [t for t, _ in data[label]]
        med = statistics.median(total)
        call = statistics.median(c for _, c in data[label]) / data["ops"] * 1e6
        gbs = data["bytes"] / med / 1e9
        lines.append(f"| {label}, {data['ops']} broadcasts | {med * 1e3:.2f} "
                     f"| {min(total) * 1e3:.2f} | {gbs:.1f} | {gbs / raw_gbs:.2f} | {call:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    reps = str(ap.parse_args().reps)
    need_gpus(2)
    raw = ranks("role_raw", 2, "2", reps, ids=mint_uid())[0][0]  # bench.py's role
    uids = {"non-blocking": mint_uid(), "blocking": mint_uid()}
    print(report(raw, ranks("role_rank", 2, reps, ids=uids, script=__file__)[0][0]))


if __name__ == "__main__":
    if not run_role(sys.argv, roles_of(sys.modules[__name__])):
        main()
