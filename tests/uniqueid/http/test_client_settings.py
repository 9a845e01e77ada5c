"""What a user hands ``VLLMClient`` besides its URL (``uniqueid.http.settings``):
an API key and headers HTTP cannot carry refused when given, in one
sentence that shows neither; https verified as ``verify=`` or the
environment says, against a real loopback https server signed by a CA each
test run makes (``support.servers.tls``); proxy variables not used, with a
warning that says so."""

from __future__ import annotations

import logging
import ssl
import time
import uuid

import pytest

from uniqueid import VLLMClient, VLLMConnectionError
from uniqueid.http.settings import CA_VARIABLES

from support.servers.recorder import Recorder
from support.servers.tls import TLSServer, authority, hashed_folder

SECRET = "9f8e7d"  # in every key and value refused below: never in a message


def refused(**kwargs) -> str:
    """The one sentence ``VLLMClient(..., **kwargs)`` is refused with."""
    kwargs.setdefault("base_url", "http://127.0.0.1:1")
    with pytest.raises(ValueError) as e:
        VLLMClient(**kwargs)
    message = str(e.value)
    assert SECRET not in message, message
    assert "\n" not in message and ". " not in message, message
    return message


# -- the API key and headers ----------------------------------------------------------

@pytest.mark.parametrize("key,says", [
    (f"sk-{SECRET}\n", "ends with a space or line break"),  # read from a file
    (f"sk-{SECRET}\r\n", "line break"),
    (f" sk-{SECRET}", "starts or ends"),
    (f"sk-é{SECRET}", "non-ASCII or control characters"),
    (f"sk-{SECRET}\x00x", "non-ASCII or control characters"),
    (f"sk-\n{SECRET}", "non-ASCII or control characters"),
    (12345, "must be a str"),
], ids=repr)
def test_an_api_key_http_cannot_carry_is_refused_when_given_without_showing_it(key, says):
    """Before, a key read from a file (its line break kept) failed at the first
    call with h11's untyped ``LocalProtocolError`` quoting the key, and a
    non-ASCII one with a bare ``UnicodeEncodeError``."""
    message = refused(api_key=key)
    assert message.startswith("api_key ") and says in message, message


@pytest.mark.parametrize("headers,says", [
    ({"X-Token": f"t-{SECRET}\n"}, "value of header X-Token starts or ends"),
    ({"X-Token": f"tö-{SECRET}"}, "value of header X-Token has non-ASCII"),
    ({"X-Token": f"a\r\nX-Evil: {SECRET}"}, "value of header X-Token has non-ASCII or control"),
    ({"X-Token": 5}, "value of header X-Token must be a str"),
    ({"X Token": SECRET}, "'X Token', which is not an HTTP header name"),
    ({"": SECRET}, "'', which is not an HTTP header name"),
    ({"Host": SECRET}, "sets Host, which the client sets itself"),
    ({"content-length": "5"}, "sets content-length, which the client sets itself"),
    ([("X-Token", SECRET)], "must be a dict"),
], ids=repr)
def test_a_header_http_cannot_carry_is_refused_naming_it_not_its_value(headers, says):
    """Before: h11's ``LocalProtocolError`` quoting the value at the first call,
    a bare ``UnicodeEncodeError``, or a second ``Host`` that h11 refused."""
    assert says in refused(headers=headers)


def test_keys_and_headers_http_can_carry_reach_the_server_as_given():
    """Inner spaces and tabs, every visible ASCII character; an empty key is
    no key (as before), an empty header value is sent; a default is overridden."""
    recorder = Recorder()
    key = "sk-A.b_c~d/e+f=g!#$%&'*^`|"
    try:
        with VLLMClient(recorder.url, api_key=key,
                        headers={"X-Team": "rl  team\tone", "X-Empty": "",
                                 "User-Agent": "trainer/1"}) as c:
            assert c.get_world_size() == 1
        with VLLMClient(recorder.url, api_key="") as c:
            assert c.get_world_size() == 1
    finally:
        recorder.close()
    (_, _, _, first), (_, _, _, second) = recorder.requests
    assert first["authorization"] == f"Bearer {key}"
    assert first["x-team"] == "rl  team\tone" and first["x-empty"] == ""
    assert first["user-agent"] == "trainer/1"
    assert "authorization" not in second


# -- https -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    return authority(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def https(auth, monkeypatch):
    """A loopback https server signed by ``auth``'s CA; no CA variable set."""
    for name in CA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    server = TLSServer(auth)
    yield server
    server.close()


def _untrusted(url: str, **kwargs) -> str:
    with VLLMClient(url, **kwargs) as c:
        with pytest.raises(VLLMConnectionError) as e:
            c.get_world_size()
    return str(e.value)


def test_verify_takes_a_bundle_a_folder_a_context_or_false(https, auth, tmp_path):
    """As httpx's ``verify=``; the CA each names is what decides."""
    context = ssl.create_default_context(cafile=auth.ca)
    for verify in (str(auth.ca), auth.ca, str(hashed_folder(auth.ca, tmp_path / "certs")),
                   context, False):
        with VLLMClient(https.url, verify=verify) as c:
            assert c.get_world_size() == 1, verify
    with VLLMClient(https.url.replace("127.0.0.1", "localhost"), verify=auth.ca) as c:
        assert c.get_world_size() == 1  # the certificate's other name
    calls = https.calls
    message = _untrusted(https.url, verify=auth.other_ca)
    assert "certificate did not verify" in message and "verify=" in message, message
    assert "did not verify" in _untrusted(https.url)  # certifi's bundle: not this CA
    mismatch = _untrusted(https.url.replace("127.0.0.1", "0.0.0.0"), verify=auth.ca)
    assert "not valid for '0.0.0.0'" in mismatch and "whose host" in mismatch, mismatch
    assert https.calls == calls  # refused at the handshake: nothing was sent


def _as(variable: str, pem, folder) -> str:
    """``pem`` as ``variable`` takes it: a folder for ``SSL_CERT_DIR``, else the file."""
    return str(hashed_folder(pem, folder) if variable == "SSL_CERT_DIR" else pem)


@pytest.mark.parametrize("variable", CA_VARIABLES)
def test_without_verify_each_ca_variable_of_the_environment_is_honoured(https, auth, tmp_path,
                                                                        monkeypatch, variable):
    """Before, only ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` (httpx's), and only as
    they were at the process's first https call."""
    monkeypatch.setenv(variable, _as(variable, auth.ca, tmp_path / "certs"))
    with VLLMClient(https.url) as c:
        assert c.get_world_size() == 1


@pytest.mark.parametrize("first,then", [(a, b) for i, a in enumerate(CA_VARIABLES)
                                        for b in CA_VARIABLES[i + 1:]])
def test_the_first_ca_variable_set_wins(https, auth, tmp_path, monkeypatch, first, then):
    """In the order ``CA_VARIABLES`` lists (docs/rendezvous.md says it)."""
    monkeypatch.setenv(first, _as(first, auth.other_ca, tmp_path / "1"))
    monkeypatch.setenv(then, _as(then, auth.ca, tmp_path / "2"))
    assert "did not verify" in _untrusted(https.url)
    monkeypatch.setenv(first, _as(first, auth.ca, tmp_path / "3"))
    monkeypatch.setenv(then, _as(then, auth.other_ca, tmp_path / "4"))
    with VLLMClient(https.url) as c:
        assert c.get_world_size() == 1


def test_a_verify_that_cannot_work_is_refused_when_given(auth, tmp_path, monkeypatch):
    for name in CA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    garbage = tmp_path / "not-a-bundle.pem"
    garbage.write_text(f"no certificate here {SECRET}\n")
    url = "https://127.0.0.1:1"
    assert "names no file or folder" in refused(base_url=url, verify=str(tmp_path / "missing"))
    assert "could not be loaded as a CA bundle" in refused(base_url=url, verify=garbage)
    assert "verify must be True, False" in refused(base_url=url, verify=3)
    assert "verify must be True, False" in refused(base_url=url, verify=b"/etc")
    assert "names no file" in refused(base_url="http://127.0.0.1:1", verify="/missing")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(garbage))
    message = refused(base_url=url)
    assert message.startswith("REQUESTS_CA_BUNDLE (from the environment) is "), message
    with VLLMClient("http://127.0.0.1:1"):  # http needs no CA
        pass


def test_https_clients_share_one_context_per_ca_source(auth):
    """256 https clients made before a fleet's connect: one TLS context
    between them (each costs tens of milliseconds), not one each."""
    start = time.monotonic()
    clients = [VLLMClient(f"https://127.0.0.1:{9000 + i}", verify=auth.ca) for i in range(256)]
    took = time.monotonic() - start
    contexts = {id(c._pool.tls) for c in clients}
    for c in clients:
        c.close()
    assert len(contexts) == 1 and took < 2.0, (len(contexts), took)


# -- proxies ---------------------------------------------------------------------------

@pytest.fixture
def no_proxies(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def test_a_proxy_variable_is_not_used_and_a_warning_says_so_once(no_proxies, caplog):
    """The call goes straight to the server (a proxy at port 1 would refuse
    it); one warning for the proxy, however many clients."""
    no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:1/{uuid.uuid4()}")
    recorder = Recorder()
    try:
        with caplog.at_level(logging.WARNING, logger="uniqueid"):
            for _ in range(3):
                with VLLMClient(recorder.url) as c:
                    assert c.get_world_size() == 1
    finally:
        recorder.close()
    warned = [r.getMessage() for r in caplog.records if "proxy" in r.getMessage()]
    assert len(warned) == 1 and "does not use" in warned[0] and "NO_PROXY" in warned[0], warned
    assert "127.0.0.1:1" not in warned[0]  # the proxy's URL (it may hold a password) is not shown


@pytest.mark.parametrize("setting", [{"HTTP_PROXY": "P", "NO_PROXY": "127.0.0.1"},
                                     {"http_proxy": "P", "no_proxy": "*"},
                                     {"HTTPS_PROXY": "P"}], ids=repr)
def test_no_warning_where_no_proxy_would_apply(no_proxies, caplog, setting):
    """The host in ``NO_PROXY``, or only an https proxy for an http server."""
    for name, value in setting.items():
        no_proxies.setenv(name, value.replace("P", f"http://p-{uuid.uuid4()}.invalid:3128"))
    with caplog.at_level(logging.WARNING, logger="uniqueid"):
        VLLMClient("http://127.0.0.1:8000").close()
    assert not [r for r in caplog.records if "proxy" in r.getMessage()]
