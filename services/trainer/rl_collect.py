"""An RL iteration's data (services.trainer.stage_rl), on the main process: :func:`collect` runs

- :func:`roll_out`: the questions, G times each, through the policy service; trajectories from another adapter or
  older than max_policy_lag iterations are dropped;
- :func:`score`: every step's logit from the scorer step_scorer names (:data:`STEP_SCORERS`: the PRM service, or the
  reference judge on the gold decomposition);
- :func:`advantages`: outcome rewards (OUTCOME_REWARDS), the group's per-step advantages (ADVANTAGE_ESTIMATORS),
  broadcast to each trajectory's generated tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial

from prorag.algorithms import lookup
from prorag.algorithms.rl import (ADVANTAGE_ESTIMATORS, OUTCOME_REWARDS, credit_counts, reference_step_scores,
                                  token_advantages)
from prorag.errors import FailedPrecondition
from prorag.rpc.pbconv import step_from_pb, token_trace_from_pb
from prorag.search.judging import judge_step
from prorag.training.lora import RLSample
from services.trainer.rl_config import RLConfig
from services.trainer.rl_publish import policy_lag, push_again
from services.trainer.rl_run import IterationData
from services.trainer.sampling import answer_f1, prm_logits, rollout, rollout_seed


def collect(cfg: RLConfig, questions, iteration: int, job_id: str, version_key: str, policy, prm) -> IterationData:
    """An iteration's data, on the main process: :func:`roll_out` ``questions`` G times each (stale trajectories
    dropped), :func:`score` their steps, then :func:`advantages`.

    version_key: the adapter version being trained (pinned requests name it). One PRM call for the whole
    iteration, every step of every kept trajectory in it."""
    stats = {"questions": len(questions), "sampled": 0, "kept": 0, "dropped_stale": 0, "dropped_foreign": 0,
             "dropped_too_long": 0, "prm_scored": 0, "service_retries": 0}
    kept, lags = roll_out(cfg, questions, iteration, job_id, version_key, policy, stats)
    steps = [[step_from_pb(s) for s in t.steps] for t in kept]
    logits = score(cfg, questions, kept, steps, prm, stats)
    return advantages(cfg, questions, iteration, kept, lags, steps, logits, stats)


# ---------------------------------------------------------------- roll out
def roll_out(cfg: RLConfig, questions, iteration: int, job_id: str, version_key: str, policy,
             stats: dict) -> tuple[list, list[int]]:
    """``questions`` [Q] rolled out G times each through the policy service, in requests of questions_per_request;
    returns the kept trajectories (pb) [N] and their policy lags [N], counting what was sampled and dropped
    (foreign, stale, too long) into ``stats``."""
    kept, lags = [], []
    t0 = time.monotonic()
    adapter = version_key if cfg.rollout_adapter == "pinned" else ""
    for start in range(0, len(questions), cfg.questions_per_request):
        chunk = questions[start:start + cfg.questions_per_request]
        for t in rollout(policy, cfg, chunk, cfg.group_size, rollout_seed(cfg.seed, start, iteration), adapter,
                         stats, after_back=partial(push_again, cfg, version_key)):
            stats["sampled"] += 1
            lag = policy_lag(t.adapter_version, cfg.adapter_name, job_id, iteration)
            dropped = _why_dropped(cfg, t, lag)
            if dropped:
                stats[dropped] += 1
                continue
            kept.append(t)
            lags.append(lag)
    stats["rollout_s"] = time.monotonic() - t0
    return kept, lags


def _why_dropped(cfg: RLConfig, trajectory, lag: int | None) -> str:
    """The stats key a sampled trajectory is dropped under, '' when it is kept."""
    if lag is None or lag < 0:  # the base, another adapter, or a killed attempt's later version
        return "dropped_foreign"
    if lag > cfg.max_policy_lag:
        return "dropped_stale"
    if len(trajectory.trace.token_ids) > cfg.max_len:
        return "dropped_too_long"
    return ""


# ---------------------------------------------------------------- score the steps
def score(cfg: RLConfig, questions, kept: list, steps: list[list], prm, stats: dict) -> list[list[float]] | None:
    """Every step's logit [N][steps of trajectory i] from cfg.step_scorer's scorer; None for outcome-only GRPO."""
    return STEP_SCORERS[cfg.step_scorer](cfg, questions, kept, steps, prm, stats)


def prm_scores(cfg: RLConfig, questions, kept: list, steps: list[list], prm, stats: dict) -> list[list[float]] | None:
    """The PRM's logit of every step, [N][steps of trajectory i], in one call; None for outcome-only GRPO
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
        partial_logits = []
        if asked:
            stats["prm_version"], partial_logits = prm_logits(
                prm, cfg, [(kept[i].question, [steps[i][j] for j in scored[i]], False) for i in asked], stats)
        logits = [[0.0] * len(ss) for ss in steps]
        for i, got in zip(asked, partial_logits):
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
    subquery retrieved). Returns [S]: +ORACLE_LOGIT where prorag.search.judging.judge_step finds step k, taken after
    steps [:k], sound (right entity for the open hop, a sub-answer stated by the last search's documents, no repeated
    search, a right final answer), -ORACLE_LOGIT otherwise. Pure: no service, no model."""
    return [ORACLE_LOGIT if judge_step(question, steps[:k], st).sound else -ORACLE_LOGIT
            for k, st in enumerate(steps)]


def oracle_scores(cfg: RLConfig, questions, kept: list, steps: list[list], prm, stats: dict
                  ) -> list[list[float]] | None:
    """step_scorer=oracle: :func:`oracle_step_logits` of every kept trajectory, [N][steps of trajectory i], in place
    of the PRM's logits (the rest of the process term is unchanged; ``prm`` is not asked); None when beta = 0."""
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


#: step_scorer -> f(cfg, questions, kept, steps, prm client, stats) -> logits [N][S_i] or None (RLConfig.step_scorer
#: lists these names as its choices)
STEP_SCORERS = {"prm": prm_scores, "oracle": oracle_scores}


# ---------------------------------------------------------------- advantages
def advantages(cfg: RLConfig, questions, iteration: int, kept: list, lags: list[int], steps: list[list],
               logits: list[list[float]] | None, stats: dict) -> IterationData:
    """Outcome rewards [N], per-step advantages within each question's group (cfg.advantage's estimator: outcome,
    plus beta x the process advantage when ``logits`` are given), broadcast to each trajectory's generated tokens
    [T_i]; the iteration's samples and statistics."""
    by_id = {q.id: q for q in questions}
    t2 = time.monotonic()
    reward_fn = OUTCOME_REWARDS[cfg.reward]
    f1s = [answer_f1(t, by_id[t.question_id].golden_answers) for t in kept]
    rewards = [reward_fn(f1, bool(t.format_valid)) for f1, t in zip(f1s, kept)]
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(kept):
        groups.setdefault(t.question_id, []).append(i)
    traces = [token_trace_from_pb(t.trace, t.prompt_length) for t in kept]
    step_adv: list[list[float]] = [[] for _ in kept]
    for members in groups.values():
        for i, a in zip(members, group_advantages(cfg, members, kept, steps, traces, rewards, logits)):
            step_adv[i] = a
    _check_finite(iteration, kept, step_adv, rewards, logits, stats)
    stats["reward_s"] = time.monotonic() - t2  # outcome rewards, PRM step scores into advantages
    samples = []
    for i, (t, tr) in enumerate(zip(kept, traces)):
        adv, mask = token_advantages(step_adv[i], tr.spans, len(tr.token_ids))
        samples.append(RLSample(tr.token_ids, tr.generated_mask, adv.tolist(), mask.tolist(), list(tr.logprobs),
                                t.question_id, rewards[i], lags[i]))
    stats["kept"] = len(samples)
    stats.update(_batch_stats(kept, lags, groups, f1s, rewards, samples, by_id))
    return IterationData(samples, stats)


def group_advantages(cfg: RLConfig, members: list[int], kept: list, steps: list[list], traces: list,
                     rewards: list[float], logits: list[list[float]] | None) -> list[list[float]]:
    """One question's group, ``members`` [G] indices into kept: its per-step advantages [G][S_i] from cfg.advantage's
    estimator, the step scores (from ``logits``, None = outcome only) read as cfg sets them."""
    tokens = [[s.generated_end - s.start for s in traces[i].spans] for i in members]
    scores, scored = None, None
    if logits is not None:
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
    estimator = lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", cfg.advantage)
    return estimator([rewards[i] for i in members], scores, tokens, cfg.beta, cfg.normalization,
                     std_floor=cfg.process_std_floor, scored=scored)


def _check_finite(iteration: int, kept: list, step_adv: list[list[float]], rewards: list[float],
                  logits: list[list[float]] | None, stats: dict) -> None:
    # a PRM that returns NaN (or a reward that overflows) would train on garbage: stop with the culprit
    for i, a in enumerate(step_adv):
        if not all(math.isfinite(x) for x in a):
            raise FailedPrecondition(
                f"iteration {iteration}: trajectory {kept[i].question_id}#{kept[i].sample_index} has non-finite "
                f"advantages {a} (reward {rewards[i]}, PRM scores {logits[i] if logits is not None else []}, "
                f"PRM {stats.get('prm_version', '-')}); no update was made and the last published adapter stays "
                "active")


def _batch_stats(kept: list, lags: list[int], groups: dict[str, list[int]], f1s: list[float], rewards: list[float],
                 samples: list[RLSample], by_id: dict) -> dict:
    """The iteration's journal numbers about its trajectories, groups and advantages, in the journal's order."""
    stats = {"groups": len(groups),
             # groups whose rollouts all scored alike teach nothing through the outcome term
             "groups_flat": sum(1 for m in groups.values() if len({rewards[i] for i in m}) <= 1)}
    stats.update(credit_counts(groups, f1s, {q: by_id[q].hops for q in groups}))
    stats["reward_mean"] = _mean(rewards)
    stats["f1_mean"] = _mean(f1s)
    stats["format_valid_rate"] = _mean([float(bool(t.format_valid)) for t in kept])
    stats["answered_rate"] = _mean([float(t.finish_reason == "answer") for t in kept])
    stats["lag_mean"] = _mean([float(x) for x in lags])
    stats["lag_max"] = float(max(lags, default=0))
    token_adv = [a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    stats["adv_mean"] = _mean(token_adv)
    stats["adv_std"] = statistics.pstdev(token_adv) if token_adv else 0.0
    stats["adv_abs_max"] = max((abs(a) for a in token_adv), default=0.0)
    stats["trained_tokens"] = len(token_adv)
    return stats


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0
