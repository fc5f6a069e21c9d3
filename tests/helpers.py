"""Test helpers shared by the service tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading


def free_port() -> int:
    """A loopback port nothing listens on now, for a server that must start on a port known in advance (and keep it
    across restarts). Drawn above the kernel's ephemeral range, from this xdist worker's own ports (those of its
    stacks, :func:`free_offset`): a port in the ephemeral range can be handed to any bind-to-0 or outgoing connection
    between this check and the server's bind, as CI once lost a vLLM policy's HTTP port to vLLM's own engine. Where
    the range leaves no room above it, a port the kernel picks."""
    import random

    span = _worker_grpc_span()
    if span is not None:
        rng = random.Random()
        for _ in range(100):
            port = rng.randrange(*span)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def xdist_worker() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker (`make test` runs two); (0, 1) in a plain pytest run."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return (int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0), max(count, 1)


def _ephemeral_top() -> int:
    """The last port of Linux's ephemeral range (32768-60999 by default): outgoing connections and bind-to-0 take
    ports below it at any moment, so a fixed port there can be taken between its check and the bind."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[1])
    except (OSError, IndexError, ValueError):
        return 60999


#: the documented ports a ServiceStack shifts by its port_offset (prorag.paths), lowest and highest
_BASE_LOW, _BASE_HIGH = 8000, 50055
#: how far above its offset a run's stacks reach: the evaluations' policies at +100 + 10 i, stages 3-4 at +200 and
#: +210 (prorag_app.pipeline); a worker's offsets are this far from any other worker's
_SPAN = 300


def _worker_offsets() -> tuple[int, int] | None:
    """This xdist worker's slice [lo, hi) of port offsets whose stacks' gRPC ports (50051 + offset, and the stacks a
    run starts up to +210 above it) lie above the ephemeral range; None where the range leaves no room."""
    low, high = _ephemeral_top() + 1 - 50051, 65535 - _BASE_HIGH - _SPAN
    if low + _BASE_LOW < 1024 or high <= low:
        return None
    return _worker_slice(low, high)


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """This xdist worker's part [lo, hi) of the offsets [low, high), _SPAN short of the next worker's."""
    index, count = xdist_worker()
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width - _SPAN


def _worker_grpc_span() -> tuple[int, int] | None:
    """[lo, hi) of the gRPC ports this worker's stacks can take (see _worker_offsets); None where there is none."""
    offsets = _worker_offsets()
    if offsets is None:
        return None
    lo, hi = offsets
    return 50051 + lo, 50051 + hi  # below the next worker's lowest: its slice starts _SPAN past this one's end


def free_offset() -> int:
    """A port_offset for a ServiceStack (or `prorag up/run --port-offset`) whose ports, and those of the stacks a
    run starts at offset +100 to +210, are free now and can be taken by nobody else in the suite: each xdist worker
    draws from its own slice of offsets, and the gRPC ports (50051 + offset) lie above the ephemeral range where the
    kernel can hand them to any connection (the cause of a rare 'ports already in use' in the end-to-end test).
    The HTTP and metrics ports then lie at 19000-25000, below the ephemeral range."""
    import random

    from prorag import paths
    from prorag_app.stack import port_free

    # an unusual ephemeral range: anywhere from 3000 up, as before
    lo, hi = _worker_offsets() or _worker_slice(3000, 14000)
    base = [*paths.GRPC_PORTS.values(), *paths.HTTP_PORTS.values(), *paths.METRICS_PORTS.values()]
    rng = random.Random()  # random within the slice: a stack a killed test left behind is stepped over
    for _ in range(50):
        off = rng.randrange(lo, hi)
        ports = [p + off + extra for p in base for extra in (0, 100, 110, 120, 130, 140, 200, 210)]
        if all(port_free("127.0.0.1", p) for p in ports):
            return off
    raise RuntimeError(f"no free port range on loopback in offsets {lo}-{hi}")


_tiny_lock = threading.Lock()
_tiny_template: list = []  # [the directory], once built in this process


def tiny_data(data) -> None:
    """Fill the data directory ``data`` (what PRORAG_DATA names) with the tiny world, its dense and BM25 indexes
    and its embedded base policy, copied from one built once per test process (each xdist worker). Building them
    (the dense index encodes the corpus) took 5-10 s, once in every module that started services on the tiny
    world; a copy takes a fraction of a second. Callers still call ensure_indexes / ensure_policy_model after it:
    those find the copy complete (the indexes name the corpus by its hash and by a path relative to their tree),
    and would rebuild whatever were not."""
    import atexit
    import shutil
    import tempfile

    with _tiny_lock:
        if not _tiny_template:
            template = tempfile.mkdtemp(prefix="prorag-tiny-data-")
            atexit.register(shutil.rmtree, template, True)
            with env("PRORAG_DATA", template):
                from prorag_app.embedded import ensure_indexes, ensure_policy_model

                ensure_indexes("tiny")
                ensure_policy_model("tiny")
            _tiny_template.append(template)
    shutil.copytree(_tiny_template[0], data, dirs_exist_ok=True)


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
