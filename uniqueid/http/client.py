"""A client for one vLLM server's weight-transfer routes, safe against a
server that misbehaves.

Why not a plain HTTP client: a trainer talks to servers whose workers may be
stuck inside NCCL, behind proxies, or not vLLM at all, and what it sends
carries the NCCL unique id, a credential. So every call here

* ends by one deadline for the whole call (connect, send, headers, body):
  per-read timeouts let a server that trickles a byte a second hold a call
  for ever. Every call runs on the process's one HTTP loop
  (``transport.py``), whose timers end it at its deadline (or up to 10 ms
  after) wherever it is;
* reads a bounded body: it asks for no compression, stops reading at
  ``max_body_bytes``, and inflates gzip or deflate itself with the same
  bound on what comes out (no gzip bomb, no endless body);
* accepts only what vLLM's router answers: a final 2xx status (redirects
  are never followed) and a JSON object of the route's shape; anything else
  is a ``VLLMProtocolError`` naming the route, not a silent success;
* says nothing secret: error messages and bodies go through
  ``codec.redact``, so a server that echoes the request does not put the
  unique id into a traceback or a log.

Each route is written once, as a coroutine (``_route``): called, it waits
for its answer; ``fleet.Calls`` makes it on many servers at once, for the
cost of one. Bodies are exactly what vLLM's router reads: each parameter
embedded under its own name.
"""

from __future__ import annotations

import functools
import json as jsonlib
import zlib
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

import h11

from nccl_cffi.waiting import check_timeout

from ..codec import redact, redacted_head
from ..errors import RendezvousError
from . import settings, transport
from .url import check_base_url, server_key

T = TypeVar("T")

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_TIMEOUT = 60.0
DEFAULT_TRANSFER_TIMEOUT = 1800.0
DEFAULT_MAX_BODY_BYTES = 16 * 2**20

# The most of a server's text an error message quotes (after redaction).
_QUOTE_CHARS = 1000
_HEADS_KEPT = 32  # requests' heads kept per client (see VLLMClient._head)
# The most of an error body parsed as JSON: vLLM's are small objects. A larger
# one is kept as the redacted start of its text, since parsing or redacting
# all of a 16 MiB body would cost seconds and gigabytes past the deadline.
_ERROR_BODY_BYTES = 64 * 2**10
_NOT_VLLM = ("vLLM answers every route with a JSON object, so check that the URL is the vLLM "
             "server itself (not a proxy, a login page or another service)")


def _quote(text: str | bytes | bytearray) -> str:
    """``text`` (bytes: UTF-8) redacted, on one line, cut to ``_QUOTE_CHARS``;
    only its start is read."""
    text = " ".join(redacted_head(text, 4 * _QUOTE_CHARS).split())
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS - 3] + "..."


def _redacted_json(raw: bytes | bytearray) -> Any:
    """An error body, redacted as text first: parsed JSON, else the text (its
    redacted start, past ``_ERROR_BODY_BYTES``)."""
    if len(raw) > _ERROR_BODY_BYTES:
        return redacted_head(raw, _ERROR_BODY_BYTES) + f"... ({len(raw)} bytes in all)"
    text = redact(raw.decode("utf-8", "replace"))
    try:
        return jsonlib.loads(text)
    except (ValueError, RecursionError):
        return text


class VLLMHTTPError(RendezvousError):
    """A route answered with an error status (400 or more).

    Args:
        route: the path, e.g. ``/update_weights``.
        status: the HTTP status.
        message: vLLM's text (from ``{"error": {"message": ...}}``,
            ``{"detail": ...}`` or ``{"error": ...}``); redacted.
        body: the decoded body (JSON, or text); strings in it redacted.
        where: method and URL, e.g. ``POST http://h:8000/update_weights``;
            the route when not given.
    """

    def __init__(self, route: str, status: int, message: str, body: Any = None,
                 where: str | None = None):
        self.route, self.status, self.where = route, status, where or route
        self.message = _quote(message)
        self.body = redact(body) if isinstance(body, str) else body
        if status == 404:
            fix = ("the server runs without VLLM_SERVER_DEV_MODE=1 or without "
                   "--weight-transfer-config '{\"backend\":\"nccl\"}': restart it with both")
        elif status >= 500:
            fix = "the server failed: its log says why"
        else:
            fix = "the server refused the request"
        super().__init__(f"{self.where} -> HTTP {status}: {self.message} ({fix})")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.route, self.status, self.message, self.body, self.where)


class VLLMConnectionError(RendezvousError, ConnectionError):
    """The server could not be reached, or the connection failed mid-call.

    Args:
        message: what happened and what to do; redacted.
        route: the path of the call, if any.
    """

    def __init__(self, message: str, route: str | None = None):
        super().__init__(redact(message))
        self.route = route

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.route)


class VLLMTimeout(VLLMConnectionError, TimeoutError):
    """The whole call did not complete within its deadline: the server may be
    stuck (its workers inside NCCL, say) or the deadline too short."""


class VLLMProtocolError(RendezvousError):
    """The server answered something vLLM's router never does: not valid
    HTTP/1.1, a 1xx or 3xx status (redirects are never followed), no body, a
    body that is not JSON or not of the route's shape, a body over the
    client's limit, or an unsupported Content-Encoding.

    Args:
        message: what came back and what to do; redacted.
        route: the path of the call.
    """

    def __init__(self, message: str, route: str):
        super().__init__(redact(message))
        self.route = route

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.route)


# One encoder for every body: json.dumps with options makes one a call.
_ENCODER = jsonlib.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json(value: Any) -> bytes:
    """``value`` as vLLM's router reads it: compact JSON, UTF-8, no NaN."""
    return _ENCODER.encode(value).encode()


class Encoded:
    """A route's argument encoded once as JSON, for the same body to many
    servers (``fleet.on_each``): an update's payload names every tensor, and
    encoding it again for each of a thousand servers was a twentieth of a
    push. The body that holds it is the same to the byte.

    Args:
        value: the argument (a JSON value).

    Raises:
        ValueError, TypeError: ``value`` is not JSON (NaN and infinities
            included).
    """

    __slots__ = ("data",)

    def __init__(self, value: Any):
        self.data = _json(value)


def _body(json: Any) -> bytes:
    """A request's body: ``json`` encoded, its ``Encoded`` values as they were."""
    if not isinstance(json, dict) or not any(type(v) is Encoded for v in json.values()):
        return _json(json)
    return b"{" + b",".join(_json(k) + b":" + (v.data if type(v) is Encoded else _json(v))
                            for k, v in json.items()) + b"}"


def _request_body(method: str, json: Any) -> bytes | None:
    """What a request sends: ``json`` encoded; nothing for a GET without
    it; else an empty body (``Content-Length: 0``, which some proxies insist on)."""
    if json is not None:
        return _body(json)
    return None if method.upper() == "GET" else b""


def _seconds(name: str, value: Any) -> float:
    """``value`` as a timeout: seconds above 0, at most ``MAX_TIMEOUT_S`` (past
    about 9.2e9 s a socket's timeout overflows)."""
    check_timeout(name, value)
    return float(value)


def _message_of(body: Any) -> str:
    """vLLM's error text out of an error body (already redacted)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
    return str(body) if body != "" else "(no body)"


def _check_final(status: int, headers: list[tuple[bytes, bytes]], where: str,
                 route: str) -> None:
    """Refuse a 1xx or 3xx final status: redirects are never followed."""
    if status < 200:
        raise VLLMProtocolError(f"{where} answered HTTP {status}, an interim status, "
                                f"as its final answer; {_NOT_VLLM}", route)
    if 300 <= status < 400:
        to = _quote(_header(headers, b"location")) or "nowhere"
        raise VLLMProtocolError(
            f"{where} answered HTTP {status}, a redirect to {to}, which is never "
            "followed (it would resend the unique id elsewhere): give the client the "
            "server's own URL", route)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    """Every value of header ``name`` (lower case, as the fields' names are), joined by commas
    ('' if absent)."""
    return ",".join(v.decode("latin-1").strip() for k, v in headers if k == name)


def _route(impl: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """A route of ``VLLMClient``, written once as the coroutine ``impl``:
    calling the route waits for its answer (the call runs on the HTTP loop,
    ``transport.run``); ``VLLMClient.<route>.coroutine`` is ``impl`` itself,
    which ``fleet.Calls`` makes on many servers at once."""
    @functools.wraps(impl)
    def call(self: VLLMClient, *args: Any, **kwargs: Any) -> T:
        return transport.run(impl(self, *args, **kwargs))

    call.coroutine = impl  # type: ignore[attr-defined]
    return call


class VLLMClient:
    """vLLM's RL control plane at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    Connections are kept alive between calls; the client is safe to share
    between threads. Every call is bounded by one deadline (see the module
    docstring), and answers only vLLM's shapes. Making one costs next to
    nothing: no connection is opened before the first call, and https's
    TLS context is made once per CA source per process. Every setting is
    checked when given. ``server_key`` is its server however the URL is
    spelled (``url.server_key``), what a fleet compares.

    Args:
        base_url: ``http://`` or ``https://`` host and port (a path prefix
            is kept).
        connect_timeout: seconds to open a connection at most (within the
            call's deadline).
        timeout: the deadline of a call whose route has no longer default.
        transfer_timeout: the deadline of the calls that wait on the
            workers' collectives or requests: init, update, finish, pause
            and the weight checker.
        api_key: sent as ``Authorization: Bearer <api_key>``.
        headers: extra headers for every call (they override the defaults).
        max_body_bytes: the largest answer read, as sent and once inflated.
        verify: how an https server's certificate is checked, as httpx
            names it: ``True`` (the environment's ``SSL_CERT_FILE``,
            ``SSL_CERT_DIR``, ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, the
            first set, else certifi's bundle), ``False`` (not at all), a CA
            bundle's path, or an ``ssl.SSLContext`` (``settings.py``).

    Raises:
        ValueError: a timeout that is not a number of seconds above 0 and at
            most ``MAX_TIMEOUT_S`` (1e9), a ``max_body_bytes`` below 1, a
            URL ``url.check_base_url`` refuses (one sentence, no password),
            an API key or header HTTP cannot carry, or a ``verify`` that
            names no CA bundle or does not load (``settings.py``; no
            message shows a key or a header's value).
    """

    def __init__(self, base_url: str, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 timeout: float = DEFAULT_TIMEOUT, transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT,
                 api_key: str | None = None, headers: dict[str, str] | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, verify: settings.Verify = True):
        self.base_url = check_base_url(base_url)
        self.server_key = server_key(self.base_url)  # one server, however its URL is spelled
        parts = urlsplit(self.base_url)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        self.timeout = _seconds("timeout", timeout)
        self.transfer_timeout = _seconds("transfer_timeout", transfer_timeout)
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
                or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
        self.max_body_bytes = max_body_bytes
        tls = parts.scheme == "https"
        self._prefix = parts.path
        self._headers = [(b"Host", parts.netloc.rpartition("@")[2].encode("idna")),
                         *settings.request_headers(api_key, headers)]
        # Checked when given; the environment's CAs matter to https alone.
        context = settings.tls_context(verify) if tls or verify is not True else None
        settings.warn_if_proxied(parts.scheme, parts.hostname or "")
        self._pool = transport.Pool(parts.hostname, parts.port or (443 if tls else 80),
                                    context if tls else None)
        self._heads: dict[tuple[Any, ...], bytes] = {}  # see _head; the loop's only
        self._closed = False

    def close(self) -> None:
        """Close the kept connections; later calls raise. Closing twice is fine."""
        self._closed = True
        transport.call(self._pool.close)

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VLLMClient({self.base_url!r})"

    # -- one call --------------------------------------------------------
    @_route
    async def request(self, method: str, route: str, *, json: Any = None,
                      params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """One call, bounded as a whole by ``timeout``.

        Args:
            method: ``GET`` or ``POST``.
            route: the path, e.g. ``/update_weights``.
            json: the body, sent as JSON (none when None).
            params: the query parameters.
            timeout: the deadline in seconds for the whole call (connect,
                send, headers, body); ``self.timeout`` when None.

        Returns:
            The decoded JSON object.

        Raises:
            ValueError: ``timeout`` is not a number of seconds above 0 and at
                most ``MAX_TIMEOUT_S``.
            RuntimeError: the client is closed.
            VLLMHTTPError: the server answered 400 or more.
            VLLMTimeout: the call did not complete by its deadline.
            VLLMConnectionError: the server could not be reached, or the
                connection failed.
            VLLMProtocolError: the answer is not a JSON object vLLM would send.
        """
        return await self._call(method, route, json=json, params=params, timeout=timeout)

    async def _call(self, method: str, route: str, *, json: Any = None,
                    params: dict[str, Any] | Sequence[tuple[str, Any]] | None = None,
                    timeout: float | None = None) -> Any:
        """``request``'s call: sent and answered (status, fields, bounded
        body) all within one deadline, the body's encoding included."""
        seconds = self.timeout if timeout is None else _seconds("timeout", timeout)
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        where = f"{method} {self.base_url}{route}"
        target = self._prefix + route + (f"?{urlencode(params)}" if params else "")
        try:
            with transport.within(seconds):
                body = _request_body(method, json)
                status, headers, raw = await self._pool.exchange(
                    self._head(method, target, json is not None, body), body,
                    max_body=self.max_body_bytes, connect_timeout=min(self.connect_timeout, seconds))
        except (transport.Expired, transport.TooBig, transport.PeerClosed, transport.Malformed,
                OSError) as e:
            raise self._failed(e, where, route, seconds) from None
        _check_final(status, headers, where, route)
        return self._answer(status, headers, raw, where, route)

    def _failed(self, e: Exception, where: str, route: str, seconds: float) -> RendezvousError:
        """The error of a call the transport ended with ``e``."""
        if isinstance(e, transport.Expired):
            return VLLMTimeout(
                f"{where}: no answer within the timeout of {round(seconds, 3):g} s for the whole call; the "
                "server may be stuck (e.g. its workers inside an NCCL call whose peer left, "
                "where vLLM sets no deadline): check its log and restart it, or give the call "
                "a longer timeout", route)
        if isinstance(e, transport.TooBig):
            return self._too_big(where, route, e.status, "as sent")
        if isinstance(e, transport.PeerClosed):
            return VLLMConnectionError(
                f"{where}: the server closed the connection before its answer was complete; "
                "check that it is up (its log says why it closed)", route)
        if isinstance(e, transport.Malformed):
            return VLLMProtocolError(
                f"{where} answered something that is not valid HTTP/1.1 ({_quote(str(e))}); "
                f"{_NOT_VLLM}", route)
        return VLLMConnectionError(
            f"{where}: the connection failed ({type(e).__name__}: {_quote(str(e))}); "
            "check the URL and that the server is up", route)

    def _head(self, method: str, target: str, is_json: bool, body: bytes | None) -> bytes:
        """The request's line and fields as sent, kept per route and body
        length: h11 checks every field of a request and writes it, which
        was a fifth of a fleet's push (the same few requests, over and over)."""
        key = (method, target, is_json, None if body is None else len(body))
        head = self._heads.get(key)
        if head is None:
            headers = list(self._headers)
            if is_json:
                headers.append((b"Content-Type", b"application/json"))
            if body is not None:
                headers.append((b"Content-Length", str(len(body)).encode()))
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            head = self._heads[key] = h11.Connection(h11.CLIENT).send(
                h11.Request(method=method, target=target, headers=headers))
        return head

    def _too_big(self, where: str, route: str, status: int, how: str) -> VLLMProtocolError:
        return VLLMProtocolError(
            f"{where} answered HTTP {status} with a body over {self.max_body_bytes} bytes "
            f"({how}); vLLM's answers are small JSON objects, so check the URL (or raise "
            "max_body_bytes if this server's answers are that large)", route)

    def _inflate(self, status: int, headers: list[tuple[bytes, bytes]], raw: bytes | bytearray,
                 where: str, route: str) -> bytes | bytearray:
        """The body decoded per its Content-Encoding, bounded like the raw body."""
        encoding = _header(headers, b"content-encoding").lower()
        if encoding in ("", "identity"):
            return raw
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise VLLMProtocolError(
                f"{where} answered with Content-Encoding {_quote(encoding)!r} although asked "
                "for none; only gzip and deflate are decoded: check any proxy in between", route)
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a zlib or gzip header
        try:
            out = inflater.decompress(raw, self.max_body_bytes + 1)
        except zlib.error:
            out = None
        if out is not None and len(out) > self.max_body_bytes:
            raise self._too_big(where, route, status, f"once {encoding} was inflated")
        if out is None or not inflater.eof or inflater.unused_data:
            raise VLLMProtocolError(f"{where} answered a body that is not valid {encoding}; "
                                    f"{_NOT_VLLM}", route)
        return out

    def _answer(self, status: int, headers: list[tuple[bytes, bytes]], raw: bytes | bytearray, where: str,
                route: str) -> Any:
        """The decoded JSON object of a final answer, or the error it stands for."""
        raw = self._inflate(status, headers, raw, where, route)
        if status >= 400:
            body = _redacted_json(raw)
            raise VLLMHTTPError(route, status, _message_of(body), body, where)
        if not raw:
            raise VLLMProtocolError(f"{where} answered HTTP {status} with no body; {_NOT_VLLM}",
                                    route)
        try:  # JSON is UTF-8 (RFC 8259), and decoded as such takes a third less time
            answer = jsonlib.loads(raw.decode())
        except (ValueError, RecursionError):  # UnicodeDecodeError included
            answer = None
        if not isinstance(answer, dict):
            raise VLLMProtocolError(
                f"{where} answered HTTP {status} with {_quote(raw)!r}, "
                f"not a JSON object; {_NOT_VLLM}", route)
        return answer

    def _long(self, timeout: float | None) -> float:
        """A transfer route's deadline: ``timeout``, else ``transfer_timeout``."""
        return self.transfer_timeout if timeout is None else timeout

    def _field(self, method: str, route: str, answer: dict[str, Any], key: str,
               valid: Callable[[Any], bool], want: str) -> Any:
        """``answer[key]`` once ``valid``; else the answer is refused."""
        if key not in answer or not valid(answer[key]):
            shown = _quote(repr(answer[key])) if key in answer else "missing"
            raise VLLMProtocolError(
                f"{method} {self.base_url}{route} answered {key}: {shown}, where vLLM sends "
                f"{want}; check that the URL is a vLLM server", route)
        return answer[key]

    # -- routes (PROTOCOL.md section 3) ---------------------------------
    @_route
    async def get_world_size(self, include_dp: bool = True, *, timeout: float | None = None) -> int:
        """``GET /get_world_size``: how many workers would join the group.

        Answered by vLLM's API process from its config (not by the engine).

        Args:
            include_dp: count the data-parallel replicas too (TP * PP * DP).
            timeout: the call's deadline in seconds; ``self.timeout`` when None.

        Returns:
            The worker count, >= 0.

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        answer = await self._call("GET", "/get_world_size", timeout=timeout,
                                  params=None if include_dp else {"include_dp": "false"})
        return self._field("GET", "/get_world_size", answer, "world_size",
                           lambda v: type(v) is int and v >= 0, "a whole number >= 0")

    @_route
    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *,
                                          timeout: float | None = None) -> Any:
        """``POST /init_weight_transfer_engine``: the workers join the group.

        Args:
            init_info: ``InitInfo.to_payload()``.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        return await self._call("POST", "/init_weight_transfer_engine",
                                json={"init_info": init_info}, timeout=self._long(timeout))

    @_route
    async def start_weight_update(self, *, timeout: float | None = None) -> Any:
        """``POST /start_weight_update``: open an update session.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        return await self._call("POST", "/start_weight_update", timeout=timeout)

    @_route
    async def update_weights(self, update_info: dict[str, Any] | Encoded, *,
                             timeout: float | None = None) -> Any:
        """``POST /update_weights``: answered once every tensor arrived.

        Args:
            update_info: ``UpdateInfo.to_payload()`` (or the sparse one), or
                it ``Encoded`` once for many servers.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        return await self._call("POST", "/update_weights", json={"update_info": update_info},
                                timeout=self._long(timeout))

    @_route
    async def finish_weight_update(self, weight_version: str | None = None, *,
                                   timeout: float | None = None) -> Any:
        """``POST /finish_weight_update``: close the session, naming the version.

        Args:
            weight_version: the new weights' version (left unchanged when None).
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        body = None if weight_version is None else {"weight_version": weight_version}
        return await self._call("POST", "/finish_weight_update", json=body,
                                timeout=self._long(timeout))

    @_route
    async def shutdown_weight_transfer_engine(self, *, timeout: float | None = None) -> Any:
        """``POST /shutdown_weight_transfer_engine``: the workers leave the group.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        return await self._call("POST", "/shutdown_weight_transfer_engine", timeout=timeout)

    @_route
    async def pause(self, mode: str = "abort", *, timeout: float | None = None) -> Any:
        """``POST /pause``: stop generation for an update.

        Args:
            mode: ``abort`` in-flight requests, ``wait`` for them (which may
                take long), or ``keep`` them queued.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            ValueError: an unknown ``mode``.
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep, got {mode!r}")
        return await self._call("POST", "/pause", params={"mode": mode},
                                timeout=self._long(timeout))

    @_route
    async def resume(self, *, timeout: float | None = None) -> Any:
        """``POST /resume``: generation goes on.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            vLLM's answer (a JSON object).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        return await self._call("POST", "/resume", timeout=timeout)

    @_route
    async def is_paused(self, *, timeout: float | None = None) -> bool:
        """``GET /is_paused``, which vLLM's engine core answers (not the API
        process): a stuck engine does not answer it.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            Whether generation is paused.

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        answer = await self._call("GET", "/is_paused", timeout=timeout)
        return self._field("GET", "/is_paused", answer, "is_paused",
                           lambda v: isinstance(v, bool), "true or false")

    @_route
    async def weight_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /weight_info``: the weights' version, from the engine core.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            ``{"weight_version": str}``.

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        answer = await self._call("GET", "/weight_info", timeout=timeout)
        self._field("GET", "/weight_info", answer, "weight_version",
                    lambda v: isinstance(v, str), "a string")
        return answer

    @_route
    async def weight_checker(self, action: str, baseline: dict[str, str] | None = None, *,
                             timeout: float | None = None) -> Any:
        """``POST /weight_checker``: checksum, reset, or compare the weights.

        Args:
            action: ``checksum``, ``reset`` or ``compare``.
            baseline: for ``compare``: the expected checksum of each name.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            ``{"checksums": {name: sha256}}`` for ``checksum``, ``{"match":
            bool, "mismatches": [name, ...]}`` for ``compare``, vLLM's
            answer for ``reset``.

        Raises:
            ValueError: an unknown ``action``.
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        if action not in ("checksum", "reset", "compare"):
            raise ValueError(f"action must be checksum, reset or compare, got {action!r}")
        body: dict[str, Any] = {"action": action}
        if baseline is not None:
            body["baseline"] = baseline
        answer = await self._call("POST", "/weight_checker", json=body,
                                  timeout=self._long(timeout))
        check = partial(self._field, "POST", "/weight_checker", answer)
        if action == "checksum":
            check("checksums", lambda v: isinstance(v, dict) and all(
                isinstance(k, str) and isinstance(s, str) for k, s in v.items()),
                "an object of strings")
        elif action == "compare":
            check("match", lambda v: isinstance(v, bool), "true or false")
            check("mismatches", lambda v: isinstance(v, list) and all(
                isinstance(s, str) for s in v), "a list of names")
        return answer

    # -- colocation: what the server is, and its memory (vLLM's dev routes) --
    @_route
    async def server_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /server_info?config_format=json``: the server's config
        (``vllm_config``, its weight-transfer backend included) and its
        ``VLLM_*`` environment (``vllm_env``), from vLLM's API process.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None (the
                first call gathers the host's environment: seconds).

        Returns:
            vLLM's answer: ``{"vllm_config": {...}, "vllm_env": {...}, ...}``.

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        answer = await self._call("GET", "/server_info", params={"config_format": "json"},
                                  timeout=timeout)
        for key in ("vllm_config", "vllm_env"):
            self._field("GET", "/server_info", answer, key, lambda v: isinstance(v, dict),
                        "an object")
        return answer

    @_route
    async def sleep(self, level: int = 1, mode: str = "abort", *,
                    timeout: float | None = None) -> Any:
        """``POST /sleep``: free the GPU memory generation holds, for the
        trainer's step (level 1: offload the weights to the host and drop
        the KV cache; level 2: drop both).

        Args:
            level: 0, 1 or 2, as vLLM's router takes it.
            mode: what happens to requests in flight: ``abort``, ``wait``, ``keep``.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            vLLM's answer (``{"status": "sleeping", "level": level}``).

        Raises:
            ValueError: a level or mode vLLM's router refuses.
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep, got {mode!r}")
        return await self._call("POST", "/sleep", params={"level": level, "mode": mode},
                                timeout=self._long(timeout))

    @_route
    async def wake_up(self, tags: Sequence[str] | None = None, *,
                      timeout: float | None = None) -> bool:
        """``POST /wake_up``: take the memory back, all of it or by tag
        (``weights`` before a push, ``kv_cache`` after it).

        Args:
            tags: vLLM's memory tags to wake (``weights``, ``kv_cache``);
                None wakes everything.
            timeout: the call's deadline; ``self.transfer_timeout`` when None.

        Returns:
            Whether the engine is fully awake now.

        Raises:
            ValueError: a tag that is not a non-empty str.
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags or ()):
            raise ValueError(f"tags must be a list of names such as 'weights', got {tags!r}")
        answer = await self._call("POST", "/wake_up", params=[("tags", t) for t in tags or ()],
                                  timeout=self._long(timeout))
        status = self._field("POST", "/wake_up", answer, "status",
                             lambda v: v in ("awake", "sleeping"), "awake or sleeping")
        return status == "awake"

    @_route
    async def is_sleeping(self, *, timeout: float | None = None) -> bool:
        """``GET /is_sleeping``, answered by the engine core.

        Args:
            timeout: the call's deadline; ``self.timeout`` when None.

        Returns:
            Whether the engine sleeps (some of its memory is released).

        Raises:
            VLLMHTTPError, VLLMTimeout, VLLMConnectionError,
            VLLMProtocolError: as ``request``.
        """
        answer = await self._call("GET", "/is_sleeping", timeout=timeout)
        return self._field("GET", "/is_sleeping", answer, "is_sleeping",
                           lambda v: isinstance(v, bool), "true or false")
