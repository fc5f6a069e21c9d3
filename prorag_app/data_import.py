"""`prorag data import`: a MuSiQue, 2WikiMultiHopQA or HotpotQA file into the question format over a corpus.

The logic is :mod:`prorag.data.imports`; this module wires its inputs: the corpus passages of the titles the
dataset names (one streaming pass over the corpus), the retriever's BM25 index over that corpus (an index root
`prorag index` or the setup built, or one built here for a corpus given alone), and the optional teacher.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.config import cfg_field
from prorag.data.loaders import iter_corpus
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.io import sha256_file, write_json, write_jsonl


@dataclass
class DataImportArgs:
    dataset: str = cfg_field(help="musique, 2wiki or hotpotqa")
    input: str = cfg_field(help="the dataset file: its original JSON/JSONL or FlashRAG's JSONL (gzip allowed)")
    corpus: str = cfg_field("", help="the corpus whose ids the decompositions name (wiki-18 JSONL); with no "
                                     "index_root, a BM25 index of it is built under data/indexes/import-<name>")
    index_root: str = cfg_field("", help="a `prorag index` root over the corpus (docstore/ and bm25/), e.g. the "
                                         "retriever's RETRIEVER_INDEX_ROOT; its corpus is the doc store's; with "
                                         "--corpus, the two are built there when missing")
    out: str = cfg_field("", help="output JSONL ('' = data/imports/<dataset>-<input name>.jsonl)")
    limit: int = cfg_field(0, help="read at most this many records (0 = all)", min=0)
    teacher_url: str = cfg_field("", help="OpenAI-compatible endpoint that writes decompositions where the "
                                          "dataset has none (HotpotQA); the key comes from OPENAI_API_KEY")
    teacher_model: str = cfg_field("gpt-4o", help="the teacher's model name")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_out(dataset: str, input_path: Path) -> Path:
    name = input_path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return paths.data_dir() / "imports" / f"{dataset}-{name}.jsonl"


def report_path(out: Path) -> Path:
    """The report beside the questions: X.jsonl -> X.report.json."""
    return out.with_name(out.name.removesuffix(".jsonl") + ".report.json")


def _bm25_root(args: DataImportArgs) -> Path:
    """An index root holding a doc store and a BM25 index of the corpus. Given a corpus, they are built (a no-op
    when current) under --index-root, or under data/indexes/import-<name> without one: `prorag index` and the
    setup build the same two there, so an import run before the setup spares it the BM25 build."""
    from services.retriever.docstore import read_meta

    root = Path(args.index_root) if args.index_root else None
    if root is not None and read_meta(root / "bm25") and read_meta(root / "docstore"):
        return root
    if not args.corpus:
        if root is not None:
            raise FailedPrecondition(f"{root} holds no finished doc store and BM25 index (docstore/, bm25/); give the "
                                     "corpus too (--corpus) to build them there")
        raise InvalidArgument("give the corpus (--corpus) or a `prorag index` root over it (--index-root)")
    corpus = Path(args.corpus)
    if not corpus.is_file():
        raise InvalidArgument(f"corpus {corpus} does not exist")
    root = root or paths.data_dir() / "indexes" / f"import-{corpus.name.split('.')[0]}"
    store = read_meta(root / "docstore")
    if store and store.get("corpus_size") != corpus.stat().st_size:  # never rebuild a served root over another corpus
        raise InvalidArgument(f"{root} indexes another corpus ({store.get('corpus_path')}), not {corpus}")
    from services.retriever.indexing import BM25Config, build_all

    _say(f"doc store and BM25 index of {corpus} under {root} (built once; reused while the corpus is unchanged)")
    build_all(corpus, root, bm25_cfg=BM25Config(), dense=False)
    return root


def _sha256_if_other(corpus: Path, docstore) -> str:
    """The corpus's sha256, read only when it is not the doc store's own file (a copy of it may sit elsewhere)."""
    if corpus.resolve() == docstore.corpus_path.resolve():
        return docstore.corpus_sha256

    return sha256_file(corpus)


def run_import(args: DataImportArgs) -> dict:
    """Import one dataset file; writes the questions and their report atomically and returns the report."""
    from prorag.data.imports import ImportConfig, OpenAITeacher, format_report, import_records, index_titles, \
        read_records, title_key
    from services.retriever.docstore import DocStore
    from services.retriever.engine import BM25Retriever

    input_path = Path(args.input)
    out = Path(args.out) if args.out else default_out(args.dataset, input_path)
    records = list(read_records(input_path, args.dataset, limit=args.limit))  # parse errors come before any work
    root = _bm25_root(args)
    docstore = DocStore(root / "docstore")
    try:
        if args.corpus and docstore.corpus_sha256 != _sha256_if_other(Path(args.corpus), docstore):
            raise InvalidArgument(f"--corpus {args.corpus} is not the corpus of {root}'s doc store "
                                  f"({docstore.corpus_path}); pass one of them")
        bm25 = BM25Retriever(root / "bm25", docstore)
        wanted = {title_key(p.title) for r in records for p in r.supporting}
        wanted |= {title_key(h.support.title) for r in records for h in r.hops or () if h.support}
        _say(f"{len(records)} {args.dataset} records read from {input_path}; finding their {len(wanted)} titles in "
             f"{docstore.corpus_path}")
        titled = index_titles(iter_corpus(docstore.corpus_path), wanted)
        teacher = None
        if args.teacher_url:
            teacher = OpenAITeacher(args.teacher_url, args.teacher_model,
                                    cache_path=paths.data_dir() / "cache" / "teacher.jsonl")
        rows, report = import_records(records, titled, bm25.search, ImportConfig(dataset=args.dataset), teacher)
    finally:
        docstore.close()
    report.update({"input": str(input_path), "output": str(out), "corpus": str(docstore.corpus_path),
                   "index_root": str(root)})
    write_jsonl(out, rows)
    write_json(report_path(out), report)
    print(format_report(report))
    print(f"wrote {len(rows)} questions to {out} and the report to {report_path(out)}")
    return report
