"""An https server on loopback with a certificate authority of the test's
own, both made with the ``openssl`` command (``pytest.skip`` without it):
the server's certificate names ``127.0.0.1`` and ``localhost`` and is
signed by ``ca.pem``; ``other_ca.pem`` is a second CA that signed nothing
here (a bundle that does not trust the server)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from support.servers.recorder import VLLM_ANSWERS, JSONHandler, answer

_SERVER_EXTENSIONS = ("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                      "basicConstraints=critical,CA:FALSE\n"
                      "keyUsage=critical,digitalSignature\n"
                      "extendedKeyUsage=serverAuth\n"
                      "authorityKeyIdentifier=keyid\n")


@dataclass(frozen=True, kw_only=True)
class Authority:
    """The files a test's CA made: ``ca`` (the CA's certificate),
    ``other_ca`` (another CA's), ``cert`` and ``key`` (the server's)."""

    ca: Path
    other_ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN=jax-vllm-nccl test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)


def authority(folder: Path) -> Authority:
    """A CA, another CA, and a server certificate the first signed, in ``folder``."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test CA")
    _make_ca(folder, "ca")
    _make_ca(folder, "other_ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
             cwd=folder)
    (folder / "server.ext").write_text(_SERVER_EXTENSIONS)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
             cwd=folder)
    return Authority(ca=folder / "ca.pem", other_ca=folder / "other_ca.pem",
                     cert=folder / "server.pem", key=folder / "server.key")


def hashed_folder(ca: Path, folder: Path) -> Path:
    """``folder`` holding ``ca`` under its subject hash (``<hash>.0``), as
    OpenSSL's ``capath`` (``SSL_CERT_DIR``) looks certificates up."""
    out = subprocess.run(["openssl", "x509", "-hash", "-noout", "-in", str(ca)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    folder.mkdir()
    shutil.copy(ca, folder / f"{out}.0")
    return folder


class TLSServer:
    """vLLM's answers (``recorder.VLLM_ANSWERS``) over https on loopback;
    ``calls`` counts the requests that got through the handshake."""

    def __init__(self, auth: Authority):
        self.calls = 0
        outer = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                outer.calls += 1
                answer(self, *VLLM_ANSWERS.get(self.path, (200, {"message": "ok"})))

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(auth.cert, auth.key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
