"""The five services as the stacks of test_auth and test_hostile_input see them alike: their gRPC descriptors, and
the files they read."""

from __future__ import annotations

from pathlib import Path

from prorag.pb import judge_pb2, policy_pb2, prm_pb2, retriever_pb2, trainer_pb2
from tests.helpers import three_doc_corpus

#: service name -> its gRPC service descriptor
DESCRIPTORS = {
    "retriever": retriever_pb2.DESCRIPTOR.services_by_name["Retriever"],
    "policy": policy_pb2.DESCRIPTOR.services_by_name["Policy"],
    "prm": prm_pb2.DESCRIPTOR.services_by_name["ProcessRewardModel"],
    "judge": judge_pb2.DESCRIPTOR.services_by_name["Judge"],
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
}


def build_stack_files(home: Path, model_dir) -> None:
    """Under ``home``: a docstore and a BM25 index of the three-document corpus (``index/``) for the retriever, and a
    fresh PRM head on the policy at ``model_dir`` (``prm/``) for the PRM service."""
    # torch and the index builders: loaded when a stack starts, not when the tests are collected
    from prorag.modeling import save_pretrained
    from prorag.prm.model import prm_from_policy
    from services.retriever.indexing import build_bm25_index, build_docstore

    corpus = three_doc_corpus(home / "corpus.jsonl")
    build_docstore(corpus, home / "index" / "docstore")
    build_bm25_index(corpus, home / "index" / "bm25")
    prm, tok = prm_from_policy(model_dir, seed=1)
    save_pretrained(prm, tok, home / "prm")
