"""prorag_app.stage2's job runner against a real trainer on port 0: a job submitted again after it failed is
followed to its real end, not to the failure replayed from its history."""

import pytest

from prorag.rpc.clients_trainer import TrainerClient
from prorag.rpc.service import ServeConfig
from prorag_app.trainer_jobs import follow_job, run_job
from services.trainer.server import TrainerConfig, start
from tests.helpers import LoopThread

FAST = {"steps": 40, "checkpoint_every": 10, "log_every": 5, "tracking": "local"}


class _Stack:
    def __init__(self, target: str):
        self.target = target

    def grpc_target(self, name: str) -> str:
        assert name == "trainer"
        return self.target


@pytest.fixture
def trainer(tmp_path):
    loop = LoopThread()
    started = loop.run(start(ServeConfig(port=0, grace_s=1),
                             TrainerConfig(jobs_root=str(tmp_path / "jobs"), tracking="local")))
    yield _Stack(f"127.0.0.1:{started.grpc_port}")
    loop.run(started.stop())
    loop.close()


def test_run_job_follows_a_failed_job_submitted_again_to_its_end(trainer, tmp_path):
    fixed = tmp_path / "cause-fixed"
    cfg = {**FAST, "fail_at_step": 25, "fail_while_missing": str(fixed)}
    with pytest.raises(SystemExit, match="selftest job flaky ended FAILED: .*failing at step 25"):
        run_job(trainer, "selftest", cfg, "flaky")
    fixed.touch()
    # the watch replays the FAILED event of the first attempt before the resumed run's events
    done = run_job(trainer, "selftest", cfg, "flaky")
    assert done["job_id"] == "flaky" and done["metrics"]["final_loss"] > 0
    with TrainerClient(trainer.target, timeout=10) as client:
        job = client.get("flaky")
        assert job.step == 40 and job.error == ""
        assert any(ev.message.startswith("re-queued by a new submission") for ev in client.watch("flaky"))


def test_follow_job_shows_progress_and_returns_the_running_time(trainer):
    seen = []
    with TrainerClient(trainer.target, timeout=10) as client:
        client.start("selftest", FAST, job_id="plain")
        seconds = follow_job(client, "plain", "selftest", lambda label, step, total: seen.append((label, step, total)))
        assert client.get("plain").step == 40
        # a finished job: nothing runs while it is followed again
        assert follow_job(client, "plain", "again", lambda *a: None) >= 0.0
    assert seconds > 0.0
    assert seen[-1] == ("selftest", 40, 40) and [s for _, s, _ in seen] == sorted(s for _, s, _ in seen)
