"""The harness's process plumbing: child environments, ports, running ranks together."""

import signal
import subprocess
import sys
import time

import pytest

from jax_sender.testing.harness import SHARE_GPUS, free_port, gpu_env, run_all

from support import on_tests_path
from support.concurrency import wait_for


def test_one_rank_per_gpu_by_default(monkeypatch):
    monkeypatch.delenv(SHARE_GPUS, raising=False)
    for name in ("NCCL_HOSTID", "NCCL_NET", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    env = gpu_env(3)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["NCCL_NVLS_ENABLE"] == "0"
    assert not {"NCCL_HOSTID", "NCCL_NET", "XLA_PYTHON_CLIENT_PREALLOCATE"} & set(env)


@pytest.mark.parametrize("share", ["1", "2", "3"])
def test_shared_gpus_fold_ranks_and_give_each_its_own_host(monkeypatch, share):
    monkeypatch.setenv(SHARE_GPUS, share)
    envs = [gpu_env(g) for g in range(4)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(g % int(share)) for g in range(4)]
    # NCCL refuses two ranks of one host on one device: every rank is a host.
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert {(e["NCCL_NET"], e["NCCL_SOCKET_IFNAME"]) for e in envs} == {("Socket", "lo")}
    # Two JAX processes on one GPU cannot both take 75% of it up front.
    assert {e["XLA_PYTHON_CLIENT_PREALLOCATE"] for e in envs} == {"false"}


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import pathlib
    import socket
    ports = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ports.exists():
        pytest.skip("no Linux ephemeral port range to stay out of")
    low = int(ports.read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low  # no bind(0) or outgoing connection can take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_run_all_returns_every_output():
    assert run_all([_child("print('OK a')"), _child("print('OK b')")], 30) == ["OK a\n", "OK b\n"]


def test_a_failing_process_kills_its_waiting_peer_at_once():
    waiter = _child("import time; print('waiting', flush=True); time.sleep(60)")
    t = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_all([waiter, _child("raise SystemExit('coordinator: port taken')")], 50)
    assert time.monotonic() - t < 20 and waiter.returncode == -signal.SIGKILL
    # The error names the failure and keeps the peer's output too.
    assert "a process failed" in str(err.value) and "port taken" in str(err.value)
    assert "waiting" in str(err.value)


def test_run_all_kills_everything_at_its_deadline():
    procs = [_child("import time; time.sleep(60)") for _ in range(2)]
    with pytest.raises(RuntimeError, match="not done within 2s"):
        run_all(procs, 2)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


def test_exiting_zero_without_ok_is_a_failure():
    with pytest.raises(RuntimeError, match="did not print OK"):
        run_all([_child("print('fine')")], 30)


def test_run_all_waits_for_the_marker_it_is_given():
    assert run_all([_child("print('RESULT 1')")], 30, expect="RESULT ") == ["RESULT 1\n"]
    with pytest.raises(RuntimeError, match="did not print RESULT"):
        run_all([_child("print('OK')")], 30, expect="RESULT ")


# -- the reference server's worker start (no GPU: the workers fail first) -----

def test_a_worker_that_exits_fails_the_start_at_once():
    from jax_sender.testing.server import start_workers
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 0 exited with status 2 before it was ready"):
        start_workers(["0"], ["--no-such-flag"], timeout=120)
    assert time.monotonic() - t < 60


def test_a_worker_that_never_connects_fails_the_start_at_its_deadline():
    """The worker dials a port that accepts but never answers, so it neither
    connects nor exits: only the deadline can end the start."""
    import socket

    from jax_sender.testing.server import start_workers
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="not ready within 3s"):
            start_workers(["0"], ["--port", str(mute.getsockname()[1])], timeout=3)
        assert time.monotonic() - t < 20


def test_a_port_taken_on_ipv4_alone_counts_as_taken():
    """JAX's coordinator binds ``[::]:port``, which a 127.0.0.1 listener blocks."""
    import socket

    from jax_sender.testing.harness import _bind_and_release
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert _bind_and_release(held.getsockname()[1]) is None
    assert _bind_and_release(0)


def test_a_run_stopped_by_sigterm_still_kills_the_servers_its_fixtures_started(tmp_path):
    """``timeout`` around pytest sends SIGTERM: the fixtures are torn down, so
    a server in a session of its own (as the harness starts them) is killed."""
    import os
    pidfile = tmp_path / "server.pid"
    (tmp_path / "test_stopped.py").write_text(f'''
import os, signal, subprocess, sys, time
import pytest

@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)
    open({str(pidfile)!r}, "w").write(str(proc.pid))
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

def test_waits(server):
    time.sleep(120)
''')
    env = on_tests_path(dict(os.environ))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "support.children.sigterm",
                            "-p", "no:cacheprovider", str(tmp_path / "test_stopped.py")],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    assert wait_for(lambda: run.poll() is not None or pidfile.exists() and pidfile.read_text(),
                    60, 0.1)
    assert run.poll() is None and pidfile.read_text(), run.stdout.read()
    pid = int(pidfile.read_text())
    time.sleep(0.5)  # inside the test's sleep
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=30)
    assert run.returncode != 0, out
    with pytest.raises(ProcessLookupError):  # reaped by the teardown: gone
        os.kill(pid, 0)
