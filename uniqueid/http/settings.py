"""What a user hands a ``VLLMClient`` besides its URL, checked when given:
the API key, extra headers, how an https server's certificate is verified;
and the proxy variables the client does not use.

Why check up front: a header HTTP cannot carry (a key read from a file
keeps its line break; a non-ASCII value) otherwise fails at the first call,
deep in h11 or in ``str.encode``, as an untyped error that quotes the value:
the API key, in a traceback or a log. Each is refused here when the client
is made, in one sentence that names the setting and never shows its value.

How https is verified (``verify``, as httpx names it): ``False`` checks
nothing; an ``ssl.SSLContext`` is used as it is; a path is a CA bundle (a
PEM file) or a folder of hashed certificates, loaded when given; ``True``
(the default) takes the first of the environment's ``SSL_CERT_FILE``,
``SSL_CERT_DIR``, ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` that is set,
else certifi's bundle (httpx's default). A context costs tens of
milliseconds and most of a megabyte, so each CA source gets one per
process, made when the first client that needs it is.

Proxies: the client never goes through one. vLLM's control plane is spoken
to directly, as NCCL's data plane must be (it cannot cross an HTTP proxy),
so ``HTTP_PROXY``, ``HTTPS_PROXY`` and ``ALL_PROXY`` are not used; a warning
says so once per proxy where one would apply (the host not in ``NO_PROXY``).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from typing import Any, Union

from .url import shown

log = logging.getLogger("uniqueid")

Verify = Union[bool, str, "os.PathLike[str]", ssl.SSLContext]

# Where ``verify=True`` looks, in this order (then certifi's bundle).
CA_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110)
_VISIBLE = re.compile(r"[\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?")  # a value, trimmed
# Headers the client sets per call, from the URL or the body: a second copy breaks the call.
_SET_PER_CALL = frozenset({"host", "content-length", "transfer-encoding", "content-type"})
_DEFAULTS = {"user-agent": ("User-Agent", "jax-vllm-nccl"),
             "accept": ("Accept", "application/json"),
             "accept-encoding": ("Accept-Encoding", "identity")}

_lock = threading.Lock()
_contexts: dict[tuple[str, str], ssl.SSLContext] = {}  # per CA source: see tls_context
_warned: set[tuple[str, str]] = set()  # (scheme, proxy) already warned about


# -- the API key and headers -------------------------------------------------------

def request_headers(api_key: Any, headers: Any) -> list[tuple[bytes, bytes]]:
    """Every call's headers: the client's own, ``headers`` over them, then
    ``Authorization: Bearer <api_key>``; each checked first.

    Args:
        api_key: vLLM's ``--api-key``, or None (or "") for none.
        headers: extra headers (a mapping of str to str), or None.

    Returns:
        The headers, encoded.

    Raises:
        ValueError: a key or header HTTP cannot carry (a line break, a
            space at either end, non-ASCII or control characters), a name
            that is not a header name, a header the client sets per call
            (``Host``, ``Content-Length``, ``Transfer-Encoding``,
            ``Content-Type``), or not a str; the value is never shown.
    """
    merged = dict(_DEFAULTS)
    for name, value in _checked_headers(headers):
        merged[name.lower()] = (name, value)
    if api_key is not None and api_key != "":
        merged["authorization"] = ("Authorization", f"Bearer {_checked_key(api_key)}")
    return [(k.encode("ascii"), v.encode("ascii")) for k, v in merged.values()]


def _checked_key(api_key: Any) -> str:
    if not isinstance(api_key, str):
        raise ValueError(f"api_key must be a str (the server's --api-key), got "
                         f"{type(api_key).__name__}")
    problem = _value_problem(api_key)
    if problem:
        raise ValueError(f"api_key {problem}")
    return api_key


def _checked_headers(headers: Any) -> list[tuple[str, str]]:
    if headers is None:
        return []
    if not isinstance(headers, Mapping):
        raise ValueError(f"headers must be a dict of header names to values, got "
                         f"{type(headers).__name__}")
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise ValueError(f"headers has the name {shown(repr(name))}, which is not an HTTP "
                             "header name (ASCII letters, digits and !#$%&'*+-.^_`|~ only)")
        if name.lower() in _SET_PER_CALL:
            raise ValueError(f"headers sets {name}, which the client sets itself on each call "
                             "(from the URL or the body): leave it out")
        if not isinstance(value, str):
            raise ValueError(f"the value of header {name} must be a str, got "
                             f"{type(value).__name__}")
        problem = _value_problem(value)
        if problem:
            raise ValueError(f"the value of header {name} {problem}")
        out.append((name, value))
    return out


def _value_problem(value: str) -> str | None:
    """Why HTTP cannot carry ``value`` in a header, as the end of a sentence
    that does not show it; None if it can (an empty value can)."""
    if value == "" or _VISIBLE.fullmatch(value):
        return None
    if value != value.strip():
        return ("starts or ends with a space or line break (as text read from a file does): "
                "pass it stripped: open(path).read().strip()")
    return ("has non-ASCII or control characters, which an HTTP header cannot carry: pass "
            "the value the server expects, in ASCII (anything else encoded, as base64 say)")


# -- https ----------------------------------------------------------------------------

def tls_context(verify: Any) -> ssl.SSLContext:
    """The TLS context for ``verify`` (see the module docstring), made once
    per CA source per process; the source is loaded here, so a bad one is
    refused when the client is made.

    Args:
        verify: ``True``, ``False``, a CA bundle's path (a PEM file, or a
            folder of hashed certificates), or an ``ssl.SSLContext``.

    Returns:
        The context every https connection of such a client uses.

    Raises:
        ValueError: ``verify`` of another type; a path (given, or from
            ``SSL_CERT_FILE`` and the others) that names nothing, or a file
            that holds no PEM certificate.
    """
    if isinstance(verify, ssl.SSLContext):
        return verify
    source, where = _source(verify)
    with _lock:
        if source not in _contexts:
            _contexts[source] = _made(source, where)
        return _contexts[source]


def _source(verify: Any) -> tuple[tuple[str, str], str]:
    """Where ``verify`` takes its CAs from (a kind and a path), and what to
    call it in a message."""
    if verify is False:
        return ("none", ""), "verify=False"
    if verify is True:
        for name in CA_VARIABLES:
            path = os.environ.get(name)
            if path:
                where = f"{name} (from the environment)"
                return _ca_path(path, where), where
        import certifi  # httpx's own dependency, and its default
        return ("file", certifi.where()), "certifi's CA bundle"
    path = os.fspath(verify) if isinstance(verify, os.PathLike) else verify
    if not isinstance(path, str):
        raise ValueError(f"verify must be True, False, a CA bundle's path or an "
                         f"ssl.SSLContext, got {type(verify).__name__}")
    return _ca_path(path, "verify"), "verify"


def _ca_path(path: str, where: str) -> tuple[str, str]:
    """The CA source at ``path``: a folder, or a file (loaded later)."""
    if os.path.isdir(path):
        return ("folder", os.path.abspath(path))
    if not os.path.isfile(path):
        raise ValueError(f"{where} is {shown(path)!r}, which names no file or folder: give the "
                         "CA bundle (a PEM file) that signed the server's certificate")
    return ("file", os.path.abspath(path))


def _made(source: tuple[str, str], where: str) -> ssl.SSLContext:
    """A context trusting ``source``'s CAs (none: trusting anything).

    Raises:
        ValueError: a file that cannot be read or holds no PEM certificate.
    """
    kind, path = source
    if kind == "none":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        if kind == "folder":
            return ssl.create_default_context(capath=path)
        return ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as e:
        why = getattr(e, "reason", None) or getattr(e, "strerror", None) or type(e).__name__
        raise ValueError(f"{where} is {shown(path)!r}, which could not be loaded as a CA bundle "
                         f"({why}): give a PEM file of the certificates that signed the "
                         "server's") from None


# -- proxies --------------------------------------------------------------------------

def warn_if_proxied(scheme: str, host: str) -> None:
    """Warn, once per proxy, that the environment's proxy for ``scheme``
    would apply to ``host`` but is not used (the module docstring says why).

    Args:
        scheme: ``http`` or ``https``.
        host: the server's host.
    """
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(host, proxies):
        return
    with _lock:
        if (scheme, proxy) in _warned:
            return
        _warned.add((scheme, proxy))
    log.warning("the environment sets a proxy for %s:// (%s_PROXY or ALL_PROXY), which this "
                "client does not use: it connects to vLLM servers directly, as NCCL's weight "
                "transfer must (it cannot go through a proxy); put the servers' hosts in "
                "NO_PROXY to silence this", scheme, scheme.upper())
