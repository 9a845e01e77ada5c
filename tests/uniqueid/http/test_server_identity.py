"""One server, however its URL is spelled (``uniqueid.http.url.server_key``):
each spelling below reaches one real loopback server and has one key; URLs
of other servers have others; and ``as_clients`` (so ``connect`` and every
sender) refuses one server given twice."""

from __future__ import annotations

import socket

import pytest

from uniqueid import VLLMClient, as_clients
from uniqueid.http.url import server_key

from support.servers.recorder import Recorder


@pytest.fixture(scope="module")
def recorder():
    r = Recorder()
    yield r
    r.close()


def spellings(port: int) -> list[str]:
    """The URLs that reach the server at ``http://127.0.0.1:port``."""
    return [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/", f"HTTP://127.0.0.1:{port}",
            f"http://localhost:{port}", f"http://LocalHost:{port}//",
            f"http://127.0.0.1:0{port}", f"http://127.0.0.1:000{port}",
            f"http://127.000.000.001:{port}", f"http://127.1:{port}",
            f"http://0x7f.0.0.1:{port}", f"http://0177.0.0.01:{port}",
            f"http://2130706433:{port}", f"http://0.0.0.0:{port}",
            f"http://[::ffff:127.0.0.1]:{port}", f"http://[0:0:0:0:0:FFFF:7F00:1]:{port}"]


def _reaches_v4_mapped(port: int) -> bool:
    """Whether this host connects an IPv6 socket to IPv4 (not where IPv6 is off)."""
    try:
        socket.create_connection(("::ffff:127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def test_every_spelling_of_one_server_reaches_it_and_has_one_key(recorder):
    port = int(recorder.url.rsplit(":", 1)[1])
    urls = spellings(port)
    reached = [u for u in urls if "[" not in u or _reaches_v4_mapped(port)]
    before = len(recorder.requests)
    for url in reached:
        with VLLMClient(url) as c:
            assert c.get_world_size() == 1, url  # the same server, really
    assert len(recorder.requests) == before + len(reached)
    assert {server_key(u) for u in urls} == {f"http://127.0.0.1:{port}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_urls_of_other_servers_have_other_keys(recorder):
    """Another port, scheme, path prefix or address (``010`` is octal: 8), an
    IPv6 loopback beside the IPv4 one, another name: each its own server."""
    port = int(recorder.url.rsplit(":", 1)[1])
    others = [f"http://127.0.0.1:{port}", f"https://127.0.0.1:{port}",
              f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}/V1",
              f"http://127.0.0.2:{port}", f"http://[::1]:{port}",
              f"http://10.0.0.1:{port}", f"http://010.0.0.1:{port}",
              f"http://h.example:{port}", f"http://h.example.org:{port}",
              f"http://127.0.0.1:{_free_port()}", "http://h.example", "https://h.example"]
    assert len({server_key(u) for u in others}) == len(others)
    assert server_key("http://h.example") == server_key("http://H.EXAMPLE.:80/")
    assert server_key("https://h.example/v1/") == server_key("https://h.example:443/v1")
    assert server_key("http://[::]:8000") == server_key("http://[0::1]:8000")


def test_as_clients_refuses_one_server_given_twice(recorder):
    """``connect([u, u])`` formed a group with ``u`` twice, its init posted
    twice; now refused before any call, naming both spellings."""
    port = int(recorder.url.rsplit(":", 1)[1])
    before = len(recorder.requests)
    for twice in ([recorder.url, f"http://localhost:0{port}/"],
                  [recorder.url, "http://127.0.0.1:1", f"HTTP://127.000.000.001:{port}"]):
        with pytest.raises(ValueError, match=rf"^{recorder.url} and .* are one server "
                                             rf"\(http://127.0.0.1:{port}\): give each server "
                                             "once$"):
            as_clients(twice)
    given = VLLMClient(recorder.url)
    with pytest.raises(ValueError, match="are one server"):
        as_clients([given, given])
    assert given.get_world_size() == 1  # a client given is not closed
    given.close()
    assert len(recorder.requests) == before + 1
