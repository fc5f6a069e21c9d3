"""The active-adapter record a restarting replica restores from: one per base model, so replicas of another
model sharing the adapter root (a world's: SFT-based and RFT-based adapters side by side) never restore an
adapter trained on a base they do not serve."""

import asyncio

import pytest

from prorag.errors import FailedPrecondition
from prorag.registry import ArtifactRef
from services.policy.manager import AdapterManager, active_file, read_active, record_active


def test_each_base_model_restores_only_its_own_active_adapter(tmp_path):
    sft, rft = "a" * 64, "b" * 64
    record_active(tmp_path, ArtifactRef("outcome_grpo", "j1-3"), sft)
    assert read_active(tmp_path, sft) == ArtifactRef("outcome_grpo", "j1-3")
    assert read_active(tmp_path, rft) is None  # a replica of the RFT model starts on its base model
    record_active(tmp_path, ArtifactRef("prorag", "j2-3"), rft)
    assert read_active(tmp_path, rft) == ArtifactRef("prorag", "j2-3")
    assert read_active(tmp_path, sft) == ArtifactRef("outcome_grpo", "j1-3")
    record_active(tmp_path, None, sft)  # back to the base model
    assert read_active(tmp_path, sft) is None and read_active(tmp_path, rft) == ArtifactRef("prorag", "j2-3")
    assert active_file(tmp_path, sft) != active_file(tmp_path, rft)


def test_the_manager_records_each_activation(tmp_path):
    sha = "a" * 64
    record_active(tmp_path, ArtifactRef("pol", "v1"), sha)
    manager = AdapterManager(engine=None, root=tmp_path, base_model="m", base_model_sha256=sha)
    asyncio.run(manager.activate(None))
    assert manager.active is None and read_active(tmp_path, sha) is None


def test_a_recorded_adapter_that_cannot_be_loaded_fails_the_start_with_the_reason(tmp_path):
    sha = "a" * 64
    record_active(tmp_path, ArtifactRef("pol", "gone"), sha)
    manager = AdapterManager(engine=None, root=tmp_path, base_model="m", base_model_sha256=sha)
    with pytest.raises(FailedPrecondition, match=r"says pol@gone is the active adapter, but it cannot be loaded: "
                                                 r".*not found.*restore_active=false"):
        asyncio.run(manager.restore_active())
    assert manager.active is None
    assert read_active(tmp_path, sha) == ArtifactRef("pol", "gone")  # restoring never rewrites the record
