"""prorag.probes: the name-copy probe scores a model that copies near 1 and one that cannot near 0."""

import pytest
import torch

from prorag.probes import copy_rows, name_copy_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["Rasho Dry", "Mai Brewery", "Delshild Builders", "Flogrurk Zymell", "Daisramburg", "Eand", "Kessaro Tor",
         "Brandvale"]


class Copier(torch.nn.Module):
    """Ideal copying: predicts token t+1 as what followed the longest earlier match of the context ending at t."""

    training = False

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, 4096)
        for b in range(B):
            ids = input_ids[b].tolist()
            for t in range(T):
                best, nxt = 0, 0
                for s in range(t):
                    n = 0
                    while n <= s and ids[s - n] == ids[t - n]:
                        n += 1
                    if n > best:
                        best, nxt = n, ids[s + 1]
                logits[b, t, nxt] = 1.0
        return type("Out", (), {"logits": logits})()


def test_rows_repeat_each_name_with_the_same_ids(tiny_policy):
    _, tok = tiny_policy
    (ids, scored), = copy_rows(tok, NAMES[:4], per_row=4)
    lengths = [len(tok.encode(n, add_special_tokens=False)) for n in NAMES[:4]]
    assert sum(scored) == sum(n - 1 for n in lengths)  # every repeated token but each name's first
    first_half = len(ids) // 2
    assert not any(scored[:first_half]) and ids[:first_half] == ids[first_half:]  # the second half repeats the first


def test_an_ideal_copier_scores_one_and_a_random_model_near_zero(tiny_policy):
    model_dir, tok = tiny_policy
    ideal = name_copy_accuracy(Copier(), tok, NAMES)
    assert ideal["names"] == 8 and ideal["token_accuracy"] == 1.0 and ideal["name_accuracy"] == 1.0
    from prorag.modeling import load_policy

    model, _ = load_policy(model_dir)
    random_model = name_copy_accuracy(model, tok, NAMES)
    assert random_model["names"] == 8
    assert random_model["name_accuracy"] <= 0.25 < ideal["name_accuracy"]


def test_too_few_names_is_a_clear_error(tiny_policy):
    with pytest.raises(ValueError, match="at least 4 distinct names"):
        name_copy_accuracy(Copier(), tiny_policy[1], NAMES[:3])
