"""Stage 4: process-supervised RL (ProRAG's dual-granularity GRPO) on LoRA adapters.

Each iteration runs these steps in order (run_rl); its optimizer steps are those of the house training loop
(prorag.training.loop.TrainingLoop), so checkpoints, resume, stop and progress events are the loop's:

1. publish and push: the current LoRA adapter (version ``<job id>-<iteration>``) is saved, published into the
   world's adapter registry (the policy's adapter root) and pushed to every policy replica, which load and
   activate it (the last update's weights are published the same way when the job ends);
2. collect rollouts (:func:`roll_out`): a batch of train questions is rolled out G times each through the policy
   service (live retrieval); every trajectory names the adapter version that produced it, and one older than
   ``max_policy_lag`` iterations (or from another adapter) is dropped;
3. score steps (:func:`score_steps`): the PRM service's logits for every step of the iteration, in one call; or,
   with step_scorer=oracle (:func:`oracle_scores`), the reference judge's verdict on the gold decomposition as a
   logit (a diagnostic ceiling: what a PRM that is always right would give);
4. advantages (:func:`advantages`): outcome reward per trajectory (OUTCOME_REWARDS on token F1 and format), and
   per step A = group_normalized(R) + beta * process advantage (algorithms.rl.group_step_advantages; the step
   score chosen by step_score, the PRM logits optionally centred per step kind, the group's sigma floored and
   the answer step optionally left out: prm_centering, process_std_floor, process_answer_step),
   broadcast to the step's generated tokens only;
5. update: ``mini_batches`` optimizer steps of the clipped surrogate (prorag.training.lora.rl_loss) with the
   sampling log-probs the policy service returned as the old policy, recomputed log-probs from the local LoRA
   model, and an optional k3 KL to the base (the same model with the adapter disabled); then the iteration's
   journal row.

Steps 1-4 talk to the services: on a launch of several processes the main process alone does them and hands the
data to the others (prorag.training.distributed.from_main), which all take part in step 5.

beta = 0 or prm = '' is outcome-only GRPO (the Search-R1-style baseline) through the same code. One update per
rollout batch (GRPO's mu = 1, as ProRAG's TRL setup): the ratio departs from 1 only by the lag between the
sampling and the training weights, which is what the clip bounds.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prorag import paths
from prorag.algorithms.rl import OUTCOME_REWARDS, PRM_CENTERINGS, STEP_SCORES, credit_counts
from prorag.rpc.clients import call_with_service_wait, push_adapter  # (call_with_service_wait: imported from here too)
from prorag.config import cfg_field
from prorag.errors import FailedPrecondition, Unavailable
from prorag.training.context import JobContext
from prorag.training.lora import (ALL_PROJECTIONS, RLSample, build_lora, collate_rl, length_chunks,
                                  publish_adapter, rl_loss, token_logprobs)
from prorag.training.run_config import TrainRunConfig
from services.trainer.stages import register_stage, resolve_model

#: bumped when what the PRM is asked to score changes (2, 3: empty and blank steps left out), so a caller that names jobs by
#: their settings (the pipeline) does not reuse a job that ran, or failed, under the old behaviour
PRM_SCORING_VERSION = 3


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
    retriever_index: str = cfg_field("", help="retriever index the policy's rollouts search ('' = its default)")
    topk: int = cfg_field(1, help="documents per subquery, as the policy was trained (ProRAG: 3)", min=1, max=20)
    prm: str = cfg_field("127.0.0.1:50053", help="PRM service that scores the steps ('' = outcome-only GRPO); "
                                                 "not used with step_scorer=oracle")
    step_scorer: str = cfg_field("prm", help="what scores each step for the process advantage: prm = the PRM "
                                             "service's logit; oracle = the reference judge's verdict on the gold "
                                             "decomposition (prorag.search.judging.judge_step, as a +/-ORACLE_LOGIT logit): "
                                             "a diagnostic ceiling, no PRM service needed",
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
    iterations: int = cfg_field(0, help="RL iterations (one rollout batch and one update each); 0 = one pass "
                                        "over the questions (ProRAG: 1 epoch)", min=0)
    questions_per_iteration: int = cfg_field(16, help="questions rolled out per iteration", min=1, max=4096)
    group_size: int = cfg_field(8, help="trajectories per question, the GRPO group (ProRAG: 8)", min=2, max=64)
    temperature: float = cfg_field(1.0, help="sampling temperature (ProRAG: 1.0); log-probs, the policy's and the "
                                             "recomputed ones alike, are the raw ones at temperature 1",
                                   min=0.01, max=5.0)
    max_step_tokens: int = cfg_field(128, help="most tokens of one generated step", min=8, max=4096)
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

    def validate(self) -> None:
        from prorag.config import ConfigError

        super().validate()
        if not self.base_model:
            raise ConfigError("base_model", "required: the model the adapters train on")
        if self.split == "test":
            raise ConfigError("split", "RL never trains on the test split's questions")
        if not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ConfigError("lora_targets", "name at least one module")


# ---------------------------------------------------------------- adapter versions
def adapter_version(job_id: str, iteration: int) -> str:
    return f"{job_id}-{iteration}"


def policy_lag(version_key: str, name: str, job_id: str, iteration: int) -> int | None:
    """How many iterations behind ``iteration`` the adapter ``version_key`` (name@version, as a trajectory
    reports it) is; None when it is not one of this job's versions (the base model, another adapter)."""
    n, _, version = version_key.partition("@")
    # a resumed attempt that had to republish a version adds ".r<k>" (versions are immutable)
    m = re.fullmatch(re.escape(job_id) + r"-(\d+)(?:\.r\d+)?", version) if n == name else None
    return iteration - int(m.group(1)) if m else None


# ---------------------------------------------------------------- rollouts -> a batch
@dataclass
class IterationData:
    samples: list[RLSample] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def collect(cfg: RLConfig, questions, iteration: int, job_id: str, version_key: str, policy, prm) -> IterationData:
    """An iteration's data, on the main process: :func:`roll_out` ``questions`` G times each (stale trajectories
    dropped), :func:`score_steps` with the PRM (or :func:`oracle_scores`), then :func:`advantages`.

    version_key: the adapter version being trained (pinned requests name it). One PRM call for the whole
    iteration, every step of every kept trajectory in it."""
    from prorag.rpc.pbconv import step_from_pb

    stats = {"questions": len(questions), "sampled": 0, "kept": 0, "dropped_stale": 0, "dropped_foreign": 0,
             "dropped_too_long": 0, "prm_scored": 0, "service_retries": 0}
    kept, lags = roll_out(cfg, questions, iteration, job_id, version_key, policy, stats)
    steps = [[step_from_pb(s) for s in t.steps] for t in kept]
    if cfg.step_scorer == "oracle":
        logits = oracle_scores(cfg, questions, kept, steps, stats)
    else:
        logits = score_steps(cfg, kept, steps, prm, stats)
    return advantages(cfg, questions, iteration, kept, lags, steps, logits, stats)


def all_unavailable(acks) -> bool:
    """No replica answered the push at all (each ack UNAVAILABLE: the policy died, or restarts)."""
    return bool(acks) and all(a.error.startswith("UNAVAILABLE") for a in acks)


def push_with_service_wait(cfg: RLConfig, name: str, version: str) -> list:
    """push_adapter to the policy's replicas; when none took it because none answered (every ack UNAVAILABLE: the
    policy died or restarts), wait for the policy's health (service_wait_s in all) and push again."""
    from prorag.rpc.clients import wait_for_health

    deadline = time.monotonic() + cfg.service_wait_s
    while True:
        acks = push_adapter(cfg.policy, name, version, timeout=cfg.push_timeout_s)
        left = deadline - time.monotonic()
        if not acks or any(a.ok for a in acks) or not all_unavailable(acks) or left <= 0:
            return acks
        if not wait_for_health(cfg.policy, "", timeout=left):
            return acks


def roll_out(cfg: RLConfig, questions, iteration: int, job_id: str, version_key: str, policy,
             stats: dict) -> tuple[list, list[int]]:
    """Step 1: ``questions`` [Q] rolled out G times each through the policy service, in requests of
    questions_per_request; returns the kept trajectories (pb) [N] and their policy lags [N], counting what was
    sampled and dropped (foreign, stale, too long) into ``stats``."""
    kept, lags = [], []
    t0 = time.monotonic()
    for start in range(0, len(questions), cfg.questions_per_request):
        chunk = questions[start:start + cfg.questions_per_request]
        sampling = policy.sampling(n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_step_tokens,
                                   seed=(cfg.seed * 7919 + iteration * 100_003 + start + 1) % (2 ** 31 - 1) or 1)

        def rollout_chunk(chunk=chunk, sampling=sampling):
            return list(policy.rollout([(q.id, q.question) for q in chunk], sampling, max_steps=cfg.max_steps,
                                       topk=cfg.topk, retriever_index=cfg.retriever_index,
                                       adapter=version_key if cfg.rollout_adapter == "pinned" else ""))

        def push_again():
            # a replica that restarted without restoring the version (restore_active off) gets it again; one
            # that refuses it fails the job here rather than sample with another adapter (all dropped as foreign)
            name, _, version = version_key.partition("@")
            acks = push_adapter(cfg.policy, name, version, timeout=cfg.push_timeout_s)
            if not any(a.ok for a in acks) and not all_unavailable(acks):
                raise FailedPrecondition(f"the policy at {cfg.policy} came back but took adapter {version_key} no "
                                         "more: " + "; ".join(f"{a.replica}: {a.error}" for a in acks))

        for t in call_with_service_wait(rollout_chunk, cfg.policy, "policy", cfg.service_wait_s, stats,
                                        after_back=push_again):
            if not hasattr(t, "question_id"):
                continue  # the summary
            stats["sampled"] += 1
            lag = policy_lag(t.adapter_version, cfg.adapter_name, job_id, iteration)
            if lag is None or lag < 0:  # the base, another adapter, or a killed attempt's later version
                stats["dropped_foreign"] += 1
                continue
            if lag > cfg.max_policy_lag:
                stats["dropped_stale"] += 1
                continue
            if len(t.trace.token_ids) > cfg.max_len:
                stats["dropped_too_long"] += 1
                continue
            kept.append(t)
            lags.append(lag)
    stats["rollout_s"] = time.monotonic() - t0
    return kept, lags


def score_steps(cfg: RLConfig, kept: list, steps: list[list], prm, stats: dict) -> list[list[float]] | None:
    """Step 2: the PRM's logit of every step, [N][steps of trajectory i], in one call; None for outcome-only GRPO
    (beta = 0 or no PRM)."""
    if not (cfg.prm and cfg.beta > 0 and prm is not None):
        stats["prm_s"] = 0.0
        return None
    logits: list[list[float]] = [[] for _ in kept]
    t1 = time.monotonic()
    if kept:
        # a sampled step can be empty or blank (Step.empty): nothing for the PRM to read,
        # so it is left out of the scored trajectory and gets a neutral logit; the step score's invalid-step term
        # (step_score_reference) is what marks it
        scored = [[j for j, st in enumerate(ss) if not st.empty] for ss in steps]
        asked = [i for i, idx in enumerate(scored) if idx]  # a trajectory of empty steps only asks nothing
        partial = []
        if asked:
            stats["prm_version"], partial = call_with_service_wait(
                lambda: prm.score([(kept[i].question, [steps[i][j] for j in scored[i]], False) for i in asked]),
                cfg.prm, "PRM", cfg.service_wait_s, stats)
        logits = [[0.0] * len(ss) for ss in steps]
        for i, got in zip(asked, partial):
            for j, x in zip(scored[i], got):
                logits[i][j] = x
        stats["empty_steps"] = sum(len(ss) - len(idx) for ss, idx in zip(steps, scored))
        stats["prm_scored"] = len(asked)
    stats["prm_s"] = time.monotonic() - t1
    return logits


#: the logit an oracle verdict stands for: sigmoid(+/-10) is 1 or 0 to 5 decimals, so through step_score_reference a
#: sound valid step scores 2, an unsound valid one 1 and an invalid one -2: a PRM that is always sure and right
ORACLE_LOGIT = 10.0
#: bumped when what the oracle scores changes (its logit, the judge's rules), as PRM_SCORING_VERSION is for the PRM
ORACLE_SCORING_VERSION = 1


def oracle_step_logits(question, steps: list) -> list[float]:
    """The reference judge's verdict on each step of one trajectory, as a PRM-like logit.

    question: a Question with its gold decomposition; steps [S] (prorag.trajectory.Step, with the documents each
    subquery retrieved). Returns [S]: +ORACLE_LOGIT where prorag.search.judging.judge_step finds step k, taken after steps
    [:k], sound (right entity for the open hop, a sub-answer stated by the last search's documents, no repeated
    search, a right final answer), -ORACLE_LOGIT otherwise. Pure: no service, no model."""
    from prorag.search.judging import judge_step

    return [ORACLE_LOGIT if judge_step(question, steps[:k], st).sound else -ORACLE_LOGIT
            for k, st in enumerate(steps)]


def oracle_scores(cfg: RLConfig, questions, kept: list, steps: list[list], stats: dict) -> list[list[float]] | None:
    """Step 2 with step_scorer=oracle: :func:`oracle_step_logits` of every kept trajectory, [N][steps of trajectory
    i], in place of the PRM's logits (the rest of the process term is unchanged); None when beta = 0."""
    if cfg.beta <= 0:
        stats["prm_s"] = 0.0
        return None
    t1 = time.monotonic()
    by_id = {q.id: q for q in questions}
    logits = [oracle_step_logits(by_id[t.question_id], ss) for t, ss in zip(kept, steps)]
    flat = [x for ls in logits for x in ls]
    stats["prm_version"] = "oracle"
    stats["oracle_scored"] = len(kept)
    stats["oracle_sound_rate"] = _mean([float(x > 0) for x in flat])
    stats["prm_s"] = time.monotonic() - t1  # the scoring step's time, under the key rl_summary reads
    return logits


def advantages(cfg: RLConfig, questions, iteration: int, kept: list, lags: list[int], steps: list[list],
               logits: list[list[float]] | None, stats: dict) -> IterationData:
    """Step 3: outcome rewards [N], per-step advantages within each question's group (outcome, plus beta x the
    process advantage when ``logits`` are given), broadcast to each trajectory's generated tokens [T_i]; the
    iteration's samples and statistics."""
    from prorag.algorithms.rl import group_step_advantages, reference_step_scores, token_advantages
    from prorag.metrics import f1_score
    from prorag.rpc.pbconv import token_trace_from_pb

    reward_fn = OUTCOME_REWARDS[cfg.reward]
    by_id = {q.id: q for q in questions}
    use_prm = logits is not None
    if logits is None:
        logits = [[] for _ in kept]
    t2 = time.monotonic()
    f1s, valid, rewards = [], [], []
    for t in kept:
        f1 = f1_score(t.answer, by_id[t.question_id].golden_answers) if t.finish_reason == "answer" else 0.0
        f1s.append(f1)
        valid.append(bool(t.format_valid))
        rewards.append(reward_fn(f1, bool(t.format_valid)))

    groups: dict[str, list[int]] = {}
    for i, t in enumerate(kept):
        groups.setdefault(t.question_id, []).append(i)
    traces = [token_trace_from_pb(t.trace, t.prompt_length) for t in kept]
    step_adv: list[list[float]] = [[] for _ in kept]
    for members in groups.values():
        tokens = [[s.generated_end - s.start for s in traces[i].spans] for i in members]
        scores, scored = None, None
        if use_prm:
            for i in members:
                if len(logits[i]) != len(steps[i]) or len(steps[i]) != len(traces[i].spans):
                    raise FailedPrecondition(f"trajectory {kept[i].question_id}#{kept[i].sample_index}: "
                                             f"{len(steps[i])} steps, {len(traces[i].spans)} token spans and "
                                             f"{len(logits[i])} PRM scores do not line up")
            kinds = [[s.kind for s in steps[i]] for i in members]
            scores = reference_step_scores([logits[i] for i in members], kinds, tokens, cfg.prm_centering,
                                           cfg.normalization, cfg.step_score)
            if not cfg.process_answer_step:
                scored = [[k != "answer" for k in ks] for ks in kinds]
        for i, a in zip(members, group_step_advantages([rewards[i] for i in members], scores, tokens, cfg.beta,
                                                       cfg.normalization, std_floor=cfg.process_std_floor,
                                                       scored=scored)):
            step_adv[i] = a

    for i, a in enumerate(step_adv):
        if not all(math.isfinite(x) for x in a):
            # a PRM that returns NaN (or a reward that overflows) would train on garbage: stop with the culprit
            raise FailedPrecondition(
                f"iteration {iteration}: trajectory {kept[i].question_id}#{kept[i].sample_index} has non-finite "
                f"advantages {a} (reward {rewards[i]}, PRM scores {logits[i]}, PRM {stats.get('prm_version', '-')});"
                " no update was made and the last published adapter stays active")
    stats["reward_s"] = time.monotonic() - t2  # outcome rewards, PRM step scores into advantages
    samples = []
    for i, (t, tr) in enumerate(zip(kept, traces)):
        adv, mask = token_advantages(step_adv[i], tr.spans, len(tr.token_ids))
        samples.append(RLSample(tr.token_ids, tr.generated_mask, adv.tolist(), mask.tolist(), list(tr.logprobs),
                                t.question_id, rewards[i], lags[i]))
    stats["kept"] = len(samples)
    stats["groups"] = len(groups)
    # groups whose rollouts all scored alike teach nothing through the outcome term
    stats["groups_flat"] = sum(1 for m in groups.values() if len({rewards[i] for i in m}) <= 1)
    stats.update(credit_counts(groups, f1s, {q: by_id[q].hops for q in groups}))
    stats["reward_mean"] = _mean(rewards)
    stats["f1_mean"] = _mean(f1s)
    stats["format_valid_rate"] = _mean([float(v) for v in valid])
    stats["answered_rate"] = _mean([float(t.finish_reason == "answer") for t in kept])
    stats["lag_mean"] = _mean([float(x) for x in lags])
    stats["lag_max"] = float(max(lags, default=0))
    token_adv = [a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    stats["adv_mean"] = _mean(token_adv)
    stats["adv_std"] = statistics.pstdev(token_adv) if token_adv else 0.0
    stats["adv_abs_max"] = max((abs(a) for a in token_adv), default=0.0)
    stats["trained_tokens"] = len(token_adv)
    return IterationData(samples, stats)


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# ---------------------------------------------------------------- the stage
def select_questions(questions: list, min_hops: int = 0, max_questions: int = 0) -> list:
    """The RL questions: those of at least ``min_hops`` hops (0 = all), then the first ``max_questions`` (0 = all),
    in the split's order."""
    picked = [q for q in questions if q.hops >= min_hops]
    return picked[:max_questions] if max_questions else picked


def pool_questions(questions: list, pool_ids) -> list:
    """The questions [Q] whose id is in ``pool_ids``, in the split's order (so the seeded draw over them is the
    same for every method that reads the same pool)."""
    wanted = set(pool_ids)
    return [q for q in questions if q.id in wanted]


def read_question_pool(path: str | Path, world: str, split: str, max_solve_rate: float = 1.0) -> list[str]:
    """The learnable question ids of a pool artifact (services.trainer.stage_rlpool) whose solve rate (the
    fraction of the pool agent's samples that were right) is at most ``max_solve_rate``; FailedPrecondition when
    the artifact is missing, or was built on another world or split than the RL job samples."""
    p = Path(path)
    if not p.is_file():
        raise FailedPrecondition(f"question_pool {str(path)!r} does not exist (run the rlpool stage first)")
    pool = json.loads(p.read_text())
    if (pool.get("world"), pool.get("split")) != (world, split):
        raise FailedPrecondition(f"question_pool {str(path)!r} was built on world {pool.get('world')!r}, split "
                                 f"{pool.get('split')!r}; this job samples world {world!r}, split {split!r}")
    rates = pool.get("questions", {})
    if max_solve_rate < 1.0 and not rates:
        raise FailedPrecondition(f"question_pool {str(path)!r} records no solve rates, so pool_max_solve_rate "
                                 f"{max_solve_rate} cannot select from it (rebuild it with the rlpool stage)")
    if max_solve_rate >= 1.0:
        return list(pool["pool"])
    unrated = [q for q in pool["pool"] if "solve_rate" not in rates.get(q, {})]
    if unrated:
        raise FailedPrecondition(f"question_pool {str(path)!r} records no solve rate for {len(unrated)} of its "
                                 f"questions (e.g. {unrated[0]!r}), so pool_max_solve_rate cannot select from it "
                                 "(rebuild it with the rlpool stage)")
    return [q for q in pool["pool"] if rates[q]["solve_rate"] <= max_solve_rate + 1e-9]


def run_rl(ctx: JobContext) -> dict:
    import torch

    from prorag.rpc.clients import PolicyClient, PRMClient
    from prorag.data.loaders import load_split
    from prorag.modeling import load_for_training
    from prorag.registry import ArtifactRef, registry, weights_sha256
    from prorag.training.distributed import from_main, full_state_dict, sum_over_processes
    from prorag.training.loop import TrainingLoop, call_in_engine

    cfg: RLConfig = ctx.config
    cfg.apply_threads()
    placement = cfg.placement()
    base = Path(resolve_model(cfg.world, cfg.base_model, "base_model"))
    base_sha = weights_sha256(base)
    qs = load_split(paths.world_dir(cfg.world), cfg.split)
    if cfg.question_pool:
        qs = pool_questions(qs, read_question_pool(cfg.question_pool, cfg.world, cfg.split, cfg.pool_max_solve_rate))
    qs = select_questions(qs, cfg.min_hops, cfg.max_questions)
    if not qs:
        raise FailedPrecondition(f"world {cfg.world!r} has no {cfg.split} questions"
                                 + (f" of {cfg.min_hops}+ hops" if cfg.min_hops else "")
                                 + (f" in question_pool {cfg.question_pool!r}" if cfg.question_pool else "")
                                 + (f" solved at most {cfg.pool_max_solve_rate:.0%} of the time"
                                    if cfg.question_pool and cfg.pool_max_solve_rate < 1 else ""))
    if cfg.step_scorer == "oracle" and cfg.beta > 0:
        lacking = [q.id for q in qs if not q.decomposition]
        if lacking:  # the oracle judges against the gold hops: without them every step would read as unsound
            raise FailedPrecondition(f"step_scorer=oracle needs each question's gold decomposition; {len(lacking)} "
                                     f"of the {cfg.split} questions have none (e.g. {lacking[0]!r})")
    per_epoch = math.ceil(len(qs) / cfg.questions_per_iteration)
    total = cfg.iterations or per_epoch
    ctx.seed_everything(cfg.seed)
    # the base is frozen under the adapter: stored in the compute dtype, the LoRA weights in float32
    model, tokenizer = load_for_training(base, placement, frozen=True, gradient_checkpointing=cfg.gradient_checkpointing)
    model = build_lora(model, cfg)
    k, m_steps = cfg.grad_accum, cfg.mini_batches
    # On a launch of several processes every process trains on each iteration's rollouts, but only the main one
    # talks to the services (publishes, pushes, rolls out, asks the PRM) and keeps the journal; the others get
    # the iteration's data from it (from_main) before its first step.
    acc = ctx.accelerator
    journal = ctx.checkpoint_dir / "rl-iterations.jsonl"
    policy = PolicyClient(cfg.policy, timeout=3600) if ctx.is_main else None
    prm = (PRMClient(cfg.prm, timeout=600) if cfg.step_scorer == "prm" and cfg.prm and cfg.beta > 0 and ctx.is_main
           else None)

    def questions_at(iteration: int):
        # the order is a function of (seed, epoch) only, so a resumed job rolls out the same questions
        epoch, j = divmod(iteration, per_epoch)
        order = torch.randperm(len(qs), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
        return [qs[int(x)] for x in order[j * cfg.questions_per_iteration:(j + 1) * cfg.questions_per_iteration]]

    def publish_and_push(iteration: int) -> tuple[str, dict]:
        """Publish the adapter as it is now (``iteration`` updates done) and make every replica serve it. Every
        process of a launch calls it (the weights are gathered from all); the main one publishes and pushes."""
        t0 = time.monotonic()
        weights = full_state_dict(acc, model)
        return from_main(acc, lambda: publish_on_main(iteration, weights, t0))

    def publish_on_main(iteration: int, weights, t0: float) -> tuple[str, dict]:
        version = publish_adapter(model, cfg.world, cfg.adapter_name, adapter_version(ctx.job_id, iteration),
                                  base=base, base_sha=base_sha, scratch=ctx.checkpoint_dir / "adapter-scratch",
                                  config={"stage": "rl", "job_id": ctx.job_id, "iteration": iteration,
                                          **ctx.config_dict}, step=iteration, state_dict=weights)
        acks = push_with_service_wait(cfg, cfg.adapter_name, version)
        ok = [a for a in acks if a.ok]
        if not ok and all_unavailable(acks):
            raise Unavailable(f"the policy service at {cfg.policy} went away and did not come back within "
                              f"service_wait_s={cfg.service_wait_s:g}s to take adapter {cfg.adapter_name}@{version} "
                              "(" + "; ".join(f"{a.replica}: {a.error}" for a in acks) + "); the job can be "
                              "resumed from its last checkpoint once it is up")
        if not ok:
            raise FailedPrecondition(f"no policy replica at {cfg.policy} took adapter {cfg.adapter_name}@{version}: "
                                     + "; ".join(f"{a.replica}: {a.error}" for a in acks))
        unloaded = _unload_old(cfg, ctx.job_id, iteration, [a.replica for a in ok])
        ctx.emit(iteration, total, message=f"pushed {cfg.adapter_name}@{version} to {len(ok)}/{len(acks)} "
                                           f"replica(s)" + "".join(f"; {a.replica} failed: {a.error}"
                                                                    for a in acks if not a.ok))
        return version, {"push_s": time.monotonic() - t0, "push_acks": float(len(acks)),
                         "push_acked": float(len(ok)), "unloaded_versions": float(unloaded),
                         "acks": [{"replica": a.replica, "ok": a.ok, "error": a.error,
                                   "latency_s": round(a.latency_s, 4)} for a in acks]}

    def iteration_data(iteration: int) -> tuple[str, dict, IterationData]:
        """Publish and push the weights as they are, then collect the iteration's data with them (rollouts, PRM
        scores, advantages: the main process, handed to the others). With several mini-batches a stop can land
        inside an iteration, after the weights that sampled it have changed: its data is kept with the
        checkpoints, so the resumed job trains on the same trajectories rather than new ones."""
        saved = ctx.checkpoint_dir / f"rl-iteration-{iteration}.pt"

        def kept_data():
            if m_steps > 1 and saved.exists():
                from prorag.training.checkpoint import load_weights_file

                return load_weights_file(saved)
            return None

        blob = from_main(acc, kept_data)
        if blob is not None:
            return blob["version"], blob["push"], IterationData([RLSample(**d) for d in blob["samples"]],
                                                                blob["stats"])
        version, push = publish_and_push(iteration)
        data = from_main(acc, lambda: collect(cfg, questions_at(iteration), iteration, ctx.job_id,
                                              f"{cfg.adapter_name}@{version}", policy, prm))
        if cfg.recompute_old_logprobs and data.samples:
            # every process of a launch computes them all (under FSDP each forward is a collective)
            model.eval()
            with torch.no_grad(), placement.autocast():
                for s_ in data.samples:
                    b = collate_rl([s_], tokenizer.pad_token_id)
                    s_.old_logprobs = call_in_engine(model, lambda m, b=b: token_logprobs(m, b[0], b[1], b[3]))[0]\
                        .tolist()
            model.train()
        if m_steps > 1 and ctx.is_main:
            from prorag.io import atomic_path

            for old in ctx.checkpoint_dir.glob("rl-iteration-*.pt"):
                old.unlink()
            with atomic_path(saved) as tmp:
                torch.save({"version": version, "push": push, "stats": data.stats,
                            "samples": [asdict(x) for x in data.samples]}, tmp)
        return version, push, data

    def micro_batches(samples: list[RLSample]) -> list[list]:
        """[m mini-batches (optimizer steps)][k micro-batches]: each (collated length chunks, scale), or None when
        it holds no trained token; the scale makes a step's gradient that of the token mean over its mini-batch."""
        steps = []
        for mb in range(m_steps):
            share = samples[mb::m_steps]
            n_share = sum(sum(s_.loss_mask) for s_ in share)
            micro = []
            for j in range(k):
                part = share[j::k]
                n = sum(sum(s_.loss_mask) for s_ in part)
                chunks = [collate_rl([part[i] for i in c], tokenizer.pad_token_id)
                          for c in length_chunks([len(x.token_ids) for x in part], cfg.chunk_tokens)]
                micro.append((chunks, k * n / n_share) if part and n else None)
            steps.append(micro)
        return steps

    def loss_fn(m, batch):
        """(scaled loss, tokens, stats) of one micro-batch; stats are token-weighted sums for the journal."""
        if batch is None:
            if acc is not None:
                # on a launch the engine averages every adapter weight's gradient over the processes, so each must
                # give one: a forward of one token, times 0 (drop_grads drops a step with no data at all)
                ids = torch.full((1, 2), tokenizer.pad_token_id, dtype=torch.long)
                return token_logprobs(m, ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0]])).sum() * 0.0, 0
            # nothing kept for this micro-batch: a loss with no path to the weights leaves their gradients None,
            # so AdamW skips them rather than stepping on stale momentum
            return torch.zeros((), requires_grad=True), 0
        chunks, scale = batch
        # the micro-batch's token mean as the token-weighted sum of its chunks' token means
        results = [rl_loss(m, c, cfg) for c in chunks]
        n = sum(st["tokens"] for _, st in results)
        loss = sum(l * (st["tokens"] / n) for l, st in results)
        stats = {key: sum(st[key] * st["tokens"] for _, st in results) for key in ("clip_fraction", "approx_kl", "kl")}
        stats["tokens"] = n
        return loss * scale, int(sum(c[1].sum() for c in chunks)), stats

    def drop_grads(m) -> None:
        # a step with no data on a launch: its zero gradients dropped, so AdamW skips it as on one process
        for p in m.parameters():
            p.grad = None

    def update(iteration: int, data: IterationData) -> dict | None:
        """The iteration's optimizer steps (its m mini-batches; a job resumed inside it does those left), summed
        statistics over every process; None when the job stops part-way (the loop saved its checkpoint)."""
        micro = micro_batches(data.samples)
        t0 = time.monotonic()
        first = loop.step - iteration * m_steps
        keys = ("clip_fraction", "approx_kl", "kl", "tokens")
        sums = dict.fromkeys(keys, 0.0)
        for mb in range(first, m_steps):
            # the stop check before the iteration's first step was made before its rollouts
            if mb > first and loop.stop_requested():
                return None
            empty = acc is not None and all(x is None for x in micro[mb])
            # micro-batch i of this step is micro[mb][i % k]: a pure function of i, as the loop needs
            got = loop.train_step(lambda i, mb=mb: micro[mb][i % k], grad_hook=drop_grads if empty else None)
            for key in keys:
                sums[key] += got.stats.get(key, 0.0)
        # each process of a launch accumulated its share of the micro-batches
        sums = dict(zip(keys, sum_over_processes(acc, [sums[key] for key in keys])))
        n = max(sums["tokens"], 1.0)
        return {"clip_fraction": sums["clip_fraction"] / n, "approx_kl": sums["approx_kl"] / n, "kl": sums["kl"] / n,
                "update_s": time.monotonic() - t0}

    def record(iteration: int, version: str, push: dict, stats: dict, done: dict) -> None:
        """The iteration's journal row, metrics and progress message (the main process)."""
        if not ctx.is_main:
            return
        numbers = {k_: v for k_, v in stats.items() if isinstance(v, (int, float))}
        row = {**numbers, **{k_: v for k_, v in push.items() if k_ != "acks"}, **done}
        ctx.log_metrics(iteration + 1, row)
        with open(journal, "a") as f:
            f.write(json.dumps({"iteration": iteration, "adapter": f"{cfg.adapter_name}@{version}",
                                "acks": push["acks"], "prm_version": stats.get("prm_version", ""), **row}) + "\n")
        ctx.emit(iteration + 1, total, message=f"iteration {iteration + 1}/{total}: kept {numbers['kept']}/"
                                               f"{numbers['sampled']}, reward {numbers['reward_mean']:.3f}, "
                                               f"F1 {numbers['f1_mean']:.3f}, stale {numbers['dropped_stale']}")

    loop_cfg = cfg.loop_config(total * m_steps, schedule="constant", beta2=0.999, grad_accum=k,
                               checkpoint_every=cfg.checkpoint_every * m_steps, log_every=cfg.log_every * m_steps)
    try:
        # the loop restores a resumed job's checkpoint: ``loop.step`` optimizer steps are done
        with TrainingLoop(ctx, model, loss_fn, loop_cfg, placement=placement) as loop:
            first = loop.step // m_steps
            if ctx.is_main:
                _trim_journal(journal, first)
            for iteration in range(first, total):
                if loop.stop_requested():
                    return {}
                # 1-3: publish and push the weights, roll out with them, score the steps, advantages
                version, push, data = iteration_data(iteration)
                # 4: the update
                done = update(iteration, data)
                if done is None:
                    return {}
                record(iteration, version, push, data.stats, done)
                # after the row: checkpoints fall on iteration boundaries (checkpoint_every counts iterations), so
                # a resumed job never lacks the row of an iteration its weights have seen
                loop.save_if_due()
            final_loss = loop.loss
        # 5: the last update's weights (each iteration's own are published as the next one starts)
        version, push = publish_and_push(total)
    finally:
        if policy is not None:
            policy.close()
        if prm is not None:
            prm.close()
    if not ctx.is_main:  # the other processes of a launch publish nothing
        return {}
    rows = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
    with ctx.artifact_file("iterations", "iterations.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = ArtifactRef(cfg.adapter_name, version)
    out = {"adapter": ref.key, "iterations": total, "final_loss": final_loss,
           "push_acked": push["push_acked"], "push_acks": push["push_acks"],
           "adapter_path": str(registry("adapter", cfg.world).path(ref))}
    for key in ("sampled", "kept", "dropped_stale", "dropped_foreign", "dropped_too_long", "trained_tokens"):
        out[f"total_{key}"] = float(sum(r.get(key, 0) for r in rows))
    if rows:
        for key in ("reward_mean", "f1_mean", "format_valid_rate", "clip_fraction", "approx_kl", "lag_mean"):
            out[f"last_{key}"] = float(rows[-1].get(key, 0.0))
        out["lag_max"] = max(float(r.get("lag_max", 0.0)) for r in rows)
        # groups whose rollouts all earned the same reward: no outcome signal (what a learnable pool cuts down)
        out["groups_flat_fraction"] = (sum(float(r.get("groups_flat", 0)) for r in rows)
                                       / max(1.0, sum(float(r.get("groups", 0)) for r in rows)))
    out["questions_drawn_from"] = float(len(qs))
    return out


def _trim_journal(journal: Path, iterations: int) -> None:
    """Drop the journal's rows of iterations >= ``iterations``: a killed job may have written rows its last
    checkpoint's weights have not seen; the resumed job runs those iterations again."""
    if journal.exists():
        keep = [line for line in journal.read_text().splitlines() if json.loads(line)["iteration"] < iterations]
        journal.write_text("".join(line + "\n" for line in keep))


def _unload_old(cfg: RLConfig, job_id: str, iteration: int, replicas: list[str]) -> int:
    """Unload this job's versions past the lag bound from the replicas, so a long run does not keep every
    version in memory; best effort: a version still serving a request stays until the next push."""
    import grpc

    from prorag.rpc.clients import PolicyClient

    done = 0
    for r in replicas:
        with PolicyClient(r, timeout=cfg.push_timeout_s) as c:
            try:
                listed = c.list_adapters()
                for a in listed.adapters:
                    key = f"{a.ref.name}@{a.ref.version}"
                    lag = policy_lag(key, cfg.adapter_name, job_id, iteration)
                    if key != listed.active and lag is not None and lag > cfg.max_policy_lag:
                        c.unload_adapter(a.ref.name, a.ref.version)
                        done += 1
            except grpc.RpcError:
                continue
    return done


register_stage("rl", RLConfig, run_rl,
               description="process-supervised GRPO on LoRA adapters: rollouts through the policy, step scores from "
                           "the PRM, a new adapter version published and pushed to every replica each iteration "
                           "(beta=0 or prm='' = outcome-only GRPO)",
               checks={"base_model": "model", "adapter_name": "name", "question_pool": "path"})
