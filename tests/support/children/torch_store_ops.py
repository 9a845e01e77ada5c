"""torch's own ``TCPStore`` client against a store at HOST:PORT, run in a
child process by the interpreter of ``JAX_SENDER_VLLM_PYTHON`` (torch, no
package of this repository). Each line of stdin is a JSON call,
``[op, args...]``; each answer is a JSON line, ``{"ok": result}`` (bytes as
hex) or ``{"error": "Type: text", "seconds": how long the call took}``.

    python torch_store_ops.py HOST PORT TIMEOUT_S [WORLD_SIZE]
"""

import json
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore


def encoded(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [encoded(v) for v in value]
    return value


def call(store, op, args):
    if op == "set":
        return store.set(args[0], bytes.fromhex(args[1]))
    if op == "compare_set":
        return store.compare_set(args[0], bytes.fromhex(args[1]), bytes.fromhex(args[2]))
    if op == "append":
        return store.append(args[0], bytes.fromhex(args[1]))
    if op == "multi_set":
        return store.multi_set(args[0], [bytes.fromhex(v) for v in args[1]])
    if op == "wait":
        return store.wait(args[0], timedelta(seconds=args[1]))
    if op == "delete_key":
        return store.delete_key(args[0])
    return getattr(store, op)(*args)


def main():
    host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    world_size = int(sys.argv[4]) if len(sys.argv) > 4 else None
    start = time.monotonic()
    try:
        store = TCPStore(host, port, world_size=world_size, is_master=False,
                         timeout=timedelta(seconds=timeout), use_libuv=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}),
              flush=True)
        return
    print(json.dumps({"ok": "connected", "seconds": time.monotonic() - start}), flush=True)
    for line in sys.stdin:
        op, *args = json.loads(line)
        start = time.monotonic()
        try:
            result = {"ok": encoded(call(store, op, args))}
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = {"error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.monotonic() - start
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
