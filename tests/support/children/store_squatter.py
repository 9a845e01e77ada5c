"""Another local process that squats a metadata store's port: it opens
COUNT connections to HOST:PORT as soon as the port listens (trying from
before), and holds them.

    python -m support.children.store_squatter HOST PORT COUNT [--join]

Each connection sends torch's ``VALIDATE`` and then stays quiet; with
``--join`` it also does what torch's client given a world size does next
(``PING``, then ``ADD init/ 1``), so the store counts it as a rank that
joined. Prints ``{"trying": true}`` once it tries, then, for each line
read on stdin, ``{"held": n, "opened": total, "closed": total}`` (closed:
by the store); ends when stdin closes. Imports nothing of this
repository, so the store sees a stranger's bytes.
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import sys
import threading
import time

VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
PING = b"\x0d" + struct.pack("<I", 7)
JOIN = b"\x04" + struct.pack("<Q", 5) + b"init/" + struct.pack("<q", 1)


class Squatter:
    """The connections, topped up on one thread."""

    def __init__(self, host: str, port: int, count: int, join: bool) -> None:
        self.address, self.count, self.join = (host, port), count, join
        self.selector = selectors.DefaultSelector()
        self.opened = self.closed = 0
        self.lock = threading.Lock()

    def _open(self) -> bool:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2)
        try:
            sock.connect(self.address)
            sock.sendall(VALIDATE + (PING + JOIN if self.join else b""))
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)
        self.opened += 1
        return True

    def _reap(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            try:
                data = key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the store closed it
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
                self.closed += 1

    def run(self) -> None:
        while self.opened < self.count:  # from before the port listens
            with self.lock:
                while self.opened < self.count and self._open():
                    pass
            time.sleep(0.0005)
        while True:
            with self.lock:
                self._reap(0.0)
            time.sleep(0.05)

    def status(self) -> dict:
        with self.lock:
            return {"held": len(self.selector.get_map()), "opened": self.opened,
                    "closed": self.closed}


def main() -> None:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    squatter = Squatter(host, port, count, "--join" in sys.argv[4:])
    threading.Thread(target=squatter.run, daemon=True).start()
    print(json.dumps({"trying": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(squatter.status()), flush=True)


if __name__ == "__main__":
    main()
