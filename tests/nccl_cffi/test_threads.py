"""Kept daemon threads (``nccl_cffi/threads.py``): reused when idle, never
while a job still runs, and none carried into a forked child (no GPU)."""

import subprocess
import sys
import threading

from nccl_cffi.threads import _idle, run_in_thread


def _run(job=lambda: None, name="job") -> tuple[int, str]:
    """Run ``job`` on a kept thread and wait; that thread's ident and name meanwhile."""
    seen, done = [], threading.Event()

    def wrapped() -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))
        job()
        done.set()

    run_in_thread(wrapped, name)
    assert done.wait(10)
    return seen[0]


def _idle_again(name: str) -> None:
    """Wait for the thread to go back to the pool, just after its job's last line."""
    for _ in range(500):
        if _idle.get(name):
            return
        threading.Event().wait(0.01)


def test_an_idle_thread_is_reused_for_jobs_of_its_name_only():
    first, name = _run(name="push")
    assert name == "push" and next(t for t in threading.enumerate() if t.ident == first).daemon
    _idle_again("push")
    assert _run(name="update")[0] != first  # another kind of job: another thread
    assert _run(name="push") == (first, "push")


def test_a_thread_inside_a_job_is_never_given_another():
    release, started = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(10)

    ident = []
    run_in_thread(lambda: (ident.append(threading.get_ident()), stuck()), "job")
    assert started.wait(10)
    try:
        others = {_run()[0] for _ in range(5)}
        assert ident[0] not in others
    finally:
        release.set()


def test_a_forked_child_makes_its_own_threads():
    """The parent keeps an idle thread for jobs named "push"; a forked child
    has no such thread, so its "push" job must get a new one (it would wait
    for ever on the parent's, which did not survive the fork)."""
    code = """
import os, threading, time
from nccl_cffi.threads import _idle, run_in_thread
done = threading.Event()
run_in_thread(done.set, "push")
assert done.wait(10)
deadline = time.monotonic() + 10
while not _idle.get("push") and time.monotonic() < deadline:  # back in the pool
    time.sleep(0.005)
assert _idle.get("push"), "the parent's thread never went idle"
pid = os.fork()
if pid == 0:
    ok = threading.Event()
    run_in_thread(ok.set, "push")  # the parent's kind: its idle thread is not here
    os._exit(0 if ok.wait(5) else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "child 0", (out.stdout, out.stderr[-2000:])
