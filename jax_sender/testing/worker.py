"""Entry point of one reference-receiver process (one GPU), driven by ``server.py``.

Runs ``ReferenceWorker`` methods that the server sends over a local
``multiprocessing.connection``; the process exits when the server goes away.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client


def _faulty(load: Callable, fail_after: int, delay: float) -> Callable:
    """``load`` that sleeps ``delay`` s per call and raises once, mid-stream,
    when more than ``fail_after`` tensors would have been loaded (-1: never)."""
    loaded = 0
    failed = False

    def faulty(pairs):
        nonlocal loaded, failed
        pairs = list(pairs)
        time.sleep(delay)
        if not failed and 0 <= fail_after < loaded + len(pairs):
            failed = True
            raise RuntimeError("injected load_weights failure")
        loaded += len(pairs)
        load(pairs)

    return faulty


def _refusing(receive: Callable, count: int) -> Callable:
    """``receive`` that raises before any collective on its first ``count``
    calls, as vLLM's worker does with an update it rejects up front."""
    calls = 0

    def refusing(info):
        nonlocal calls
        calls += 1
        if calls <= count:
            raise ValueError("injected refusal of /update_weights before any collective")
        return receive(info)

    return refusing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--worker-rank", type=int, required=True)
    ap.add_argument("--fail-load-after", type=int, default=-1,
                    help="fault injection: load_weights raises once, past this many tensors")
    ap.add_argument("--load-delay", type=float, default=0.0,
                    help="fault injection: load_weights sleeps this long per call")
    ap.add_argument("--refuse-updates", type=int, default=0,
                    help="fault injection: refuse this many updates before any collective")
    args = ap.parse_args()
    conn = Client(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["JVN_AUTHKEY"]))

    import jax

    from uniqueid import InitInfo, SparseUpdateInfo, UpdateInfo

    from .receiver import ReferenceWorker
    try:
        jax.local_devices(backend="gpu")
    except RuntimeError as e:  # no CUDA backend, or no device behind it
        sys.exit(f"reference worker {args.worker_rank}: JAX sees no GPU on CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} ({str(e).splitlines()[0]}); "
                 "give --gpus devices this machine has")

    worker = ReferenceWorker(0, worker_rank=args.worker_rank)
    if args.fail_load_after >= 0 or args.load_delay:
        worker.load_weights = _faulty(worker.load_weights, args.fail_load_after, args.load_delay)
    if args.refuse_updates:
        worker.receive = _refusing(worker.receive, args.refuse_updates)
    methods = {
        "init": lambda p: worker.init(InitInfo.from_payload(p)),
        "receive": lambda p: worker.receive(UpdateInfo.from_payload(p)),
        "receive_sparse": lambda p: worker.receive_sparse(SparseUpdateInfo.from_payload(p)),
        "shutdown": lambda: worker.shutdown(),
        "checksums": lambda: worker.checksums(),
        "reset": lambda: worker.reset(),
    }
    conn.send(("ready", os.environ.get("CUDA_VISIBLE_DEVICES", "")))
    while True:
        try:
            method, args_ = conn.recv()
        except (EOFError, OSError):
            break
        try:
            conn.send(("ok", methods[method](*args_)))
        except Exception as e:  # the server turns it into vLLM's HTTP 500
            traceback.print_exc()
            conn.send(("err", f"{type(e).__name__}: {e}"))
    worker.shutdown()


if __name__ == "__main__":
    main()
