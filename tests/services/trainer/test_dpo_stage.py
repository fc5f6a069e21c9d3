"""The `dpo` stage (ReasonRAG's baseline): DPO with LoRA on value-labelled sibling steps raises the chosen step's
log-probability over the rejected one's relative to the reference, trains only the step's own tokens, publishes
an adapter (what it refuses: test_pairs_stages)."""

import torch

from prorag.registry import registry
from prorag.training.context import local_context
from services.trainer.stage_dpo import DPOConfig, encode_preference, preference_logps, run_dpo
from tests.helpers import founder_pairs
from tests.services.trainer.test_pairs_stages import pairs_job, run_logging_bfloat16

def _pairs(n, seed=0):
    """The chosen subanswer reads the founder from the document, the rejected one guesses (value-labelled only:
    ReasonRAG has no judge)."""
    return founder_pairs(n, seed, judge=False)


def _job(tmp_path, model_dir, n_pairs: int, **fields) -> DPOConfig:
    """A DPO job on ``n_pairs`` value-labelled pairs, a rank-4 adapter over the tiny policy at ``model_dir``."""
    return pairs_job(DPOConfig, tmp_path, _pairs(n_pairs), base_model=str(model_dir), lr=1e-2, lora_r=4,
                     lora_alpha=8, **fields)


def test_a_preference_is_trls_example_of_the_shared_context_and_each_siblings_generated_tokens(tiny_policy):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from prorag.data.sft import agent_prompt, encode_segments

    _, tok = tiny_policy
    pair = _pairs(1)[0]
    example = encode_preference(tok, pair, pair.value_choice)
    for key, step in (("chosen_ids", pair.steps[pair.value_choice]),
                      ("rejected_ids", pair.steps[1 - pair.value_choice])):
        assert tok.decode(example[key], skip_special_tokens=False).strip() == step.text  # the step, no glue
        # the prompt is the token prefix the policy read before the step, documents and glue included
        whole = encode_segments(tok, agent_prompt(pair.question), [*pair.context, step], {}, {}).token_ids
        assert list(whole[:len(example["prompt_ids"]) + len(example[key])]) == example["prompt_ids"] + example[key]
    assert tok.decode(example["prompt_ids"]).count("Mai Brewery was founded by") == 1  # the context's document
    # TRL's collator marks exactly the siblings' tokens as the completion DPO sums over
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([example])
    assert batch["completion_mask"].sum(-1).tolist() == [len(example["chosen_ids"]), len(example["rejected_ids"])]


def test_dpo_stage_prefers_the_chosen_step_and_publishes_an_adapter(tiny_policy, tmp_path, monkeypatch):
    from peft import PeftModel
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from prorag.modeling import load_policy

    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, tok = tiny_policy
    cfg = _job(tmp_path, model_dir, 48, epochs=4, warmup_ratio=0.0)
    out = run_dpo(local_context(tmp_path / "work", cfg))
    assert out["train_pairs"] == 48 and out["steps"] == 24 and out["too_long"] == 0
    assert out["final_loss"] < 0.5  # from ln 2 = 0.69 where the adapter starts as the reference
    adapter_dir = registry("adapter", "tiny").resolve(out["adapter"])
    base, _ = load_policy(model_dir, device="cpu", dtype="float32")
    tuned = PeftModel.from_pretrained(load_policy(model_dir, device="cpu", dtype="float32")[0], str(adapter_dir))
    base.eval()
    tuned.eval()
    fresh = _pairs(16, seed=99)  # names in new pairings: the preference generalises, not memorised pairs
    examples = [encode_preference(tok, p, p.value_choice) for p in fresh]
    collator = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        margins = []
        for m in (base, tuned):
            c, r = preference_logps(m, collator, examples)
            margins.append(c - r)
    implicit_reward = margins[1] - margins[0]  # DPO's reward of chosen over rejected, per pair
    assert float((implicit_reward > 0).float().mean()) >= 0.75


def test_dpo_stage_trains_float32_adapters_over_a_bfloat16_base_on_the_cpu(tiny_policy, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("PRORAG_DATA", str(tmp_path / "data"))
    model_dir, _ = tiny_policy
    cfg = _job(tmp_path, model_dir, 16, epochs=1, dtype="bfloat16", log_every=1)
    out = run_logging_bfloat16(run_dpo, cfg, tmp_path / "work")
    assert out["steps"] == 2 and 0 < out["final_loss"] < float("inf")
    adapter = load_file(str(registry("adapter", "tiny").resolve(out["adapter"]) / "adapter_model.safetensors"))
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}
