"""Rewards, advantages and policy losses of stages 3-4 against values computed by hand."""

import math

import pytest
import torch

from prorag.algorithms.rl import (ADVANTAGE_ESTIMATORS, OUTCOME_REWARDS, POLICY_LOSSES, centered_step_advantages,
                                  clipped_policy_loss, dpo_loss, dual_granularity_advantages, group_centered,
                                  group_normalized, group_step_advantages,
                                  outcome_reward_paper, outcome_reward_reference, process_advantages,
                                  step_score_reference, step_score_stats, token_advantages)
from prorag.tokens import StepSpan


def test_advantage_estimators_and_policy_losses_are_chosen_by_name():
    from prorag.algorithms import lookup
    from prorag.errors import InvalidArgument

    assert ADVANTAGE_ESTIMATORS == {"grpo": group_step_advantages, "dr_grpo": centered_step_advantages}
    assert POLICY_LOSSES == {"clipped": clipped_policy_loss}
    with pytest.raises(InvalidArgument, match="unknown policy loss 'dpo' .known: clipped"):
        lookup(POLICY_LOSSES, "policy loss", "dpo")


def test_outcome_rewards_reference_paper_and_f1():
    assert outcome_reward_reference(0.2, True) == pytest.approx(1.4)   # at the threshold: 2 * 0.2 + 1
    assert outcome_reward_reference(0.19, True) == 1.0                 # below it: only the format term
    assert outcome_reward_reference(0.0, False) == -1.0
    assert outcome_reward_paper(0.3, True, nu=0.5) == pytest.approx(0.8)
    assert outcome_reward_paper(0.3, False, nu=0.5) == pytest.approx(0.3)
    # the answer alone: an invalid format that still answers keeps its F1, a valid one earns nothing for it
    assert OUTCOME_REWARDS["f1"](0.3, False) == OUTCOME_REWARDS["f1"](0.3, True) == pytest.approx(0.3)
    assert OUTCOME_REWARDS["f1"](0.0, True) == 0.0
    assert set(OUTCOME_REWARDS) == {"reference", "paper", "f1"}


def test_step_score_reference():
    assert step_score_reference(2.0, True) == pytest.approx(1 / (1 + math.exp(-2)) + 1)  # 1.8808
    assert step_score_reference(-1.0, False) == pytest.approx(1 / (1 + math.e) - 2)      # -1.7311


def test_group_normalized_by_hand():
    # rewards 3, 1, 2: mean 2, sample std 1 -> (1, -1, 0) / (1 + 1e-4)
    assert group_normalized([3.0, 1.0, 2.0]) == pytest.approx([1 / 1.0001, -1 / 1.0001, 0.0])
    assert group_normalized([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # no signal: no advantage
    assert group_normalized([0.4, 0.4, 0.4]) == [0.0, 0.0, 0.0]  # exactly, though the mean rounds to 0.4000000000000001
    assert group_normalized([2.0]) == [0.0] and group_normalized([]) == []


def test_group_centered_keeps_the_reward_scale():
    # Dr. GRPO: R - mean, so a near-agreeing group's small F1 gap stays small where the spread would inflate it
    assert group_centered([1.0, 0.0, 0.5]) == pytest.approx([0.5, -0.5, 0.0])
    near = [1.0, 1.0, 1.0, 0.9]
    assert group_centered(near) == pytest.approx([0.025, 0.025, 0.025, -0.075])
    assert min(group_normalized(near)) < -1.4  # the spread-normalised one: as large as a win against a loss
    assert group_centered([0.4] * 3) == [0.0] * 3 and group_centered([]) == []


def test_dr_grpo_steps_add_the_same_process_term_as_grpo():
    rewards, scores, tokens = [1.0, 0.0, 0.5], [[0.2, 0.9], [0.1], [0.6]], [[2, 3], [4], [1]]
    grpo = group_step_advantages(rewards, scores, tokens, beta=0.3)
    dr = centered_step_advantages(rewards, scores, tokens, beta=0.3)
    outcome_g, outcome_d = group_normalized(rewards), group_centered(rewards)
    for g, d, og, od in zip(grpo, dr, outcome_g, outcome_d):
        assert [x - og for x in g] == pytest.approx([x - od for x in d])  # the process parts agree step by step
    assert centered_step_advantages(rewards, None, tokens, beta=0.3) == [[0.5, 0.5], [-0.5], [0.0]]


def test_process_advantages_token_weighted_vs_per_step():
    scores = [[1.0, 3.0], [2.0]]
    tokens = [[1, 3], [4]]
    # token-weighted: values 1 (x1), 3 (x3), 2 (x4) over 8 tokens -> mean (1 + 9 + 8) / 8 = 2.25;
    # var = (1.25^2 * 1 + 0.75^2 * 3 + 0.25^2 * 4) / 8 = (1.5625 + 1.6875 + 0.25) / 8 = 0.4375
    mu, sigma = step_score_stats(scores, [[1, 3], [4]])
    assert (mu, sigma) == pytest.approx((2.25, math.sqrt(0.4375)))
    tok = process_advantages(scores, tokens, "token")
    s = math.sqrt(0.4375) + 1e-4
    assert tok[0] == pytest.approx([-1.25 / s, 0.75 / s]) and tok[1] == pytest.approx([-0.25 / s])
    # per step: values 1, 3, 2 -> mean 2, population std sqrt(2/3)
    step = process_advantages(scores, tokens, "step")
    s = math.sqrt(2 / 3) + 1e-4
    assert step[0] == pytest.approx([-1 / s, 1 / s]) and step[1] == pytest.approx([0.0])
    # a step with no generated token does not move the statistics
    no_token_step = process_advantages([[1.0, 3.0, 100.0]], [[1, 1, 0]], "step")
    assert no_token_step[0][:2] == pytest.approx([-1 / 1.0001, 1 / 1.0001])
    with pytest.raises(ValueError, match="'token' or 'step'"):
        process_advantages(scores, tokens, "sequence")


def test_dual_granularity_and_broadcast_to_generated_tokens():
    adv = dual_granularity_advantages([0.5, -0.5], [[1.0, -1.0], [2.0]], beta=0.3)
    assert adv[0] == pytest.approx([0.8, 0.2]) and adv[1] == pytest.approx([0.1])
    assert dual_granularity_advantages([0.5], [[7.0, -9.0]], beta=0.0) == [[0.5, 0.5]]  # outcome-only GRPO
    # prompt 0-3; step 0 generated 3-6, documents 6-9; step 1 generated 9-11, nothing inserted
    spans = [StepSpan(3, 6, 9), StepSpan(9, 11, 11)]
    a, m = token_advantages([0.8, 0.2], spans, 12)
    assert a.tolist() == pytest.approx([0, 0, 0, 0.8, 0.8, 0.8, 0, 0, 0, 0.2, 0.2, 0])
    assert m.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="does not fit"):
        token_advantages([0.1], [StepSpan(3, 6, 20)], 12)


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 4)
    # ratios e^0.5 = 1.6487 (clipped to 1.2 for A > 0), e^-0.5 = 0.6065 (clipped to 0.8 for A < 0 -> min picks 0.8*A?)
    new = torch.tensor([[0.5, -0.5, 0.1, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is a document token: ignored
    loss, stats = clipped_policy_loss(new, old, adv, mask, clip=0.2)
    r = [math.exp(0.5), math.exp(-0.5), math.exp(0.1)]
    expected = -(min(r[0] * 1, 1.2 * 1) + min(r[1] * -1, 0.8 * -1) + min(r[2] * 2, min(max(r[2], 0.8), 1.2) * 2)) / 3
    assert float(loss.detach()) == pytest.approx(expected)
    assert stats["clip_fraction"] == pytest.approx(2 / 3) and stats["tokens"] == 3
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * ratio / n
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == 0 and new.grad[0, 3] == 0
    assert float(new.grad[0, 2]) == pytest.approx(-2 * r[2] / 3)


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    lp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    zero_adv = torch.zeros(1, 2)
    loss, stats = clipped_policy_loss(lp, lp, zero_adv, mask, kl_coef=0.1, ref_logprobs=lp)
    assert float(loss) == 0 and stats["kl"] == 0
    ref = torch.tensor([[-1.5, -2.0]])  # delta = -0.5 on the first token: k3 = e^-0.5 + 0.5 - 1 = 0.10653
    loss, stats = clipped_policy_loss(lp, lp, zero_adv, mask, kl_coef=0.1, ref_logprobs=ref)
    assert stats["kl"] == pytest.approx((math.exp(-0.5) + 0.5 - 1) / 2)
    assert float(loss) == pytest.approx(0.1 * stats["kl"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        clipped_policy_loss(lp, lp, zero_adv, mask, kl_coef=0.1)


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.5])
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.3)
    # logits: 0.3 * ((0.5) - (-0.5)) = 0.3; 0.3 * ((0) - (0.5)) = -0.15
    expected = -(math.log(1 / (1 + math.exp(-0.3))) + math.log(1 / (1 + math.exp(0.15)))) / 2
    assert float(loss) == pytest.approx(expected)
    assert stats["reward_accuracy"] == 0.5 and stats["margin"] == pytest.approx((1.0 - 0.5) / 2)


def test_group_step_advantages_is_outcome_plus_beta_process_and_beta_zero_is_outcome_only():
    rewards, scores, tokens = [3.0, 1.0, 0.0], [[1.5, -1.5], [0.5], [1.0, 1.0, 0.2]], [[4, 2], [3], [1, 1, 5]]
    full = group_step_advantages(rewards, scores, tokens, beta=0.3, normalization="step")
    outcome = group_normalized(rewards)
    process = process_advantages(scores, tokens, "step")
    for a, o, ps in zip(full, outcome, process):
        assert a == pytest.approx([o + 0.3 * p for p in ps])
    # beta 0 with step scores and no step scores at all give the same advantages: the outcome, on every step
    zero = group_step_advantages(rewards, scores, tokens, beta=0.0)
    assert zero == group_step_advantages(rewards, None, tokens, beta=0.3)
    assert zero == [[o] * len(ns) for o, ns in zip(outcome, tokens)]
    # a group that all scored alike carries only the process term
    same = group_step_advantages([1.0, 1.0], [[2.0], [0.0]], [[1], [1]], beta=0.5, normalization="token")
    assert same[0][0] == pytest.approx(0.5 * 1.0 / (1.0 + 1e-4)) and same[1][0] == pytest.approx(-same[0][0])


def test_the_docstring_examples_hold():
    import doctest

    import prorag.algorithms.rl as rl

    result = doctest.testmod(rl)
    assert result.attempted >= 4 and result.failed == 0


def test_credit_counts_find_the_groups_only_a_process_term_can_teach():
    from prorag.algorithms.rl import credit_counts

    groups = {"q1": [0, 1], "q3": [2, 3], "q4": [4, 5]}
    f1s = [0.19, 0.0, 0.2, 0.0, 0.0, 0.1]  # q3's first rollout reaches the threshold exactly
    assert credit_counts(groups, f1s, {"q1": 1, "q3": 3, "q4": 4}) == {
        "groups_uncredited": 2, "deep_groups": 2, "deep_groups_uncredited": 1}
    assert credit_counts(groups, f1s, {"q1": 1, "q3": 3, "q4": 4}, threshold=0.15) == {
        "groups_uncredited": 1, "deep_groups": 2, "deep_groups_uncredited": 1}  # q4's best is 0.1


# ---------------------------------------------------------------- calibrated process term (issue 30, item 2)
KINDS = [["subquery", "subanswer", "answer"], ["subquery", "subanswer"]]


def test_center_per_kind_by_hand_step_and_token_weighted():
    from prorag.algorithms.rl import center_per_kind, step_weights

    logits = [[1.0, 3.0, 0.0], [2.0, 5.0]]
    tokens = [[2, 1, 1], [1, 3]]
    # per step: subquery mean (1 + 2) / 2 = 1.5, subanswer (3 + 5) / 2 = 4, answer 0
    step = center_per_kind(logits, KINDS, step_weights(tokens, "step"))
    assert step[0] == pytest.approx([-0.5, -1.0, 0.0]) and step[1] == pytest.approx([0.5, 1.0])
    # per token: subquery (1 x 2 + 2 x 1) / 3 = 4/3, subanswer (3 x 1 + 5 x 3) / 4 = 4.5
    tok = center_per_kind(logits, KINDS, step_weights(tokens, "token"))
    assert tok[0] == pytest.approx([-1 / 3, -1.5, 0.0]) and tok[1] == pytest.approx([2 / 3, 0.5])
    # a step with no generated token is shifted by its kind's mean without moving it
    assert center_per_kind([[1.0, 9.0]], [["subquery", "subquery"]], [[1.0, 0.0]]) == [[0.0, 8.0]]
    with pytest.raises(ValueError, match="one entry per step"):
        center_per_kind(logits, [["subquery"], ["answer"]], step_weights(tokens, "step"))


def test_per_kind_centring_stops_a_low_offset_kind_from_being_pushed_down():
    """The issue's offsets: subqueries near +1.7, sub-answers near +2.0 (logits). Normalised together, every
    subquery sits below every sub-answer; centred per kind, each kind's better step gets the positive advantage."""
    from prorag.algorithms.rl import process_advantages, reference_step_scores

    logits = [[1.6, 1.9], [1.8, 2.1]]
    kinds = [["subquery", "subanswer"], ["subquery", "subanswer"]]
    tokens = [[1, 1], [1, 1]]
    raw = process_advantages(reference_step_scores(logits, kinds, tokens, "none", "step"), tokens, "step")
    assert raw[1][0] < 0  # the better subquery is pushed down by the sub-answers' offset
    centred = reference_step_scores(logits, kinds, tokens, "per_kind", "step")
    # each kind's logits become -0.1 and +0.1: s = sigmoid(+-0.1) + 1 (valid steps)
    lo, hi = 1 / (1 + math.exp(0.1)) + 1, 1 / (1 + math.exp(-0.1)) + 1
    assert centred == [pytest.approx([lo, lo]), pytest.approx([hi, hi])]
    adv = process_advantages(centred, tokens, "step")
    d = (hi - lo) / 2  # mean (lo + hi) / 2, population std d
    assert adv == [pytest.approx([-d / (d + 1e-4)] * 2), pytest.approx([d / (d + 1e-4)] * 2)]
    # "none" is the reference's score exactly
    assert reference_step_scores(logits, kinds, tokens) == [[step_score_reference(x, True) for x in xs]
                                                            for xs in logits]
    with pytest.raises(ValueError, match="centering"):
        reference_step_scores(logits, kinds, tokens, "per_question")


def test_per_kind_centring_keeps_the_format_penalty_of_invalid_steps():
    from prorag.algorithms.rl import reference_step_scores

    # invalid steps are a kind of their own, centred among themselves; their -2 format term stays
    scores = reference_step_scores([[0.5, 3.0], [1.5]], [["subquery", "invalid"], ["subquery"]], [[1, 1], [1]],
                                   "per_kind", "step")
    assert scores[0][1] == pytest.approx(0.5 - 2)  # its logit centred to 0: sigmoid 0.5, then -2
    # the subqueries' logits 0.5 and 1.5 centred to -0.5 and +0.5
    assert scores[0][0] == pytest.approx(1 / (1 + math.exp(0.5)) + 1)
    assert scores[1][0] == pytest.approx(1 / (1 + math.exp(-0.5)) + 1)


def test_std_floor_keeps_the_small_differences_of_an_alike_group_small():
    scores, tokens = [[1.0, 1.02], [1.01]], [[1, 1], [1]]
    # per step: mean 1.01, population std sqrt((0.01^2 + 0.01^2 + 0) / 3) = 0.008165
    sigma = math.sqrt(2e-4 / 3)
    free = process_advantages(scores, tokens, "step")
    assert free[0] == pytest.approx([-0.01 / (sigma + 1e-4), 0.01 / (sigma + 1e-4)])  # blown up to ~ +-1.2
    floored = process_advantages(scores, tokens, "step", std_floor=0.5)
    assert floored[0] == pytest.approx([-0.01 / 0.5001, 0.01 / 0.5001]) and floored[1] == pytest.approx([0.0])
    # a floor under the group's spread changes nothing
    assert process_advantages(scores, tokens, "step", std_floor=0.001) == free
    # and group_step_advantages passes it through to the process term
    full = group_step_advantages([1.0, 0.0], scores, tokens, beta=0.3, normalization="step", std_floor=0.5)
    outcome = group_normalized([1.0, 0.0])
    assert full[0] == pytest.approx([outcome[0] + 0.3 * p for p in floored[0]])


def test_the_verdict_step_score_carries_no_format_term():
    from prorag.algorithms.rl import STEP_SCORES, reference_step_scores, step_score_verdict

    assert step_score_verdict(0.0, True) == step_score_verdict(0.0, False) == 0.5
    assert step_score_verdict(10.0, False) == pytest.approx(1.0, abs=1e-4)
    assert STEP_SCORES["reference"] is step_score_reference and STEP_SCORES["verdict"] is step_score_verdict
    logits, kinds, tokens = [[2.0, -1.0]], [["subquery", "invalid"]], [[1, 1]]
    # the invalid step keeps its verdict's score, not the reference's -2 shaping
    assert reference_step_scores(logits, kinds, tokens, score="verdict") == [
        [pytest.approx(1 / (1 + math.exp(-2.0))), pytest.approx(1 / (1 + math.exp(1.0)))]]
    with pytest.raises(ValueError, match="score must be one of"):
        reference_step_scores(logits, kinds, tokens, score="format")


def test_steps_left_out_of_the_process_term_neither_move_its_statistics_nor_get_a_process_advantage():
    scores, tokens = [[1.0, 0.0, 5.0], [0.0, 9.0]], [[2, 2, 1], [2, 1]]
    scored = [[True, True, False], [True, False]]  # the answers (last steps) left out
    adv = process_advantages(scores, tokens, "step", scored=scored)
    inside = process_advantages([[1.0, 0.0], [0.0]], [[2, 2], [2]], "step")
    assert adv == [[inside[0][0], inside[0][1], 0.0], [inside[1][0], 0.0]]
    # every step scored is the default
    assert process_advantages(scores, tokens, "step", scored=[[True] * 3, [True] * 2]) == process_advantages(
        scores, tokens, "step")
    full = group_step_advantages([1.0, 0.0], scores, tokens, beta=0.3, normalization="step", scored=scored)
    outcome = group_normalized([1.0, 0.0])
    assert full[0][2] == pytest.approx(outcome[0]) and full[1][1] == pytest.approx(outcome[1])
    with pytest.raises(ValueError, match="scored"):
        process_advantages(scores, tokens, "step", scored=[[True], [True]])


def test_a_sound_oracle_step_never_gets_a_negative_process_advantage_uncentred():
    """Issue 47: the oracle's verdicts (+-10 logits) uncentred, under either step score and either weighting, give a
    sound step a process advantage >= 0 in any group; centred per kind they do not (a sound subquery in a group of
    sound subqueries centres to 0, below the sound sub-answers of the same group)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from prorag.algorithms.rl import reference_step_scores

    step = st.tuples(st.sampled_from(["subquery", "subanswer", "answer", "invalid"]), st.booleans(),
                     st.integers(0, 40))
    group = st.lists(st.lists(step, min_size=1, max_size=6), min_size=2, max_size=8)

    @settings(max_examples=300, deadline=None)
    @given(group, st.sampled_from(["reference", "verdict"]), st.sampled_from(["token", "step"]), st.booleans())
    def check(rollouts, score, normalization, answer_scored):
        # the oracle judges an invalid step unsound
        sound = [[ok and kind != "invalid" for kind, ok, _ in r] for r in rollouts]
        logits = [[10.0 if ok else -10.0 for ok in r] for r in sound]
        kinds = [[kind for kind, _, _ in r] for r in rollouts]
        tokens = [[n for _, _, n in r] for r in rollouts]
        scored = [[answer_scored or k != "answer" for k in ks] for ks in kinds]
        adv = process_advantages(reference_step_scores(logits, kinds, tokens, "none", normalization, score),
                                 tokens, normalization, scored=scored)
        for ok_row, adv_row in zip(sound, adv):
            for ok, a in zip(ok_row, adv_row):
                if ok:
                    assert a >= -1e-6

    check()
    kinds, tokens = [["subquery", "subanswer"]] * 4, [[1, 1]] * 4
    logits = [[10.0, 10.0]] * 3 + [[10.0, -10.0]]  # every subquery sound; three sub-answers sound, one not
    centred = process_advantages(reference_step_scores(logits, kinds, tokens, "per_kind", "step", "verdict"),
                                 tokens, "step")
    assert centred[0][0] < 0  # the confound the oracle no longer inherits


# ---------------------------------------------------------------- RFT per step
def test_rft_kept_steps_keeps_steps_at_or_above_the_threshold_of_correct_valid_trajectories():
    from prorag.algorithms.rl import rft_kept_steps

    assert rft_kept_steps(True, True, [0.0, -0.01, 2.0]) == [True, False, True]  # at the threshold passes
    assert rft_kept_steps(True, True, [0.4, 0.6], threshold=0.5) == [False, True]
    assert rft_kept_steps(False, True, [2.0, 3.0]) == [False, False]
    assert rft_kept_steps(True, False, [2.0]) == [False]


def test_step_loss_mask_puts_the_loss_on_kept_steps_generated_tokens_only():
    from prorag.algorithms.rl import step_loss_mask

    # prompt 0-3; step 0 generated 3-6, documents 6-9; step 1 generated 9-11, glue 11; step 2 generated 12-14
    spans = [StepSpan(3, 6, 9), StepSpan(9, 11, 12), StepSpan(12, 14, 14)]
    assert step_loss_mask([True, False, True], spans, 14) == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert step_loss_mask([False, True, False], spans, 15) == [0] * 9 + [1, 1] + [0] * 4
    assert step_loss_mask([False] * 3, spans, 14) == [0] * 14
    with pytest.raises(ValueError, match="3 steps"):
        step_loss_mask([True], spans, 14)
    with pytest.raises(ValueError, match="does not fit"):
        step_loss_mask([True, True, True], spans, 13)


# ---------------------------------------------------------------- hop-balanced question draw
def test_hop_balanced_sample_draws_evenly_over_hop_counts_where_available():
    from collections import Counter

    from prorag.algorithms.rl import hop_balanced_sample

    hops = [1] * 40 + [2] * 30 + [3] * 5 + [4] * 25
    drawn = hop_balanced_sample(hops, 40, seed=1)
    assert drawn == sorted(set(drawn)) and len(drawn) == 40
    # 4 hop counts, 10 each; 3 hops has only 5: its other 5 are shared by the rest (counts differ by at most one)
    counts = Counter(hops[i] for i in drawn)
    assert counts[3] == 5 and sorted(counts[h] for h in (1, 2, 4)) == [11, 12, 12]
    assert hop_balanced_sample(hops, 40, seed=1) == drawn  # the seed fixes the draw
    assert hop_balanced_sample(hops, 40, seed=2) != drawn
    even = Counter(hops[i] for i in hop_balanced_sample(hops, 16, seed=0))
    assert even == {1: 4, 2: 4, 3: 4, 4: 4}
    # n = 0 or at least every question: all of them, in order
    assert hop_balanced_sample(hops, 0, seed=1) == hop_balanced_sample(hops, 500, seed=1) == list(range(100))


def test_all_lists_every_public_function_and_constant():
    import inspect

    import prorag.algorithms.rl as rl

    public = {n for n, v in vars(rl).items() if not n.startswith("_") and (
        (inspect.isfunction(v) and v.__module__ == rl.__name__) or n.isupper())}
    assert set(rl.__all__) == public
