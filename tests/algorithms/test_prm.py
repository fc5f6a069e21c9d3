"""prorag.algorithms.prm against hand-computed values."""

import math

import pytest
import torch

from prorag.algorithms import prm
from prorag.tokens import StepSpan


def test_score_positions_are_each_steps_last_token():
    spans = [StepSpan(5, 9, 20), StepSpan(20, 26, 26)]
    assert prm.score_positions(spans) == [19, 25]
    with pytest.raises(ValueError):
        prm.score_positions([StepSpan(4, 4, 4)])


def test_left_truncate_keeps_prefix_and_newest_step():
    ids = list(range(10))
    out, pos = prm.left_truncate(ids, [3, 5, 9], max_len=6, keep_prefix=2)
    # 4 tokens cut right after the prefix [0, 1]: [0, 1, 6, 7, 8, 9]
    assert out == [0, 1, 6, 7, 8, 9]
    assert pos == [None, None, 5]
    assert out[pos[-1]] == ids[9]
    # short sequences are untouched
    assert prm.left_truncate(ids, [9], max_len=10) == (ids, [9])
    # a prefix longer than the room shrinks, never the newest token
    out, pos = prm.left_truncate(ids, [9], max_len=3, keep_prefix=8)
    assert len(out) == 3 and out[pos[0]] == 9
    with pytest.raises(ValueError):
        prm.left_truncate(ids, [9], max_len=0)


def test_bradley_terry_loss():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    want = (-math.log(1 / (1 + math.exp(-2.0))) + math.log(2.0)) / 2
    assert prm.bradley_terry_loss(c, r).item() == pytest.approx(want, rel=1e-6)
    assert prm.bradley_terry_loss(c, r, margin=torch.tensor([2.0, 0.0])).item() == pytest.approx(math.log(2.0))


def test_verdict_loss_asks_accepted_steps_above_zero_and_rejected_below():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([-1.0, 0.0])
    sp = lambda x: math.log1p(math.exp(x))  # -log sigmoid(-x)
    want = ((sp(-2.0) + sp(-1.0)) / 2 + (sp(0.0) + sp(0.0)) / 2) / 2
    assert prm.verdict_loss(c, r).item() == pytest.approx(want, rel=1e-6)
    # unlike Bradley-Terry, a shift of both scores changes it: the level of a kind is no longer free
    assert prm.bradley_terry_loss(c + 5, r + 5).item() == pytest.approx(prm.bradley_terry_loss(c, r).item())
    assert prm.verdict_loss(c + 5, r + 5).item() != pytest.approx(prm.verdict_loss(c, r).item())
    assert prm.verdict_loss(torch.tensor([30.0]), torch.tensor([-30.0])).item() < 1e-6


def _fit_two_kinds(verdict_weight: float):
    """A scorer w * x + b[kind] on pairs within two kinds (chosen x = +1, rejected x = -1), its kind levels
    starting apart (+8, -8) as a fine-tuned trunk's may; returns (chosen scores, rejected scores) of both kinds."""
    w, b = torch.zeros(1, requires_grad=True), torch.tensor([8.0, -8.0], requires_grad=True)
    kind = torch.tensor([0, 1])
    opt = torch.optim.SGD([w, b], lr=0.5)
    for _ in range(300):
        c, r = w + b[kind], -w + b[kind]
        loss = prm.bradley_terry_loss(c, r) + verdict_weight * prm.verdict_loss(c, r)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (w + b[kind]).tolist(), (-w + b[kind]).tolist()


def test_verdict_loss_puts_kinds_on_one_scale_where_bradley_terry_leaves_them():
    c, r = _fit_two_kinds(0.0)
    assert all(x > y for x, y in zip(c, r))  # within a kind both rank right
    assert prm.auc(c, r) < 1.0  # across kinds kind 0's rejected step outscores kind 1's chosen one
    c, r = _fit_two_kinds(1.0)
    assert prm.auc(c, r) == 1.0 and min(c) > 0 > max(r)


def test_pairwise_accuracy_and_auc():
    assert prm.pairwise_accuracy([1.0, 0.0, 2.0], [0.0, 1.0, 2.0]) == pytest.approx(0.5)
    assert prm.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert prm.auc([0.1], [0.9]) == 0.0
    # ties count half: positives [0.5, 0.9] vs negatives [0.5, 0.1] -> (0.5 + 1 + 1 + 1) / 4
    assert prm.auc([0.5, 0.9], [0.5, 0.1]) == pytest.approx(0.875)
    with pytest.raises(ValueError):
        prm.auc([], [0.1])


def test_shared_prefix_length_compares_ids():
    assert prm.shared_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert prm.shared_prefix_length([1, 2], [1, 2, 3]) == 2
    assert prm.shared_prefix_length([7], [1]) == 0
    assert prm.shared_prefix_length([], [1]) == 0


def test_branch_attention_by_hand():
    # row 0: prefix 2, chosen 2, rejected 1, one padding token; row 1: a plain sequence of 3, then padding
    allowed, positions = prm.branch_attention([(2, 2, 1), (3, 0, 0)], 6)
    assert allowed.shape == (2, 6, 6) and allowed.dtype == torch.bool and positions.shape == (2, 6)
    expect0 = [[1, 0, 0, 0, 0, 0],
               [1, 1, 0, 0, 0, 0],
               [1, 1, 1, 0, 0, 0],  # chosen: the prefix and itself, causally
               [1, 1, 1, 1, 0, 0],
               [1, 1, 0, 0, 1, 0],  # rejected: the prefix and itself, never the chosen tokens
               [0, 0, 0, 0, 0, 1]]  # padding: only itself
    expect1 = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
               [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert allowed[0].int().tolist() == expect0
    assert allowed[1].int().tolist() == expect1
    # the rejected step continues the prefix at position 2, as in a sequence of its own
    assert positions.tolist() == [[0, 1, 2, 3, 2, 0], [0, 1, 2, 0, 0, 0]]
    # every query attends to at least one key (softmax stays defined), none to a later one
    assert allowed.any(-1).all() and not (allowed & ~torch.ones(6, 6, dtype=torch.bool).tril()).any()
    with pytest.raises(ValueError):
        prm.branch_attention([(4, 2, 1)], 6)
    with pytest.raises(ValueError):
        prm.branch_attention([(2, -1, 1)], 6)


def test_join_pair_and_when_it_declines():
    ids, counts, c_at, r_at = prm.join_pair([1, 2, 3, 4], 3, [1, 2, 5, 6, 7], 4, max_len=8)
    assert ids == [1, 2, 3, 4, 5, 6, 7] and counts == (2, 2, 3)
    assert ids[c_at] == 4 and ids[r_at] == 7
    # a score position before the renderings' end reads from its own branch
    assert prm.join_pair([1, 2, 3, 4], 2, [1, 2, 5, 6, 7], 3, max_len=8)[2:] == (2, 5)
    assert prm.join_pair([9, 2, 3], 2, [1, 2, 3], 2, max_len=8) is None  # nothing shared
    assert prm.join_pair([1, 2, 3], 2, [1, 2, 3, 4], 3, max_len=8) is None  # chosen's score token is shared
    assert prm.join_pair([1, 2, 3], 2, [1, 2, 4], 2, max_len=2) is None  # truncation would cut them apart


def test_written_positions_are_the_policys_tokens_inside_each_span():
    spans = [StepSpan(3, 6, 9), StepSpan(9, 12, 12)]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]  # step 0: written 3-5, documents 6-7, closing tag 8 written
    assert prm.written_positions(spans, mask) == [[3, 4, 5, 8], [9, 10, 11]]


def test_left_truncate_steps_shifts_written_indices_and_drops_those_cut():
    ids = list(range(20))
    written = [[3, 4, 5], [8, 9], [15, 16, 17]]
    cut, pos, kept = prm.left_truncate_steps(ids, [6, 10, 19], written, max_len=12, keep_prefix=2)
    assert cut == ids[:2] + ids[10:]  # 8 tokens after the prompt cut
    assert pos == [None, 2, 11]
    assert kept == [[], [], [7, 8, 9]]
    # nothing to cut: as given
    assert prm.left_truncate_steps(ids, [6], [[3, 4]], max_len=20) == (ids, [6], [[3, 4]])


def test_predecessors_continue_the_prefix_for_the_second_branch():
    # prefix 5, first branch 3 (5-7), second branch 4 (8-11): token 8 follows the prefix, not the first branch
    assert prm.predecessors([3, 5, 6, 8, 9, 11], (5, 3, 4)) == [2, 4, 5, 4, 8, 10]
    assert prm.predecessors([5, 8], (9, 0, 0)) == [4, 7]  # a plain row
    with pytest.raises(ValueError, match="predecessor"):
        prm.predecessors([0], (4, 0, 0))


def test_mean_per_step_averages_each_steps_values_and_gives_zero_to_an_empty_step():
    values = torch.tensor([-1.0, -3.0, -0.5, -2.0])
    got = prm.mean_per_step(values, torch.tensor([0, 0, 2, 2]), 3)
    assert torch.allclose(got, torch.tensor([-2.0, 0.0, -1.25]))
