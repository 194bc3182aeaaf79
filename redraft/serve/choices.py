"""One HTTP request as several scheduler jobs: ``n`` choices per prompt, several prompts per
completions request (OpenAI's semantics: choice ``index = prompt * n + j``).

    jobs = [Job(ids, params_j, loop) for ...]       # one per choice, submitted together
    fan = FanIn(jobs)                                # their messages on one queue, tagged with the index
    msg = await fan.next(disconnect)                 # (index, (kind, payload)) or None: client gone

Each choice is an independent request in the batch (its own row, its own seed); nothing here
touches the decoder. Seeds of choices ``j > 0`` derive from the request's seed
(:func:`choice_seed`), so a seeded ``n=4`` request is reproducible and its choices differ.
"""

from __future__ import annotations

import asyncio
import hashlib

from redraft.serve.scheduler import Job


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice ``j`` of a request seeded with ``seed``: choice 0 keeps it (``n=1``
    gives the same text as choice 0 of ``n=4``); the others hash (seed, j) to 63 bits."""
    if seed is None or j == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{j}".encode()).digest()[:8], "big") >> 1


def _final(msg) -> bool:
    kind, payload = msg
    return kind == "error" or (kind == "event" and payload.done)


class FanIn:
    """The messages of several jobs on one queue, as ``(index, (kind, payload))``."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, job)) for i, job in enumerate(jobs)]

    async def _pump(self, i: int, job: Job) -> None:
        while True:
            msg = await job.queue.get()
            self.queue.put_nowait((i, msg))
            if _final(msg):
                return

    async def next(self, disconnect: asyncio.Future):
        """The next message of any job, or None when ``disconnect`` completes first."""
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None

    def close(self) -> None:
        for p in self._pumps:
            p.cancel()
