"""JobStore and JobManager in process: persistence, idempotency, validation, inputs, failure, cancel, resume."""

import json
import time
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from dataclasses import dataclass

import pytest
import torch

from prorag.config import cfg_field
from prorag.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from prorag.io import sha256_file
from services.trainer import stages
from services.trainer.jobs import Artifact, Job, JobManager, JobState, JobStore
from services.trainer.stages import register_stage, unregister_stage
from services.trainer.tracking import Tracker

REPO = Path(__file__).resolve().parents[3]
FAST = {"steps": 40, "checkpoint_every": 10, "log_every": 10, "tracking": "local"}


@pytest.fixture
def managers(tmp_path):
    made = []

    def make(root=None, **kw):
        m = JobManager(root or tmp_path / "jobs", tracking="local", **kw)
        m.start()
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop(10)


@dataclass
class NeedsPolicyConfig:
    policy: str = cfg_field("", help="manifest of an earlier run")
    note: str = cfg_field("", help="free text")


@pytest.fixture
def needs_policy_stage():
    seen = {}

    def fn(ctx):
        seen["inputs"] = dict(ctx.inputs)
        return {"ok": 1}

    register_stage("needs_policy", NeedsPolicyConfig, fn, inputs=["policy"], replace=True)
    yield seen
    unregister_stage("needs_policy")


# ---------------------------------------------------------------- store
def test_torn_last_event_line_is_ignored_and_seq_continues(tmp_path, managers):
    root = tmp_path / "jobs"
    m = JobManager(root, tracking="local")
    m.load()  # loaded but no worker: the job stays QUEUED
    m.submit("selftest", FAST, job_id="torn")
    events_file = root / "torn" / "events.jsonl"
    with open(events_file, "ab") as fh:
        fh.write(b'{"job_id": "torn", "seq": 2, "state": "RUN')  # a kill mid-append
    assert [e["seq"] for e in JobStore(root).read_events("torn")] == [1]
    m.stop()  # the killed trainer is gone: its lock on the root with it

    m2 = managers(root)  # the restarted trainer
    done = m2.wait("torn", 60)
    assert done.state is JobState.SUCCEEDED
    seqs = [e["seq"] for e in m2.events_after("torn")]
    assert seqs == list(range(1, len(seqs) + 1))
    lines = events_file.read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == seqs  # every line parses: the torn one was cut
    assert any("re-queued after a trainer restart" in e["message"] for e in m2.events_after("torn"))


# job.json files as trainers have written them (existing job directories must keep loading): a finished job, and a
# queued one (no outputs, stopped_cleanly or process_deaths yet); ROOT stands for the jobs root
FINISHED_JOB_JSON = """{
  "artifacts": [
    {
      "name": "weights",
      "path": "weights.pt",
      "sha256": "2458153817038fed607dbbabcefa93ebc5e868308b69c24fa4d1ec473c76680a"
    }
  ],
  "attempts": 1,
  "cancel_requested": false,
  "checkpoint_dir": "ROOT/done/checkpoints",
  "config": {
    "seed": 0,
    "steps": 20,
    "tracking": "local"
  },
  "config_json": "{\\"seed\\":0,\\"steps\\":20,\\"tracking\\":\\"local\\"}",
  "created_at": "2026-11-26T20:40:53.779Z",
  "error": "",
  "finished_at": "2026-11-26T20:41:00.231Z",
  "inputs": {},
  "job_id": "done",
  "last_seq": 6,
  "metrics": {
    "final_loss": 1.4008893966674805,
    "loss": 2.310152053833008,
    "tokens_per_s": 4401.022247333059
  },
  "outputs": {
    "model": "selftest@done"
  },
  "resumed_from_step": null,
  "run_dir": "ROOT/done/run",
  "stage": "selftest",
  "started_at": "2026-11-26T20:40:53.807Z",
  "state": "SUCCEEDED",
  "step": 20,
  "stopped_cleanly": false,
  "total_steps": 20,
  "traceback": "",
  "updated_at": "2026-11-26T20:41:00.236Z"
}
"""
QUEUED_JOB_JSON = """{
  "artifacts": [],
  "attempts": 0,
  "cancel_requested": false,
  "checkpoint_dir": "ROOT/waiting/checkpoints",
  "config": {
    "seed": 3,
    "steps": 20,
    "tracking": "local"
  },
  "config_json": "{\\"seed\\":3,\\"steps\\":20,\\"tracking\\":\\"local\\"}",
  "created_at": "2026-11-26T20:41:00.298Z",
  "error": "",
  "finished_at": "",
  "inputs": {},
  "job_id": "waiting",
  "last_seq": 1,
  "metrics": {},
  "resumed_from_step": null,
  "run_dir": "ROOT/waiting/run",
  "stage": "selftest",
  "started_at": "",
  "state": "QUEUED",
  "step": 0,
  "total_steps": 0,
  "traceback": "",
  "updated_at": "2026-11-26T20:41:00.298Z"
}
"""


def test_existing_job_json_files_load_into_typed_records_and_keep_their_keys_and_values(tmp_path, caplog):
    root = tmp_path / "jobs"
    texts = {"done": FINISHED_JOB_JSON, "waiting": QUEUED_JOB_JSON,
             "odd": QUEUED_JOB_JSON.replace('"QUEUED"', '"PAUSED"').replace("waiting", "odd")}
    for job_id, text in texts.items():
        (root / job_id).mkdir(parents=True)
        (root / job_id / "job.json").write_text(text.replace("ROOT", str(root)))
        (root / job_id / "events.jsonl").write_text(json.dumps({"job_id": job_id, "seq": 1, "state": "QUEUED",
                                                                "message": "queued"}) + "\n")
    store = JobStore(root)
    done = store.load("done")
    assert done.state is JobState.SUCCEEDED and done.step == 20 and done.last_seq == 6
    assert done.artifacts == [Artifact(name="weights", path="weights.pt", sha256=json.loads(FINISHED_JOB_JSON)[
        "artifacts"][0]["sha256"])]
    assert done.outputs == {"model": "selftest@done"} and done.resumed_from_step is None
    waiting = store.load("waiting")
    assert (waiting.outputs, waiting.stopped_cleanly, waiting.process_deaths) == ({}, False, 0)
    for job_id, job in (("done", done), ("waiting", waiting)):
        on_disk = json.loads((root / job_id / "job.json").read_text())
        store.save(job)
        # the same keys and values; a field the record did not have yet is written with its default
        assert json.loads((root / job_id / "job.json").read_text()) == {
            "outputs": {}, "stopped_cleanly": False, "process_deaths": 0, **on_disk}
    with pytest.raises(ValueError, match="'PAUSED' is not a valid JobState"):
        store.load("odd")
    with pytest.raises(ValueError, match="lacks stage, config"):
        Job.from_dict({"job_id": "x", "state": "QUEUED"})

    # a trainer starting on this root takes up the finished job as it is and queues the waiting one again
    m = JobManager(root, tracking="local")
    with caplog.at_level(logging.WARNING, logger="prorag.trainer.jobs"):
        m.load()
    try:
        assert "skipping job odd: unreadable job.json" in caplog.text
        assert [j.job_id for j in m.list()] == ["done", "waiting"]
        assert m.get("done").state is JobState.SUCCEEDED and m.get("done").metrics == done.metrics
        assert m.get("waiting").state is JobState.QUEUED and list(m._queue) == ["waiting"]
        assert m.events_after("waiting", 1)[0]["message"].startswith("re-queued after a trainer restart (was QUEUED)")
    finally:
        m.stop()


def test_job_layout_and_manifest(tmp_path, managers):
    m = managers()
    job = m.wait(m.submit("selftest", FAST, job_id="lay").job_id, 60)
    assert job.state is JobState.SUCCEEDED and job.step == 40 and job.total_steps == 40
    run = tmp_path / "jobs" / "lay" / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage"] == "selftest" and manifest["job_id"] == "lay"
    assert manifest["config"]["steps"] == 40 and manifest["code_version"]
    assert set(manifest["metrics"]) == {"final_loss", "train_loss", "weight_error"}
    assert manifest["started_at"] <= manifest["finished_at"]
    [art] = manifest["artifacts"]
    assert art["name"] == "weights" and sha256_file(run / art["path"]) == art["sha256"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30, 40] and all("loss" in r for r in rows)
    assert len(list((tmp_path / "jobs" / "lay" / "checkpoints").glob("step-*.pt"))) == 2  # keep last K
    assert not [p for p in run.rglob(".*") if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- submission
def test_start_is_idempotent_and_conflicting_id_is_refused(managers):
    m = managers()
    a = m.submit("selftest", dict(FAST), job_id="same")
    b = m.submit("selftest", json.dumps({**FAST, "seed": 0}), job_id="same")  # same config after defaults
    assert a.job_id == b.job_id == "same" and a.created_at == b.created_at
    assert len(m.list()) == 1
    with pytest.raises(AlreadyExists, match="different config"):
        m.submit("selftest", {**FAST, "seed": 1}, job_id="same")
    m.wait("same", 60)
    assert m.submit("selftest", FAST, job_id="same").state is JobState.SUCCEEDED  # still idempotent when done


@dataclass
class TalksToConfig:
    retriever: str = cfg_field("127.0.0.1:50051", help="a service the job calls")
    topk: int = cfg_field(1, help="what it computes")
    fail_while_missing: str = cfg_field("", help="fail while this file does not exist")
    hold_while_missing: str = cfg_field("", help="keep running until this file exists (up to 30 s)")
    gone: str = cfg_field("", help="an address whose service is gone: a run against it fails")


@dataclass
class TalksToConfigLater(TalksToConfig):
    note: str = cfg_field("", help="a field added after jobs were stored; its default keeps the old behaviour")


@pytest.fixture
def talks_to_stage():
    """A stage that records the retriever address it ran with: (fn, the addresses it ran with)."""
    ran = []

    def fn(ctx):
        deadline = time.monotonic() + 30
        while ctx.config.hold_while_missing and not Path(ctx.config.hold_while_missing).exists() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        if ctx.config.fail_while_missing and not Path(ctx.config.fail_while_missing).exists():
            raise RuntimeError("talks_to: the service was not there")
        if ctx.config.retriever == ctx.config.gone:
            raise RuntimeError(f"talks_to: nothing answers at {ctx.config.gone}")
        ran.append(ctx.config.retriever)
        return {"ok": 1}

    register_stage("talks_to", TalksToConfig, fn, replace=True)
    yield fn, ran
    unregister_stage("talks_to")


def test_a_job_submitted_again_with_its_services_elsewhere_runs_against_them(tmp_path, managers, talks_to_stage):
    """`prorag run --port-offset` moves every service: an unfinished job submitted again from such a run is the
    same job (its id leaves addresses out) and must run or resume against the new addresses, not be refused."""
    root = tmp_path / "jobs"
    m = JobManager(root, tracking="local")
    m.load()  # no worker: the job stays QUEUED, as a killed trainer leaves it
    m.submit("talks_to", {"retriever": "127.0.0.1:1001"}, job_id="moved")
    again = m.submit("talks_to", {"retriever": "127.0.0.1:2002"}, job_id="moved")
    assert again.config["retriever"] == "127.0.0.1:2002" and again.state is JobState.QUEUED
    with pytest.raises(AlreadyExists, match=r"different config \(topk\)"):  # other work is still refused
        m.submit("talks_to", {"retriever": "127.0.0.1:2002", "topk": 3}, job_id="moved")
    m.stop()
    # a field added to the stage's config since, submitted at its default, is the same work too
    fn, ran = talks_to_stage
    register_stage("talks_to", TalksToConfigLater, fn, replace=True)
    m2 = JobManager(root, tracking="local")
    m2.load()
    m2.submit("talks_to", {"retriever": "127.0.0.1:3003"}, job_id="moved")
    m2.start()
    assert m2.wait("moved", 60).state is JobState.SUCCEEDED and ran == ["127.0.0.1:3003"]
    assert "127.0.0.1:3003" in json.loads((root / "moved" / "job.json").read_text())["config_json"]
    with pytest.raises(AlreadyExists, match=r"different config \(note\)"):
        m2.submit("talks_to", {"retriever": "127.0.0.1:3003", "note": "other"}, job_id="moved")
    # finished: returned as it is, whatever the addresses now
    done = m2.submit("talks_to", {"retriever": "127.0.0.1:4004"}, job_id="moved")
    assert done.state is JobState.SUCCEEDED and done.config["retriever"] == "127.0.0.1:3003"
    m2.stop(10)


def test_a_failed_job_submitted_again_with_its_services_elsewhere_resumes_against_them(tmp_path, managers,
                                                                                       talks_to_stage):
    m = managers()
    fixed = tmp_path / "service-up"
    cfg = {"retriever": "127.0.0.1:1001", "fail_while_missing": str(fixed)}
    assert m.wait(m.submit("talks_to", cfg, job_id="down").job_id, 60).state is JobState.FAILED
    fixed.touch()
    m.submit("talks_to", {**cfg, "retriever": "127.0.0.1:2002"}, job_id="down")
    assert m.wait("down", 60).state is JobState.SUCCEEDED and talks_to_stage[1] == ["127.0.0.1:2002"]
    messages = [e["message"] for e in m.events_after("down")]
    assert any("other addresses" in msg and "retriever=127.0.0.1:2002" in msg for msg in messages), messages
    assert any(msg.startswith("re-queued by a new submission") for msg in messages), messages


def test_a_running_job_whose_services_moved_resumes_against_them_instead_of_failing(tmp_path, managers,
                                                                                  talks_to_stage):
    """A trainer restarted by a run on other ports resumes the old run's job against the old addresses; the new run
    submits it again with the new ones while it runs. When the old services fail it, it is re-queued with the new
    addresses and succeeds: whoever waits on it never sees it fail."""
    m = managers()
    release = tmp_path / "release"
    cfg = {"retriever": "127.0.0.1:1001", "gone": "127.0.0.1:1001", "hold_while_missing": str(release)}
    m.submit("talks_to", cfg, job_id="moving")
    while m.get("moving").state is not JobState.RUNNING:
        time.sleep(0.01)
    again = m.submit("talks_to", {**cfg, "retriever": "127.0.0.1:2002"}, job_id="moving")
    assert again.state is JobState.RUNNING and again.config["retriever"] == "127.0.0.1:1001"  # goes on as it was
    release.touch()
    job = m.wait("moving", 60)
    assert job.state is JobState.SUCCEEDED and talks_to_stage[1] == ["127.0.0.1:2002"]
    states = [e.get("state") for e in m.events_after("moving")]
    assert "FAILED" not in states, states
    messages = [e["message"] for e in m.events_after("moving")]
    assert any("failed against the services it started with" in msg and "retriever=127.0.0.1:2002" in msg
               for msg in messages), messages
    # a running job resubmitted elsewhere that finishes on its own addresses keeps them; nothing stays pending
    m.submit("talks_to", {"retriever": "127.0.0.1:3003", "hold_while_missing": str(tmp_path / "later")},
             job_id="stays")
    while m.get("stays").state is not JobState.RUNNING:
        time.sleep(0.01)
    m.submit("talks_to", {"retriever": "127.0.0.1:4004", "hold_while_missing": str(tmp_path / "later")},
             job_id="stays")
    (tmp_path / "later").touch()
    assert m.wait("stays", 60).config["retriever"] == "127.0.0.1:3003"
    deadline = time.monotonic() + 10
    while "stays" in m.running and time.monotonic() < deadline:  # its worker lets go just after the end is recorded
        time.sleep(0.01)
    assert "stays" not in m.running and "stays" not in m._readdress
    # a failure with no moved services is still a failure
    assert m.wait(m.submit("talks_to", {"retriever": "127.0.0.1:5005", "gone": "127.0.0.1:5005"},
                           job_id="down").job_id, 60).state is JobState.FAILED


def test_a_failed_or_cancelled_job_submitted_again_resumes_from_its_checkpoint(tmp_path, managers):
    m = managers()
    fixed = tmp_path / "cause-fixed"
    cfg = {**FAST, "fail_at_step": 25, "fail_while_missing": str(fixed)}
    failed = m.wait(m.submit("selftest", cfg, job_id="flaky").job_id, 60)
    assert failed.state is JobState.FAILED and "failing at step 25" in failed.error
    fixed.touch()
    again = m.submit("selftest", cfg, job_id="flaky")
    assert again.state in (JobState.QUEUED, JobState.RUNNING) and again.created_at == failed.created_at
    job = m.wait("flaky", 60)
    assert job.state is JobState.SUCCEEDED and job.error == "" and job.resumed_from_step == 20
    messages = [e["message"] for e in m.events_after("flaky")]
    assert any(msg.startswith("re-queued by a new submission of the same config "
                              "(was FAILED: RuntimeError: selftest: failing")
               for msg in messages), messages
    seqs = [e["seq"] for e in m.events_after("flaky")]
    assert seqs == list(range(1, len(seqs) + 1))
    # it ends where an uninterrupted run of the same training ends
    straight = m.wait(m.submit("selftest", FAST, job_id="straight").job_id, 60)
    assert job.metrics["final_loss"] == pytest.approx(straight.metrics["final_loss"], abs=1e-9)
    # a cancelled one too, also after a trainer restart (its events were not loaded at start-up)
    slow = {**FAST, "steps": 10_000, "step_sleep_s": 0.01}
    m.submit("selftest", slow, job_id="stopped")
    while m.get("stopped").step < 5:
        time.sleep(0.02)
    m.cancel("stopped")
    assert m.wait("stopped", 30).state is JobState.CANCELLED
    m.stop(10)
    m2 = managers(tmp_path / "jobs")
    assert m2.submit("selftest", slow, job_id="stopped").state in (JobState.QUEUED, JobState.RUNNING)
    assert any(e["message"].startswith("re-queued by a new submission of the same config (was CANCELLED")
               for e in m2.events_after("stopped"))
    m2.cancel("stopped")
    # and a finished one is still returned as it is
    assert m2.submit("selftest", FAST, job_id="straight").state is JobState.SUCCEEDED


@pytest.mark.parametrize("config, fragment", [
    ({"lr": 2.0}, "config.lr: must be <= 1.0"),
    ({"steps": 0}, "config.steps: must be >= 1"),
    ({"bogus": 1}, "config.bogus: unknown key"),
    ({"steps": "many"}, "config.steps: expected an integer"),
    ({"tracking": "tensorboard"}, "config.tracking: must be one of"),
    ("{not json", "config_json is not valid JSON"),
    ("[1, 2]", "config must be a JSON object"),
    # a lone surrogate (issue 51): escaped in config_json, or raw in an in-process caller's mapping; refused before
    # it is used as a path (os.stat cannot encode it)
    ('{"init_from": "\\ud800"}', "config_json: init_from holds a lone high surrogate U+D800"),
    ('{"steps": 3, "\\udc00": 1}', 'config_json: ["\\udc00"] (a key) holds a lone low surrogate'),
    ({"fail_while_missing": "x\udfff"}, "config: fail_while_missing holds a lone low surrogate U+DFFF at character 1"),
])
def test_bad_config_is_refused_naming_the_field(managers, config, fragment):
    m = managers()
    with pytest.raises(InvalidArgument) as ei:
        m.submit("selftest", config)
    assert fragment in str(ei.value)
    assert m.list() == []


def test_unknown_stage_lists_known_stages(managers):
    with pytest.raises(InvalidArgument, match="known stages: .*selftest"):
        managers().submit("nope", {})


def test_bad_job_id_is_refused(managers):
    with pytest.raises(InvalidArgument, match="job_id"):
        managers().submit("selftest", FAST, job_id="../escape")


def test_missing_or_incomplete_input_is_a_failed_precondition(tmp_path, managers, needs_policy_stage):
    m = managers()
    with pytest.raises(InvalidArgument, match="config.policy: input 'policy' is required"):
        m.submit("needs_policy", {})
    # (inside the data root, which includes the jobs root: a path outside it is refused before it is looked at)
    with pytest.raises(InvalidArgument, match="config.policy .* outside the data root"):
        m.submit("needs_policy", {"policy": str(tmp_path / "nowhere" / "manifest.json")})
    with pytest.raises(FailedPrecondition, match="input 'policy'.*not a complete run"):
        m.submit("needs_policy", {"policy": str(m.store.root / "nowhere" / "manifest.json")})
    half = m.store.root / "half-run"
    half.mkdir()
    (half / "weights.pt").write_bytes(b"x")  # outputs but no manifest: not complete
    with pytest.raises(FailedPrecondition, match="input 'policy'"):
        m.submit("needs_policy", {"policy": str(half)})
    with pytest.raises(FailedPrecondition, match="job 'ghost' is unknown"):
        m.submit("needs_policy", {"policy": "job:ghost"})
    assert m.list() == []

    # A complete run is accepted by path, run dir or job:<id>; its manifest digest is recorded.
    first = m.wait(m.submit("selftest", FAST, job_id="base").job_id, 60)
    manifest = f"{first.run_dir}/manifest.json"
    for i, ref in enumerate([manifest, first.run_dir, "job:base"]):
        job = m.wait(m.submit("needs_policy", {"policy": ref, "note": str(i)}).job_id, 30)
        assert job.state is JobState.SUCCEEDED, job.error
        recorded = json.loads(open(f"{job.run_dir}/manifest.json").read())["inputs"]["policy"]
        assert recorded == {"path": manifest, "sha256": sha256_file(manifest)}
    assert str(needs_policy_stage["inputs"]["policy"]) == manifest


def test_input_chain_uses_earlier_weights(managers):
    m = managers()
    m.wait(m.submit("selftest", FAST, job_id="a").job_id, 60)
    b = m.wait(m.submit("selftest", {**FAST, "init_from": "job:a", "steps": 10}).job_id, 60)
    assert b.state is JobState.SUCCEEDED, b.error


# ---------------------------------------------------------------- running
def test_failed_stage_records_error_and_traceback(managers, caplog):
    m = managers()
    with caplog.at_level(logging.ERROR, logger="prorag.trainer.jobs"):
        job = m.wait(m.submit("selftest", {**FAST, "fail_at_step": 15}).job_id, 60)
    assert job.state is JobState.FAILED
    assert "failing at step 15" in job.error and "Traceback" in job.traceback
    assert "failing at step 15" in caplog.text
    assert m.events_after(job.job_id)[-1]["state"] == "FAILED"
    assert not (m.store.run_dir(job.job_id) / "manifest.json").exists()


def test_cancel_running_queued_and_finished(managers):
    m = managers()
    slow = m.submit("selftest", {**FAST, "steps": 10_000, "step_sleep_s": 0.01}, job_id="slow")
    queued = m.submit("selftest", FAST, job_id="behind")
    deadline = threading.Event()
    while m.get("slow").step < 10 and not deadline.wait(0.05):
        pass
    assert m.cancel("behind").state is JobState.CANCELLED  # never ran
    assert m.cancel("slow").state in (JobState.RUNNING, JobState.CANCELLED)
    job = m.wait("slow", 30)
    assert job.state is JobState.CANCELLED and job.step < 10_000
    assert not (m.store.run_dir("slow") / "manifest.json").exists()
    with pytest.raises(FailedPrecondition, match="already CANCELLED"):
        m.cancel("slow")
    with pytest.raises(NotFound):
        m.cancel("missing")
    assert queued.state is JobState.QUEUED


def test_parallel_workers_run_jobs_side_by_side_in_fifo_order(managers):
    m = managers(parallel_jobs=2)
    slow = {**FAST, "steps": 10_000, "step_sleep_s": 0.01}
    for name in ("first", "second", "third"):
        m.submit("selftest", slow, job_id=name)
    wait = threading.Event()
    while not (m.get("first").step >= 5 and m.get("second").step >= 5) and not wait.wait(0.05):
        pass
    assert m.running == {"first", "second"}  # both progress at once; the third waits for a free worker
    assert m.get("third").state is JobState.QUEUED
    m.cancel("first")
    assert m.wait("first", 30).state is JobState.CANCELLED
    while m.get("third").state is JobState.QUEUED and not wait.wait(0.05):
        pass
    assert m.get("third").state is JobState.RUNNING and m.get("second").state is JobState.RUNNING
    for name in ("second", "third"):
        m.cancel(name)
        assert m.wait(name, 30).state is JobState.CANCELLED
    with pytest.raises(ValueError, match="parallel_jobs"):
        JobManager(m.store.root, parallel_jobs=0)


def test_list_filters_by_stage_and_get_unknown_is_not_found(managers, needs_policy_stage):
    m = managers()
    m.wait(m.submit("selftest", FAST, job_id="s1").job_id, 60)
    m.wait(m.submit("needs_policy", {"policy": "job:s1"}, job_id="n1").job_id, 60)
    assert [j.job_id for j in m.list()] == ["s1", "n1"]
    assert [j.job_id for j in m.list("needs_policy")] == ["n1"]
    assert m.list("rl") == []
    with pytest.raises(NotFound, match="'zzz' not found"):
        m.get("zzz")


def test_graceful_stop_and_restart_resumes_to_identical_weights(tmp_path, managers):
    cfg = {**FAST, "steps": 200, "checkpoint_every": 25, "step_sleep_s": 0.005}
    m1 = JobManager(tmp_path / "a", tracking="local")
    m1.start()
    m1.submit("selftest", cfg, job_id="r")
    while m1.get("r").step < 60:
        threading.Event().wait(0.05)
    m1.stop(30)  # the stage checkpoints at its next step; the job stays RUNNING on disk
    assert m1.get("r").state is JobState.RUNNING
    stopped_at = json.loads((tmp_path / "a" / "r" / "job.json").read_text())["step"]
    assert stopped_at < 200

    m2 = managers(tmp_path / "a")
    resumed = m2.wait("r", 60)
    assert resumed.state is JobState.SUCCEEDED and resumed.attempts == 2
    msgs = [e["message"] for e in m2.events_after("r")]
    assert any(msg.startswith("resumed from step") for msg in msgs)
    assert resumed.resumed_from_step >= 60

    ref = managers(tmp_path / "b")
    straight = ref.wait(ref.submit("selftest", cfg, job_id="r").job_id, 60)
    w1 = torch.load(tmp_path / "a" / "r" / "run" / "weights.pt", weights_only=True)
    w2 = torch.load(tmp_path / "b" / "r" / "run" / "weights.pt", weights_only=True)
    for k in w2:
        assert torch.allclose(w1[k], w2[k], atol=1e-6), k
    assert resumed.metrics["final_loss"] == pytest.approx(straight.metrics["final_loss"], abs=1e-6)
    # metrics.jsonl was rewound at resume: each step logged once
    steps = [json.loads(line)["step"] for line in open(tmp_path / "a" / "r" / "run" / "metrics.jsonl")]
    assert steps == sorted(set(steps))


def test_restart_recovers_a_job_killed_after_its_manifest(tmp_path, managers):
    m = managers(tmp_path / "jobs")
    job = m.wait(m.submit("selftest", FAST, job_id="late").job_id, 60)
    m.stop(5)
    # Rewind the record as if the kill came after manifest.json but before job.json said SUCCEEDED.
    path = tmp_path / "jobs" / "late" / "job.json"
    rec = json.loads(path.read_text())
    rec["state"] = "RUNNING"
    path.write_text(json.dumps(rec))
    again = managers(tmp_path / "jobs")
    assert again.get("late").state is JobState.SUCCEEDED
    assert again.get("late").metrics["final_loss"] == job.metrics["final_loss"]


# ---------------------------------------------------------------- one trainer per root, bounded retries
def test_a_second_trainer_on_the_same_jobs_root_is_refused_naming_the_root_and_the_holder(tmp_path, managers):
    root = tmp_path / "jobs"
    first = managers(root)
    second = JobManager(root, tracking="local")
    with pytest.raises(FailedPrecondition) as ei:
        second.start()
    msg = str(ei.value)
    assert str(root) in msg and f"pid {os.getpid()}" in msg and "one trainer per jobs root" in msg
    assert not second.loaded
    first.stop(10)  # the first one going away frees the root
    third = managers(root)
    assert third.loaded


def test_a_second_trainer_process_on_the_same_jobs_root_fails_to_start(tmp_path, managers):
    root = tmp_path / "jobs"
    managers(root)
    code = f"from services.trainer.jobs import JobManager; JobManager({str(root)!r}, tracking='local').load()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"jobs root {root} is in use by another trainer (pid {os.getpid()}" in proc.stderr


def _left_running(root: Path, job_id: str, stopped_cleanly: bool = False) -> None:
    """Rewrite the record as a trainer leaves it when its process dies (or stops cleanly) mid-job."""
    path = root / job_id / "job.json"
    rec = json.loads(path.read_text())
    rec.update(state="RUNNING", step=rec["step"] + 7, stopped_cleanly=stopped_cleanly)
    path.write_text(json.dumps(rec))


def test_a_job_whose_process_keeps_dying_fails_after_max_attempts(tmp_path):
    root = tmp_path / "jobs"
    m = JobManager(root, tracking="local")
    m.load()  # no workers: nothing runs, the restarts are simulated on the record
    m.submit("selftest", FAST, job_id="doomed")
    m.stop()
    _left_running(root, "doomed", stopped_cleanly=True)  # a clean shutdown: not a death
    for deaths in (0, 1, 2):
        m = JobManager(root, tracking="local", max_attempts=3)
        m.load()
        job = m.get("doomed")
        assert job.state is JobState.QUEUED and job.process_deaths == deaths
        m.stop()
        _left_running(root, "doomed")
    m = JobManager(root, tracking="local", max_attempts=3)
    m.load()
    job = m.get("doomed")
    m.stop()
    assert job.state is JobState.FAILED and job.process_deaths == 3
    assert job.error == (f"the job's process died 3 times while running (last at step {7 * 4}); not retried "
                            f"(max_attempts 3): see {root / 'doomed' / 'job.log'} and the trainer's log")
    assert json.loads((root / "doomed" / "job.json").read_text())["state"] == "FAILED"  # persisted
    messages = [e["message"] for e in m.events_after("doomed")]
    assert sum("its process died under it" in msg for msg in messages) == 2
    # and it stays failed: a later start neither re-queues nor counts it again
    again = JobManager(root, tracking="local", max_attempts=3)
    again.load()
    assert again.get("doomed").state is JobState.FAILED and not again._queue
    again.stop()


DIES = textwrap.dedent("""
    import os, sys, time
    from dataclasses import dataclass
    from prorag.config import cfg_field
    from services.trainer.jobs import JobManager
    from services.trainer.stages import register_stage

    @dataclass
    class Cfg:
        note: str = cfg_field("", help="unused")

    def dies(ctx):
        ctx.emit(step=5, total_steps=10)
        ctx.log.warning("about to die")
        os._exit(9)  # what an out-of-memory kill or a segfault looks like to the trainer: no clean-up

    register_stage("dies", Cfg, dies)
    m = JobManager(sys.argv[1], tracking="local", max_attempts=2)
    m.start()
    if sys.argv[2] == "submit":
        m.submit("dies", {}, job_id="crasher")
    time.sleep(60)
    sys.exit("the stage did not kill the process")
""")


def test_a_stage_that_kills_its_process_is_retried_then_failed(tmp_path):
    root = tmp_path / "jobs"
    for arg in ("submit", "restart"):
        proc = subprocess.run([sys.executable, "-c", DIES, str(root), arg], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 9, proc.stderr[-2000:]
    m = JobManager(root, tracking="local", max_attempts=2)
    m.load()
    job = m.get("crasher")
    m.stop()
    assert job.state is JobState.FAILED and job.attempts == 2
    assert "the job's process died 2 times while running (last at step 5)" in job.error
    assert (root / "crasher" / "job.log").read_text().count("about to die") == 2


class RunsCode:
    def __reduce__(self):
        return os.system, ("true",)


def test_a_planted_checkpoint_that_would_run_code_fails_the_job_with_a_clear_error(tmp_path, managers):
    root = tmp_path / "jobs"
    m = JobManager(root, tracking="local")
    m.load()  # no workers yet
    m.submit("selftest", FAST, job_id="planted")
    ck = root / "planted" / "checkpoints"
    ck.mkdir()
    torch.save({"step": 10, "model": {}, "evil": RunsCode()}, ck / "step-000000010.pt")
    m.stop()
    job = managers(root).wait("planted", 60)
    assert job.state is JobState.FAILED
    assert "UnsafeFile: refusing to load" in job.error and "step-000000010.pt" in job.error


# ---------------------------------------------------------------- tracking
def test_tracking_falls_back_to_local_when_wandb_init_fails(tmp_path, monkeypatch, caplog):
    import wandb

    def boom(**_):
        raise RuntimeError("no wandb here")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(wandb, "init", boom)
    with caplog.at_level(logging.WARNING, logger="prorag.trainer.tracking"):
        t = Tracker(tmp_path, "job-1", "selftest", {"a": 1}, mode="wandb")
    assert not t.wandb_active and "wandb.init failed" in caplog.text
    t.log(1, {"loss": 0.5, "note": "not a number"})
    t.log(2, {"loss": 0.25})
    t.rewind(1)
    t.log(2, {"loss": 0.2})
    t.finish()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.2}]


def test_wandb_mode_defaults(monkeypatch):
    from services.trainer.tracking import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_register_stage_checks_inputs_are_config_fields():
    with pytest.raises(TypeError, match="input 'model'"):
        register_stage("bad_inputs", NeedsPolicyConfig, lambda ctx: {}, inputs=["model"])
    assert "bad_inputs" not in stages.known_stages()


def test_job_with_wandb_offline_tracking(tmp_path, managers, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    m = managers()
    job = m.wait(m.submit("selftest", {**FAST, "tracking": "wandb"}, job_id="wb").job_id, 60)
    assert job.state is JobState.SUCCEEDED, job.error
    run = tmp_path / "jobs" / "wb" / "run"
    assert list((run / "wandb").glob("offline-run-*")), "wandb wrote its offline run into the run dir"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


@dataclass
class CallsServicesConfig:
    retriever: str = cfg_field("127.0.0.1:50051", help="retriever service")
    judge: str = cfg_field("", help="judge service ('' = none)")


def test_service_addresses_fill_what_a_job_config_leaves_unset(managers):
    register_stage("calls_services", CallsServicesConfig, lambda ctx: {"ok": 1}, replace=True)
    try:
        m = managers(service_addresses={"retriever": "retriever:50051", "judge": "judge:50054",
                                        "policy": "policy:50052"})
        job = m.submit("calls_services", {})
        assert job.config == {"retriever": "retriever:50051", "judge": "judge:50054"}  # no field 'policy' here
        job = m.submit("calls_services", {"judge": ""})
        assert job.config == {"retriever": "retriever:50051", "judge": ""}  # what the job sets wins
        with pytest.raises(InvalidArgument, match="allowed_endpoints"):  # the filled-in value is checked like any
            managers(root=m.store.root.parent / "other", service_addresses={"retriever": "evil.example:1"}).submit(
                "calls_services", None)
    finally:
        unregister_stage("calls_services")


def start_running(m, job_id: str, config: dict) -> None:
    """Submit ``job_id`` and return once a worker runs it."""
    m.submit("selftest", config, job_id=job_id)
    deadline = time.monotonic() + 30
    while m.get(job_id).state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_queue_and_a_config_have_bounds(managers):
    from prorag.errors import ResourceExhausted

    m = managers(parallel_jobs=1, max_queued_jobs=2)
    slow = {**FAST, "steps": 100_000, "step_sleep_s": 0.01}
    start_running(m, "running", slow)
    m.submit("selftest", slow, job_id="q1")
    m.submit("selftest", slow, job_id="q2")
    with pytest.raises(ResourceExhausted, match="max_queued_jobs 2"):
        m.submit("selftest", slow, job_id="q3")
    assert m.submit("selftest", slow, job_id="q1").job_id == "q1"  # an idempotent resubmission still answers
    m.cancel("q2")
    m.submit("selftest", slow, job_id="q3")  # room again
    for j in ("running", "q1", "q3"):
        m.cancel(j)
    with pytest.raises(InvalidArgument, match="config_json has"):
        m.submit("selftest", json.dumps({"note": "x" * (1 << 20)}))


def test_a_job_that_must_wait_names_the_jobs_ahead_of_it(managers):
    """A run whose job sat "queued" behind an earlier run's unfinished job, resumed by this trainer, said nothing
    of why; the first event now names what it waits behind."""
    m = managers(parallel_jobs=1)
    slow = {**FAST, "steps": 100_000, "step_sleep_s": 0.01}
    start_running(m, "running", slow)
    m.submit("selftest", slow, job_id="waits")
    m.submit("selftest", slow, job_id="last")
    assert m.events_after("waits")[0]["message"] == ("queued behind running (selftest, running): the trainer runs "
                                                     "1 job(s) at a time")
    assert m.events_after("last")[0]["message"].startswith("queued behind running (selftest, running), waits "
                                                           "(selftest, queued):")
    for j in ("running", "waits", "last"):
        m.cancel(j)
    for j in ("running", "waits", "last"):  # the worker may start one of the queued ones before its cancel lands
        m.wait(j, 30)
    m.submit("selftest", FAST, job_id="alone")
    assert m.events_after("alone")[0]["message"] == "queued"  # a free worker: nothing to name
    m.wait("alone", 30)
