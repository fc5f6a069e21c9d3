"""The RL and MCTS tests' policy server as a process of its own, so that a test can SIGKILL it and start it again:
`python -m tests.services.trainer.fault_policy --port P --retriever HOST:PORT [--delay-s S]`, PRORAG_DATA naming
the data directory whose tiny world and base model the test built.

It serves the scripted engine of those tests (test_rl_stage.RecordingGoldWalk: the tiny world's train questions,
the tiny base's tokenizer, steps drawn per seed) through the real policy server (adapter manager, scheduler,
rollouts with live retrieval); ``--delay-s`` makes every engine call take that long, so a kill lands inside calls.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _serve(args) -> None:
    from transformers import AutoTokenizer

    from prorag import paths
    from prorag.data.loaders import load_split
    from prorag.rpc.grpc_server import serve_until_signal
    from prorag.rpc.service import ServeConfig
    from prorag_app.embedded import ensure_policy_model
    from services.policy.server import PolicyConfig, start
    from tests.services.trainer.test_rl_stage import RecordingGoldWalk

    class Slow(RecordingGoldWalk):
        def generate(self, prompts, params, adapter=None, seeds=None):
            time.sleep(args.delay_s)
            return super().generate(prompts, params, adapter, seeds)

    base = str(ensure_policy_model("tiny"))
    engine = Slow(AutoTokenizer.from_pretrained(base), load_split(paths.world_dir("tiny"), "train"))
    started = await start(ServeConfig(port=args.port, http_port=-1),
                          PolicyConfig(model=base, world="tiny", retriever=args.retriever), engine=engine)
    print(f"policy: gRPC on 127.0.0.1:{started.grpc_port}", flush=True)
    await serve_until_signal([started.stop])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--retriever", required=True)
    ap.add_argument("--delay-s", type=float, default=0.0)
    asyncio.run(_serve(ap.parse_args()))


if __name__ == "__main__":
    main()
