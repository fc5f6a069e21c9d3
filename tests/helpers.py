"""Test helpers shared by the service tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading


def free_port() -> int:
    """A loopback port nothing listens on now (for a server that must start on a port known in advance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


#: the founders the sibling-pair fixtures draw from
FOUNDERS = ["Tova Lunn", "Kora Vell", "Arn Pell", "Mira Dost", "Sel Varn", "Oda Kree", "Bram Tull", "Ina Rook"]


def founder_pairs(n: int, seed: int = 0, *, names=FOUNDERS, judge: bool = True, value: bool = True) -> list:
    """Sibling pairs whose contrast is reading: the document names the founder, the chosen subanswer reads it, the
    rejected one guesses another name. Sibling order is shuffled; judge=True labels the reading by the judge,
    value=True by value (SPRE margin: values 0.9 / 0.0)."""
    import random

    from prorag.data.loaders import Document
    from prorag.search.pairs import StepPair
    from prorag.trajectory import Step

    rng = random.Random(seed)
    out = []
    for i in range(n):
        good, bad = rng.sample(names, 2)
        doc = Document(id=f"d{i}", title="Mai Brewery", text=f"Mai Brewery was founded by {good}.",
                       contents=f'"Mai Brewery"\nMai Brewery was founded by {good}.')
        ctx = [Step("subquery", thought="First the founder.", content="Who founded Mai Brewery?", docs=[doc])]
        steps = (Step("subanswer", thought="The document names the founder.", content=good),
                 Step("subanswer", thought="I will guess.", content=bad))
        flip = rng.random() < 0.5
        labels = {}
        if judge:
            labels["judge_choice"] = int(flip)
        if value:
            labels.update(values=(0.0, 0.9) if flip else (0.9, 0.0), value_choice=int(flip))
        out.append(StepPair(f"q{i}", "Who founded Mai Brewery?", ctx, steps[::-1] if flip else steps, **labels))
    return out


def three_doc_corpus(path):
    """A three-document corpus (a two-hop chain and a distractor) for services started on a tiny BM25 index."""
    import json

    docs = [("d1", "Mai Brewery", "Mai Brewery was founded by Tova Lunn."),
            ("d2", "Tova Lunn", "Tova Lunn was born in Harlow."),
            ("d3", "Harlow", "Harlow is a town on the river Stort.")]
    path.write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, t, x in docs))
    return path
