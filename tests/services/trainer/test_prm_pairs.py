"""The PRM stage's shared-prefix pair encoding (pair_encoding "shared"): one sequence per pair, the rejected step
masked from the chosen one, gives the scores and Bradley-Terry gradients of two full sequences; pairs it cannot
join fall back to two sequences."""

import pytest
import torch

from prorag.algorithms.prm import bradley_terry_loss
from prorag.errors import InvalidArgument
from prorag.prm.model import LIKELIHOOD_WEIGHT
from services.trainer.stage_prm import encode_pairs, pair_rows, pair_scores
from tests.helpers import founder_pairs

PAD = 0


def _prm(attn: str, seed: int = 0, likelihood: float = 0.0):
    """A randomly initialised two-layer Qwen3 PRM (scalar token head), in eval mode: the head's dropout off;
    likelihood: its likelihood readout's weight (prorag.prm.model)."""
    from transformers import Qwen3Config, Qwen3ForTokenClassification

    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      num_labels=1, pad_token_id=PAD, tie_word_embeddings=True)
    setattr(cfg, LIKELIHOOD_WEIGHT, likelihood)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen3ForTokenClassification(cfg)
    with torch.no_grad():  # a head large enough that the scores differ well above float rounding
        model.score.weight.normal_(0, 0.2)
    return model.eval()


def _pairs(shapes, seed=0):
    """Encoded pairs (chosen ids, position, rejected ids, position) of random tokens: (prefix, chosen tail,
    rejected tail) lengths per pair, the tails differing at their first token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, a, b in shapes:
        prefix = torch.randint(3, 300, (p,), generator=g).tolist()
        c, r = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (a, b))
        r[0] = c[0] % 297 + 3 if r[0] == c[0] else r[0]
        out.append((prefix + c, p + a - 1, prefix + r, p + b - 1))
    return out


def _with_written(pairs):
    """The pairs with written-token indices: each step's own tokens and the prefix's last three (a step can start
    before the two renderings part)."""
    out = []
    for c, c_pos, r, r_pos in pairs:
        n = next(k for k, (x, y) in enumerate(zip(c, r)) if x != y)
        out.append((c, c_pos, r, r_pos, list(range(max(1, n - 3), c_pos + 1)), list(range(max(1, n - 3), r_pos + 1))))
    return out


SHAPES = [(30, 5, 9), (12, 20, 3), (57, 4, 4), (3, 1, 11)]  # joined lengths 44, 35, 65, 15: padded rows


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_scores_equal_two_sequence_scores(attn):
    model, batch = _prm(attn), _pairs(SHAPES)
    with torch.no_grad():
        c_old, r_old, t_old = pair_scores(model, batch, 512, PAD, encoding="separate")
        c_new, r_new, t_new = pair_scores(model, batch, 512, PAD, encoding="shared")
    assert torch.allclose(c_new, c_old, atol=1e-5, rtol=0) and torch.allclose(r_new, r_old, atol=1e-5, rtol=0)
    assert (c_old - r_old).abs().min() > 1e-3  # the comparison is not between constants
    assert t_old == sum(2 * p + a + b for p, a, b in SHAPES) and t_new == sum(p + a + b for p, a, b in SHAPES)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_gradients_equal_two_sequence_gradients(attn):
    model, batch = _prm(attn), _pairs(SHAPES, seed=1)
    grads = {}
    for encoding in ("separate", "shared"):
        model.zero_grad()
        chosen, rejected, _ = pair_scores(model, batch, 512, PAD, encoding=encoding)
        bradley_terry_loss(chosen, rejected).backward()
        grads[encoding] = {n: p.grad.clone() for n, p in model.named_parameters()}
    worst = max((grads["shared"][n] - g).abs().max().item() for n, g in grads["separate"].items())
    assert worst < 1e-5
    assert max(g.abs().max().item() for g in grads["separate"].values()) > 1e-3


def test_pairs_that_share_no_prefix_or_exceed_max_len_fall_back():
    model = _prm("sdpa")
    joined = _pairs([(10, 4, 6)], seed=2)
    other = _pairs([(0, 5, 7)], seed=3)  # nothing shared: the tails differ at the first token
    long_ = _pairs([(30, 8, 2)], seed=4)  # chosen 38 tokens > max_len 36: left truncation cuts it alone
    batch = joined + other + long_
    seqs, branches, pos, written = pair_rows(batch, 36, encoding="shared")
    assert written is None  # these pairs carry no written indices
    assert branches == [(10, 4, 6), (5, 0, 0), (7, 0, 0), (36, 0, 0), (32, 0, 0)]
    assert pos == [[13, 19], [4], [6], [35], [31]]
    with torch.no_grad():
        old = pair_scores(model, batch, 36, PAD, encoding="separate")
        new = pair_scores(model, batch, 36, PAD, encoding="shared")
    assert torch.allclose(torch.stack(new[:2]), torch.stack(old[:2]), atol=1e-5, rtol=0)
    # a batch with nothing to join is scored unmasked, as "separate" scores it
    with torch.no_grad():
        assert torch.equal(torch.stack(pair_scores(model, other, 36, PAD, encoding="shared")[:2]),
                           torch.stack(pair_scores(model, other, 36, PAD, encoding="separate")[:2]))
    # "separate" never joins
    assert all(b[1:] == (0, 0) for b in pair_rows(joined, 512, encoding="separate")[1])


def test_an_attention_without_custom_masks_is_refused():
    model = _prm("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(InvalidArgument, match="custom attention mask"):
        pair_scores(model, _pairs(SHAPES[:1]), 512, PAD, encoding="shared")


def test_rendered_pairs_share_their_prefix_token_for_token(tiny_policy):
    """The stage's renderings (prm_inputs of context + step) of real pairs join: the question, documents and
    earlier steps tokenise alike before either step."""
    model_dir, tok = tiny_policy
    batch = encode_pairs(tok, founder_pairs(6, 0, value=False), "judge")
    seqs, branches, _, written = pair_rows(batch, 512)
    assert len(seqs) == len(batch) and all(b[1] > 0 and b[2] > 0 for b in branches)
    # the prefix is most of a pair's tokens
    assert sum(b[0] for b in branches) > sum(b[1] + b[2] for b in branches)
    # each step's written indices come along, pointing at the same tokens in the joined row
    for ids, (c_ids, _, r_ids, _, c_w, r_w), w in zip(seqs, batch, written):
        assert c_w and r_w
        assert [ids[i] for i in w[0]] == [c_ids[j] for j in c_w]
        assert [ids[i] for i in w[1]] == [r_ids[j] for j in r_w]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_with_a_likelihood_readout_shared_scores_and_gradients_equal_two_sequences(attn):
    """The readout's second-branch tokens are predicted by the prefix's last output, as in a sequence of their own."""
    model, batch = _prm(attn, seed=2, likelihood=1.0), _with_written(_pairs(SHAPES, seed=5))
    grads, scores = {}, {}
    for encoding in ("separate", "shared"):
        model.zero_grad()
        chosen, rejected, _ = pair_scores(model, batch, 512, PAD, encoding=encoding)
        bradley_terry_loss(chosen, rejected).backward()
        scores[encoding] = (chosen.detach(), rejected.detach())
        grads[encoding] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(scores["shared"], scores["separate"]))
    worst = max((grads["shared"][n] - g).abs().max().item() for n, g in grads["separate"].items())
    assert worst < 1e-5
    # the readout moves the scores: the head alone gives others
    setattr(model.config, LIKELIHOOD_WEIGHT, 0.0)
    with torch.no_grad():
        head_only = pair_scores(model, batch, 512, PAD, encoding="shared")[0]
    assert (head_only - scores["shared"][0]).abs().min() > 1.0  # mean log-prob of ~300-way random tokens: ~ -5.7
