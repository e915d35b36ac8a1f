"""The engine client's HTTP/1.1 transport against a real socket server that answers as each test says:
keep-alive reuse, the three ways a body ends, answers cut into pieces, idle connections the server
closed, answers cut short, cancellation."""

import asyncio

import pytest
from engine_helpers import run

from slime_mt.engine.http import within


def test_within_never_loses_a_cancellation_that_arrives_as_the_call_finishes():
    """A cancellation the caller's task accepted (it had not finished) ends it cancelled, whenever it
    arrives around the call's end; ``asyncio.wait_for`` before Python 3.12 returns the result when the
    call finished just before, and the cancelled episode runs on."""

    async def once(steps_after_the_call_ends: int) -> tuple[bool, str]:
        done = asyncio.get_running_loop().create_future()

        async def call():
            return await done

        async def caller():
            await within(call(), 10.0)
            return "ran on"

        task = asyncio.create_task(caller())
        for _ in range(3):
            await asyncio.sleep(0)  # the caller waits inside within()
        done.set_result(1)
        for _ in range(steps_after_the_call_ends):
            await asyncio.sleep(0)
        accepted = task.cancel()
        try:
            return accepted, await task
        except asyncio.CancelledError:
            return accepted, "cancelled"

    outcomes = [run(once(steps)) for steps in range(4)]
    assert any(accepted for accepted, _ in outcomes)
    for accepted, outcome in outcomes:
        assert outcome == ("cancelled" if accepted else "ran on")


def test_within_bounds_a_call():
    async def go():
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(10), 0.1)
        return await within(asyncio.sleep(0, "result"), None)

    assert run(go()) == "result"
