"""The PRM scores every step of a trajectory in one forward pass, equal to scoring each prefix alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prorag.errors import FailedPrecondition, InvalidArgument, NotFound
from prorag.modeling import save_pretrained
from prorag.prm.model import LIKELIHOOD_WEIGHT, likelihood_weight, load_prm, prm_from_policy, score_batch


@pytest.fixture(scope="module")
def prm(tiny_policy):
    model_dir, _ = tiny_policy
    model, tok = prm_from_policy(model_dir, seed=1)
    return model.eval(), tok


def test_one_pass_equals_each_prefix(prm):
    model, tok = prm
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(300, len(tok), (40,), generator=g).tolist(),
            torch.randint(300, len(tok), (23,), generator=g).tolist()]
    positions = [[9, 25, 39], [4, 22]]
    with torch.no_grad():
        together = score_batch(model, seqs, positions, max_len=512, pad_id=tok.pad_token_id)
        for ids, pos, got in zip(seqs, positions, together):
            for p, s in zip(pos, got):
                alone = score_batch(model, [ids[:p + 1]], [[p]], max_len=512, pad_id=tok.pad_token_id)[0][0]
                assert float(s) == pytest.approx(float(alone), abs=1e-5)
    # the scores differ between steps: the head is not a constant
    assert len({round(float(s), 6) for s in together[0]}) == 3


def test_padding_does_not_change_a_score(prm):
    """A short row padded to a long one (no padding mask: the padding is on the right of a causal model) scores as it
    does alone, whatever token pads it."""
    model, tok = prm
    g = torch.Generator().manual_seed(1)
    short, long_ = (torch.randint(300, len(tok), (n,), generator=g).tolist() for n in (7, 120))
    with torch.no_grad():
        alone = [float(s) for s in score_batch(model, [short], [[2, 6]], max_len=512)[0]]
        for pad in (tok.pad_token_id, 0, 301):
            padded = score_batch(model, [long_, short], [[119], [2, 6]], max_len=512, pad_id=pad)[1]
            assert [float(s) for s in padded] == pytest.approx(alone, abs=1e-5)


def test_left_truncation_keeps_the_newest_step(prm):
    model, tok = prm
    ids = list(range(300, 360))
    with torch.no_grad():
        full = score_batch(model, [ids], [[5, 59]], max_len=20, pad_id=tok.pad_token_id, keep_prefix=4)[0]
    assert full[0] is None and full[1] is not None


def test_save_load_round_trip(prm, tmp_path):
    model, tok = prm
    save_pretrained(model, tok, tmp_path / "prm")
    loaded, _ = load_prm(tmp_path / "prm")
    ids = [[301, 302, 303, 304]]
    with torch.no_grad():
        a = score_batch(model, ids, [[3]], 512)[0][0]
        b = score_batch(loaded, ids, [[3]], 512)[0][0]
    assert float(a) == pytest.approx(float(b), abs=1e-6)


def test_bad_paths_and_models(tiny_policy, tmp_path):
    with pytest.raises(NotFound):
        prm_from_policy(tmp_path / "missing")
    with pytest.raises(NotFound):
        load_prm(tmp_path / "missing")
    with pytest.raises(InvalidArgument):
        load_prm(tiny_policy[0])  # a causal LM's config has no 1-output head


def _written_logp(policy_dir, ids, written):
    """Mean log-probability of each written index under the policy as a causal LM (the reference the readout equals
    before training: the PRM's trunk is the policy's)."""
    lm = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return [sum(float(logp[j - 1, ids[j]]) for j in w) / len(w) for w in written]


def test_likelihood_readout_adds_the_trunks_mean_log_probability_of_the_written_tokens(tiny_policy, tmp_path):
    model_dir, tok = tiny_policy
    model, _ = prm_from_policy(model_dir, seed=1, likelihood_weight=0.5)
    model.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(300, len(tok), (40,), generator=g).tolist()
    positions, written = [12, 39], [[5, 6, 7, 12], [30, 31, 39]]
    with torch.no_grad():
        got = [float(s) for s in score_batch(model, [ids], [positions], 512, written=[written])[0]]
        setattr(model.config, LIKELIHOOD_WEIGHT, 0.0)
        head = [float(s) for s in score_batch(model, [ids], [positions], 512)[0]]
        setattr(model.config, LIKELIHOOD_WEIGHT, 0.5)
    expected = [h + 0.5 * lp for h, lp in zip(head, _written_logp(model_dir, ids, written))]
    assert got == pytest.approx(expected, abs=1e-4)
    assert abs(got[0] - head[0]) > 0.1  # the readout is not negligible beside the head
    # the readout alone (the policy's own preference, whatever the PRM's weight): no head, weight 1
    with torch.no_grad():
        alone_ll = [float(s) for s in score_batch(model, [ids], [positions], 512, written=[written],
                                                  likelihood_only=True)[0]]
    assert alone_ll == pytest.approx(_written_logp(model_dir, ids, written), abs=1e-4)
    # a step scored with the rest of its trajectory scores as its prefix alone, and left truncation keeps the newest
    with torch.no_grad():
        alone = float(score_batch(model, [ids[:13]], [[12]], 512, written=[[written[0]]])[0][0])
        cut = score_batch(model, [ids], [positions], max_len=20, keep_prefix=2, written=[written])[0]
    assert alone == pytest.approx(got[0], abs=1e-5)
    assert cut[0] is None and cut[1] is not None
    # the weight travels with the saved PRM, and scoring it without written indices is refused
    save_pretrained(model, tok, tmp_path / "prm")
    loaded, _ = load_prm(tmp_path / "prm")
    assert likelihood_weight(loaded) == 0.5
    with torch.no_grad():
        assert [float(s) for s in score_batch(loaded, [ids], [positions], 512, written=[written])[0]] == \
            pytest.approx(got, abs=1e-5)
        with pytest.raises(InvalidArgument, match="written"):
            score_batch(loaded, [ids], [positions], 512)


def test_likelihood_readout_needs_tied_embeddings(tiny_policy, tmp_path):
    model_dir, tok = tiny_policy
    untied = AutoModelForCausalLM.from_pretrained(str(model_dir))
    untied.config.tie_word_embeddings = False
    save_pretrained(untied, tok, tmp_path / "untied")
    with pytest.raises(FailedPrecondition, match="not tied"):
        prm_from_policy(tmp_path / "untied", likelihood_weight=1.0)
    assert likelihood_weight(prm_from_policy(tmp_path / "untied")[0]) == 0.0  # the head alone still works
