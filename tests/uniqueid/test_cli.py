"""``jax-vllm-nccl``: every check of ``doctor`` against real HTTP servers on
loopback, and a sentence (not a traceback) for every wrong setup (no GPU)."""

import os
import subprocess
import sys
import time

import pytest

import nccl_cffi
from uniqueid import cli

from support.servers.bad_http import BadServer, json_answer, silent
from support.servers.recorder import Recorder

HEALTHY = {"/get_world_size": (200, {"world_size": 2}), "/is_paused": (200, {"is_paused": False}),
           "/weight_info": (200, {"weight_version": "v0"}), "/version": (200, {"version": "0.33.0"})}


def cli_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("NCCL_LIBRARY", "VLLM_NCCL_SO_PATH")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "uniqueid", *args], capture_output=True,
                          text=True, timeout=120, env=e)


@pytest.fixture
def server():
    r = Recorder(dict(HEALTHY))
    yield r
    r.close()


def test_bare_command_prints_help_and_version_works():
    out = cli_run()
    assert out.returncode == 0 and "doctor" in out.stdout and "mint" in out.stdout
    assert not out.stderr
    out = cli_run("--version")
    assert out.returncode == 0 and out.stdout.startswith("jax-vllm-nccl ")


def test_doctor_without_a_gpu_says_so_and_fails():
    """This machine has no NVIDIA driver: doctor must not claim success."""
    out = cli_run("doctor")
    assert out.returncode == 1, out.stdout
    assert "PROBLEM  GPU: no NVIDIA driver found" in out.stdout
    assert "not checked: server" in out.stdout and "Traceback" not in out.stderr


def test_doctor_refuses_an_explicit_library_that_does_not_exist():
    out = cli_run("doctor", "--nccl", "/nonexistent/libnccl.so.2")
    assert out.returncode == 1
    assert "/nonexistent/libnccl.so.2 does not exist" in out.stdout
    assert "NCCL 2." not in out.stdout  # the wheel was not loaded instead


def test_mint_without_a_library_is_one_sentence():
    out = cli_run("mint", NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    assert out.returncode == 1 and not out.stdout
    assert out.stderr.count("\n") == 1 and "NCCL_LIBRARY cannot be used" in out.stderr


NOT_NCCL = "/lib/x86_64-linux-gnu/libc.so.6"  # a real library, but not libnccl


@pytest.mark.skipif(not os.path.exists(NOT_NCCL), reason=f"no {NOT_NCCL} here")
@pytest.mark.parametrize("command", ["mint", "doctor"])
def test_a_library_that_is_not_nccl_is_one_sentence(command):
    out = cli_run(command, NCCL_LIBRARY=NOT_NCCL)
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout
    if command == "mint":
        assert not out.stdout and out.stderr.count("\n") == 1
        assert "is not libnccl (it has no ncclGetVersion)" in out.stderr
    else:
        line, = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBLEM  libnccl:")]
        assert "is not libnccl (it has no ncclGetVersion)" in line


@pytest.fixture(params=[4096, 2**20])
def truncated_nccl(request, tmp_path) -> str:
    """The real libnccl (the nvidia-nccl-cu13 wheel's) cut to its first bytes,
    as a copy or download that did not finish leaves it."""
    path = tmp_path / "libnccl.so.2"
    with open(nccl_cffi.library_info().path, "rb") as f:
        path.write_bytes(f.read(request.param))
    return str(path)


@pytest.mark.parametrize("command", ["mint", "doctor"])
def test_a_truncated_libnccl_is_one_sentence_not_a_crash(command, truncated_nccl):
    """dlopen of a truncated ELF maps segments past the file's end and dies of
    SIGBUS with no message (both commands did); now the file is refused first."""
    out = cli_run(command, NCCL_LIBRARY=truncated_nccl)
    assert out.returncode == 1, (out.returncode, out.stderr[-500:])
    said = out.stderr if command == "mint" else out.stdout
    line, = [ln for ln in said.splitlines() if "cannot be used" in ln]
    assert f"{truncated_nccl} is cut short: {os.path.getsize(truncated_nccl)} bytes" in line
    assert "Traceback" not in out.stderr + out.stdout and line.count("\n") == 0
    if command == "mint":
        assert not out.stdout and out.stderr.count("\n") == 1


def test_mint_prints_an_id_vllm_accepts():
    """vLLM's decode_nccl_unique_id: standard base64 (validate=True) of 128 bytes."""
    import base64
    out = cli_run("mint")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and out.stdout.count("\n") == 1
    assert len(base64.b64decode(out.stdout.strip(), validate=True)) == 128


def _doctor(url: str, capsys, monkeypatch) -> tuple[int, str]:
    # No GPU here: take the GPU check as passed, so each test sees one problem at most.
    monkeypatch.setattr(cli, "_check_gpu", lambda r: r.ok("GPU: (taken as present)"))
    rc = cli.main(["doctor", "--url", url])
    return rc, capsys.readouterr().out


def test_doctor_passes_a_healthy_server_with_the_matching_nccl(server, capsys, monkeypatch):
    rc, out = _doctor(server.url, capsys, monkeypatch)
    have = ".".join(map(str, nccl_cffi.library_info().version))
    # the pinned test extra is what vLLM 0.33.0 loads (torch 2.14.0 pins NCCL 2.30.7)
    assert have == cli.VLLM_NCCL["0.33.0"] == "2.30.7"
    assert rc == 0, out
    assert "2 worker(s) -> world_size 3" in out and "NCCL match: vLLM 0.33.0" in out
    assert out.splitlines()[-1] == "every check passed"


def test_doctor_fails_loudly_on_a_different_nccl(server, capsys, monkeypatch):
    monkeypatch.setitem(cli.VLLM_NCCL, "9.9.9", "2.99.1")
    server.answers["/version"] = (200, {"version": "9.9.9"})
    rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1
    assert "pip install 'nvidia-nccl-cu13==2.99.1'" in out
    assert "PROBLEM  NCCL match: the server's vLLM 9.9.9 loads NCCL 2.99.1" in out


@pytest.mark.parametrize("answer, expect", [
    ((200, {"version": "0.99.0"}), "vLLM 0.99.0 is not a release this version knows"),
    ((404, {"detail": "Not Found"}), "GET /version failed"),
])
def test_doctor_cannot_check_the_match_and_says_so(server, capsys, monkeypatch, answer, expect):
    server.answers["/version"] = answer
    rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 0 and expect in out
    assert "torch.cuda.nccl.version()" in out
    assert out.splitlines()[-1] == "every check passed; not checked: NCCL match"


def test_doctor_fails_on_a_server_with_no_workers(server, capsys, monkeypatch):
    server.answers["/get_world_size"] = (200, {"world_size": 0})
    rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1 and "reports 0 workers" in out


def test_doctor_names_missing_rl_routes(server, capsys, monkeypatch):
    server.answers["/is_paused"] = (404, {"detail": "Not Found"})
    rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1 and "VLLM_SERVER_DEV_MODE=1" in out


def test_doctor_on_an_unreachable_url(capsys, monkeypatch):
    from jax_sender.testing.harness import free_port
    rc, out = _doctor(f"http://127.0.0.1:{free_port()}", capsys, monkeypatch)
    assert rc == 1 and "unreachable" in out and "check the URL" in out


@pytest.mark.parametrize("stuck", ["/is_paused", "/weight_info"])
def test_doctor_names_a_server_whose_engine_is_stuck(stuck, capsys, monkeypatch):
    """vLLM's API process answers /get_world_size from its config; /is_paused and
    /weight_info wait for the engine core, which a worker inside NCCL blocks."""
    monkeypatch.setattr(cli, "CALL_TIMEOUT", 1.0)
    routes = {path: json_answer(*answer) for path, answer in HEALTHY.items()}
    routes[stuck] = silent
    with BadServer(routes) as server:
        start = time.monotonic()
        rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1 and time.monotonic() - start < 1.0 + 2.0, out
    problem, = [ln for ln in out.splitlines() if ln.startswith("PROBLEM")]
    assert f"{server.url}: its engine does not answer (GET {stuck} took over 1 s" in problem
    assert "stuck inside NCCL" in problem and "restart that server" in problem
    assert "2 worker(s)" in out  # /get_world_size did answer


def test_doctor_on_a_server_that_never_answers(capsys, monkeypatch):
    monkeypatch.setattr(cli, "CALL_TIMEOUT", 1.0)
    with BadServer(silent) as server:
        start = time.monotonic()
        rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1 and time.monotonic() - start < 1.0 + 2.0
    assert "unreachable" in out and "no answer within the timeout of 1 s" in out


def test_doctor_on_something_that_is_not_vllm(capsys, monkeypatch):
    with BadServer(json_answer(200, ["a", "list"])) as server:
        rc, out = _doctor(server.url, capsys, monkeypatch)
    assert rc == 1 and "not a JSON object" in out and "unreachable" not in out


PASSWORD = "s3cret-pw"
BAD_URLS = {
    "not a URL": ("not a url", "must start with http:// or https://"),
    "ftp": ("ftp://127.0.0.1:8000", "must start with http:// or https://"),
    "an IPv6 literal left open": ("http://[::1", "cannot be parsed (Invalid IPv6 URL)"),
    "no host": ("http://", "has no host"),
    "port 99999": ("http://127.0.0.1:99999", "cannot be parsed (Port out of range"),
    "a unicode host": ("http://h\u00e9llo.example:8000", "non-ASCII"),
    "a unicode path": ("http://127.0.0.1:8000/p\u00e2th", "non-ASCII"),
    "a host label over 63 characters": (f"http://{'a' * 64}.example:8000",
                                        "a host name part of 64 characters"),
    "a password": (f"http://user:{PASSWORD}@127.0.0.1:8000", "carries a user or password"),
    "a password and an open IPv6 literal": (f"http://user:{PASSWORD}@[::1", "cannot be parsed"),
}


@pytest.mark.parametrize("url,says", BAD_URLS.values(), ids=BAD_URLS.keys())
def test_doctor_names_a_bad_url_in_one_sentence_without_its_password(url, says, capsys,
                                                                     monkeypatch):
    """Each shape was a traceback (ValueError, TypeError, UnicodeError) or
    printed the password; now one PROBLEM line, and the URL with ``***`` for
    what stands before its ``@``."""
    rc, out = _doctor(url, capsys, monkeypatch)
    assert rc == 1, out
    line, = [ln for ln in out.splitlines() if ln.startswith("PROBLEM")]
    assert line.startswith("PROBLEM  server: the server URL ") and says in line, line
    assert ". " not in line  # one sentence
    assert PASSWORD not in out and "not checked: server" in out
