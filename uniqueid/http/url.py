"""A vLLM server's base URL: checked whole when a client is made, and shown
in messages without a password.

Why check it up front: a URL that cannot work (not http(s), no host, a port
out of range, an IPv6 literal left open, a DNS label over 63 characters,
non-ASCII) otherwise fails deep in the URL parser, the HTTP stack or the
resolver, as a bare ``ValueError``, ``TypeError`` or ``UnicodeError``, at the
first call rather than when it was given. A URL may also carry a user and
password (``http://user:secret@host``): this client sends no credentials
from the URL (they go in ``api_key`` or ``headers``), so such a URL is
refused, and no message ever shows what stands before its ``@``.

One server has many spellings (``http://localhost:8000/``,
``HTTP://127.000.000.001:08000``, ``http://0.0.0.0:8000``): a fleet that
took two of them as two servers would init one server twice in one group.
``server_key`` is what two URLs share exactly when they name one server,
read as this machine's resolver reads them (IPv4's short, octal and hex
forms by ``inet_aton``, as ``getaddrinfo`` does), without a DNS lookup.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any
from urllib.parse import SplitResult, urlsplit

# The most of a URL a message quotes.
_SHOWN_CHARS = 200
_DNS_LABEL_CHARS = 63
_HTTP = re.compile(r"https?://", re.IGNORECASE)
_DNS_NAME_CHARS = 253
_DEFAULT_PORTS = {"http": 80, "https": 443}
# What a connection to these reaches: the host's own IPv4 loopback, or its IPv6 one.
_IPV4_SELF = frozenset({"localhost", "0.0.0.0"})
_IPV6_SELF = ipaddress.IPv6Address("::")
_IPV4_FORM = re.compile(r"[0-9a-fx.]+")


def shown(url: str) -> str:
    """``url`` as a message may show it: a user and password (anything from
    its ``//``, or its start, up to its last ``@``) replaced by ``***``, and
    cut to a few hundred characters.

    Args:
        url: any text given as a URL.

    Returns:
        The text to quote.
    """
    at = url.rfind("@")
    if at >= 0:
        start = url.find("//")
        start = start + 2 if 0 <= start < at else 0
        url = url[:start] + "***" + url[at:]
    return url if len(url) <= _SHOWN_CHARS else url[:_SHOWN_CHARS - 3] + "..."


def check_base_url(url: Any) -> str:
    """``url`` as a vLLM server's base URL, or one sentence on why it cannot be.

    Args:
        url: ``http://HOST:PORT`` or ``https://...``, a path prefix allowed.

    Returns:
        ``url`` without a trailing ``/``, its scheme in lower case.

    Raises:
        ValueError: not a str; not http(s); non-ASCII, space or control
            characters; unparsable (an IPv6 literal left open, a port out of
            range or not a number); a user or password in it; no host; port
            0; a query or fragment; a host name DNS cannot carry.
    """
    if not isinstance(url, str):
        raise ValueError(f"a server URL is a str such as http://HOST:PORT, got "
                         f"{type(url).__name__}")
    where = f"the server URL {shown(url)!r}"
    if not _HTTP.match(url):
        raise ValueError(f"{where} must start with http:// or https://, as in http://HOST:PORT")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise ValueError(f"{where} has non-ASCII, space or control characters: write a "
                         "non-ASCII host in its IDNA form (xn--...) and percent-encode the path")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{where} cannot be parsed ({shown(str(e))}): write it as "
                         "http://HOST:PORT (an IPv6 host in brackets: http://[::1]:8000)") from None
    problem = _problem(parts, port)
    if problem:
        raise ValueError(f"{where} {problem}")
    return parts.scheme + url[len(parts.scheme):].rstrip("/")  # the scheme in lower case


def _problem(parts: SplitResult, port: int | None) -> str | None:
    """What is wrong with a parsed URL, as the end of a sentence; None if nothing."""
    if "@" in parts.netloc:
        return ("carries a user or password, which this client never sends: give the URL "
                "without it, and an API key as api_key= (or headers=)")
    if not parts.hostname:
        return "has no host: write it as http://HOST:PORT"
    if port == 0:
        return "has port 0: give the port the server listens on (1 to 65535)"
    if parts.query or parts.fragment:
        return "has a query or fragment: give the server's base URL alone, as http://HOST:PORT"
    return _host_problem(parts.hostname)


def _host_problem(host: str) -> str | None:
    """Why DNS cannot carry ``host`` (an IP address is fine); None if it can."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    if len(name) > _DNS_NAME_CHARS:
        return (f"has a host name of {len(name)} characters, where DNS allows "
                f"{_DNS_NAME_CHARS}: check the URL")
    for label in name.split("."):
        if not 1 <= len(label) <= _DNS_LABEL_CHARS:
            return (f"has a host name part of {len(label)} characters, where DNS allows 1 to "
                    f"{_DNS_LABEL_CHARS}: check the URL")
    return None


def server_key(url: Any) -> str:
    """The server ``url`` names, as one string: two URLs give the same key
    exactly when they name one server, however spelled.

    The scheme in lower case; the host in lower case without a trailing
    dot, an IP address in its one form (IPv4 in dotted decimal, read as
    ``inet_aton`` reads its short, octal and hex forms; IPv6 compressed,
    an IPv4-mapped one as its IPv4), ``localhost`` and ``0.0.0.0`` as
    ``127.0.0.1`` and ``::`` as ``::1`` (what a connection to them
    reaches); the port, the scheme's when none is written (leading zeros
    dropped); the path prefix without trailing ``/``. Names are not
    looked up: two DNS names of one machine are two servers.

    Args:
        url: a server's base URL.

    Returns:
        ``scheme://host:port/prefix``, normalised as above.

    Raises:
        ValueError: a URL ``check_base_url`` refuses.
    """
    parts = urlsplit(check_base_url(url))
    port = parts.port or _DEFAULT_PORTS[parts.scheme]
    return f"{parts.scheme}://{_host_key(parts.hostname or '')}:{port}{parts.path.rstrip('/')}"


def _host_key(host: str) -> str:
    """``host`` (lower case, as ``urlsplit`` gives it) in its one form."""
    ip = _ip_of(host)
    if ip is None:
        name = host[:-1] if host.endswith(".") else host
        return "127.0.0.1" if name in _IPV4_SELF else name
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return "127.0.0.1" if str(ip) in _IPV4_SELF else str(ip)
    return "[::1]" if ip == _IPV6_SELF else f"[{ip.compressed}]"


def _ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` is written as, if it is one: IPv6, or IPv4 in
    any form ``getaddrinfo`` takes (``127.1``, ``0x7f.0.0.1``,
    ``127.000.000.001``); None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _IPV4_FORM.fullmatch(host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None
