"""Following one job's events for a WatchJob stream: what the journal holds after a sequence number, then each new
event as the job's thread records it, until the job ends or the trainer shuts down."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from prorag.errors import NotFound, Unavailable
from services.trainer.jobs import JobManager

#: a watcher re-checks the job this often even without a wake-up (belt and braces)
POLL_S = 1.0


class JobWatcher:
    def __init__(self, manager: JobManager):
        self.manager = manager
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End open watches with UNAVAILABLE so clients re-watch after a restart."""
        self._closing.set()

    async def events(self, job_id: str, after_seq: int) -> AsyncIterator[tuple[dict, str]]:
        """(event, the job's run dir) for each event of ``job_id`` after ``after_seq``, as they come."""
        if not job_id:
            raise NotFound("job_id is required")
        run_dir = self.manager.get(job_id).run_dir  # NOT_FOUND before the stream starts
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify() -> None:  # called from the job's thread
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed: the server is gone
                pass

        self.manager.add_listener(job_id, notify)
        seq = after_seq
        try:
            while True:
                wake.clear()
                events = self.manager.events_after(job_id, seq)
                if not events and self.manager.get(job_id).state.terminal:
                    # State and its final event change under one lock: one more read drains the tail.
                    events = self.manager.events_after(job_id, seq)
                    if not events:
                        return
                for ev in events:
                    yield ev, run_dir
                    seq = ev["seq"]
                if events:
                    continue
                if self._closing.is_set():
                    raise Unavailable("the trainer is shutting down; watch again from the last seq after it restarts")
                closing = asyncio.ensure_future(self._closing.wait())
                woken = asyncio.ensure_future(wake.wait())
                try:
                    await asyncio.wait({closing, woken}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closing.cancel()
                    woken.cancel()
        finally:
            self.manager.remove_listener(job_id, notify)
