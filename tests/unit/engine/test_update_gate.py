"""The update gate's own bookkeeping (``engine/clients/update_gate.py``), on an event loop and nothing else:
requests wait at a closed gate, one queued for a connection when the gate closes stays in the client, each
request knows whether an update began while it was out, and ``back`` tells when every request is back.
With real engines (pause, abort, the drain): tests/integration/engine/test_update_gate.py. Unit tier, < 1 s."""

import asyncio

from slime_mt.engine.clients.update_gate import UpdateGate


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


async def _request(gate: UpdateGate, slots: asyncio.Semaphore, entered: list, leave: asyncio.Event, seen: list):
    async with gate.sending(slots) as update_began:
        entered.append(gate.updates)
        await leave.wait()
        seen.append(update_began())


def test_a_request_waits_at_a_closed_gate_and_knows_an_update_began_while_it_was_out():
    async def go():
        gate, slots = UpdateGate(), asyncio.Semaphore(4)
        entered, seen, leave = [], [], asyncio.Event()
        gate.hold()
        first = asyncio.ensure_future(_request(gate, slots, entered, leave, seen))
        await asyncio.sleep(0.05)
        waited = (list(entered), gate.out, gate.is_open)
        gate.release()
        await asyncio.sleep(0.05)
        out_after_open = gate.out
        gate.hold()  # an update begins while the request is out
        second = asyncio.ensure_future(_request(gate, slots, entered, asyncio.Event(), []))
        leave.set()
        await first
        await asyncio.sleep(0.05)
        state = (entered, seen, gate.out, gate.updates)
        second.cancel()
        return waited, out_after_open, state

    waited, out_after_open, (entered, seen, out, updates) = run(go())
    assert waited == ([], 0, False)  # nothing left through the closed gate
    assert out_after_open == 1
    assert entered == [1] and seen == [True]  # sent after update 1, back after update 2 began
    assert out == 0 and updates == 2  # the second request still waits at the gate


def test_a_request_queued_for_a_connection_when_the_gate_closes_stays_in_the_client():
    async def go():
        gate, slots = UpdateGate(), asyncio.Semaphore(1)  # one connection
        entered, seen, leave = [], [], asyncio.Event()
        first = asyncio.ensure_future(_request(gate, slots, entered, leave, seen))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(_request(gate, slots, entered, asyncio.Event(), []))
        await asyncio.sleep(0.05)
        gate.hold()
        leave.set()  # the connection frees while the gate is closed
        await first
        await asyncio.sleep(0.05)
        closed = (len(entered), gate.out, slots.locked())
        gate.release()
        await asyncio.sleep(0.05)
        opened = (len(entered), gate.out)
        queued.cancel()
        return closed, opened

    closed, opened = run(go())
    assert closed == (1, 0, False)  # the queued request took the connection, saw the gate closed, gave it back
    assert opened == (2, 1)


def test_back_tells_whether_every_request_came_back_within_the_timeout():
    async def go():
        gate, slots = UpdateGate(), asyncio.Semaphore(4)
        leave = asyncio.Event()
        idle = await gate.back(0.01)
        request = asyncio.ensure_future(_request(gate, slots, [], leave, []))
        await asyncio.sleep(0.05)
        waiting = await gate.back(0.05)
        asyncio.get_running_loop().call_later(0.05, leave.set)
        returned = await gate.back(1.0)
        await request
        return idle, waiting, returned, gate.out

    assert run(go()) == (True, False, True, 0)
