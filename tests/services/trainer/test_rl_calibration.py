"""The RL stage's calibrated process term on real rollouts (tiny world, the scripted policy of test_rl_stage and
a real policy server): with prm_centering=per_kind the advantages do not move when the PRM scores one kind of step
at another offset, and a process_std_floor far above a group's spread leaves only the outcome term."""

from __future__ import annotations

import random

import pytest

from tests.services.trainer.scripted_stack import scripted_stack
from tests.services.trainer.test_rl_stage import RecordingGoldWalk, _config, _push_zero_adapter


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    with scripted_stack(tmp_path_factory.mktemp("rl-calibration") / "data", RecordingGoldWalk) as stack:
        yield stack


def test_per_kind_centring_ignores_a_kind_offset_and_a_high_std_floor_leaves_the_outcome(services, tmp_path,
                                                                                         one_thread, monkeypatch):
    from prorag import paths
    from prorag.rpc.clients import PolicyClient
    from prorag.data.loaders import load_split
    from prorag.rpc.pbconv import step_from_pb
    from prorag.algorithms.rl import ADVANTAGE_ESTIMATORS
    from services.trainer.rl_collect import advantages, roll_out

    defaults = _config(services)
    assert (defaults.prm_centering, defaults.process_std_floor) == ("none", 0.0)  # the reference, unless asked
    key = _push_zero_adapter(services, tmp_path, "calibration")
    qs = load_split(paths.world_dir("tiny"), "train")[:3]
    with PolicyClient(services["policy"]) as policy:
        counts = {"sampled": 0, "kept": 0, "dropped_stale": 0, "dropped_foreign": 0, "dropped_too_long": 0,
                  "service_retries": 0}
        kept, lags = roll_out(defaults, qs, 0, "calibration", key, policy, counts)
    steps = [[step_from_pb(s) for s in t.steps] for t in kept]
    kinds = {s.kind for ss in steps for s in ss}
    assert len(kept) == 12 and {"subquery", "answer"} <= kinds

    rng = random.Random(0)
    logits = [[rng.gauss(0.0, 1.0) for _ in ss] for ss in steps]
    # the offsets: gold subqueries near +1.7, sub-answers near +2.0, weak answers near -1.6
    offset = {"subquery": 1.7, "subanswer": 2.0, "answer": -1.6, "invalid": 0.5}
    shifted = [[x + offset[s.kind] for x, s in zip(xs, ss)] for xs, ss in zip(logits, steps)]

    def adv(cfg, lg):
        return [a for s in advantages(cfg, qs, 0, kept, lags, steps, lg, {}).samples for a in s.advantages]

    for normalization in ("token", "step"):
        centred = _config(services, prm_centering="per_kind", normalization=normalization)
        assert adv(centred, shifted) == pytest.approx(adv(centred, logits), abs=1e-9)
        raw = _config(services, normalization=normalization)
        assert adv(raw, shifted) != pytest.approx(adv(raw, logits), abs=1e-3)  # uncentred, the offset moves them
    # sigma floored far above every group's spread (step scores lie in [-2, 2]): beta x the process term is at
    # most 0.3 x 4 / 100, so every step gets about its outcome
    floored = adv(_config(services, process_std_floor=100.0), logits)
    assert floored == pytest.approx(adv(_config(services, beta=0.0), None), abs=0.3 * 4 / 100)
    assert floored != pytest.approx(adv(defaults, logits), abs=1e-3)

    # the estimator is the one the config names from ADVANTAGE_ESTIMATORS: a new one is a function and a row
    def outcome_sign(rewards, step_scores, step_tokens, beta, normalization, std_floor=0.0, scored=None):
        mean = sum(rewards) / len(rewards)
        return [[float((r > mean) - (r < mean))] * len(ns) for r, ns in zip(rewards, step_tokens)]

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "outcome_sign", outcome_sign)
    signed = _config(services)
    signed.advantage = "outcome_sign"  # the config's choices were read from the table before this row was added
    assert set(adv(signed, logits)) <= {-1.0, 0.0, 1.0} and set(adv(signed, logits)) != {0.0}
