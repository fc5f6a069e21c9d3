"""Test helpers shared by the service tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading


class LoopThread:
    """An asyncio loop in a daemon thread: servers run on it, synchronous clients call in."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@contextlib.contextmanager
def env(name: str, value: str):
    """Set an environment variable for the block (child processes inherit it), then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def scripted_engine_base():
    """A GenerationEngine base for scripted test engines (a model's steps written by the test): adapters are
    accepted and ignored, info names the engine. Returned by a function so importing the helpers stays light."""
    from prorag.engine import GenerationEngine

    class ScriptedEngine(GenerationEngine):
        name = "scripted"

        def load_adapter(self, key, path): ...
        def unload_adapter(self, key): ...
        def adapters(self): return []
        def info(self): return {"engine": self.name}

    return ScriptedEngine
