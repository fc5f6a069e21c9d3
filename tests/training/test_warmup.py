"""The warm-up's data is a function of the step: same batch whenever and wherever it is drawn, phases in order."""

import pytest
import torch

from prorag.errors import InvalidArgument
from prorag.modeling import WarmupConfig
from prorag.training.warmup import WarmupBatches, warmup_loss
from prorag.data.warmup import Fact

DOCS = {"d1": '"city"\nThe city was founded by the band. The river is in the mountain.',
        "d2": '"film"\nThe film was directed by the president. The album is from the school.'}
FACTS = [Fact("d1", "Who founded the city?", "the band"), Fact("d2", "Who directed the film?", "the president"),
         Fact("d2", "Who was the director of the film?", "the president")]
CFG = WarmupConfig(copy_steps=2, copy_length=6, copy_min_length=4, copy_mix=2, sentence_steps=1, document_steps=1,
                   gap_steps=1, paraphrase_steps=1, retrieved_steps=1, copy_final_steps=1, distractors=1,
                   batch_size=3)


def _same(a, b):
    return a.tokens == b.tokens and len(a.parts) == len(b.parts) and all(
        torch.equal(x, y) and torch.equal(m, n) for (x, m), (y, n) in zip(a.parts, b.parts))


def test_a_step_s_batch_does_not_depend_on_what_was_drawn_before(tiny_policy):
    _, tok = tiny_policy
    forward = WarmupBatches(tok, DOCS, FACTS, CFG, seed=3)
    drawn = [forward(s) for s in range(CFG.total_steps)]
    backward = WarmupBatches(tok, DOCS, FACTS, CFG, seed=3)
    assert all(_same(backward(s), drawn[s]) for s in reversed(range(CFG.total_steps)))
    assert not _same(WarmupBatches(tok, DOCS, FACTS, CFG, seed=4)(0), drawn[0])


def test_phases_in_order_with_copy_rows_mixed_into_reading(tiny_policy):
    _, tok = tiny_policy
    batches = WarmupBatches(tok, DOCS, FACTS, CFG)
    assert [batches.phase_at(s) for s in range(CFG.total_steps)] == [
        "copy", "copy", 1, 2, 3, None, "gap", "paraphrase", "retrieved", "copy"]
    with pytest.raises(IndexError):
        batches.phase_at(CFG.total_steps)
    copy, reading = batches(0), batches(2)
    assert len(copy.parts) == 1 and copy.parts[0][0].shape[0] == 3
    assert len(reading.parts) == 2 and reading.parts[1][0].shape[0] == 2  # batch rows, then copy_mix rows
    x, m = copy.parts[0]
    length = x.shape[1] // 2
    assert torch.equal(x[:, :length], x[:, length:]) and m[:, :length + 1].sum() == 0 and m[:, length + 1:].all()
    assert reading.tokens == sum(int((x != tok.pad_token_id).sum()) for x, _ in reading.parts)


def test_loss_adds_up_the_parts_and_counts_real_tokens(tiny_policy):
    from prorag.modeling import build_model

    _, tok = tiny_policy
    model = build_model("tiny", tok)
    batch = WarmupBatches(tok, DOCS, FACTS, CFG)(2)
    loss, tokens = warmup_loss(model, batch)
    one = WarmupBatches(tok, DOCS, FACTS, WarmupConfig(**{**CFG.__dict__, "copy_mix": 0}))(2)
    assert tokens == batch.tokens and loss.item() > warmup_loss(model, one)[0].item() > 0


def test_nothing_to_read_or_paraphrase_is_refused(tiny_policy):
    _, tok = tiny_policy
    with pytest.raises(InvalidArgument, match="no facts"):
        WarmupBatches(tok, {}, FACTS, CFG)
    with pytest.raises(InvalidArgument, match="nothing to paraphrase"):
        WarmupBatches(tok, DOCS, FACTS[:2], CFG)


def test_a_step_s_rows_split_evenly_into_micro_batches(tiny_policy):
    """grad_accum > 1 (a launch on several processes): micro-batch i is a share of step i // k's rows, the shares
    together the step's batch; 1 is the batch itself; rows that do not split evenly are refused."""
    _, tok = tiny_policy
    cfg = WarmupConfig(**{**CFG.__dict__, "batch_size": 4})
    batches = WarmupBatches(tok, DOCS, FACTS, cfg)
    for step in (0, 2):
        whole = WarmupBatches(tok, DOCS, FACTS, cfg)(step)
        assert _same(batches.micro_batch(step, 1), whole)
        shares = [batches.micro_batch(step * 2 + j, 2) for j in range(2)]
        for p, (x, m) in enumerate(whole.parts):
            assert torch.equal(torch.cat([s.parts[p][0] for s in shares]), x)
            assert torch.equal(torch.cat([s.parts[p][1] for s in shares]), m)
        assert sum(s.tokens for s in shares) == whole.tokens
    with pytest.raises(InvalidArgument, match="grad_accum=3"):
        batches.micro_batch(0, 3)
