"""A ``StoreServer`` alone in a child process, so that what other processes
make it hold shows in its own resident memory, nothing of the test's.

    python store_host.py LIMITS_JSON     (this checkout's interpreter)

Prints ``{"port": P}`` once listening. Each line of stdin is a JSON call,
answered by one JSON line:

* ``["memory"]``: ``{"rss": bytes now, "peak": bytes at most since the
  last reset}`` (Linux ``VmRSS``, ``VmHWM``);
* ``["reset_peak"]``: start the peak again from now;
* ``["set", key, size, seconds]``: rank 0's own ``set`` of ``size`` bytes
  within a deadline: ``{"ok": seconds taken}`` or ``{"error": ...}``;
* ``["connections"]``: ``{"connections": n}`` open;
* ``["held"]``: ``{"held": bytes the store counts, "connections": n}``.
"""

import json
import sys
import time

from nccl_cffi.waiting import Deadline
from uniqueid.store import StoreError, StoreLimits, StoreServer


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def call(server, op, args):
    if op == "memory":
        return {"rss": _status("VmRSS"), "peak": _status("VmHWM")}
    if op == "reset_peak":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return {"ok": True}
    if op == "set":
        key, size, seconds = args
        start = time.monotonic()
        try:
            server.set(key, b"v" * size, Deadline(seconds))
        except StoreError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        return {"ok": time.monotonic() - start}
    if op == "connections":
        return {"connections": server.connections()}
    return {"held": server.held_bytes(), "connections": server.connections()}


def main():
    server = StoreServer("127.0.0.1", limits=StoreLimits(**json.loads(sys.argv[1])))
    print(json.dumps({"port": server.port}), flush=True)
    for line in sys.stdin:
        op, *args = json.loads(line)
        print(json.dumps(call(server, op, args)), flush=True)
    server.close()


if __name__ == "__main__":
    main()
