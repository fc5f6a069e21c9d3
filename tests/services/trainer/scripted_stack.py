"""Real retriever, policy and PRM servers on loopback over the tiny world, the policy running a scripted engine
(the MCTS test's GoldWalkEngine or a subclass), for the stages that sample through the services (RFT, RL)."""

from __future__ import annotations

from contextlib import contextmanager

from prorag.rpc.service import ServeConfig
from tests.helpers import LoopThread, env


@contextmanager
def scripted_stack(data, engine_cls, judge: bool = False):
    """Yields {"policy", "prm", "retriever" (targets), "base" (the tiny base's directory), "engine", "loop"}, and
    "judge" (the reference judge on the tiny world) when asked; the PRM is a fresh head on the tiny base, saved
    under ``data``/prm. PRORAG_DATA points at ``data`` meanwhile."""
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
