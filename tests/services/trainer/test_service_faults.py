"""kill -9 of a service a training job calls, in the middle of the job, then the service started again on the same
port: the job waits for it (service_wait_s), asks again with the same request and seed, and ends with exactly what
an uninterrupted run of the same config ends with. A service that never comes back fails the job within its wait
with UNAVAILABLE naming the service and its address, and the job's journal is intact: resumed once the service is
back, it ends as the uninterrupted run.

The retriever, the PRM and the judge run as `prorag serve` processes; the policy as
tests/services/trainer/fault_policy.py (the stage tests' scripted engine behind the real policy server, each engine call
slowed so the kill lands inside a call). The stages run in process (local_context), as the stage tests run them; a
killed *trainer* is test_rl_stage's and test_kill_resume's. A service is started again only once the job has been seen
waiting for it (prorag.rpc.clients.wait_for_health, spied on), so every kill is sure to be noticed by the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prorag.rpc.clients import wait_for_health as _health  # the real one: the spy below sees only the job's waits
from prorag.config import from_dict
from prorag.io import read_jsonl
from prorag.training.context import local_context
from tests.helpers import env
from tests.helpers import free_port, tiny_data

REPO = Path(__file__).resolve().parents[3]
#: seconds each policy engine call takes: a rollout or a search question spans several, so a kill lands inside one
ENGINE_DELAY_S = 0.05


class Service:
    """One service as a process of its own on a fixed port: started, SIGKILLed, started again on that port."""

    def __init__(self, name: str, port: int, cmd: list[str], log_dir: Path):
        self.name, self.port, self.cmd, self.log_dir = name, port, cmd, log_dir
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def spawn(self) -> None:
        from prorag_app import procs

        log = self.log_dir / f"{self.name}-{len(self.logs)}.log"
        self.logs.append(log)
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as fh:  # procs.spawn: the process dies with this one, however this one dies
            self.proc = procs.spawn(self.cmd, cwd=REPO, env=child_env, stdout=fh, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> None:
        if not _health(self.target, "", timeout=timeout):
            self.stop()
            raise RuntimeError(f"{self.name} did not become ready on {self.target}:\n"
                               f"{self.logs[-1].read_text(errors='replace')[-3000:]}")

    def kill(self) -> None:
        from prorag_app import procs

        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None:
            procs.stop([self.proc], timeout=1)  # reaped already: only leaves procs' registry

    def stop(self) -> None:
        from prorag_app import procs

        if self.proc is not None:
            procs.stop([self.proc], timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The tiny world, its base model and a fresh PRM head on it; the retriever, policy, PRM and (reference)
    judge as processes."""
    root = tmp_path_factory.mktemp("faults")
    logs = root / "logs"
    logs.mkdir()
    tiny_data(root / "data")
    with env("PRORAG_DATA", str(root / "data")):
        from prorag.modeling import save_pretrained
        from prorag.prm.model import prm_from_policy
        from prorag_app.embedded import ensure_indexes, ensure_policy_model

        ensure_indexes("tiny")
        base = str(ensure_policy_model("tiny"))
        prm_model, tok = prm_from_policy(base, seed=1)
        save_pretrained(prm_model, tok, root / "prm")
        serve = [sys.executable, "-m", "prorag_app.cli", "serve"]
        ports = {name: free_port() for name in ("retriever", "policy", "prm")}
        retriever = Service("retriever", ports["retriever"],
                            serve + ["retriever", "--port", str(ports["retriever"]), "--http-port", "-1",
                                     "--metrics-port", "-1", "--log-format", "text", "--set", "world=tiny"], logs)
        policy = Service("policy", ports["policy"],
                         [sys.executable, "-m", "tests.services.trainer.fault_policy", "--port", str(ports["policy"]),
                          "--retriever", retriever.target, "--delay-s", str(ENGINE_DELAY_S)], logs)
        prm = Service("prm", ports["prm"],
                      serve + ["prm", "--port", str(ports["prm"]), "--metrics-port", "-1", "--log-format", "text",
                               "--set", f"model={root / 'prm'}"], logs)
        ports["judge"] = free_port()
        judge = Service("judge", ports["judge"],
                        serve + ["judge", "--port", str(ports["judge"]), "--metrics-port", "-1", "--log-format", "text",
                                 "--set", "world=tiny"], logs)
        services = {"retriever": retriever, "policy": policy, "prm": prm, "judge": judge}
        try:
            for s in services.values():  # all three load at once
                s.spawn()
            for s in services.values():
                s.wait_ready()
            yield {"base": base, "logs": logs, **services}
        finally:
            for s in services.values():
                s.stop()


class Waits:
    """The services the job has waited for (prorag.rpc.clients.wait_for_health, which call_with_service_wait and the
    RL stage's push call when a service went away), by target."""

    def __init__(self, monkeypatch):
        import prorag.rpc.clients as clients

        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

        def spy(target, service="", timeout=60.0):
            self.event(target).set()
            return _health(target, service, timeout)

        monkeypatch.setattr(clients, "wait_for_health", spy)

    def event(self, target: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(target, threading.Event())

    def seen(self, target: str) -> bool:
        return self.event(target).is_set()


class Outage:
    """SIGKILL ``services`` ``after_s`` seconds after begin(); with restart, start each again on its port ``pause_s``
    after the job is seen waiting for it (at most ``give_up_s`` later, or once finish() says the job ended)."""

    def __init__(self, services: list[Service], waits: Waits, after_s: float = 0.2, pause_s: float = 0.2,
                 restart: bool = True, give_up_s: float = 120.0):
        self.services, self.waits, self.after_s, self.pause_s = services, waits, after_s, pause_s
        self.restart, self.give_up_s = restart, give_up_s
        self.killed = threading.Event()
        self.killed_at = 0.0
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def begin(self, now: bool = False) -> None:
        """Start the outage; ``now`` kills in the calling thread (the job's, from its emit), so the kill is sure to
        land before the job's next call, however fast the machine runs that call."""
        if now:
            self._run(sleep=False)
            return
        t = threading.Thread(target=self._run, daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, sleep: bool = True) -> None:
        if sleep:
            time.sleep(self.after_s)
        for s in self.services:
            s.kill()
        self.killed_at = time.monotonic()
        self.killed.set()
        if not self.restart:
            return
        for s in self.services:
            t = threading.Thread(target=self._back, args=(s,), daemon=True)
            self.threads.append(t)
            t.start()

    def _back(self, s: Service) -> None:
        try:
            deadline = time.monotonic() + self.give_up_s
            while not self.waits.seen(s.target) and not self.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(self.pause_s)
            s.start()
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.errors.append(e)

    def on_step(self, step: int):
        """A job's emit that begins the outage at the progress event of ``step`` finished questions (a journalled
        one is kept; the next one is being worked on when the kill lands)."""
        def emit(ev):
            if ev.get("step") == step and not self.threads:
                self.begin()
        return emit

    def finish(self, timeout: float = 200.0) -> None:
        """The job ended: start what it never waited for, join, raise what went wrong in the threads."""
        self.done.set()
        for t in list(self.threads):
            t.join(timeout)
        if self.errors:
            raise self.errors[0]


# ---------------------------------------------------------------- RL
def _rl_config(stack, **kw):
    from services.trainer.stage_rl import RLConfig

    return from_dict(RLConfig, {
        "world": "tiny", "max_questions": 4, "base_model": stack["base"], "policy": stack["policy"].target,
        "prm": stack["prm"].target, "group_size": 4, "questions_per_iteration": 2, "iterations": 2,
        "max_step_tokens": 48, "max_steps": 6, "lora_r": 4, "lora_alpha": 8, "lr": 1e-3, "seed": 3,
        "tracking": "local", "service_wait_s": 120, **kw})


#: what an iteration's journal row says about its data (the rest are timings, versions and retry counts)
RL_DATA_KEYS = ("iteration", "questions", "sampled", "kept", "dropped_stale", "dropped_foreign", "dropped_too_long",
                "prm_scored", "prm_version", "reward_mean", "f1_mean", "format_valid_rate", "adv_std",
                "trained_tokens", "groups", "groups_uncredited", "lag_max")


def test_rl_policy_and_prm_killed_mid_iteration_come_back_and_the_job_ends_as_uninterrupted(
        stack, tmp_path, one_thread, monkeypatch):
    from services.trainer.stage_rl import run_rl
    from tests.services.trainer.test_rl_stage import _assert_same_adapter

    cfg = _rl_config(stack)
    straight = run_rl(local_context(tmp_path / "rl-straight", cfg, stage="rl"))

    waits = Waits(monkeypatch)
    policy, prm = stack["policy"], stack["prm"]
    outage = Outage([policy, prm], waits)
    work = tmp_path / "rl-killed"

    def emit(ev):
        # iteration 1's adapter is pushed: both die before its rollout starts. A kill on a timer could land after
        # the rollout on a fast machine (CI saw it land in the update, and the final push waits without a retry).
        # The PRM is started again only once the job waits for it, so it is still down when the steps are scored.
        if ev.get("message", "").startswith(f"pushed rl@{work.name}-1 ") and not outage.killed.is_set():
            outage.begin(now=True)

    try:
        out = run_rl(local_context(work, cfg, emit=emit, stage="rl"))
    finally:
        outage.finish()
    assert outage.killed.is_set(), "the job ended before the kill"
    assert waits.seen(policy.target), "the job never waited for the killed policy"
    assert waits.seen(prm.target), "the job never waited for the killed PRM"
    assert len(policy.logs) >= 2 and len(prm.logs) >= 2  # both were started again
    rows = [json.loads(line) for line in (work / "run" / "iterations.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (tmp_path / "rl-straight" / "run" / "iterations.jsonl").read_text()
           .splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    # iteration 1 retried its rollout and its PRM call (at least once each: a call may also fail while a channel
    # reconnects to the restarted service)
    assert rows[0]["service_retries"] == 0 and rows[1]["service_retries"] >= 2
    for got, want in zip(rows, ref):
        assert {k: got.get(k) for k in RL_DATA_KEYS} == {k: want.get(k) for k in RL_DATA_KEYS}
    assert out["iterations"] == straight["iterations"] == 2 and out["total_kept"] == straight["total_kept"]
    _assert_same_adapter(out["adapter"], straight["adapter"])  # the same final weights, to 1e-6


# ---------------------------------------------------------------- MCTS
def _mcts_config(stack, **kw):
    from services.trainer.stage_mcts import MCTSStageConfig

    return from_dict(MCTSStageConfig, {
        "world": "tiny", "split": "train", "max_questions": 3, "policy": stack["policy"].target,
        "policy_model": stack["base"], "retriever": stack["retriever"].target, "judge": "", "topk": 1,
        "concurrency": 1, "seed": 3, "max_step_tokens": 48, "tracking": "local", "service_wait_s": 120,
        "mcts": {"simulations": 4, "expansions": 3, "max_children": 3, "max_depth": 4, "rollouts": 1}, **kw})


def _trees_and_pairs(work: Path) -> tuple[dict, list]:
    trees = {r["question_id"]: r["tree"] for r in read_jsonl(work / "run" / "trees.jsonl")}
    return trees, list(read_jsonl(work / "run" / "pairs.jsonl"))


@pytest.fixture(scope="module")
def mcts_straight(stack, tmp_path_factory, one_thread):
    from services.trainer.stage_mcts import run_mcts

    work = tmp_path_factory.mktemp("mcts") / "straight"
    metrics = run_mcts(local_context(work, _mcts_config(stack), stage="mcts"))
    assert metrics["service_retries"] == 0 and metrics["pairs"] > 0
    return _trees_and_pairs(work)


def test_mcts_policy_and_retriever_killed_mid_search_come_back_and_the_trees_are_the_uninterrupted_ones(
        stack, mcts_straight, tmp_path, one_thread, monkeypatch):
    from services.trainer.stage_mcts import run_mcts

    waits = Waits(monkeypatch)
    policy, retriever = stack["policy"], stack["retriever"]
    outage = Outage([policy, retriever], waits)

    emit = outage.on_step(1)  # the first question is journalled; the kill lands in the second

    try:
        metrics = run_mcts(local_context(tmp_path / "killed", _mcts_config(stack), emit=emit, stage="mcts"))
    finally:
        outage.finish()
    assert outage.killed.is_set(), "the job ended before the kill"
    assert metrics["policy_retries"] >= 1 and waits.seen(policy.target)
    # the retriever is asked only for subqueries the run's cache has not seen: the next question's are new
    assert metrics["retriever_retries"] >= 1 and waits.seen(retriever.target)
    assert metrics["service_retries"] == metrics["policy_retries"] + metrics["retriever_retries"]
    trees, pairs = _trees_and_pairs(tmp_path / "killed")
    want_trees, want_pairs = mcts_straight
    assert trees == want_trees and pairs == want_pairs


def test_a_service_that_never_comes_back_fails_the_job_within_its_wait_and_the_journal_resumes(
        stack, mcts_straight, tmp_path, one_thread, monkeypatch):
    from prorag.errors import Unavailable
    from services.trainer.stage_mcts import run_mcts

    waits = Waits(monkeypatch)
    policy = stack["policy"]
    outage = Outage([policy], waits, after_s=0.0, restart=False)
    work = tmp_path / "gone"
    cfg = _mcts_config(stack, service_wait_s=3)

    emit = outage.on_step(1)  # the first question is journalled; the kill lands in the second

    try:
        with pytest.raises(Unavailable) as err:
            run_mcts(local_context(work, cfg, emit=emit, stage="mcts"))
        failed_at = time.monotonic()
        outage.finish()
        assert outage.killed.is_set()
        # the wait (3 s) plus the last health probe (2 s) and the interrupted call, not a wait per question
        assert failed_at - outage.killed_at < 3 + 10
        msg = str(err.value)
        assert f"the policy service at {policy.target}" in msg and "service_wait_s=3s" in msg, msg
        assert err.value.code.name == "UNAVAILABLE"
        # the journal holds the question finished before the kill, whole; nothing was published
        journal = [json.loads(line) for line in
                   (work / "checkpoints" / "mcts-journal.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in journal] == [next(iter(mcts_straight[0]))]
        assert not (work / "run" / "trees.jsonl").exists()
    finally:
        if policy.proc is None or policy.proc.poll() is not None:
            policy.start()
    # resumed once the policy is back: the finished question is kept, the others searched, the same trees
    metrics = run_mcts(local_context(work, cfg, stage="mcts"))
    assert metrics["questions"] == 3
    trees, pairs = _trees_and_pairs(work)
    assert trees == mcts_straight[0] and pairs == mcts_straight[1]


# ---------------------------------------------------------------- the sibling sampler
def _siblings_config(stack, **kw):
    from services.trainer.stage_siblings import SiblingsStageConfig

    return from_dict(SiblingsStageConfig, {
        "world": "tiny", "split": "train", "max_questions": 3, "policy": stack["policy"].target,
        "policy_model": stack["base"], "retriever": stack["retriever"].target, "judge": stack["judge"].target,
        "topk": 1, "samples": 2, "max_steps": 4, "max_step_tokens": 48, "concurrency": 1, "seed": 3,
        "tracking": "local", "service_wait_s": 120, **kw})


def test_siblings_policy_and_judge_killed_mid_job_come_back_and_the_pairs_are_the_uninterrupted_ones(
        stack, tmp_path, one_thread, monkeypatch):
    from services.trainer.stage_siblings import run_siblings

    straight = run_siblings(local_context(tmp_path / "straight", _siblings_config(stack), stage="siblings"))
    assert straight["service_retries"] == 0 and straight["judge_labelled"] > 0
    waits = Waits(monkeypatch)
    policy, judge = stack["policy"], stack["judge"]
    outage = Outage([policy, judge], waits)

    emit = outage.on_step(1)  # the first question is journalled; the kill lands in the second

    work = tmp_path / "killed"
    try:
        metrics = run_siblings(local_context(work, _siblings_config(stack), emit=emit, stage="siblings"))
    finally:
        outage.finish()
    assert outage.killed.is_set(), "the job ended before the kill"
    # the policy is killed inside the second question's sampling, the judge is down when its pairs are judged
    assert metrics["policy_retries"] >= 1 and waits.seen(policy.target)
    assert metrics["judge_retries"] >= 1 and waits.seen(judge.target)
    assert list(read_jsonl(work / "run" / "pairs.jsonl")) == list(read_jsonl(tmp_path / "straight" / "run" /
                                                                             "pairs.jsonl"))
    assert {k: metrics[k] for k in ("pairs", "judge_labelled", "prefixes")} == \
           {k: straight[k] for k in ("pairs", "judge_labelled", "prefixes")}


# ---------------------------------------------------------------- RFT
def test_rft_policy_and_prm_killed_while_sampling_come_back_and_the_job_ends_as_uninterrupted(
        stack, tmp_path, one_thread, monkeypatch):
    from prorag.training.checkpoint import load_weights_file
    from services.trainer.stage_rft import RFTConfig, run_rft

    cfg = from_dict(RFTConfig, {
        "world": "tiny", "max_questions": 6, "base_model": stack["base"], "policy": stack["policy"].target,
        "prm": stack["prm"].target, "samples_per_question": 4, "max_step_tokens": 48, "max_steps": 6,
        "questions_per_request": 2, "prm_threshold": -1e9, "max_train_steps": 1, "batch_size": 2, "seed": 3,
        "tracking": "local", "service_wait_s": 120})
    straight = run_rft(local_context(tmp_path / "straight", cfg, stage="rft"))
    assert straight["data_correct"] > 0
    waits = Waits(monkeypatch)
    policy, prm = stack["policy"], stack["prm"]
    outage = Outage([policy, prm], waits)

    def emit(ev):
        # the first request's trajectories are sampled and scored: both die before the second's rollout
        if ev.get("message", "").startswith("sampled 2/") and not outage.killed.is_set():
            outage.begin(now=True)

    work = tmp_path / "killed"
    try:
        metrics = run_rft(local_context(work, cfg, emit=emit, stage="rft"))
    finally:
        outage.finish()
    assert outage.killed.is_set(), "the job ended before the kill"
    assert waits.seen(policy.target) and metrics["data_service_retries"] >= 1
    data_keys = [k for k in straight if k.startswith("data_") and k != "data_service_retries"]
    assert {k: metrics[k] for k in data_keys} == {k: straight[k] for k in data_keys}
    got, want = (load_weights_file(w / "checkpoints" / "rft_data.pt") for w in (work, tmp_path / "straight"))
    assert got.keys() == want.keys()
    for key in got:
        if key != "stats":
            assert got[key] == want[key], key
