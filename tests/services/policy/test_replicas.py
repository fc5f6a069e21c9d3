"""Several policy replicas as local processes on loopback, the way a headless Service exposes them: calls
from one client spread over every replica (round-robin), an adapter push reaches each replica and waits for
its ack, and a replica that restarts serves the active adapter version by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from prorag.rpc.clients import PolicyClient, push_adapter, resolve_replicas, wait_for_health
from services.trainer.sampling import rollout
from tests.services.policy.test_service import make_lora
from tests.helpers import free_port



class Replica:
    def __init__(self, port: int, model_dir, adapter_root, log_dir):
        self.port, self.model_dir, self.adapter_root, self.log_dir = port, model_dir, adapter_root, log_dir
        self.proc = None

    def start(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PRORAG_THREADS": "1"}
        log = open(self.log_dir / f"policy-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prorag_app.cli", "serve", "policy", "--port", str(self.port), "--http-port", "-1",
             "--set", f"model={self.model_dir}", "--set", f"adapter_root={self.adapter_root}",
             "--set", "retriever=127.0.0.1:1"], stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait(self):
        ok = wait_for_health(f"127.0.0.1:{self.port}", "prorag.v1.Policy", timeout=120)
        if not ok:
            raise AssertionError((self.log_dir / f"policy-{self.port}.log").read_text()[-3000:])

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def replicas(tiny_policy, tmp_path_factory):
    from prorag.registry import ArtifactRef, Registry, weights_sha256

    model_dir, _ = tiny_policy
    root = tmp_path_factory.mktemp("adapters")
    src = tmp_path_factory.mktemp("lora")
    reg = Registry(root, "adapter")
    for i, version in enumerate(("v1", "v2")):
        make_lora(model_dir, src / version, seed=i + 1)
        reg.publish(src / version, ArtifactRef("pol", version), base_model=str(model_dir),
                    base_model_sha256=weights_sha256(model_dir))
    logs = tmp_path_factory.mktemp("logs")
    reps = [Replica(free_port(), model_dir, root, logs).start() for _ in range(3)]
    try:
        for r in reps:
            r.wait()
        yield reps
    finally:
        for r in reps:
            if r.proc and r.proc.poll() is None:
                r.proc.terminate()
                r.proc.wait(30)


def _target(reps) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in reps)


def test_calls_from_one_client_spread_over_every_replica(replicas):
    assert resolve_replicas(_target(replicas)) == [f"127.0.0.1:{r.port}" for r in replicas]
    with PolicyClient(_target(replicas)) as c:
        # round robin reaches a replica once its connection is up, so the first calls may all go to the replica
        # that connected first: call until every replica has answered (bounded), then check each did
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.add(c.model_info().extra["replica"])
        assert len(seen) == 3, seen
        # rollouts too: each stream goes to the next replica
        for i in range(3):
            events = list(c.rollout([("q", "Who founded Kest?")], c.sampling(max_tokens=4), max_steps=1))
            assert events[-1].num_trajectories == 1


def test_push_reaches_every_replica_and_a_restarted_replica_serves_the_active_version(replicas):
    target = _target(replicas)
    acks = push_adapter(target, "pol", "v1")
    assert [a.ok for a in acks] == [True] * 3 and {a.replica for a in acks} == set(resolve_replicas(target))
    acks = push_adapter(target, "pol", "v2")
    assert all(a.ok for a in acks), acks
    for r in replicas:
        with PolicyClient(f"127.0.0.1:{r.port}") as c:
            assert c.list_adapters().active == "pol@v2"
    # A replica dies and comes back: it loads and activates pol@v2 before it reports ready.
    replicas[1].kill()
    acks = push_adapter(target, "pol", "v2", timeout=5)
    assert [a.ok for a in acks] == [True, False, True] and acks[1].error.startswith("UNAVAILABLE")
    replicas[1].start().wait()
    with PolicyClient(f"127.0.0.1:{replicas[1].port}") as c:
        status = c.list_adapters()
        assert status.active == "pol@v2" and c.model_info().extra["active_adapter"] == "pol@v2"
    # Back to the base model everywhere; a restart then stays on the base model.
    with PolicyClient(f"127.0.0.1:{replicas[0].port}") as c:
        c.activate_adapter("", "")
    replicas[0].kill()
    replicas[0].start().wait()
    with PolicyClient(f"127.0.0.1:{replicas[0].port}") as c:
        assert c.list_adapters().active == ""


def test_the_trainers_rollouts_split_a_request_over_the_replicas_and_get_the_whole_requests_samples(replicas):
    questions = [SimpleNamespace(id=f"q{i}", question=q) for i, q in enumerate(
        ["Who founded Kest?", "Where was the director of Red Harbour born?", "When did Vell open?",
         "Who wrote Amber Gate?", "Which river runs through Kest?"])]
    cfg = SimpleNamespace(temperature=1.0, max_step_tokens=6, max_steps=1, topk=1, retriever_index="",
                          service_wait_s=30.0)
    for r in replicas:  # every replica on the base model (an earlier test left adapters active)
        with PolicyClient(f"127.0.0.1:{r.port}") as c:
            c.activate_adapter("", "")
    whole_target = f"127.0.0.1:{replicas[0].port}"
    with PolicyClient(whole_target) as c:
        whole = rollout(c, SimpleNamespace(**vars(cfg), policy=whole_target), questions, 2, 11, "", {})
    with PolicyClient(_target(replicas)) as c:
        split = rollout(c, SimpleNamespace(**vars(cfg), policy=_target(replicas)), questions, 2, 11, "", {})
    # three parts (2 + 2 + 1 questions), one per replica, each sampling with its questions' seeds in the whole
    assert [(t.question_id, t.sample_index) for t in whole] == [(q.id, j) for q in questions for j in range(2)]
    assert [(t.question_id, t.sample_index, list(t.trace.token_ids)) for t in split] == \
        [(t.question_id, t.sample_index, list(t.trace.token_ids)) for t in whole]
    assert len({tuple(t.trace.token_ids) for t in whole}) > 1  # sampled, not one greedy answer repeated
