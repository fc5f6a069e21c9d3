"""Real retriever, policy and PRM servers on loopback over the tiny world, the policy running a scripted engine
(the MCTS test's GoldWalkEngine or a subclass), for the stages that sample through the services (MCTS, siblings, RFT,
RL), and those stages' configs against it."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from prorag.config import from_dict
from prorag.io import read_jsonl
from prorag.rpc.service import ServeConfig
from prorag.training.context import StageStopped, local_context
from tests.helpers import LoopThread, env, tiny_data


@contextmanager
def scripted_stack(data, engine_cls, judge: bool = False):
    """Yields {"policy", "prm", "retriever" (targets), "base" (the tiny base's directory), "engine", "loop"}, and
    "judge" (the reference judge on the tiny world) when asked; the PRM is a fresh head on the tiny base, saved
    under ``data``/prm. PRORAG_DATA points at ``data`` meanwhile."""
    tiny_data(data)
    with env("PRORAG_DATA", str(data)):
        from transformers import AutoTokenizer

        from prorag import paths
        from prorag.data.loaders import load_split
        from prorag.modeling import save_pretrained
        from prorag.prm.model import prm_from_policy
        from prorag_app.embedded import ensure_indexes, ensure_policy_model
        from services.policy.server import PolicyConfig, start as start_policy
        from services.prm.engine import PRMEngine
        from services.prm.server import PRMServeConfig, start as start_prm
        from services.retriever.server import RetrieverConfig, start as start_retriever

        ensure_indexes("tiny")
        base = str(ensure_policy_model("tiny"))
        prm, tok = prm_from_policy(base, seed=1)
        save_pretrained(prm, tok, data / "prm")
        engine = engine_cls(AutoTokenizer.from_pretrained(base), load_split(paths.world_dir("tiny"), "train"))
        loop = LoopThread()
        r = loop.run(start_retriever(ServeConfig(port=0, http_port=-1), RetrieverConfig(world="tiny")))
        retriever = f"127.0.0.1:{r.grpc_port}"
        p = loop.run(start_policy(ServeConfig(port=0, http_port=-1),
                                  PolicyConfig(model=base, world="tiny", retriever=retriever), engine=engine))
        s = loop.run(start_prm(ServeConfig(port=0), PRMServeConfig(), engine=PRMEngine(data / "prm")))
        servers = [s, p, r]
        stack = {"policy": f"127.0.0.1:{p.grpc_port}", "prm": f"127.0.0.1:{s.grpc_port}", "base": base,
                 "engine": engine, "retriever": retriever, "loop": loop}
        if judge:
            from services.judge.server import JudgeConfig, start as start_judge

            j = loop.run(start_judge(ServeConfig(port=0), JudgeConfig(world="tiny")))
            servers.insert(0, j)
            stack["judge"] = f"127.0.0.1:{j.grpc_port}"
        try:
            yield stack
        finally:
            for srv in servers:
                loop.run(srv.stop())
            loop.close()


def stack_fixture(name: str, engine_cls, judge: bool = False):
    """A test module's ``services`` fixture: one scripted stack (``engine_cls``, the judge when asked) for all of
    its tests, its data in a fresh directory named after ``name``."""

    @pytest.fixture(scope="module", name="services")
    def services(tmp_path_factory):
        with scripted_stack(tmp_path_factory.mktemp(name) / "data", engine_cls, judge=judge) as stack:
            yield stack

    return services


def _stack_fields(stack: dict) -> dict:
    # what every stage sampling through a scripted stack is set to: the tiny world, the stack's policy, seed 3
    return {"world": "tiny", "policy": stack["policy"], "seed": 3, "max_step_tokens": 48, "tracking": "local"}


def search_stage_config(config_cls, stack: dict, **fields):
    """A searching stage's config (MCTS, siblings) against ``stack`` (with its judge): the first six train
    questions, three at a time, one document per search; ``fields`` add to it or override it."""
    return from_dict(config_cls, {**_stack_fields(stack), "split": "train", "max_questions": 6,
                                  "policy_model": stack["base"], "retriever": stack["retriever"],
                                  "judge": stack["judge"], "topk": 1, "concurrency": 3, **fields})


def training_stage_config(config_cls, stack: dict, **fields):
    """A stage that trains on what ``stack`` samples (RFT, RL): from its base model, steps scored by its PRM, at
    most six steps a trajectory; ``fields`` add to it or override it."""
    return from_dict(config_cls, {**_stack_fields(stack), "base_model": stack["base"], "prm": stack["prm"],
                                  "max_steps": 6, **fields})


def journal_after_a_stop(run, cfg, work, stage: str) -> list[dict]:
    """Run a searching stage's job in ``work`` and stop it once two questions are journalled; returns its journal
    (at least those two rows), what a resumed job starts from."""
    stop = threading.Event()

    def emit(ev):
        if ev.get("step", 0) >= 2:
            stop.set()

    with pytest.raises(StageStopped):
        run(local_context(work, cfg, emit=emit, stop=stop, stage=stage))
    journal = list(read_jsonl(work / "checkpoints" / f"{stage}-journal.jsonl"))
    assert len(journal) >= 2
    return journal
