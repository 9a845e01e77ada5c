"""A real HTTP server on loopback that records every request and answers
like vLLM (fixed bodies per path, 400/500 with vLLM's error shape)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer(handler: BaseHTTPRequestHandler, status: int, body) -> None:
    """Send ``body`` as a JSON answer with ``status``."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class Recorder:
    def __init__(self, answers=None, delay=0.0):
        self.requests = []
        self.answers = answers or {}
        self.delay = delay
        rec = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out as separate writes: without this, Nagle holds
            # the body for the client's delayed ACK (~40 ms a call on Linux)
            disable_nagle_algorithm = True

            def _do(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rec.requests.append((self.command, self.path, raw,
                                     {k.lower(): v for k, v in self.headers.items()}))
                time.sleep(rec.delay)
                answer(self, *rec.answers.get(self.path.split("?")[0], (200, {"message": "ok"})))

            do_GET = do_POST = _do

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
