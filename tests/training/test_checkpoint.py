"""Checkpoints: RNG round trip, keep-last-K, and atomicity when a write is interrupted."""

import os
import random
import threading

import numpy as np
import pytest
import torch

from prorag.training import checkpoint
from prorag.training.context import JobContext


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    _draws()
    checkpoint.save(tmp_path, {"x": torch.arange(3)}, step=7)
    expected = _draws()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # scramble
    state, path = checkpoint.load_latest(tmp_path)
    assert path.name == "step-000000007.pt" and state["step"] == 7
    assert torch.equal(state["x"], torch.arange(3))
    checkpoint.restore_rng(state["rng"])
    assert _draws() == expected


def test_keeps_only_the_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, {"w": torch.full((2,), float(step))}, step=step, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [30, 40]
    state, _ = checkpoint.load_latest(tmp_path)
    assert state["step"] == 40 and state["w"][0].item() == 40.0


def test_crash_between_tmp_write_and_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, {"w": torch.ones(4)}, step=10)
    before = (tmp_path / "step-000000010.pt").read_bytes()
    real_replace = os.replace

    def crash(src, dst):  # the process "dies" after the temp file is complete, before the rename
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"w": torch.zeros(4)}, step=20)
    monkeypatch.setattr(os, "replace", real_replace)

    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [10]
    assert (tmp_path / "step-000000010.pt").read_bytes() == before
    state, _ = checkpoint.load_latest(tmp_path)
    assert state["step"] == 10 and torch.equal(state["w"], torch.ones(4))


def test_a_killed_writers_temp_file_is_never_loaded_and_is_cleaned(tmp_path):
    checkpoint.save(tmp_path, {"w": torch.ones(2)}, step=10)
    # What SIGKILL mid-write leaves: a truncated temp file (no finally clause ran).
    (tmp_path / ".step-000000020.pt.abc123.tmp").write_bytes(b"PK\x03\x04 truncated")
    state, path = checkpoint.load_latest(tmp_path)
    assert state["step"] == 10
    assert checkpoint.cleanup_temp(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010.pt"]


def test_unreadable_latest_falls_back_to_previous(tmp_path):
    checkpoint.save(tmp_path, {"w": torch.ones(2)}, step=10)
    checkpoint.save(tmp_path, {"w": torch.ones(2)}, step=20)
    (tmp_path / "step-000000020.pt").write_bytes(b"garbage")  # e.g. bit rot under the real name
    state, path = checkpoint.load_latest(tmp_path)
    assert state["step"] == 10


def test_job_context_checkpoint_round_trip_emits_resume_event(tmp_path):
    events = []

    def ctx():
        return JobContext(job_id="j", stage="s", config=None, run_dir=tmp_path / "run", checkpoint_dir=tmp_path / "ck",
                          inputs={}, emit_fn=events.append, artifact_fn=lambda a: None,
                          cancel_event=threading.Event(), stop_event=threading.Event(), keep_checkpoints=1)

    first = ctx()
    assert first.load_checkpoint() is None
    torch.manual_seed(5)
    first.save_checkpoint({"step": 30, "model": {"w": torch.ones(1)}})
    expected = torch.rand(2)
    second = ctx()
    state = second.load_checkpoint()
    assert state["step"] == 30 and second.resumed_from_step == 30
    assert torch.equal(torch.rand(2), expected)  # RNG restored by load_checkpoint
    assert [e["message"] for e in events] == ["checkpoint saved at step 30", "resumed from step 30"]
    with pytest.raises(ValueError, match="step"):
        second.save_checkpoint({"model": {}})


class RunsCode:
    """A pickled object whose loading runs a shell command (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_with_a_clear_error_and_not_skipped(tmp_path):
    marker, ck = tmp_path / "ran", tmp_path / "ck"
    checkpoint.save(ck, {"w": torch.ones(2)}, step=10)
    bad = ck / "step-000000020.pt"  # e.g. written by someone else on a shared volume
    torch.save({"step": 20, "model": {"w": torch.ones(2)}, "extra": RunsCode(marker)}, bad)
    with pytest.raises(checkpoint.UnsafeFile) as ei:
        checkpoint.load(bad)
    msg = str(ei.value)
    assert str(bad) in msg and "posix.system" in msg and "not plain data" in msg
    assert "weights_only=False" not in msg  # torch's own message advises exactly that
    # resuming from the older checkpoint instead would hide a tampered job store
    with pytest.raises(checkpoint.UnsafeFile):
        checkpoint.load_latest(ck)
    assert not marker.exists()


def test_a_launchs_checkpoint_directories_are_listed_only_when_complete_and_temp_ones_are_cleaned(tmp_path):
    complete, incomplete = tmp_path / "step-000000004", tmp_path / "step-000000006"
    complete.mkdir()
    torch.save({"step": 4}, complete / checkpoint.LOOP_STATE)
    incomplete.mkdir()  # a directory without the loop's state, written last, is not a checkpoint
    (tmp_path / ".step-000000008.x1.tmp").mkdir()  # what a killed launch leaves
    assert checkpoint.list_launch_checkpoints(tmp_path) == [(4, complete)]
    assert checkpoint.cleanup_temp(tmp_path) == 1 and not (tmp_path / ".step-000000008.x1.tmp").exists()


def test_one_process_and_a_launch_refuse_each_others_checkpoints_instead_of_starting_over(tmp_path):
    from prorag.errors import FailedPrecondition

    launch = tmp_path / "launch"
    (launch / "step-000000004").mkdir(parents=True)
    torch.save({"step": 4}, launch / "step-000000004" / checkpoint.LOOP_STATE)
    with pytest.raises(FailedPrecondition, match="launch on several processes"):
        checkpoint.load_latest(launch)
    single = tmp_path / "single"
    checkpoint.save(single, {"x": torch.zeros(1)}, step=3)
    # the choice is the main process's (here the only one): refused before anything is loaded
    with pytest.raises(FailedPrecondition, match="single-process run"):
        checkpoint.load_latest_launch(single, None)
