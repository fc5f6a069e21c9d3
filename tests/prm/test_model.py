"""The PRM scores every step of a trajectory in one forward pass, equal to scoring each prefix alone."""

import pytest
import torch

from prorag.errors import InvalidArgument, NotFound
from prorag.modeling import save_pretrained
from prorag.prm.model import load_prm, prm_from_policy, score_batch


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
