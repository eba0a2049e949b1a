"""relay.api.drain without processes: a fake client whose requests end when the test says."""

from __future__ import annotations

import asyncio

from relay.api.drain import SHUTTING_DOWN, drain


class FakeClient:
    def __init__(self, requests: int):
        self.requests = requests
        self.refusing: str | None = None
        self.aborted_with: str | None = None
        self.changed = asyncio.Event()

    def stop_accepting(self, reason: str) -> None:
        self.refusing = reason

    def in_flight(self) -> int:
        return self.requests

    async def wait_idle(self) -> None:
        while self.requests:
            self.changed.clear()
            await self.changed.wait()

    def finish_one(self) -> None:
        self.requests -= 1
        self.changed.set()

    def abort_all(self, message: str) -> int:
        n, self.requests, self.aborted_with = self.requests, 0, message
        return n


def run(
    client: FakeClient, timeout: float, during=None, cut: asyncio.Event | None = None
) -> tuple[int, float]:
    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()
        if during is not None:
            loop.call_soon(during)
        aborted = await drain(client, timeout, cut or asyncio.Event())
        return aborted, loop.time() - start

    return asyncio.run(go())


def test_requests_that_finish_in_time_are_not_aborted():
    client = FakeClient(2)

    def both_finish():
        client.finish_one()
        asyncio.get_running_loop().call_soon(client.finish_one)

    aborted, took = run(client, 60, both_finish)
    assert aborted == 0 and took < 5 and client.aborted_with is None
    assert client.refusing == SHUTTING_DOWN


def test_what_is_still_running_at_the_timeout_is_aborted_with_an_error_naming_the_flag():
    client = FakeClient(3)
    aborted, took = run(client, 0.2, client.finish_one)
    assert aborted == 2 and took >= 0.2
    assert "--shutdown-timeout 0.2 s" in client.aborted_with and client.refusing


def test_timeout_zero_aborts_at_once_and_an_idle_server_stops_at_once():
    client = FakeClient(4)
    assert run(client, 0)[0] == 4
    idle = FakeClient(0)
    aborted, took = run(idle, 60)
    assert aborted == 0 and took < 5 and idle.refusing


def test_a_second_signal_cuts_the_wait_short():
    client = FakeClient(1)
    cut = asyncio.Event()
    aborted, took = run(client, 60, cut.set, cut)
    assert aborted == 1 and took < 5
