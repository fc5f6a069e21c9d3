"""kill -9 the trainer mid-job, restart it: the job resumes from its checkpoint and ends exactly
where an uninterrupted run of the same config ends, with no partial file in its run dir."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prorag.rpc.clients import wait_for_health
from prorag.rpc.clients_trainer import TrainerClient, state_name
from prorag.io import sha256_file
from services.trainer.jobs import JobManager, JobState
from services.trainer.server import SERVICE
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[3]
CONFIG = {"steps": 300, "checkpoint_every": 50, "log_every": 10, "step_sleep_s": 0.01, "seed": 3,
          "tracking": "local"}



class Trainer:
    """`prorag serve trainer` as a real subprocess with its own PRORAG_HOME."""

    def __init__(self, home: Path, port: int, env: dict[str, str] | None = None):
        self.home, self.port, self.extra_env = home, port, dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PRORAG_RUNS", "PRORAG_DATA")}
        env.update(PRORAG_HOME=str(self.home), WANDB_MODE="disabled", PYTHONUNBUFFERED="1", **self.extra_env)
        log = self.home / f"trainer-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "prorag_app.cli", "serve", "trainer", "--port",
                                          str(self.port)], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
        if not wait_for_health(f"127.0.0.1:{self.port}", SERVICE, timeout=60):
            self.kill()
            pytest.fail(f"trainer did not become ready:\n{log.read_text()[-3000:]}")

    def exited(self) -> str | None:
        """gone() for TrainerClient.watch: why the trainer process is not running, else None."""
        code = self.proc.poll() if self.proc else None
        return None if code is None else f"exited with {code}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def reference(tmp_path):
    """The same job, uninterrupted, in another home, in process; it runs alongside (the steps mostly sleep)."""
    ref = JobManager(tmp_path / "ref" / "jobs", tracking="local")
    ref.start()
    ref.submit("selftest", CONFIG, job_id="kill-me")
    yield ref
    ref.stop(10)


def test_kill_dash_nine_then_resume_matches_uninterrupted_run(tmp_path, reference):
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    trainer = Trainer(home, port)
    trainer.start()
    try:
        with TrainerClient(f"127.0.0.1:{port}", timeout=10) as tc:
            tc.start("selftest", CONFIG, job_id="kill-me")
            events, killed_at_seq = [], None
            # One watch across the kill: the client re-watches from the last seq once the trainer is back (asking
            # gone() between tries, as `prorag run` does: the restarted process is running, so it waits on)
            for ev in tc.watch("kill-me", timeout=120, gone=trainer.exited):
                events.append(ev)
                if killed_at_seq is None and ev.message.startswith("checkpoint saved"):
                    assert ev.step < CONFIG["steps"]
                    trainer.kill()
                    killed_at_seq = ev.seq
                    trainer.start()
            job = tc.wait("kill-me", timeout=60)
    finally:
        trainer.terminate()
    logs = "\n".join(p.read_text() for p in trainer.logs)

    assert killed_at_seq is not None, "the job finished before any checkpoint event"
    assert state_name(job.state) == "SUCCEEDED", (job.error, logs[-3000:])
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), "events lost or repeated across the restart"
    messages = [e.message for e in events]
    resumed = [m for m in messages if m.startswith("resumed from step")]
    assert len(resumed) == 1, messages
    step = int(resumed[0].rsplit(" ", 1)[1])
    assert step >= 50 and step % 50 == 0
    assert any(m.startswith("re-queued after a trainer restart") for m in messages)

    run = Path(job.run_dir)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumed_from_step"] == step and manifest["attempts"] == 2
    for art in manifest["artifacts"]:
        assert sha256_file(run / art["path"]) == art["sha256"]
    assert not [p for p in run.rglob("*") if p.name.startswith(".")], "temp files left in the run dir"
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(10, 301, 10))  # rewound at resume: no step logged twice

    straight = reference.wait("kill-me", 60)
    assert straight.state is JobState.SUCCEEDED
    w_resumed = torch.load(run / "weights.pt", weights_only=True)
    w_straight = torch.load(Path(straight.run_dir) / "weights.pt", weights_only=True)
    assert w_resumed.keys() == w_straight.keys()
    for k in w_straight:
        assert torch.allclose(w_resumed[k], w_straight[k], atol=1e-6), k
    assert job.metrics["final_loss"] == pytest.approx(straight.metrics["final_loss"], abs=1e-6)
