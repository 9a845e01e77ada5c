"""A server's answer to one HTTP/1.1 request, read as its bytes arrive, bounded.

Why not h11 here: a push makes three or four exchanges on every server,
and h11's events and state machines cost 40-50 us of CPU an exchange
(this reads one in about 8 us), more than the rest of a call: at 1,024
servers, over a tenth of a second a push. A client that sends one request at a time on a
connection needs less of HTTP/1.1 (RFC 9112) than a general state machine
offers: the status line, the header fields, and where the body ends
(``Content-Length``, chunked, or the connection's end), interim 1xx
answers skipped. That is all there is here, checked with h11's own
grammar; anything else is ``Malformed``. Nothing is read unbounded: a head
over ``MAX_HEAD``, a chunk-size line over ``MAX_LINE``, a body over the
call's limit (``TooBig``, at once when its ``Content-Length`` says so).
What goes out is still h11's (``client.py`` makes each request's head
with it, once per route).
"""

from __future__ import annotations

import re

MAX_HEAD = 16 * 1024  # h11's bound on a head (status line and fields)
MAX_LINE = 1024  # a chunk's size line, extensions included

# RFC 9112's grammar, as h11 writes it (h11._abnf).
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?")
_NAME = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_VALUE = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"
# Every field line at once (one regex an answer, not one a line): a line that
# is not a field is the third group's.
_FIELD_LINES = re.compile(rb"(?:(" + _NAME + rb"):[ \t]*(" + _VALUE + rb")[ \t]*|([^\n]*))\r?\n")
_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[^\r\n]*)?[ \t]*")


class Malformed(Exception):
    """The server answered something that is not valid HTTP/1.1."""


class TooBig(Exception):
    """The answer's body is over the call's limit (``status``: its status)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class Answer:
    """One answer, fed its bytes as they arrive (``feed``) and the
    connection's end (``end``).

    Args:
        max_body: the most bytes of body read.

    Attributes:
        status: the final status (0 until its head arrived).
        headers: its fields, names in lower case, in order.
        body: its body, as sent (no content coding undone).
        done: whether it is complete.
        keep: whether the connection may carry another exchange after it.
    """

    __slots__ = ("max_body", "status", "headers", "body", "done", "keep", "_buf", "_scanned",
                 "_left", "_step")

    def __init__(self, max_body: int):
        self.max_body = max_body
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.done = False
        self.keep = True
        self._buf = b""
        self._scanned = 0  # how far the head was searched for its end; the trailer's length
        self._left = 0  # bytes of the body (or of the chunk) still to come
        # Reads what it can of the buffer; whether it moved on. A function of
        # the class, not a bound method: that would be an object per step.
        self._step = Answer._head

    def feed(self, data: bytes) -> bool:
        """Take ``data``; whether the answer is complete.

        Raises:
            Malformed: not HTTP/1.1.
            TooBig: the body is over ``max_body``.
        """
        if self.done:  # more than the answer: the connection is not reused
            self.keep = False
            return True
        self._buf = self._buf + data if self._buf else data
        while not self.done and self._step(self):
            pass
        if self.done and self._buf:
            self.keep = False
        return self.done

    def end(self) -> bool:
        """The connection ended: whether that completes the answer (a body
        that runs to the connection's end)."""
        if self._step is Answer._to_end:
            self.done, self.keep = True, False
        return self.done

    # The steps, each on the buffer.
    def _head(self) -> bool:
        at = _blank(self._buf, max(0, self._scanned - 2))
        self._scanned = len(self._buf)
        if at is None or at[0] > MAX_HEAD:
            if len(self._buf) > MAX_HEAD:
                raise Malformed(f"an answer's head over {MAX_HEAD} bytes")
            return False
        status_line, _, fields = self._buf[:at[0]].partition(b"\n")
        self._buf, self._scanned = self._buf[at[1]:], 0
        version, status = _status_of(status_line.rstrip(b"\r"))
        headers = _fields_of(fields + b"\n") if fields else []
        if status == 101:
            raise Malformed("an unasked-for 101 Switching Protocols")
        if status >= 200:  # an interim answer (1xx) is skipped
            self.status, self.headers = status, headers
            self._frame(version)
        return True

    def _frame(self, version: bytes) -> None:
        """Where the body ends, from the head (RFC 9112 section 6.3)."""
        self.keep = version == b"1" and b"close" not in _tokens(self.field(b"connection"))
        coding, length = self.field(b"transfer-encoding"), self.field(b"content-length")
        if self.status in (204, 304):
            self.done = True
        elif coding is not None:
            if coding.strip().lower() != b"chunked":
                raise Malformed(f"Transfer-Encoding {coding[:40]!r}, not chunked")
            self._step = Answer._chunk_size
        elif length is not None:
            self._left = _length_of(length)
            if self._left > self.max_body:
                raise TooBig(self.status)
            self.done = self._left == 0
            self._step = Answer._sized
        else:
            self._step, self.keep = Answer._to_end, False

    def _take(self, most: int) -> int:
        """Up to ``most`` bytes of the buffer into the body; how many."""
        buf = self._buf
        n = min(most, len(buf))
        if len(self.body) + n > self.max_body:
            raise TooBig(self.status)
        if n == len(buf):
            self.body += buf
            self._buf = b""
        else:
            self.body += buf[:n]
            self._buf = buf[n:]
        return n

    def _sized(self) -> bool:
        self._left -= self._take(self._left)
        self.done = self._left == 0
        return False

    def _to_end(self) -> bool:
        self._take(len(self._buf))
        return False

    def _chunk_size(self) -> bool:
        line = self._line()
        if line is None:
            return False
        size = _CHUNK.fullmatch(line)
        if size is None:
            raise Malformed(f"a chunk's size line {line[:40]!r}")
        self._left = int(size.group(1), 16)
        self._step = Answer._chunk if self._left else Answer._trailer
        return True

    def _chunk(self) -> bool:
        self._left -= self._take(self._left)
        if self._left:
            return False
        self._step = Answer._chunk_end
        return True

    def _chunk_end(self) -> bool:
        line = self._line()
        if line is None:
            return False
        if line:
            raise Malformed("a chunk longer than its size")
        self._step = Answer._chunk_size
        return True

    def _trailer(self) -> bool:
        """The trailer's fields, up to the blank line (read, then dropped;
        ``MAX_HEAD`` bytes of them at most)."""
        line = self._line()
        if line is None:
            return False
        self._scanned += len(line) + 1
        if self._scanned > MAX_HEAD:
            raise Malformed(f"an answer's trailer over {MAX_HEAD} bytes")
        self.done = not line
        return True

    def _line(self) -> bytes | None:
        """The buffer's next line, taken off it (None: not whole yet)."""
        end = self._buf.find(b"\n")
        if end < 0:
            if len(self._buf) > MAX_LINE:
                raise Malformed(f"a line of a chunked body over {MAX_LINE} bytes")
            return None
        line, self._buf = self._buf[:end], self._buf[end + 1:]
        return line.rstrip(b"\r")

    def field(self, name: bytes) -> bytes | None:
        """Every value of field ``name`` (lower case), joined by commas; None if absent."""
        values = [v for k, v in self.headers if k == name]
        return b",".join(values) if values else None


def _blank(buf: bytes, start: int) -> tuple[int, int] | None:
    """Where the head in ``buf`` ends and what follows it starts: at its
    first empty line (after CRLF or a bare LF, as h11 takes them), looked
    for from ``start``; None before it arrived."""
    crlf, lf = buf.find(b"\n\r\n", start), buf.find(b"\n\n", start)
    if crlf < 0 and lf < 0:
        return None
    at, after = (crlf, crlf + 3) if lf < 0 or 0 <= crlf < lf else (lf, lf + 2)
    return (at - 1 if at and buf[at - 1] == 13 else at), after  # 13: a CR ending the last line


def _status_of(line: bytes) -> tuple[bytes, int]:
    """The minor version and the status of a status line."""
    match = _STATUS.fullmatch(line)
    if match is None or int(match.group(2)) < 100:
        raise Malformed(f"a status line {line[:40]!r}")
    return match.group(1), int(match.group(2))


def _fields_of(lines: bytes) -> list[tuple[bytes, bytes]]:
    """The field lines' names (lower case) and values (each line ends in a line break)."""
    found = _FIELD_LINES.findall(lines)
    if any(other for _, _, other in found):
        raise Malformed("a field line that is not a name, a colon and a value")
    return [(name.lower(), value) for name, value, _ in found]


def _tokens(value: bytes | None) -> list[bytes]:
    """A comma-separated field's tokens, in lower case."""
    return [] if value is None else [t.strip().lower() for t in value.split(b",")]


def _length_of(value: bytes) -> int:
    """A ``Content-Length``: one number, or the same one repeated."""
    if value.isdigit():
        return int(value)
    lengths = set(_tokens(value))
    if len(lengths) != 1 or not (text := lengths.pop()).isdigit():
        raise Malformed(f"Content-Length {value[:40]!r}")
    return int(text)
