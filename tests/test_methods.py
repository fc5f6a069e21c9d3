"""The method table: a method either trains (a stage) or reads with another method's model."""

import pytest

from prorag.errors import InvalidArgument
from prorag.methods import COMPARISONS, METHODS, SFT_METHODS, SFT_MODES, Method


def test_every_method_trains_or_reads_with_a_trained_one():
    for m in METHODS.values():
        if m.reader:
            assert m.stage == "" and METHODS[m.reader].stage == "sft", m.name
        if m.stage == "sft":
            assert m.train["mode"] in SFT_MODES and m.kind == m.train["mode"], m.name
    assert METHODS["standard_rag"].reader == "sft" and "standard_rag" not in SFT_METHODS
    assert "standard_rag_ft" in SFT_METHODS


def test_a_method_cannot_both_train_and_read_with_another():
    with pytest.raises(InvalidArgument, match="exactly one"):
        Method("x", "single_search", stage="sft", reader="sft")
    with pytest.raises(InvalidArgument, match="exactly one"):
        Method("x", "single_search", stage="")
    with pytest.raises(InvalidArgument, match="kind must be"):
        Method("x", "retrieval_only")


def test_comparisons_name_the_oracle_ceiling_and_the_same_start_headline_among_known_methods():
    assert ("prorag_oracle", "outcome_grpo") in COMPARISONS and ("prorag_no_rft", "outcome_grpo") in COMPARISONS
    assert len(set(COMPARISONS)) == len(COMPARISONS)
    assert {m for pair in COMPARISONS for m in pair} <= set(METHODS)
