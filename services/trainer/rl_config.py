"""The RL stage's settings (services.trainer.stage_rl): what one GRPO job samples, scores and trains, field by
field. Apart from the stage so that its steps (rl_collect, rl_publish, rl_update) read the settings without
importing the stage that runs them."""

from __future__ import annotations

from dataclasses import dataclass

from prorag.algorithms.rl import ADVANTAGE_ESTIMATORS, OUTCOME_REWARDS, POLICY_LOSSES, PRM_CENTERINGS, STEP_SCORES
from prorag.config import ConfigError, cfg_field
from prorag.data.world.config import RL_SPLITS, TEST_SPLITS
from prorag.training.lora import ALL_PROJECTIONS
from prorag.training.run_config import TrainRunConfig
from services.trainer.sampling import rollout_index_field, rollout_topk_field, step_tokens_field


@dataclass
class RLConfig(TrainRunConfig):
    """GRPO with outcome and PRM step rewards on LoRA adapters, sampled through the policy service."""

    world: str = cfg_field("default", help="embedded world whose questions are sampled; adapters are published "
                                           "into its adapter registry (the policy's default adapter root)")
    split: str = cfg_field("train", help="split whose questions are sampled (never the test split)")
    max_questions: int = cfg_field(0, help="questions used, the split's first ones (0 = all)", min=0)
    min_hops: int = cfg_field(0, help="only questions of at least this many hops (0 = all; before max_questions)",
                              min=0, max=16)
    base_model: str = cfg_field("", help="required: the model the adapters train on (a directory or name@version "
                                         "in the world's registry); the policy service must serve this model")
    policy: str = cfg_field("127.0.0.1:50052", help="policy service (every replica of the target gets each "
                                                    "adapter version)")
    retriever_index: str = rollout_index_field()
    topk: int = rollout_topk_field(" (ProRAG: 3)")
    prm: str = cfg_field("127.0.0.1:50053", help="PRM service that scores the steps ('' = outcome-only GRPO); "
                                                 "not used with step_scorer=oracle")
    step_scorer: str = cfg_field("prm", help="what scores each step for the process advantage: prm = the PRM "
                                             "service's logit; oracle = the reference judge's verdict on the gold "
                                             "decomposition (prorag.search.judging.judge_step, as a +/-ORACLE_LOGIT "
                                             "logit): a diagnostic ceiling, no PRM service needed",
                                 choices=("prm", "oracle"))
    question_pool: str = cfg_field("", help="a question pool artifact (trainer stage rlpool's pool.json): only its "
                                            "learnable questions are drawn, before min_hops and max_questions "
                                            "('' = the whole split)")
    pool_max_solve_rate: float = cfg_field(1.0, help="of question_pool's learnable questions, only those the pool's "
                                                     "agent answered right in at most this fraction of its samples "
                                                     "(1 = all of them): a question it mostly solves already "
                                                     "has a greedy answer that is likely right, so RL there mostly "
                                                     "sharpens what greedy decoding already picks",
                                           min=0.0, max=1.0)
    pool_max_greedy_f1: float = cfg_field(1.0, help="of question_pool's learnable questions, only those whose greedy "
                                                    "answer (the pool's greedy rollout: rlpool greedy=true) scored at "
                                                    "most this F1 (1 = all of them): where greedy decoding already "
                                                    "answers in full, RL can only sharpen the samples toward it",
                                          min=0.0, max=1.0)
    balance_hops: bool = cfg_field(False, help="draw as many questions of each hop count per iteration (a count "
                                                "with fewer questions revisited more often): RL otherwise moves the "
                                                "agent's planned hop count toward the pool's most common one")
    iterations: int = cfg_field(0, help="RL iterations (one rollout batch and one update each); 0 = one pass "
                                        "over the questions (ProRAG: 1 epoch)", min=0)
    questions_per_iteration: int = cfg_field(16, help="questions rolled out per iteration", min=1, max=4096)
    group_size: int = cfg_field(8, help="trajectories per question, the GRPO group (ProRAG: 8)", min=2, max=64)
    temperature: float = cfg_field(1.0, help="sampling temperature (ProRAG: 1.0); log-probs, the policy's and the "
                                             "trainer's alike, are the raw ones at temperature 1 unless "
                                             "tempered_logprobs",
                                   min=0.01, max=5.0)
    max_step_tokens: int = step_tokens_field()
    max_steps: int = cfg_field(11, help="steps of a trajectory at most (ProRAG: 11 for RL)", min=1, max=64)
    questions_per_request: int = cfg_field(32, help="questions in one Rollout request", min=1, max=4096)
    reward: str = cfg_field("reference", help="outcome reward (prorag.algorithms.rl.OUTCOME_REWARDS): reference = "
                                              "(2 F1 if F1 >= 0.2) +/- 1 format; paper = F1 + 1 valid format; f1 = "
                                              "the answer's F1 alone (no format term)",
                            choices=tuple(OUTCOME_REWARDS))
    beta: float = cfg_field(0.3, help="weight of the process advantage (ProRAG: 0.3; 0 = outcome only)",
                            min=0.0, max=10.0)
    normalization: str = cfg_field("token", help="process-advantage statistics over every generated token of a "
                                                 "group (token, the reference) or over its steps (step)",
                                   choices=("token", "step"))
    prm_centering: str = cfg_field("none", help="PRM logits as they come (none, the reference) or centred per step "
                                                "kind within each group before they become step scores (per_kind: "
                                                "each kind's mean, weighted as normalization weighs steps, is "
                                                "subtracted; a Bradley-Terry PRM leaves each kind at its own "
                                                "offset, which would push a low-offset kind down in every group; "
                                                "algorithms.rl.reference_step_scores)", choices=PRM_CENTERINGS)
    step_score: str = cfg_field("reference", help="a step's score from its PRM logit (prorag.algorithms.rl."
                                                  "STEP_SCORES): reference = sigmoid(logit) + 1 for a valid step / "
                                                  "- 2 for an invalid one (format shaping); verdict = sigmoid(logit) "
                                                  "alone, so that with reward=f1 the process arms differ from "
                                                  "outcome GRPO in the step verdicts only",
                                choices=tuple(STEP_SCORES))
    process_answer_step: bool = cfg_field(True, help="the final answer step takes part in the process term (the "
                                                     "reference); off: it neither moves the group's step statistics "
                                                     "nor gets a process advantage, since its verdict repeats the "
                                                     "outcome the outcome term already rewards")
    process_std_floor: float = cfg_field(0.0, help="least spread the process advantage divides a group's step "
                                                   "scores by (sigma := max(sigma, floor); 0 = the reference), so a "
                                                   "group whose steps all score alike keeps tiny differences tiny",
                                         min=0.0, max=100.0)
    clip: float = cfg_field(0.2, help="PPO ratio clip (ProRAG: 0.2)", min=0.0, max=10.0)
    kl_coef: float = cfg_field(0.0, help="k3 KL penalty to the base model, the adapter disabled (ProRAG: 0)",
                               min=0.0, max=10.0)
    recompute_old_logprobs: bool = cfg_field(False, help="take the old policy's log-probs from the local model "
                                                         "before the update instead of the policy service's "
                                                         "sampling log-probs (when the engine's numerics differ)")
    tempered_logprobs: bool = cfg_field(False, help="the ratio, the gradient and the KL read the log-probs of the "
                                                    "distribution sampled from (logits / temperature), as TRL and "
                                                    "verl do; the policy service returns them so (a vLLM policy "
                                                    "needs vllm_logprobs=tempered). Off: raw log-probs whatever "
                                                    "the temperature")
    max_policy_lag: int = cfg_field(0, help="oldest adapter a kept trajectory may come from, in iterations behind "
                                            "the one being trained (0 = strictly on-policy)", min=0, max=100)
    rollout_adapter: str = cfg_field("active", help="active = each replica samples with its active adapter (a "
                                                    "replica the push missed serves an older one, which "
                                                    "max_policy_lag bounds); pinned = requests name the current "
                                                    "version (a replica without it fails the rollout)",
                                     choices=("active", "pinned"))
    adapter_name: str = cfg_field("rl", help="adapters are published as adapter_name@<job id>-<iteration>")
    lora_r: int = cfg_field(16, help="LoRA rank (ProRAG: 16)", min=1, max=1024)
    lora_alpha: int = cfg_field(32, help="LoRA alpha (ProRAG: 32)", min=1, max=4096)
    lora_dropout: float = cfg_field(0.0, help="LoRA dropout (0 keeps the recomputed log-probs of an unchanged "
                                              "model equal to the sampling ones)", min=0.0, max=0.9)
    lora_targets: str = cfg_field(ALL_PROJECTIONS, help="comma-separated module names LoRA adapts (default: every "
                                                        "attention and MLP projection)")
    lr: float = cfg_field(1e-5, help="learning rate (constant; ProRAG: 1e-5)", min=0.0, max=1.0)
    warmup_ratio: float = cfg_field(0.0, help="fraction of the optimizer steps with a linear learning-rate ramp, "
                                              "constant after (ProRAG: none)", min=0.0, max=0.5)
    chunk_tokens: int = cfg_field(16384, help="most padded tokens in one forward pass of the update: a micro-batch's "
                                              "trajectories, sorted by length, go through in chunks of at most this "
                                              "many (the gradient is the same; less padding; 0 = one pass)", min=0)
    grad_accum: int = cfg_field(1, help="micro-batches each optimizer step's trajectories are split into", min=1,
                                max=4096)
    mini_batches: int = cfg_field(1, help="optimizer steps per iteration, each on a 1/m share of its trajectories "
                                          "(verl's PPO mini-batches): the same rollouts buy m steps; the later "
                                          "steps are off-policy, which the clipped ratio bounds", min=1, max=64)
    max_len: int = cfg_field(4096, help="longest trajectory in tokens; longer ones are dropped", min=16)
    seed: int = cfg_field(0, help="question order, sampling seeds and LoRA init", min=0, max=2 ** 31 - 1)
    checkpoint_every: int = cfg_field(10, help="iterations between checkpoints", min=1)
    log_every: int = cfg_field(1, help="iterations between the loop's progress events", min=1)
    push_timeout_s: float = cfg_field(120.0, help="deadline of loading an adapter on one replica", min=1.0)
    service_wait_s: float = cfg_field(300.0, help="how long a push, rollout or PRM call waits, in all, for a "
                                                  "policy or PRM service that went away (UNAVAILABLE) to come back "
                                                  "before the job fails (UNAVAILABLE, naming the service and its "
                                                  "address); the interrupted call is made again whole with the "
                                                  "same seed, so no trajectory is lost, changed or counted twice",
                                      min=0.0)
    advantage: str = cfg_field("grpo", help="per-step advantage estimator of each question's group "
                                            "(prorag.algorithms.rl.ADVANTAGE_ESTIMATORS): grpo = ProRAG's "
                                            "dual-granularity GRPO, the group-normalised outcome plus beta x the "
                                            "normalised step score; dr_grpo = the outcome centred in its group "
                                            "but not divided by the group's spread (Dr. GRPO), the same process "
                                            "term", choices=tuple(ADVANTAGE_ESTIMATORS))
    policy_loss: str = cfg_field("clipped", help="token-level policy loss of the update (prorag.algorithms.rl."
                                                 "POLICY_LOSSES): clipped = the PPO/GRPO clipped surrogate, token "
                                                 "mean, plus the k3 KL when kl_coef > 0", choices=tuple(POLICY_LOSSES))

    def validate(self) -> None:
        super().validate()
        if not self.base_model:
            raise ConfigError("base_model", "required: the model the adapters train on")
        if self.split in TEST_SPLITS:
            raise ConfigError("split", f"RL never trains on {self.split!r}: the final figures are read on it "
                                       f"(train on 'train' or one of {list(RL_SPLITS)})")
        if not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ConfigError("lora_targets", "name at least one module")

    def logprob_temperature(self) -> float:
        """The temperature the update's log-probs are read at: the sampling one with tempered_logprobs, else 1."""
        return self.temperature if self.tempered_logprobs else 1.0

