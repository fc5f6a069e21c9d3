"""services.trainer.sampling's pure parts: how a Rollout request is split over the policy's replicas and put back in
the request's order (the split against real replicas: tests/services/policy/test_replicas.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.trainer.sampling import in_request_order, replica_count, split_evenly


@pytest.mark.parametrize("count, parts, bounds", [
    (5, 2, [(0, 3), (3, 5)]),
    (6, 3, [(0, 2), (2, 4), (4, 6)]),
    (2, 4, [(0, 1), (1, 2)]),  # never an empty part
    (7, 1, [(0, 7)]),
    (0, 3, [(0, 0)]),
    (3, 0, [(0, 3)]),  # no replica resolved: one part
])
def test_parts_tile_the_questions_with_sizes_at_most_one_apart(count, parts, bounds):
    assert split_evenly(count, parts) == bounds


def test_trajectories_come_back_question_major_in_the_requests_order_whatever_finished_first():
    questions = [SimpleNamespace(id=i) for i in ("b", "a", "c", "a")]  # a question asked twice
    t = lambda qid, j, tag="": SimpleNamespace(question_id=qid, sample_index=j, tag=tag)
    streamed = [t("c", 1), t("a", 0, "first"), t("b", 1), t("a", 1), t("c", 0), t("b", 0), t("a", 0, "second")]
    ordered = in_request_order(streamed, questions)
    assert [(x.question_id, x.sample_index) for x in ordered] == \
        [("b", 0), ("b", 1), ("a", 0), ("a", 0), ("a", 1), ("c", 0), ("c", 1)]
    # the two copies of a's sample 0 keep the order they streamed in
    assert [x.tag for x in ordered if x.question_id == "a" and x.sample_index == 0] == ["first", "second"]


def test_the_replicas_a_target_reaches():
    assert replica_count("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") == 3
    assert replica_count("127.0.0.1:50052") == 1
    # a target the lookup cannot read (as one whose name does not resolve now): one request, which waits for the
    # service like any call
    assert replica_count("dns:///no-port") == 1
