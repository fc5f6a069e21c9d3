"""Thin gRPC servicer for prorag.v1.Retriever: convert, call the front end (which checks and batches)."""

from __future__ import annotations

from prorag.pb import retriever_pb2, retriever_pb2_grpc
from prorag.rpc.grpc_server import deadline_of
from prorag.rpc.pbconv import document_pb, scored_document_pb
from services.retriever.frontend import SearchFrontend


class RetrieverServicer(retriever_pb2_grpc.RetrieverServicer):
    def __init__(self, frontend: SearchFrontend):
        self.frontend = frontend

    async def Search(self, request, context):
        index, results = await self.frontend.search(list(request.queries), request.topk, request.index,
                                                    deadline=deadline_of(context))
        return retriever_pb2.SearchResponse(
            index=index,
            results=[retriever_pb2.QueryResult(documents=[scored_document_pb(d) for d in docs]) for docs in results])

    async def ListIndexes(self, request, context):
        frontend = self.frontend
        infos = []
        for info in frontend.list_indexes():
            infos.append(retriever_pb2.IndexInfo(
                name=info["name"], kind=info["kind"], num_documents=int(info.get("num_documents", 0)),
                encoder=info.get("encoder") or "", faiss_type=info.get("faiss_type") or "",
                is_default=bool(info.get("is_default")),
                extra={k: str(v) for k, v in (info.get("extra") or {}).items()}))
        return retriever_pb2.ListIndexesResponse(indexes=infos, max_topk=frontend.max_topk,
                                                 max_batch=frontend.max_batch,
                                                 max_query_chars=frontend.max_query_chars)

    async def GetDocuments(self, request, context):
        docs = self.frontend.get_documents(list(request.ids))
        return retriever_pb2.GetDocumentsResponse(documents=[document_pb(d) for d in docs])
