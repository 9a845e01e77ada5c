"""The vLLM client against servers that misbehave on purpose (raw sockets on
loopback, ``support.servers.bad_http``): every call ends by its deadline with a typed
error that names the route, reads a bounded body, never quotes the unique
id, and leaves no thread or socket behind."""

import base64
import math
import os
import pickle
import threading
import time
import traceback
import tracemalloc
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from uniqueid import (
    UniqueId,
    VLLMClient,
    VLLMConnectionError,
    VLLMHTTPError,
    VLLMProtocolError,
    VLLMTimeout,
    redact,
)
from uniqueid.codec import redacted_head
from uniqueid.http import transport

from support.servers.bad_http import (
    BadServer,
    echo,
    endless_body,
    gzip_answer,
    gzip_bomb,
    json_answer,
    raw_answer,
    response,
    silent,
    trickle_body,
    trickle_headers,
)

DEADLINE = 1.5
MARGIN = 1.0  # a loaded machine's scheduling, on top of the deadline
MEMORY_CAP = 64 * 2**20

UID = UniqueId(os.urandom(128)).to_b64()
SECRETS = (UID, UID.replace("/", "\\/"))


def init(c: VLLMClient):
    return c.init_weight_transfer_engine({"nccl_unique_id_b64": UID, "rank_offset": 1,
                                          "world_size": 2}, timeout=DEADLINE)


def world_size(c: VLLMClient):
    return c.get_world_size(timeout=DEADLINE)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def leaves_nothing_behind():
    """No thread or file descriptor more after the block than before (fewer
    is fine: another test's server threads may end meanwhile). The process's
    one HTTP loop, kept for its life, is started before counting."""
    transport.loop()
    threads, fds = threading.active_count(), open_fds()
    yield
    assert threading.active_count() <= threads
    assert open_fds() <= fds


def texts_of(err: BaseException) -> list[str]:
    """Everything of ``err`` that may reach a log: its text, repr, traceback
    and body, and the same of its pickled copy."""
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err) and str(copy) == str(err)
    assert getattr(copy, "route", None) == getattr(err, "route", None)
    out = []
    for e in (err, copy):
        out += [str(e), repr(e), "".join(traceback.format_exception(e)),
                repr(getattr(e, "body", None)), repr(getattr(e, "message", None))]
    return out


def assert_secret_free(err: BaseException) -> None:
    for text in texts_of(err):
        for secret in SECRETS:
            assert secret not in text
    # nothing chained that a traceback would print (httpcore's text may quote the server)
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def call_misbehaving(behave, call, error: type[Exception], *,
                     memory_cap: int = MEMORY_CAP) -> tuple[Exception, BadServer]:
    """``call`` against ``behave``: returns the error, checked for its
    deadline, its memory (the peak of Python's allocations during the call,
    the server's thread included, under ``memory_cap``), its route and its
    secrets."""
    with leaves_nothing_behind():
        with BadServer(behave) as server:
            client = VLLMClient(server.url, timeout=DEADLINE, transfer_timeout=DEADLINE)
            tracemalloc.start()
            start = time.monotonic()
            try:
                with pytest.raises(error) as caught:
                    call(client)
                took = time.monotonic() - start
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            client.close()
    err = caught.value
    assert took < DEADLINE + MARGIN, f"{took:.2f} s"
    assert peak < memory_cap, f"{peak >> 20} MiB"
    method, route = server.requests[0][:2]
    assert f"{method} {server.url}{route}" in str(err)
    assert err.route == route
    assert_secret_free(err)
    return err, server


HTML = [("Content-Type", "text/html")]


def not_http(ex) -> bool:
    """Another service's greeting, then nothing (no end of stream to blame)."""
    ex.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    return silent(ex)


def cut_short(ex) -> bool:
    """A valid answer less its last bytes, then the connection closed."""
    ex.send(response(200, b'{"world_size": 2}')[:-5])
    return False
TIMEOUTS = {
    "trickled headers": trickle_headers(),
    "trickled body": trickle_body(),
    "no answer": silent,
}


@pytest.mark.parametrize("behave", TIMEOUTS.values(), ids=TIMEOUTS.keys())
def test_a_stalling_server_ends_by_the_deadline(behave):
    start = time.monotonic()
    err, _ = call_misbehaving(behave, init, VLLMTimeout)
    assert time.monotonic() - start >= DEADLINE * 0.9  # it did wait
    assert isinstance(err, TimeoutError) and isinstance(err, VLLMConnectionError)
    assert f"within the timeout of {DEADLINE:g} s" in str(err) and "NCCL" in str(err)


BOUNDED = {
    "endless chunked body": (endless_body(chunked=True), "(as sent)"),
    "endless body under a 1 TiB Content-Length": (endless_body(chunked=False), "(as sent)"),
    "gzip bomb": (gzip_answer(gzip_bomb()), "(once gzip was inflated)"),
}


@pytest.mark.parametrize("behave,how", BOUNDED.values(), ids=BOUNDED.keys())
def test_a_huge_answer_is_cut_at_the_limit(behave, how):
    err, _ = call_misbehaving(behave, world_size, VLLMProtocolError)
    assert f"over {16 * 2**20} bytes {how}" in str(err)


MALFORMED = {
    "HTML 200": (raw_answer(200, b"<html><body>Sign in</body></html>", HTML), "not a JSON object"),
    "JSON that is not an object": (json_answer(200, [1, 2]), "not a JSON object"),
    "204": (raw_answer(204, length=False), "HTTP 204 with no body"),
    "empty 200": (raw_answer(200), "HTTP 200 with no body"),
    "302": (raw_answer(302, headers=[("Location", "/elsewhere")]),
            "HTTP 302, a redirect to /elsewhere, which is never followed"),
    "307 to another host": (raw_answer(307, headers=[("Location", "http://198.51.100.1/x")]),
                            "never followed"),
    "unsolicited 101": (raw_answer(101, headers=[("Upgrade", "x"), ("Connection", "Upgrade")],
                                   length=False), "not valid HTTP/1.1"),
    "not HTTP at all": (not_http, "not valid HTTP/1.1"),
    "brotli": (raw_answer(200, b"\x0b\x02\x80{}\x03", [("Content-Encoding", "br")]),
               "Content-Encoding 'br'"),
    "broken gzip": (raw_answer(200, b"\x1f\x8b\x08\x00garbage", [("Content-Encoding", "gzip")]),
                    "not valid gzip"),
}


@pytest.mark.parametrize("behave,says", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answer_is_a_protocol_error(behave, says):
    err, server = call_misbehaving(behave, init, VLLMProtocolError)
    assert says in str(err)
    assert [path for _, path, _ in server.requests] == ["/init_weight_transfer_engine"]


SHAPES = {
    "world_size a string": ("/get_world_size", {"world_size": "2"}, world_size),
    "world_size a bool": ("/get_world_size", {"world_size": True}, world_size),
    "world_size negative": ("/get_world_size", {"world_size": -1}, world_size),
    "world_size missing": ("/get_world_size", {"size": 2}, world_size),
    "is_paused a string": ("/is_paused", {"is_paused": "no"}, lambda c: c.is_paused()),
    "weight_version a number": ("/weight_info", {"weight_version": 3}, lambda c: c.weight_info()),
    "checksums not strings": ("/weight_checker", {"checksums": {"w": 1}},
                              lambda c: c.weight_checker("checksum")),
    "mismatches not a list": ("/weight_checker", {"match": False, "mismatches": "w"},
                              lambda c: c.weight_checker("compare", {"w": "x"})),
}


@pytest.mark.parametrize("path,answer,call", SHAPES.values(), ids=SHAPES.keys())
def test_an_answer_of_the_wrong_shape_is_a_protocol_error(path, answer, call):
    err, _ = call_misbehaving({path: json_answer(200, answer)}, call, VLLMProtocolError)
    assert "where vLLM sends" in str(err)


ECHOES = {
    "JSON": echo(as_json=True),
    "JSON with escaped slashes": echo(as_json=True, escape_slashes=True),
    "text with escaped slashes": echo(as_json=False, escape_slashes=True),
    "a 400": echo(status=400),
}


@pytest.mark.parametrize("behave", ECHOES.values(), ids=ECHOES.keys())
def test_an_error_that_echoes_the_request_does_not_leak_the_unique_id(behave):
    err, server = call_misbehaving(behave, init, VLLMHTTPError)
    assert UID.encode() in server.requests[0][2]  # it was sent, and echoed
    assert err.status in (400, 500) and "<redacted>" in err.message
    assert "cannot parse the body" in str(err)


def base64_words(nbytes: int) -> bytes:
    """``nbytes`` of random base64 words of 60 characters a space apart: each
    run too short to be redacted, so all of it is ordinary text to keep."""
    run = base64.b64encode(os.urandom(nbytes))
    return b" ".join(run[i:i + 60] for i in range(0, len(run), 60))[:nbytes]


def hostile_body(kind: str) -> bytes:
    """A 16 MiB (the default bound) error body of base64-like characters that
    holds the unique id, as JSON ``{"detail": ...}``."""
    size, uid = 16 * 2**20, UID.encode()
    if kind == "one run":  # one 16 MiB run, the id inside it
        text = base64.b64encode(os.urandom(size // 2))[:size // 2] + uid
        text += base64.b64encode(os.urandom(size // 2))
    else:  # words, the id first and across the start the error keeps (64 KiB)
        spelled = uid.replace(b"/", b"\\/") if kind == "escaped words" else uid
        words = base64_words(size)
        cut = 64 * 2**10 - 80
        text = spelled + b" " + words[:cut] + b" " + spelled + b" " + words[cut:]
    body = b'{"detail": "' + text
    return body[:size - 2] + b'"}'


@pytest.mark.parametrize("kind", ["one run", "words", "escaped words"])
def test_a_16_mib_error_body_costs_its_size_within_the_deadline(kind):
    """A 16 MiB error answer made of base64-like characters (the id in it):
    the whole call, redaction included, ends within its deadline (+ margin),
    its peak memory is the body (read once, not copied) plus a few MiB, and
    no id, nor a part of one cut at the end of what is kept, is quoted."""
    body = hostile_body(kind)
    assert len(body) == 16 * 2**20
    err, _ = call_misbehaving(raw_answer(500, body, [("Content-Type", "application/json")]),
                              init, VLLMHTTPError, memory_cap=len(body) * 9 // 8 + 8 * 2**20)
    assert err.status == 500 and "<redacted>" in err.message
    assert isinstance(err.body, str) and f"({len(body)} bytes in all)" in err.body
    assert len(err.body) < 70 * 2**10 and len(str(err)) < 2000
    for text in texts_of(err):
        for secret in SECRETS:
            assert secret[:40] not in text and secret[-40:] not in text
    if kind != "one run":  # the words themselves are kept
        assert err.body.count(" ") > 1000


def test_a_connection_closed_mid_answer_is_a_connection_error():
    err, _ = call_misbehaving(cut_short, world_size, VLLMConnectionError)
    assert not isinstance(err, VLLMTimeout) and "closed the connection" in str(err)


def test_a_server_that_never_reads_cannot_hold_a_send():
    """A 32 MiB body into a server that never reads: the send ends by the deadline."""
    with leaves_nothing_behind(), BadServer(deaf=True) as server:
        with VLLMClient(server.url) as client:
            start = time.monotonic()
            with pytest.raises(VLLMTimeout) as e:
                client.update_weights({"names": ["x" * 2**25]}, timeout=DEADLINE)
            assert time.monotonic() - start < DEADLINE + MARGIN
    assert "POST" in str(e.value) and "/update_weights" in str(e.value)


def test_a_gzip_answer_is_decoded():
    import gzip
    body = gzip.compress(b'{"world_size": 4}')
    with BadServer(gzip_answer(body)) as server, VLLMClient(server.url) as client:
        assert client.get_world_size() == 4


def test_unreachable_is_a_connection_error_naming_the_route():
    with BadServer(silent) as server:
        url = server.url
    with VLLMClient(url, connect_timeout=DEADLINE) as client:
        with pytest.raises(VLLMConnectionError) as e:
            client.resume()
    assert not isinstance(e.value, VLLMTimeout)
    assert f"POST {url}/resume" in str(e.value) and "check the URL" in str(e.value)


# -- the happy path: every route against vLLM 0.33.0's answers -----------------

def vllm(ex) -> bool:
    """vLLM's router's answer to each route (api_router.py)."""
    answers = {
        "/get_world_size": {"world_size": 2},
        "/is_paused": {"is_paused": True},
        "/weight_info": {"weight_version": "v3"},
        "/pause": {"status": "paused"},
        "/resume": {"status": "resumed"},
        "/init_weight_transfer_engine": {"message": "Weight transfer initialized"},
        "/start_weight_update": {"message": "Weight update started"},
        "/update_weights": {"message": "Weights updated"},
        "/finish_weight_update": {"message": "Weight update finished"},
        "/shutdown_weight_transfer_engine": {"message": "Weight transfer shut down"},
        "/weight_checker": {b'{"action":"checksum"}': {"checksums": {"w": "ab"}},
                            b'{"action":"reset"}': {"status": "reset"}}.get(
                                ex.body, {"match": False, "mismatches": ["w"]}),
    }
    return json_answer(200, answers[ex.path])(ex)


def test_every_route_answers_vllms_shapes_over_one_kept_connection():
    with leaves_nothing_behind(), BadServer(vllm) as server:
        with VLLMClient(server.url, api_key="k") as c:
            assert c.get_world_size() == 2 and c.get_world_size(False, timeout=3) == 2
            assert c.init_weight_transfer_engine({"nccl_unique_id_b64": UID}) == {
                "message": "Weight transfer initialized"}
            assert c.start_weight_update()["message"] == "Weight update started"
            assert c.update_weights({"names": []}, timeout=5)["message"] == "Weights updated"
            assert c.finish_weight_update("v3")["message"] == "Weight update finished"
            assert c.pause("wait") == {"status": "paused"}
            assert c.is_paused() is True
            assert c.resume() == {"status": "resumed"}
            assert c.weight_info() == {"weight_version": "v3"}
            assert c.weight_checker("checksum") == {"checksums": {"w": "ab"}}
            assert c.weight_checker("reset") == {"status": "reset"}
            assert c.weight_checker("compare", {"w": "cd"}) == {"match": False,
                                                                "mismatches": ["w"]}
            assert c.shutdown_weight_transfer_engine()["message"] == "Weight transfer shut down"
            assert c.request("GET", "/get_world_size", params={"include_dp": "true"}) == {
                "world_size": 2}
        assert server.connections == 1 and len(server.requests) == 15


def test_deadlines_are_per_call_when_threads_share_a_client():
    """One thread stuck on a silent route does not shorten, lengthen or block
    another thread's calls on the same client."""
    routes = {"/is_paused": silent, "/get_world_size": json_answer(200, {"world_size": 2})}
    with leaves_nothing_behind(), BadServer(routes) as server:
        with VLLMClient(server.url) as c:
            stuck: list[BaseException] = []

            def wait_on_the_silent_route() -> None:
                try:
                    c.is_paused(timeout=DEADLINE)
                except VLLMTimeout as e:
                    stuck.append(e)

            thread = threading.Thread(target=wait_on_the_silent_route)
            start = time.monotonic()
            thread.start()
            answers = [c.get_world_size(timeout=0.5) for _ in range(20)]
            assert time.monotonic() - start < DEADLINE  # none waited for the stuck call
            thread.join()
            assert DEADLINE * 0.9 <= time.monotonic() - start < DEADLINE + MARGIN
    assert answers == [2] * 20 and len(stuck) == 1


def test_close_twice_and_calls_after_close():
    with BadServer(vllm) as server:
        client = VLLMClient(server.url)
        assert client.get_world_size() == 2
        client.close()
        client.close()
        with pytest.raises(RuntimeError, match="closed"):
            client.get_world_size()


BAD_SECONDS = [None, math.inf, math.nan, 0, -1.0, True, "5", 1e10]


@pytest.mark.parametrize("name", ["connect_timeout", "timeout", "transfer_timeout"])
@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_a_timeout_must_be_positive_and_finite(name, value):
    with pytest.raises(ValueError, match=name):
        VLLMClient("http://127.0.0.1:1", **{name: value})


@pytest.mark.parametrize("value", BAD_SECONDS[1:], ids=repr)
def test_a_per_call_timeout_must_be_positive_and_finite(value):
    with VLLMClient("http://127.0.0.1:1") as c:
        for call in (lambda: c.get_world_size(timeout=value),
                     lambda: c.update_weights({}, timeout=value),
                     lambda: c.request("GET", "/x", timeout=value)):
            with pytest.raises(ValueError, match="timeout"):
                call()


@pytest.mark.parametrize("kwargs", [
    dict(max_body_bytes=0), dict(max_body_bytes=1.5), dict(base_url="ftp://h:1"),
    dict(base_url="127.0.0.1:8000"), dict(base_url="http://h:99999"),
    dict(base_url="http://[::1"), dict(base_url="http://h\u00e9.example"),
    dict(base_url="http://u:pw-9f8e@h:1"), dict(base_url="http://u:pw-9f8e@[::1"),
    dict(base_url=f"http://{'a' * 64}.example"), dict(base_url="http://h:1/?q=1"),
    dict(timeout=1e10), dict(transfer_timeout=1e12), dict(connect_timeout=2e9)], ids=repr)
def test_a_bad_setting_is_refused(kwargs):
    """When the client is made, in one sentence that shows no password: not
    later, at the first call, as a bare error of the HTTP stack or an
    ``OverflowError`` of a socket's timeout (past about 9.2e9 s)."""
    with pytest.raises(ValueError) as e:
        VLLMClient(**{"base_url": "http://127.0.0.1:1", **kwargs})
    assert "pw-9f8e" not in str(e.value) and ". " not in str(e.value)


def test_a_url_is_kept_as_given_less_its_trailing_slash():
    for url, kept in [("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
                      ("HTTPS://vllm.example.com/v/", "https://vllm.example.com/v"),
                      ("http://[::1]:8000", "http://[::1]:8000")]:
        with VLLMClient(url) as c:
            assert c.base_url == kept


def test_max_body_bytes_bounds_a_small_answer_too():
    with BadServer(json_answer(200, {"world_size": 2, "pad": "x" * 100})) as server:
        with VLLMClient(server.url, max_body_bytes=64) as c:
            with pytest.raises(VLLMProtocolError, match="over 64 bytes"):
                c.get_world_size()


# -- redact ------------------------------------------------------------------

def test_redact_hides_ids_in_every_spelling():
    raw = os.urandom(128)
    std = base64.b64encode(raw).decode()
    url = base64.urlsafe_b64encode(raw).decode()
    for spelled in (std, url, std.replace("/", "\\/"), std.rstrip("="), std[:64]):
        out = redact(f'{{"nccl_unique_id_b64":"{spelled}"}} and more')
        assert out == '{"nccl_unique_id_b64":"<redacted>"} and more'
    assert redact(f"{std} {url}") == "<redacted> <redacted>"


SPELLINGS = {"std": lambda raw: base64.b64encode(raw).decode(),
             "url": lambda raw: base64.urlsafe_b64encode(raw).decode(),
             "escaped": lambda raw: base64.b64encode(raw).decode().replace("/", "\\/"),
             "unpadded": lambda raw: base64.b64encode(raw).decode().rstrip("=")}
AROUND = st.text(alphabet="aZ09+/=-_\\ \"{}:\n\u00e9", max_size=90)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=128, max_size=128), spelling=st.sampled_from(sorted(SPELLINGS)),
       before=AROUND, after=AROUND, keep=st.integers(0, 400))
def test_redact_removes_an_id_wherever_it_appears(raw, spelling, before, after, keep):
    """An id in any spelling, next to anything (base64 characters that lengthen
    its run, escapes, padding, quotes, non-ASCII): no 40 characters of it are
    left by ``redact``, nor by ``redacted_head`` cutting anywhere (in it too),
    from text or from UTF-8 bytes."""
    spelled = SPELLINGS[spelling](raw)
    text = before + spelled + after
    outs = [redact(text), redacted_head(text, keep), redacted_head(text.encode(), keep)]
    assert len(outs[1]) <= keep and len(outs[2]) <= keep
    for out in outs:
        assert "<redacted>" in out or len(out) < len(before) + 40
        for i in range(len(spelled) - 40):
            assert spelled[i:i + 40] not in out


def test_redacted_head_keeps_what_redact_keeps():
    """The start of ``redact``'s answer, read from text or bytes, at any cut."""
    text = f"error {UID} in 'x' " * 3 + "plain words " * 40 + f"{UID[:100]}|{UID}"
    for keep in (0, 5, 6, 200, 230, 600, 10**6):
        assert redacted_head(text, keep) == redact(text)[:keep]
        assert redacted_head(text.encode(), keep) == redact(text)[:keep]


@pytest.mark.parametrize("text", [
    "", "start_weight_update must be called first", "dGhpcyBpcyBzaG9ydA==",
    "x" * 63, "a/b/c " * 20, "HTTP 500: Call to collective_rpc method failed",
])
def test_redact_leaves_ordinary_text_alone(text):
    assert redact(text) == text


def test_a_server_that_closes_after_an_error_does_not_fail_the_next_call():
    """uvicorn, under vLLM's routes, answers a handler's exception with 500
    and closes the connection a moment later (seen after vLLM 0.33.0 refused
    ``/shutdown_weight_transfer_engine``): the next call must not meet the
    reset on a kept connection."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reply(conn, status: bytes, body: bytes) -> None:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def serve() -> None:
        first, _ = listener.accept()
        reply(first, b"500 Internal Server Error", b'{"error": {"message": "refused"}}')
        time.sleep(0.1)  # the reset comes a moment after the answer
        first.close()
        second, _ = listener.accept()
        reply(second, b"200 OK", b'{"message": "Weight update finished"}')
        second.close()

    threading.Thread(target=serve, daemon=True).start()
    client = VLLMClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(VLLMHTTPError, match="refused"):
        client.shutdown_weight_transfer_engine()
    assert client.finish_weight_update() == {"message": "Weight update finished"}
    client.close()
    listener.close()
