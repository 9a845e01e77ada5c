"""Entry point of one reference-receiver process (one GPU), driven by ``server.py``.

Runs ``ReferenceWorker`` methods that the server sends over a local
``multiprocessing.connection``; the process exits when the server goes away.
"""

from __future__ import annotations

import argparse
import os
import traceback
from multiprocessing.connection import Client


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--worker-rank", type=int, required=True)
    ap.add_argument("--fail-load-after", type=int, default=-1,
                    help="fault injection: load_weights raises after this many tensors")
    args = ap.parse_args()
    conn = Client(("127.0.0.1", args.port), authkey=bytes.fromhex(os.environ["JVN_AUTHKEY"]))

    from uniqueid import InitInfo, UpdateInfo

    from .receiver import ReferenceWorker

    worker = ReferenceWorker(0, worker_rank=args.worker_rank)
    if args.fail_load_after >= 0:
        loaded = 0
        store = worker.load_weights

        def failing(pairs):
            nonlocal loaded
            pairs = list(pairs)
            if loaded + len(pairs) > args.fail_load_after:
                raise RuntimeError("injected load_weights failure")
            loaded += len(pairs)
            store(pairs)

        worker.load_weights = failing
    methods = {
        "init": lambda p: worker.init(InitInfo.from_payload(p)),
        "receive": lambda p: worker.receive(UpdateInfo.from_payload(p)),
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
