"""Issue 30's oracle ceiling and learnable question pool, against real retriever and policy servers on the tiny world
(the RL stage test's scripted engine: steps right 60% of the time, so some rollouts are right and some wrong):

- step_scorer=oracle scores each step with the reference judge on the gold decomposition, with no PRM service;
- the rlpool stage samples the start model, keeps the questions neither always nor never answered right, writes
  pool.json atomically and resumes from its journal;
- an RL job with question_pool draws only the pool's questions.

The pure parts (the oracle's per-step logits, pool membership and counts) are tested on hand-built inputs."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from prorag import paths
from prorag.algorithms.rl import group_step_advantages, step_score_reference
from prorag.config import from_dict
from prorag.data.loaders import Document, load_split
from prorag.errors import FailedPrecondition
from prorag.rpc.clients import PolicyClient
from prorag.training.context import local_context
from prorag.trajectory import Step
from services.trainer.rl_config import RLConfig
from services.trainer.stage_rl import (ORACLE_LOGIT, collect, hop_balanced_draw, oracle_step_logits, pool_questions,
                                       read_question_pool, run_rl)
from services.trainer.stage_rlpool import RLPoolConfig, learnable, pool_counts, run_rlpool
from tests.search.test_judging import DOC1, Q  # the judging tests' two-hop question and its first document
from tests.services.trainer.scripted_stack import scripted_stack
from tests.services.trainer.test_rl_stage import RecordingGoldWalk, _config, _journal, _push_zero_adapter

#: nothing listens here: a job that asked this "PRM" anything would fail (service_wait_s=0)
DEAD_PRM = "127.0.0.1:9"

DOC2 = Document(id="d2", title="Tova Lunn", text="Tova Lunn was born in Edraand.",
                contents='"Tova Lunn"\nTova Lunn was born in Edraand.')
DOC3 = Document(id="d3", title="Kest", text="Kest was founded by Aro Vell.",
                contents='"Kest"\nKest was founded by Aro Vell.')


# ---------------------------------------------------------------- the oracle, pure
def test_oracle_logits_follow_the_reference_judge_step_by_step():
    sound = [Step("subquery", content="Who founded Mai Brewery?", docs=[DOC1]),
             Step("subanswer", content="Tova Lunn"),
             Step("subquery", content="Where was Tova Lunn born?", docs=[DOC2]),
             Step("subanswer", content="Edraand"),
             Step("answer", content="Edraand")]
    assert oracle_step_logits(Q, sound) == [ORACLE_LOGIT] * 5
    flawed = [Step("subquery", content="Who founded Kest?", docs=[DOC3]),  # wrong entity for hop 1
              Step("subanswer", content="Tova Lunn"),  # right name, but the last search's document lacks it
              Step("subquery", content="Who founded Kest?", docs=[DOC3]),  # a repeated search
              Step("invalid", text="garbage"),
              Step("answer", content="Norway")]
    assert oracle_step_logits(Q, flawed) == [-ORACLE_LOGIT] * 5
    # each step is judged after the steps before it: the same sub-answer is sound once its document was retrieved
    mixed = [Step("subquery", content="Who founded Kest?", docs=[DOC3]),
             Step("subquery", content="Who founded Mai Brewery?", docs=[DOC1]),
             Step("subanswer", content="Tova Lunn")]
    assert oracle_step_logits(Q, mixed) == [-ORACLE_LOGIT, ORACLE_LOGIT, ORACLE_LOGIT]
    assert oracle_step_logits(Q, []) == []


def test_oracle_scores_sit_on_the_prm_scale_and_the_process_term_prefers_sound_steps():
    # through the reference step score: sound 2, unsound but valid 1, invalid -2 (a sure PRM's extremes)
    good = [Step("subquery", content="Who founded Mai Brewery?", docs=[DOC1]), Step("subanswer", content="Tova Lunn")]
    bad = [Step("subquery", content="Who founded Kest?", docs=[DOC3]), Step("invalid", text="??")]
    scores = [[step_score_reference(x, s.valid) for x, s in zip(oracle_step_logits(Q, t), t)] for t in (good, bad)]
    assert scores[0] == pytest.approx([2.0, 2.0], abs=1e-4) and scores[1] == pytest.approx([1.0, -2.0], abs=1e-4)
    # same outcome reward: only the process term differs, and it ranks the sound steps first
    adv = group_step_advantages([1.0, 1.0], scores, [[5, 3], [5, 3]], beta=0.3, normalization="step")
    assert min(adv[0]) > max(adv[1]) and adv[1][0] > adv[1][1]


# ---------------------------------------------------------------- the pool, pure
def test_a_question_is_learnable_when_its_samples_are_neither_all_right_nor_all_wrong():
    assert learnable([True] + [False] * 7) and learnable([True] * 7 + [False])
    assert not learnable([True] * 8) and not learnable([False] * 8) and not learnable([])
    rows = [{"hops": 1, "correct": [True, True]}, {"hops": 2, "correct": [True, False]},
            {"hops": 2, "correct": [False, False]}, {"hops": 3, "correct": [False, True]}]
    c = pool_counts(rows)
    assert (c["candidates"], c["all_right"], c["all_wrong"], c["learnable"]) == (4, 1, 1, 2)
    assert c["by_hops"] == {"1": {"candidates": 1, "all_right": 1, "all_wrong": 0, "learnable": 0},
                            "2": {"candidates": 2, "all_right": 0, "all_wrong": 1, "learnable": 1},
                            "3": {"candidates": 1, "all_right": 0, "all_wrong": 0, "learnable": 1}}


def test_pool_questions_keep_the_splits_order_and_a_pool_of_another_split_is_refused(tmp_path):
    qs = [SimpleNamespace(id=f"q{i}") for i in range(5)]
    assert [q.id for q in pool_questions(qs, ["q3", "q1", "zz"])] == ["q1", "q3"]
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"world": "tiny", "split": "dev", "pool": ["q1"]}))
    with pytest.raises(FailedPrecondition, match="split 'dev'"):
        read_question_pool(path, "tiny", "train")
    assert read_question_pool(path, "tiny", "dev") == ["q1"]
    with pytest.raises(FailedPrecondition, match="does not exist"):
        read_question_pool(tmp_path / "none.json", "tiny", "dev")
    with pytest.raises(FailedPrecondition, match="records no solve rate for 1 of its questions"):
        read_question_pool(path, "tiny", "dev", max_solve_rate=0.5)


def test_pool_max_solve_rate_keeps_the_questions_the_agent_mostly_fails(tmp_path):
    rates = {"q1": 0.125, "q2": 0.5, "q3": 0.625, "q4": 0.875, "q5": 0.0}  # q5: all wrong, not in the pool
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"world": "tiny", "split": "train", "pool": ["q1", "q2", "q3", "q4"],
                                "questions": {q: {"solve_rate": r} for q, r in rates.items()}}))
    assert read_question_pool(path, "tiny", "train") == ["q1", "q2", "q3", "q4"]
    assert read_question_pool(path, "tiny", "train", max_solve_rate=0.5) == ["q1", "q2"]
    assert read_question_pool(path, "tiny", "train", max_solve_rate=0.1) == []
    del rates["q3"]  # a hand-edited pool: a question without its rate is named, not a KeyError
    path.write_text(json.dumps({"world": "tiny", "split": "train", "pool": ["q1", "q2", "q3", "q4"],
                                "questions": {q: {"solve_rate": r} for q, r in rates.items()}}))
    with pytest.raises(FailedPrecondition, match="no solve rate for 1 of its questions"):
        read_question_pool(path, "tiny", "train", max_solve_rate=0.5)


def test_pool_max_greedy_f1_keeps_the_questions_greedy_decoding_does_not_answer_in_full(tmp_path):
    figures = {"q1": (0.125, 0.0), "q2": (0.5, 1.0), "q3": (0.25, 0.5), "q4": (0.875, 0.4)}
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"world": "tiny", "split": "train", "pool": list(figures), "greedy": True,
                                "questions": {q: {"solve_rate": r, "greedy_f1": g} for q, (r, g) in figures.items()}}))
    assert read_question_pool(path, "tiny", "train", max_greedy_f1=0.99) == ["q1", "q3", "q4"]
    assert read_question_pool(path, "tiny", "train", max_greedy_f1=0.0) == ["q1"]
    # both bounds hold at once
    assert read_question_pool(path, "tiny", "train", max_solve_rate=0.5, max_greedy_f1=0.99) == ["q1", "q3"]
    # a pool built without the greedy rollouts cannot be selected on them: said, not a KeyError
    path.write_text(json.dumps({"world": "tiny", "split": "train", "pool": list(figures),
                                "questions": {q: {"solve_rate": r} for q, (r, _) in figures.items()}}))
    with pytest.raises(FailedPrecondition, match="no greedy F1 for 4 of its questions.*greedy=true"):
        read_question_pool(path, "tiny", "train", max_greedy_f1=0.99)
    assert read_question_pool(path, "tiny", "train", max_solve_rate=0.5) == ["q1", "q2", "q3"]


# ---------------------------------------------------------------- through the services
@pytest.fixture(scope="module")
def services(tmp_path_factory):
    with scripted_stack(tmp_path_factory.mktemp("rl-oracle") / "data", RecordingGoldWalk) as stack:
        yield stack


def test_oracle_rl_needs_no_prm_service_and_scores_steps_by_the_judge(services, tmp_path, one_thread):
    cfg = _config(services, step_scorer="oracle", prm=DEAD_PRM, service_wait_s=0.0)
    work = tmp_path / "rl-oracle"
    out = run_rl(local_context(work, cfg, stage="rl"))
    assert out["iterations"] == 2 and out["total_kept"] == 16.0 and 0.0 <= out["groups_flat_fraction"] <= 1.0
    for r in _journal(work):
        assert r["prm_version"] == "oracle" and r["oracle_scored"] == r["kept"] == 8
        assert "prm_scored" not in r or r["prm_scored"] == 0
        # the scripted engine is right 60% of the time per step: the judge finds sound and unsound steps
        assert 0.0 < r["oracle_sound_rate"] < 1.0
    # the oracle's process term splits the steps of one rollout; beta 0 gives each rollout one advantage
    key = _push_zero_adapter(services, tmp_path, "collect-oracle")
    qs = load_split(paths.world_dir("tiny"), "train")[:3]
    with PolicyClient(services["policy"]) as policy:
        oracle = collect(cfg, qs, 0, "collect-oracle", key, policy, None)
        outcome = collect(_config(services, step_scorer="oracle", beta=0.0), qs, 0, "collect-oracle", key, policy,
                          None)
    assert [s.token_ids for s in oracle.samples] == [s.token_ids for s in outcome.samples]
    assert [s.reward for s in oracle.samples] == [s.reward for s in outcome.samples]
    assert "oracle_scored" not in outcome.stats
    assert any(len({round(a, 6) for a, m in zip(s.advantages, s.loss_mask) if m}) > 1 for s in oracle.samples)
    assert all(len({a for a, m in zip(s.advantages, s.loss_mask) if m}) == 1 for s in outcome.samples)
    # issue 47's clean ceiling: the verdict alone (no format term), the answer step out of the process term; the
    # settings reach the advantages (same rollouts, other process term, same outcome rewards)
    with PolicyClient(services["policy"]) as policy:
        clean = collect(_config(services, step_scorer="oracle", step_score="verdict", process_answer_step=False), qs,
                        0, "collect-oracle", key, policy, None)
    assert [s.token_ids for s in clean.samples] == [s.token_ids for s in oracle.samples]
    assert [s.reward for s in clean.samples] == [s.reward for s in outcome.samples]
    assert [s.advantages for s in clean.samples] != [s.advantages for s in oracle.samples]


def _pool_config(services, **kw):
    return from_dict(RLPoolConfig, {"world": "tiny", "max_questions": 6, "policy": services["policy"],
                                    "policy_model": services["base"], "samples": 4, "questions_per_request": 2,
                                    "max_step_tokens": 48, "max_steps": 6, "seed": 5, "tracking": "local", **kw})


def _serve_base(services):
    with PolicyClient(services["policy"]) as c:
        c.activate_adapter("", "")  # the served model itself, as the pipeline's fresh SFT policy serves


def test_rlpool_writes_the_learnable_questions_and_resumes_from_its_journal(services, tmp_path, one_thread):
    _serve_base(services)
    cfg = _pool_config(services)
    work = tmp_path / "pool"
    stop = threading.Event()
    first = []

    def emit(ev):
        first.append(ev)
        if ev.get("step") == 2:  # the first request (2 questions) is journaled: stop before the next
            stop.set()

    assert run_rlpool(local_context(work, cfg, emit=emit, stop=stop, stage="rlpool")) == {}
    journal = work / "checkpoints" / "rlpool-journal.jsonl"
    assert len(journal.read_text().splitlines()) == 1 and not (work / "run" / "pool.json").exists()
    out = run_rlpool(local_context(work, cfg, stage="rlpool"))
    assert out["sampled_this_attempt"] == 4 * 4  # the two requests left, not the first again
    assert [json.loads(line)["request"] for line in journal.read_text().splitlines()] == [0, 1, 2]
    pool = json.loads((work / "run" / "pool.json").read_text())
    assert out["pool_path"] == str(work / "run" / "pool.json")
    assert (pool["world"], pool["split"], pool["samples"]) == ("tiny", "train", 4)
    rows = [json.loads(line)["rows"] for line in journal.read_text().splitlines()]
    rows = [r for chunk in rows for r in chunk]
    assert len(rows) == 6 and all(len(r["correct"]) == 4 for r in rows)
    assert pool["pool"] == [r["id"] for r in rows if learnable(r["correct"])]
    c = pool["counts"]
    assert (c["candidates"] == 6 == c["all_right"] + c["all_wrong"] + c["learnable"]
            and c["learnable"] == out["learnable"])
    assert sum(h["learnable"] for h in c["by_hops"].values()) == c["learnable"]
    assert pool["pool"], "the scripted engine (right 60% of the time per step) should leave some questions learnable"
    for r in rows:
        q = pool["questions"][r["id"]]
        assert q["solve_rate"] == sum(r["correct"]) / 4 and q["hops"] == r["hops"]
    # the resumed pool is the one an uninterrupted job builds: each request's seed is its place in the list
    straight = run_rlpool(local_context(tmp_path / "pool-straight", cfg, stage="rlpool"))
    assert json.loads(open(straight["pool_path"]).read())["questions"] == pool["questions"]


def test_rlpool_with_greedy_records_each_candidates_greedy_answer(services, tmp_path, one_thread):
    _serve_base(services)
    engine = services["engine"]
    engine.sampling.clear()
    out = run_rlpool(local_context(tmp_path / "pool", _pool_config(services, greedy=True), stage="rlpool"))
    # per request: the greedy rollouts (temperature 0), then the samples at the RL's temperature
    assert {t for _, t in engine.sampling} == {0.0, 1.0}
    pool = json.loads(open(out["pool_path"]).read())
    assert pool["greedy"] is True
    greedy = {q: r["greedy_f1"] for q, r in pool["questions"].items()}
    assert len(greedy) == 6 and all(0.0 <= f <= 1.0 for f in greedy.values())
    assert out["learnable_greedy_imperfect"] == sum(1 for q in pool["pool"] if greedy[q] < 1.0)
    assert out["greedy_f1_mean"] == pytest.approx(sum(greedy.values()) / 6)
    # the samples are those of a pool without the greedy pass: the greedy rollouts take no sampling seed from them
    plain = json.loads(open(run_rlpool(local_context(tmp_path / "plain", _pool_config(services),
                                                     stage="rlpool"))["pool_path"]).read())
    assert {q: {k: v for k, v in r.items() if k != "greedy_f1"} for q, r in pool["questions"].items()} == \
        plain["questions"]


def test_rlpool_refuses_samples_from_an_adapter(services, tmp_path, one_thread):
    key = _push_zero_adapter(services, tmp_path, "pool-adapter")  # pushed and active
    try:
        with pytest.raises(FailedPrecondition, match="sampled with adapter"):
            run_rlpool(local_context(tmp_path / "pool-adapter", _pool_config(services), stage="rlpool"))
    finally:
        with PolicyClient(services["policy"]) as c:
            c.activate_adapter("", "")
    assert key.startswith("rl@")


def test_rl_with_a_question_pool_draws_only_its_questions(services, tmp_path, one_thread, monkeypatch):
    train = load_split(paths.world_dir("tiny"), "train")
    picked = [train[1].id, train[4].id, train[6].id]
    path = tmp_path / "pool.json"
    start_f1 = dict(zip(picked, (0.25, 0.5, 1.0)))  # the pool agent's mean sampled F1 on each
    path.write_text(json.dumps({"world": "tiny", "split": "train", "pool": picked,
                                "questions": {q: {"f1_mean": f} for q, f in start_f1.items()}}))
    cfg = _config(services, prm="", beta=0.0, question_pool=str(path), max_questions=0, iterations=3)
    asked: list[str] = []
    real_rollout = PolicyClient.rollout

    def recording_rollout(self, questions, *a, **kw):  # the real call, with the question ids noted
        asked.extend(qid for qid, _ in questions)
        return real_rollout(self, questions, *a, **kw)

    monkeypatch.setattr(PolicyClient, "rollout", recording_rollout)
    out = run_rl(local_context(tmp_path / "rl-pool", cfg, stage="rl"))
    # a pool of 3 at 2 questions per iteration: epoch 0 is iterations 0 (2 questions) and 1 (the third), then
    # iteration 2 starts epoch 1; pool questions only, each epoch all of them
    assert out["questions_drawn_from"] == 3.0 and out["total_kept"] == (2 + 1 + 2) * 4
    first = list(asked)
    assert len(first) == 5 and set(first[:3]) == set(picked) and set(first) == set(picked)
    # each iteration's journal row reads its rollouts against the start model's F1 on the same questions
    journal = next((tmp_path / "rl-pool").rglob("rl-iterations.jsonl"))
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    drawn = [first[:2], first[2:3], first[3:]]
    # outcome-only: a group whose rollouts all earned one reward has zero advantage, and its trajectories are left
    # out of the update's forward passes (here one flat group of 4 an iteration)
    assert [r["update_skipped"] for r in rows] == [r["groups_flat"] * 4 for r in rows]
    assert any(r["update_skipped"] for r in rows)
    assert [r["start_f1_mean"] for r in rows] == pytest.approx(
        [sum(start_f1[q] for q in qs) / len(qs) for qs in drawn])
    asked.clear()
    run_rl(local_context(tmp_path / "rl-pool-again", cfg, stage="rl"))
    assert asked == first  # the same seeded draw for every method that reads the same pool


def test_a_hop_balanced_draw_meets_each_hop_count_equally_often_without_repeats():
    hops = [3] * 60 + [4] * 31  # the 2:1 mix of make run's learnable pool
    for it in range(12):
        draw = hop_balanced_draw(hops, per_iteration=16, iteration=it, seed=1)
        assert len(draw) == len(set(draw)) == 16  # no question twice in one iteration
        assert sum(hops[i] == 4 for i in draw) == 8
        assert draw == hop_balanced_draw(hops, 16, it, seed=1)  # a resumed job draws the same
    assert hop_balanced_draw(hops, 16, 0, seed=1) != hop_balanced_draw(hops, 16, 0, seed=2)
    # one pass over the 4-hop questions: the first 3 iterations (8 each of 31) meet 24 different ones
    four = [i for it in range(3) for i in hop_balanced_draw(hops, 16, it, seed=1) if hops[i] == 4]
    assert len(set(four)) == 24
    # a count with fewer questions than its share gives all of them, once
    draw = hop_balanced_draw([3] * 20 + [4] * 3, per_iteration=16, iteration=5, seed=0)
    assert sorted(i for i in draw if i >= 20) == [20, 21, 22] and len(draw) == len(set(draw)) == 11
    # one hop count: a plain draw of per_iteration questions
    assert len(set(hop_balanced_draw([3] * 40, 16, 7, seed=0))) == 16


def test_balance_hops_is_an_rl_setting():
    cfg = from_dict(RLConfig, {"world": "tiny", "base_model": "m", "balance_hops": True})
    assert cfg.balance_hops and not from_dict(RLConfig, {"world": "tiny", "base_model": "m"}).balance_hops
