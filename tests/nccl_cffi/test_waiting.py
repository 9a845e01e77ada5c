"""The waiting toolkit every blocking step goes through (``nccl_cffi.waiting``)."""

import math
import threading
import time
from concurrent.futures import Future

import pytest

from nccl_cffi import Deadline, Job, JobStopped, NcclTimeoutError, await_future, in_background
from nccl_cffi.waiting import MAX_TIMEOUT_S


def test_a_future_that_failed_with_a_timeout_error_is_seen_at_once():
    """``concurrent.futures.TimeoutError`` is ``TimeoutError``: a wait that
    caught it from ``result(timeout)`` would take a future that failed with
    any timeout error (an HTTP call's, an NCCL wait's) for one still running,
    and hold the caller to the deadline."""
    failed: Future = Future()
    failed.set_exception(NcclTimeoutError("the peer never came"))
    t = time.monotonic()
    with pytest.raises(NcclTimeoutError, match="never came"):
        await_future(failed, time.monotonic() + 5.0)
    assert time.monotonic() - t < 0.5


def test_await_future_returns_false_at_its_deadline_and_polls_its_check():
    pending: Future = Future()
    polls = []
    t = time.monotonic()
    assert not await_future(pending, time.monotonic() + 0.3, lambda: polls.append(1))
    assert 0.3 <= time.monotonic() - t < 1.3 and len(polls) >= 3
    with pytest.raises(KeyError):
        await_future(pending, None, lambda: {}["stop"])


def test_a_deadline_that_starts_later():
    """A callable deadline gives None until it starts (the answers after
    the last broadcast): the wait goes on until then."""
    pending: Future = Future()
    start = time.monotonic() + 0.3
    t = time.monotonic()
    assert not await_future(pending, lambda: None if time.monotonic() < start else start + 0.2)
    assert 0.5 <= time.monotonic() - t < 1.5


@pytest.mark.parametrize("seconds", [-1, math.inf, math.nan, 1e10, True, "5"])
def test_a_deadline_is_a_finite_number_of_seconds(seconds):
    """Refused when made, in one sentence, not later as an OverflowError of the
    timed wait it is handed to (past about 9.2e9 s)."""
    with pytest.raises(ValueError, match="finite number of seconds from 0 to 1e.09") as e:
        Deadline(seconds)
    assert "\n" not in str(e.value) and str(e.value).count(". ") == 0
    assert Deadline(MAX_TIMEOUT_S).left() > MAX_TIMEOUT_S - 1
    assert Deadline(None).left() is None and not Deadline(None).passed()
    d = Deadline(0.05)
    assert d.cap(10.0) <= 0.05 and d.cap(None) <= 0.05
    time.sleep(0.06)
    assert d.passed() and d.left() == 0.0


def test_a_stopped_job_ends_at_its_next_check_and_cleans_up_once_it_returns():
    """The blocking init's and the lane's way out: ``stop`` makes the job's
    check raise; a job inside a call that does not return is left there,
    and ``then`` runs when (if) it returns."""
    release = threading.Event()
    job = Job(lambda check: (release.wait(5), check()), name="test-job")
    assert not job.stop(0.1) and job.busy  # still inside its "call"
    cleaned = threading.Event()
    job.then(lambda f: cleaned.set() if isinstance(f.exception(), JobStopped) else None)
    release.set()
    assert cleaned.wait(5) and not job.busy


def test_in_background_delivers_the_result_or_the_exception():
    assert in_background(lambda a, b: a + b, 2, 3, name="test-bg").result(5) == 5
    with pytest.raises(ZeroDivisionError):
        in_background(lambda: 1 / 0, name="test-bg").result(5)
