"""What `prorag bench load` and `prorag bench soak` ask of each service: how it is started and one caller's
request, checked for the answer's shape."""

from __future__ import annotations

import abc

from prorag import paths
from prorag.data.loaders import load_corpus, load_split
from prorag.pb import policy_pb2, policy_pb2_grpc, prm_pb2, prm_pb2_grpc, retriever_pb2, retriever_pb2_grpc
from prorag.rpc.clients import channel
from prorag.rpc.pbconv import step_pb
from prorag.trajectory import render_prompt
from prorag_app.bench.models import bench_model, bench_prm_model
from prorag_app.embedded import ensure_indexes

LOAD_SERVICES = ("retriever", "policy", "prm")


class Workload(abc.ABC):
    """One service's requests: how it is started (``sets``) and a caller per client (``make_caller(target)`` ->
    ``call(deadline_s)`` that raises grpc.RpcError or returns the number of items it carried)."""

    service = ""
    items = "requests"

    def sets(self) -> dict:
        return {}

    def overload_sets(self, limit: int) -> dict:
        return {}

    @abc.abstractmethod
    def make_caller(self, target: str):
        """A function that makes one call to the service at ``target`` (each workload's own request)."""


class _RetrieverLoad(Workload):
    """One query per request (a rollout's search), top-3, on the index given; queries are the test split's
    sub-questions, round-robin."""

    service, items = "retriever", "queries"

    def __init__(self, world: str, index: str):
        ensure_indexes(world, dense=index != "bm25", bm25=index != "dense")
        qs = load_split(paths.world_dir(world), "test")
        self.pool = [s.question for q in qs for s in q.decomposition] or [q.question for q in qs]
        self.world, self.index = world, index
        self._next = 0

    def sets(self) -> dict:
        return {"world": self.world, "default_index": self.index}

    def overload_sets(self, limit: int) -> dict:
        # the batcher's own bound below the server's, so both refusals are exercised: the server's at its RPC limit
        # and the batcher's "server busy" when admitted calls find its queue full
        return {"max_queue": batcher_queue_limit(limit)}

    def make_caller(self, target: str):
        ch = channel(target)
        stub = retriever_pb2_grpc.RetrieverStub(ch)
        i = [self._next]  # each caller starts elsewhere in the pool
        self._next += 7

        def call(deadline_s: float) -> int:
            q = self.pool[i[0] % len(self.pool)]
            i[0] += 1
            resp = stub.Search(retriever_pb2.SearchRequest(queries=[q], topk=3, index=self.index), timeout=deadline_s)
            if len(resp.results) != 1 or not resp.results[0].documents:
                raise BadAnswer("no documents")
            return 1

        return call, ch


class _PolicyLoad(Workload):
    """GenerateSteps of one agent prompt (a test question), one sample of ``tokens`` tokens at temperature 1."""

    service, items = "policy", "tokens"

    def __init__(self, world: str, model: str, tokens: int):
        self.world, self.model, self.tokens = world, bench_model(world, model), tokens
        self.prompts = [render_prompt(q.question) for q in load_split(paths.world_dir(world), "test")[:64]]
        self._next = 0

    def sets(self) -> dict:
        # restore_active off: the bare model, whatever adapter an RL run activated; rollouts (and so the retriever)
        # are not used by GenerateSteps
        return {"world": self.world, "model": self.model, "restore_active": "false"}

    def make_caller(self, target: str):
        ch = channel(target)
        stub = policy_pb2_grpc.PolicyStub(ch)
        i = [self._next]
        self._next += 5

        def call(deadline_s: float) -> int:
            p = self.prompts[i[0] % len(self.prompts)]
            i[0] += 1
            resp = stub.GenerateSteps(policy_pb2.GenerateStepsRequest(
                prefixes=[policy_pb2.Prefix(text=p)],
                sampling=policy_pb2.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=self.tokens,
                                                   seed=1 + i[0])), timeout=deadline_s)
            if len(resp.results) != 1 or len(resp.results[0].completions) != 1:
                raise BadAnswer("not one completion")
            return len(resp.results[0].completions[0].token_ids)

        return call, ch


class _PRMLoad(Workload):
    """ScoreSteps of one gold trajectory (every step scored) of a test question."""

    service, items = "prm", "steps"

    def __init__(self, world: str, model: str):
        from prorag_app.profiles import PROFILES
        from prorag_app.eval import gold_trajectories

        self.world = world
        self.model = bench_prm_model(world, model if model != "sft" else "prm")
        world_dir = paths.world_dir(world)
        qs = [q for q in load_split(world_dir, "test") if any(s.doc_id for s in q.decomposition)][:64]
        docs = {d.id: d for d in load_corpus(world_dir / "corpus.jsonl")}
        trajs = gold_trajectories(qs, docs, PROFILES["default"].sft_for("sft"))
        self.requests = [prm_pb2.ScoreStepsRequest(inputs=[prm_pb2.ScoringInput(
            question=q.question, steps=[step_pb(s) for s in steps])]) for q, steps in zip(qs, trajs) if steps]
        if not self.requests:
            raise SystemExit(f"world {world!r} has no test question with a gold trajectory to score")
        self._next = 0

    def sets(self) -> dict:
        return {"world": self.world, "model": self.model}

    def make_caller(self, target: str):
        ch = channel(target)
        stub = prm_pb2_grpc.ProcessRewardModelStub(ch)
        i = [self._next]
        self._next += 3

        def call(deadline_s: float) -> int:
            req = self.requests[i[0] % len(self.requests)]
            i[0] += 1
            resp = stub.ScoreSteps(req, timeout=deadline_s)
            if len(resp.results) != 1 or len(resp.results[0].scores) != len(req.inputs[0].steps):
                raise BadAnswer("wrong number of scores")
            return len(resp.results[0].scores)

        return call, ch


class BadAnswer(Exception):
    """A call that got an answer of the wrong shape (counted as an error, like a status)."""


def batcher_queue_limit(rpc_limit: int) -> int:
    """The retriever batcher's max_queue in the past-capacity phase, for a server limit of ``rpc_limit`` calls."""
    return max(1, rpc_limit // 2)


def workload(service: str, args) -> Workload:
    if service == "retriever":
        return _RetrieverLoad(args.world, args.index)
    if service == "policy":
        return _PolicyLoad(args.world, args.model, args.load_tokens)
    if service == "prm":
        return _PRMLoad(args.world, args.model)
    raise SystemExit(f"bench load/soak drives {', '.join(LOAD_SERVICES)}; not {service!r}")
