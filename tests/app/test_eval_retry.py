"""prorag_app.eval.run_agent when the retriever behind the policy goes away mid-evaluation (a starved or restarted
retriever: the policy answers UNAVAILABLE): the chunk is made again once it is back, and nothing is lost or
counted twice; a retriever that stays away stops the evaluation with the service named.

Real retriever and policy servers on loopback over the tiny world; the policy runs the MCTS test's scripted
engine (GoldWalkEngine), since what is under test is the evaluation's retry, not a model."""

from __future__ import annotations

import threading
import time

import pytest

from prorag import paths
from prorag.data.loaders import load_split
from prorag.errors import Unavailable
from prorag.rpc.clients import PolicyClient
from prorag.rpc.service import ServeConfig
from prorag_app.embedded import ensure_indexes, ensure_policy_model
from prorag_app.eval import run_agent
from services.policy.server import PolicyConfig
from services.policy.server import start as start_policy
from services.retriever.server import RetrieverConfig
from services.retriever.server import start as start_retriever
from tests.helpers import LoopThread, env, tiny_data
from tests.services.trainer.test_mcts_stage import GoldWalkEngine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    data = tmp_path_factory.mktemp("eval-retry") / "data"
    tiny_data(data)
    with env("PRORAG_DATA", str(data)):
        ensure_indexes("tiny")
        yield str(ensure_policy_model("tiny"))


def _start_retriever(loop, port: int = 0):
    return loop.run(start_retriever(ServeConfig(port=port, http_port=-1), RetrieverConfig(world="tiny")))


def test_a_chunk_whose_retriever_went_away_is_made_again_once_it_is_back(world):
    from transformers import AutoTokenizer  # here, as in the other tests: collecting the module stays light

    questions = load_split(paths.world_dir("tiny"), "train")[:6]
    loop = LoopThread()
    retriever = _start_retriever(loop)
    port = retriever.grpc_port
    engine = GoldWalkEngine(AutoTokenizer.from_pretrained(world), questions)
    policy = loop.run(start_policy(ServeConfig(port=0, http_port=-1),
                                   PolicyConfig(model=world, world="tiny", retriever=f"127.0.0.1:{port}",
                                                retriever_timeout_s=2.0), engine=engine))
    try:
        with PolicyClient(f"127.0.0.1:{policy.grpc_port}") as client:
            whole = run_agent(client, questions, chunk=3)
            loop.run(retriever.stop())
            # away for good: the evaluation stops once its wait is spent, naming the policy and the retriever
            with pytest.raises(Unavailable) as stopped:
                run_agent(client, questions, chunk=3, service_wait_s=3.0)
            assert f"retriever at 127.0.0.1:{port} failed" in str(stopped.value)
            assert "service_wait_s=3s is spent" in str(stopped.value)
            # away for a while: back on its port after 3 s, the same records, each question once
            back = threading.Timer(3.0, lambda: back_on.append(_start_retriever(loop, port)))
            back_on: list = []
            t0 = time.monotonic()
            back.start()
            again = run_agent(client, questions, chunk=3, service_wait_s=60.0)
            assert time.monotonic() - t0 >= 3.0  # it did wait for the retriever
            back.join()
            retriever = back_on[0]
    finally:
        loop.run(policy.stop())
        loop.run(retriever.stop())
        loop.close()
    assert [r["id"] for r in again] == [q.id for q in questions]
    assert [(r["prediction"], r["f1"]) for r in again] == [(r["prediction"], r["f1"]) for r in whole]
    assert any(step.get("retrieved") for r in again
               for step in r["trajectory"].get("steps", []))  # searches were answered, not skipped
