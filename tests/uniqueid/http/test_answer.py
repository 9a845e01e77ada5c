"""An answer read as it arrives (``uniqueid.http.answer``): whatever a valid
HTTP/1.1 answer is and however its bytes are split, it reads what h11 (the
reference state machine) reads; what is not HTTP/1.1, or over its bounds,
is refused."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from uniqueid.http.answer import MAX_HEAD, Answer, Malformed, TooBig

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~",
                min_size=1, max_size=12)
VALUE = st.text(alphabet="abc XYZ019=;,/\"\t()", max_size=30).map(str.strip)
# Fields that would change the framing are the framing strategy's to add.
FRAMING = {"content-length", "transfer-encoding", "connection"}
FIELD = st.tuples(TOKEN.filter(lambda n: n.lower() not in FRAMING), VALUE)


@st.composite
def answers(draw) -> tuple[bytes, bool]:
    """A valid answer (after 0 to 2 interim ones) and whether its body runs to the end."""
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"]))
    status = draw(st.sampled_from([200, 201, 204, 304, 400, 404, 422, 500, 503]))
    fields = draw(st.lists(FIELD, max_size=6))
    body = b"" if status in (204, 304) else draw(st.binary(max_size=300))
    framing = "none" if status in (204, 304) else draw(st.sampled_from(["length", "chunked", "end"]))
    if draw(st.booleans()):
        fields.append(("Connection", draw(st.sampled_from(["close", "keep-alive", "Close"]))))
    out = b"".join(f"HTTP/1.1 {draw(st.sampled_from([100, 102, 103]))} Wait\r\n\r\n".encode()
                   for _ in range(draw(st.integers(0, 2))))
    if framing == "length":
        fields.append(("Content-Length", str(len(body))))
    elif framing == "chunked":
        fields.append(("Transfer-Encoding", "chunked"))
        body = chunked(body, draw(st.lists(st.integers(1, 64), max_size=8)),
                       draw(st.booleans()))
    eol = draw(st.sampled_from(["\r\n", "\n"]))
    head = f"HTTP/{version} {status} {draw(st.sampled_from(['OK', '', 'Some Reason']))}".rstrip()
    head += eol + "".join(f"{k}:{draw(st.sampled_from(['', ' ', '  ']))}{v}{eol}"
                          for k, v in fields) + eol
    return out + head.encode() + body, framing == "end"


def chunked(body: bytes, sizes: list[int], extras: bool) -> bytes:
    """``body`` in chunks of ``sizes`` (the rest in one), with extensions and
    a trailer when ``extras``."""
    out, at = b"", 0
    for size in [*sizes, len(body)]:
        part = body[at:at + size]
        at += len(part)
        if part:
            out += b"%x%s\r\n%s\r\n" % (len(part), b";ext=1" if extras else b"", part)
    return out + b"0\r\n" + (b"X-Trailer: 1\r\n" if extras else b"") + b"\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


def by_h11(data: bytes, to_end: bool) -> tuple[int, list, bytes, bool]:
    """What h11, as the client of a GET, reads of ``data``."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "h")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if to_end:
        conn.receive_data(b"")
    status, headers, body = 0, [], b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        if isinstance(event, h11.Response):
            status, headers = event.status_code, list(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
    # A connection that ended the answer is not used again, whatever its state says.
    keep = not to_end and conn.their_state is h11.DONE and conn.our_state is h11.DONE
    return status, headers, body, keep


@settings(max_examples=400, deadline=None)
@given(answer=answers(), cuts=st.lists(st.integers(0, 10**4), max_size=6))
def test_a_valid_answer_split_anywhere_reads_as_h11_reads_it(answer, cuts):
    data, to_end = answer
    a = Answer(max_body=10**6)
    done = False
    for part in split(data, cuts):
        assert not done  # it was not complete before its last byte
        done = a.feed(part)
    if to_end:
        assert not done and a.end()
    assert a.done
    status, headers, body, keep = by_h11(data, to_end)
    assert (a.status, a.headers, bytes(a.body), a.keep) == (status, headers, body, keep)


def test_bytes_past_the_answer_leave_the_connection_unused():
    a = Answer(100)
    assert a.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\n")
    assert bytes(a.body) == b"{}" and not a.keep


def test_an_answer_cut_short_is_not_complete_at_the_end():
    a = Answer(100)
    assert not a.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{\"world")
    assert not a.end() and not a.done


@pytest.mark.parametrize("data", [
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"HTTP/1.1 099 Odd\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\n folded: value\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: a\rb\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}}\r\n0\r\n\r\n",
], ids=repr)
def test_what_is_not_http_1_1_is_malformed(data):
    with pytest.raises(Malformed):
        Answer(100).feed(data)


def test_a_repeated_content_length_of_one_number_is_taken():
    a = Answer(100)
    assert a.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\n{}")
    assert bytes(a.body) == b"{}"


@pytest.mark.parametrize("data", [
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD,  # a head that never ends
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n{}",  # one that ends too late
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000,  # a size line
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: " + b"a" * 2000,  # a trailer
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"X: a\r\n" * 4000,  # trailers
], ids=["head", "head ended late", "chunk size line", "trailer line", "trailers"])
def test_a_line_or_head_past_its_bound_is_malformed_fed_whole_or_byte_by_byte(data):
    with pytest.raises(Malformed):
        Answer(100).feed(data)
    a = Answer(100)
    with pytest.raises(Malformed):
        for i in range(len(data)):
            a.feed(data[i:i + 1])


@pytest.mark.parametrize("head,body", [
    (b"Content-Length: 101", b""),  # refused from its length, before any of it
    (b"Transfer-Encoding: chunked", b"40\r\n" + b"x" * 64 + b"\r\n40\r\n" + b"x" * 64),
    (b"Connection: close", b"x" * 101),
], ids=["length", "chunked", "to the end"])
def test_a_body_over_its_bound_is_too_big_with_its_status(head, body):
    with pytest.raises(TooBig) as e:
        Answer(100).feed(b"HTTP/1.1 503 Busy\r\n" + head + b"\r\n\r\n" + body)
    assert e.value.status == 503


def test_a_body_of_exactly_its_bound_is_read():
    a = Answer(100)
    assert a.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
    assert len(a.body) == 100 and a.keep
