"""A real HTTP server on loopback that records every request and answers
like vLLM (fixed bodies per path, of vLLM 0.33.0's shapes; 400/500 with
vLLM's error shape)."""

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


class JSONHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1, quiet; subclasses answer with ``answer``."""

    protocol_version = "HTTP/1.1"
    # headers and body go out as separate writes: without this, Nagle holds
    # the body for the client's delayed ACK (~40 ms a call on Linux)
    disable_nagle_algorithm = True

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def log_message(self, *a) -> None:
        pass


def serve(handler: type[JSONHandler], port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """``handler`` served on loopback port ``port`` (0: a free one), on a
    daemon thread; the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# What vLLM 0.33.0's router answers on success (weight_checker: for "compare").
VLLM_ANSWERS = {
    "/get_world_size": (200, {"world_size": 1}),
    "/is_paused": (200, {"is_paused": False}),
    "/weight_info": (200, {"weight_version": "default"}),
    "/pause": (200, {"status": "paused"}),
    "/resume": (200, {"status": "resumed"}),
    "/weight_checker": (200, {"match": True, "mismatches": []}),
}


class Recorder:
    """Answers ``answers[path]`` (status, body), else ``VLLM_ANSWERS[path]``,
    else vLLM's ``{"message": "ok"}``, after ``delay`` seconds."""

    def __init__(self, answers=None, delay=0.0):
        self.requests = []
        self.answers = {**VLLM_ANSWERS, **(answers or {})}
        self.delay = delay
        rec = self

        class H(JSONHandler):
            def _do(self):
                raw = self.body()
                rec.requests.append((self.command, self.path, raw,
                                     {k.lower(): v for k, v in self.headers.items()}))
                time.sleep(rec.delay)
                answer(self, *rec.answers.get(self.path.split("?")[0], (200, {"message": "ok"})))

            do_GET = do_POST = _do

        self.server, self.url = serve(H)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
