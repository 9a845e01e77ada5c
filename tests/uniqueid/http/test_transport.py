"""The HTTP loop's deadlines (``transport.within``): calls whose deadlines
fall in one step share one timer, and each still ends by its own deadline,
only its own, and leaves no timer behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from uniqueid.http import transport

STEP = transport.DEADLINE_STEP_S


def on_loop(coro):
    return transport.run(coro)


async def forever() -> None:
    await asyncio.get_running_loop().create_future()


async def answered_after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "answer"


async def inside(seconds: float, awaitable):
    with transport.within(seconds):
        return await awaitable


async def outcome(seconds: float, awaitable) -> tuple[str, float]:
    """What ``within`` ended in, and when (loop time)."""
    start = asyncio.get_running_loop().time()
    try:
        with transport.within(seconds):
            result = await awaitable
    except transport.Expired:
        result = "expired"
    return result, asyncio.get_running_loop().time() - start


def test_calls_under_one_timer_each_end_by_their_own_deadline():
    """200 calls at once with the same deadline: those the answer reaches in
    time return it, the silent ones expire at the deadline (not before it,
    at most a step after), and no timer is left."""
    async def fleet():
        calls = [outcome(0.3, answered_after(0.05) if i % 2 else forever()) for i in range(200)]
        return await asyncio.gather(*calls)

    results = on_loop(fleet())
    assert [r for r, _ in results] == ["expired", "answer"] * 100
    expired = [t for r, t in results if r == "expired"]
    assert min(expired) >= 0.3 and max(expired) < 0.3 + STEP + 0.5
    assert not transport._expiries


def test_a_deadline_passed_inside_another_of_the_same_step_is_the_inner_calls():
    """A connect within a call, both ending in the same step (``Pool``'s
    dial inside a call's deadline): the inner one expires, the task goes on
    uncancelled, and the outer one still bounds what follows."""
    async def nested():
        inner, _ = await outcome(0.2, inside(0.2, forever()))
        task = asyncio.current_task()
        cancelling = task.cancelling() if hasattr(task, "cancelling") else 0  # Python 3.11+
        await asyncio.sleep(0.01)  # the task was not left cancelled
        later, took = await outcome(0.2, forever())
        return inner, cancelling, later, took

    inner, cancelling, later, took = on_loop(nested())
    assert (inner, cancelling, later) == ("expired", 0, "expired") and took >= 0.2
    assert not transport._expiries


def test_a_callers_cancel_is_not_taken_for_a_deadline():
    """A phase given up (``Calls.cancel``) cancels its calls: they end
    cancelled at once, not as expired, and the others of their step keep
    their deadline."""
    async def two():
        loop = asyncio.get_running_loop()
        given_up = loop.create_task(inside(5.0, forever()))
        kept = loop.create_task(outcome(5.0, answered_after(0.2)))
        await asyncio.sleep(0.05)
        given_up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await given_up
        return await kept

    start = time.monotonic()
    assert on_loop(two())[0] == "answer"
    assert time.monotonic() - start < 4.0
    assert not transport._expiries


# -- a phase given up past its grace says what the loop was doing ------------------

def _phase_given_up(block_loop_s: float) -> str:
    """The error of a one-server phase whose call never ends (it ignores any
    deadline), the HTTP loop blocked for ``block_loop_s`` once it started."""
    from nccl_cffi import Deadline
    from uniqueid import RendezvousTimeout, VLLMClient
    from uniqueid.http.fleet import Calls

    async def silent(i: int, left: float | None) -> None:
        if block_loop_s:
            asyncio.get_running_loop().call_later(0.05, time.sleep, block_loop_s)
        await forever()

    calls = Calls([VLLMClient("http://127.0.0.1:9")], silent, deadline=Deadline(0.1))
    with pytest.raises(RendezvousTimeout, match="no answer by the deadline") as e:
        calls.wait()
    time.sleep(block_loop_s)  # the loop free again for the next test
    return str(e.value)


def test_a_phase_given_up_says_the_loop_was_blocked():
    """Past its grace with the loop blocked: the error says so (a call's own
    deadline runs on the loop, so only a loop that did not run outlives it)."""
    message = _phase_given_up(3.0)
    assert "the loop is blocked" in message and "calls started 0.0" in message, message


def test_a_phase_given_up_with_the_loop_running_says_so():
    """Past its grace with the loop free (the stall, if any, over): the error
    says the loop runs, and when the calls started."""
    message = _phase_given_up(0.0)
    assert "the loop runs now" in message and "given up after 1." in message, message
