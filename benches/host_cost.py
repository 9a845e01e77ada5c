"""The sender's own host cost per push, on CPU, with no GPU and no vLLM.

    PYTHONPATH=.:tests python benches/host_cost.py [--sends 500] [--tensors 1]

(From the repository's root. ``tests``: the in-memory link is the test
suite's ``support.memory_link``; ``.`` first, or ``tests/jax_sender/``
would stand in for the package.) A 4 KiB push (the bench's fixed-cost row)
through ``WeightSender.send`` over that in-memory link: real HTTP
on loopback with vLLM's session rules, the broadcast handed over in memory.
Its HTTP calls are timed where they are made (start and finish on the
caller's thread, the update inside its own thread: ``SendStats.update_s``);
the rest of ``send()`` is the sender's own: validation, the handoffs to and
from the update's and the NCCL calls' threads, the waits.
That rest is what a sender adds to vLLM's three calls on any machine, and
what this script measures; "prepare" is its part before the first HTTP
call (validation, the kept description). ``--tensors 20000 --sends 10``
pushes 20,000 such tensors instead of one.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sends", type=int, default=500)
    ap.add_argument("--tensors", type=int, default=1)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from support.memory_link import memory_sender

    jax.config.update("jax_platforms", "cpu")
    sender, _, _ = memory_sender()
    params = [(f"w{i}", jnp.full((1024,), i, jnp.float32)) for i in range(args.tensors)]
    for _ in range(50 if args.tensors == 1 else 2):  # warm-up: compiles, pools, connections
        sender.send(params)
    walls, stats = [], []
    for _ in range(args.sends):
        t = time.perf_counter()
        stats.append(sender.send(params))
        walls.append(time.perf_counter() - t)
    sender.close()
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f}"  # noqa: E731
    http = [s.start_s + s.update_s + s.finish_s for s in stats]
    print(f"Medians of {args.sends} pushes of {args.tensors} 4 KiB tensor(s), ms.\n")
    print("| send() | start | update | finish | the sender's own | of which prepare |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {ms(walls)} | {ms([s.start_s for s in stats])} | "
          f"{ms([s.update_s for s in stats])} | {ms([s.finish_s for s in stats])} | "
          f"{ms([w - h for w, h in zip(walls, http)])} | {ms([s.prepare_s for s in stats])} |")


if __name__ == "__main__":
    main()
