"""The retriever's front end: the one place a request is checked, for gRPC and HTTP alike."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from prorag.errors import InvalidArgument, NotFound
from services.retriever.frontend import SearchFrontend


@pytest.fixture(scope="module")
def frontend(engine):
    return SearchFrontend(engine, max_topk=50, max_batch=100, max_query_chars=300)


def test_request_errors_are_actionable(frontend):
    cases = [
        ([], 3, "no queries"),
        (["ok", "   "], 3, r"queries\[1\] is blank"),
        (["ok", "x" * 301], 3, r"queries\[1\] has 301 characters; the limit is 300"),
        (["q"] * 101, 3, "the limit is 100"),
        (["q"], 0, "from 1 to 50"),
        (["q"], 51, "from 1 to 50"),
    ]
    for queries, topk, msg in cases:
        with pytest.raises(InvalidArgument, match=msg):
            frontend.check_search(queries, topk)
    with pytest.raises(NotFound, match="known indexes: bm25, dense, dense-hnsw, dense-ivfpq, hybrid"):
        frontend.check_search(["q"], 3, "colbert")
    assert frontend.check_search(["q"], 3) == "hybrid" and frontend.check_search(["q"], 3, "bm25") == "bm25"
    with pytest.raises(InvalidArgument, match="101 ids in one call; the limit is 100"):
        frontend.get_documents(["topic-1"] * 101)
    assert [d.id for d in frontend.get_documents(["topic-3"])] == ["topic-3"]


def test_a_merged_batch_may_exceed_a_callers_limit(frontend):
    """max_batch limits one caller's request; the batcher's merged engine call may hold more."""
    results = frontend._run("bm25", [("lighthouse", 1)] * 101)
    assert len(results) == 101 and all(len(r) == 1 for r in results)


def test_search_answers_with_the_index_it_resolved(engine):
    async def go():
        frontend = SearchFrontend(engine, max_topk=50, max_batch=100, max_query_chars=300)
        try:
            return await frontend.search(["lighthouse"], 2)
        finally:
            await frontend.close()

    name, results = asyncio.run(go())
    assert name == "hybrid" and len(results) == 1 and len(results[0]) == 2


def test_searching_never_imports_the_index_builder():
    """The serving side (engine, front end, transports) reads indexes through docstore/encoders only."""
    probe = ("import sys, services.retriever.server, services.retriever.engine; "
             "assert 'services.retriever.indexing' not in sys.modules, 'the builder was imported'")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
