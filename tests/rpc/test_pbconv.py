"""prorag.rpc.pbconv: the one conversion between core documents / token trajectories and prorag.v1 messages."""

from prorag.data.loaders import Document
from prorag.pb import common_pb2
from prorag.rpc.pbconv import document_from_pb, document_pb, scored_document_from_pb, scored_document_pb, token_trace_pb
from prorag.tokens import TokenTrajectory


def test_documents_round_trip():
    ranked = Document("d7", 'The "Best" Song', "Text here", '"The "Best" Song"\nText here', score=0.75, rank=2)
    m = scored_document_pb(ranked)
    assert (m.document.contents, m.score, m.rank) == (ranked.contents, 0.75, 2)
    assert scored_document_from_pb(m) == ranked
    # a plain document carries no ranking
    plain = Document.from_parts("d8", "Title", "body")
    assert document_pb(plain) == common_pb2.Document(id="d8", title="Title", text="body", contents='"Title"\nbody')
    assert document_from_pb(document_pb(plain)) == plain
    assert (scored_document_pb(plain).score, scored_document_pb(plain).rank) == (0.0, 0)


def test_token_trace_carries_spans():
    t = TokenTrajectory.from_prompt([1, 2])
    t.add_step([3, 4], [1.0, 5.0], [-0.5, -1.0])
    t.add_inserted([5])
    t.add_step([6], [1.0], [-2.0])
    m = token_trace_pb(t)
    assert list(m.token_ids) == [1, 2, 3, 4, 5, 6] and list(m.generated_mask) == [0, 0, 1, 1, 0, 1]
    assert list(m.logprobs) == [0.0, 0.0, -0.5, -1.0, 0.0, -2.0]
    assert [(s.start, s.generated_end, s.end) for s in m.step_spans] == [(2, 4, 5), (5, 6, 6)]
