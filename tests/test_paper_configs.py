"""configs/paper: every job config is a valid config of its trainer stage with the paper's numbers, and the
accelerate FSDP2 file loads as an accelerate config. (Nothing here runs at that scale: no GPU.)"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "paper"
STAGE_OF = {"sft": "sft", "mcts": "mcts", "prm": "prm", "rft": "rft", "rl": "rl", "rl_outcome_only": "rl",
            "dpo": "dpo"}


@pytest.mark.parametrize("name", sorted(STAGE_OF))
def test_each_paper_config_is_a_valid_stage_config(name, tmp_path):
    from services.trainer.stages import get_stage, load_stage_modules, validate_config

    load_stage_modules()
    raw = json.loads((PAPER / f"{name}.json").read_text())
    if name == "sft":  # the GPU host's model directory does not exist here: checked against a stand-in directory
        assert raw["base_model"].endswith("Qwen3-8B")
        raw["base_model"] = str(tmp_path)
    cfg = validate_config(get_stage(STAGE_OF[name]), raw)
    assert getattr(cfg, "world") == "hotpotqa-musique"


def test_the_rl_configs_are_the_papers_and_differ_only_in_what_makes_the_baseline():
    from prorag.config import from_dict
    from prorag.training.lora import ALL_PROJECTIONS
    from services.trainer.stage_rl import RLConfig

    prorag = from_dict(RLConfig, json.loads((PAPER / "rl.json").read_text()))
    outcome = from_dict(RLConfig, json.loads((PAPER / "rl_outcome_only.json").read_text()))
    assert (prorag.lora_r, prorag.lora_alpha, prorag.lr, prorag.group_size, prorag.beta, prorag.clip,
            prorag.kl_coef, prorag.temperature, prorag.max_steps, prorag.lora_targets) == \
        (16, 32, 1e-5, 8, 0.3, 0.2, 0.0, 1.0, 11, ALL_PROJECTIONS)
    assert prorag.reward == "reference" and prorag.max_questions == 10000 and prorag.iterations == 0  # 1 epoch
    a, b = json.loads((PAPER / "rl.json").read_text()), json.loads((PAPER / "rl_outcome_only.json").read_text())
    assert {k for k in a if a[k] != b.get(k)} == {"base_model", "prm", "beta", "adapter_name"}
    assert outcome.beta == 0.0 and outcome.prm == ""


def test_the_accelerate_file_is_an_fsdp2_config():
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "configs" / "accelerate" / "fsdp2.yaml"))
    assert str(cfg.distributed_type).endswith("FSDP") and cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3DecoderLayer"
