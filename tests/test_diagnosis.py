"""prorag.diagnosis: solve-rate bins, the sampled tokens' entropy, wins and losses by bin, and the reading."""

import math

import pytest

from prorag.diagnosis import SOLVE_RATE_BINS, reading, solve_rate_bin, token_entropy, wins_losses_by_bin


def test_solve_rate_bins_split_never_rarely_often_always():
    assert [solve_rate_bin(r) for r in (0.0, 0.125, 0.5, 0.625, 0.875, 1.0)] == [
        "never", "rarely", "rarely", "often", "often", "always"]
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        solve_rate_bin(1.5)


def test_token_entropy_is_the_mean_negative_log_prob_of_the_sampled_tokens():
    # a uniform choice among 4 tokens: every sampled token has log p = -log 4, the entropy log 4
    assert token_entropy([[-math.log(4)] * 3, [-math.log(4)]]) == pytest.approx(math.log(4))
    assert token_entropy([]) == token_entropy([[]]) == 0.0


def test_wins_and_losses_are_counted_per_bin_over_questions_both_sides_answered():
    model = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.5, "e": 1.0}
    ref = {"a": 0.0, "b": 1.0, "c": 0.5, "d": 0.0}  # e: no reference answer, left out
    bins = {"a": "rarely", "b": "always", "c": "rarely", "d": "often", "e": "never"}
    out = wins_losses_by_bin(model, ref, bins)
    assert set(out) == set(SOLVE_RATE_BINS)
    assert out["rarely"] == {"n": 2, "wins": 1, "losses": 0, "ties": 1, "diff": 0.5}
    assert out["always"] == {"n": 1, "wins": 0, "losses": 1, "ties": 0, "diff": -1.0}
    assert out["never"] == {"n": 0, "wins": 0, "losses": 0, "ties": 0, "diff": 0.0}
    with pytest.raises(ValueError, match="not one of"):
        wins_losses_by_bin(model, ref, {"a": "sometimes"})


def test_the_reading_puts_unseen_questions_first():
    up, flat, down = [0.01, 0.04], [-0.01, 0.02], [-0.04, -0.01]
    assert reading(up, up, 0.0, 0.0) == "learns"
    assert reading(up, down, 0.1, -0.5) == "drifts"  # a gain on the pool does not hide a loss on new questions
    assert reading(up, flat, 0.1, -0.5) == "memorises"
    assert reading(flat, flat, 0.05, -0.2) == "sharpens"
    assert reading(flat, flat, 0.05, 0.1) == reading(flat, flat, -0.01, -0.2) == "no change"
    assert reading(None, None, 0.0, 0.0) == "no change"
