"""A graceful stop of the http process (`--shutdown-timeout S`, vLLM's semantics).

On SIGTERM (or SIGINT) the server stops taking work: /health and every new request answer 503
with a JSON error, while requests in flight run on for up to S seconds. Those still running
then are aborted: a stream ends with an error event, a whole response is a 503 error; none is
cut off silently. S = 0 (the default, as vLLM's) aborts them at once. A second signal ends the
wait early. The server exits 0 afterwards (uvicorn then closes the connections).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down"


class Drainable(Protocol):
    """What a drain needs of the http process's link to the pipeline (procs.http_server)."""

    def stop_accepting(self, reason: str) -> None: ...
    def in_flight(self) -> int: ...
    async def wait_idle(self) -> None: ...
    def abort_all(self, message: str) -> int: ...


async def drain(client: Drainable, timeout: float, cut: asyncio.Event) -> int:
    """Refuse new work, wait up to `timeout` s (or until `cut` is set) for the requests in flight
    to finish, and abort the rest with an error; returns how many were aborted."""
    client.stop_accepting(SHUTTING_DOWN)
    waiting = client.in_flight()
    if waiting and timeout > 0:
        logger.info(
            "stopping: letting %d requests in flight finish for up to %g s (--shutdown-timeout)",
            waiting,
            timeout,
        )
        idle, stop = asyncio.ensure_future(client.wait_idle()), asyncio.ensure_future(cut.wait())
        try:
            await asyncio.wait({idle, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            stop.cancel()
    if not client.in_flight():
        return 0
    aborted = client.abort_all(
        f"{SHUTTING_DOWN}: the request was still running after --shutdown-timeout {timeout:g} s"
    )
    if aborted:
        logger.warning("stopping: aborted %d requests still in flight", aborted)
    return aborted
