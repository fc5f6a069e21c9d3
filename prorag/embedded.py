"""The embedded default: build whatever is missing (world, indexes) and nothing that exists."""

from __future__ import annotations

from pathlib import Path

from prorag import paths
from prorag.config import from_dict
from prorag.progress import progress_bars

WORLD_SIZES = ("tiny", "small", "default", "large")


def world_is_complete(name: str) -> bool:
    return (paths.world_dir(name) / "DONE").exists()


def ensure_world(name: str = "default", size: str | None = None, seed: int = 0, force: bool = False) -> dict:
    """Generate the embedded benchmark ``name`` unless it is complete. ``size`` defaults to ``name``
    when that is a size (so worlds "tiny" and "default" are what they say)."""
    from prorag.data.world import WorldConfig, build_world

    out = paths.world_dir(name)
    size = size or (name if name in WORLD_SIZES else "default")
    cfg = from_dict(WorldConfig, {"name": name, "size": size, "seed": seed})
    with progress_bars() as progress:
        summary = build_world(cfg, out, progress=progress, force=force)  # reuses a finished build of this config
    return summary if isinstance(summary, dict) else summary.to_dict()


def ensure_indexes(world: str = "default", size: str | None = None, faiss_type: str = "flat",
                   encoder: str = "minilm", pooling: str = "mean", query_prefix: str = "",
                   doc_prefix: str = "", corpus: str | None = None, out: str | None = None) -> dict:
    """Build dense + BM25 indexes (+ docstore) for a corpus; resumes an interrupted build."""
    from services.retriever.encoders import EncoderConfig
    from services.retriever.indexing import BM25Config, DenseIndexConfig, build_all

    if corpus is None:
        ensure_world(world, size)
        corpus_path = paths.world_dir(world) / "corpus.jsonl"
    else:
        corpus_path = Path(corpus)
        if not corpus_path.exists():
            raise SystemExit(f"corpus not found: {corpus_path}")
    index_root = Path(out) if out else paths.index_dir(world)
    dense_cfg = DenseIndexConfig(encoder=EncoderConfig(model=encoder, pooling=pooling, query_prefix=query_prefix,
                                                       doc_prefix=doc_prefix), faiss_type=faiss_type)
    with progress_bars() as progress:
        return build_all(corpus_path, index_root, dense_cfg, BM25Config(), progress=progress)


def policy_base_dir(world: str = "default") -> Path:
    return paths.data_dir() / "models" / world / "policy-base"


#: embedded base policy per world size when nobody asks for a specific one
DEFAULT_POLICY = {"tiny": ("tiny", 2048)}


def ensure_policy_model(world: str = "default", preset: str | None = None, vocab_size: int | None = None,
                        seed: int = 0, pretrain_steps: int = 0) -> Path:
    """The embedded policy: a BPE tokenizer trained on the world's corpus and questions (plus the
    format's special tokens) and a randomly initialised Qwen3-architecture model, saved in HF format.
    ``pretrain_steps`` > 0 adds a causal-LM warm-up on the corpus text."""
    import json

    from prorag.data.loaders import iter_corpus, load_split
    from services.policy.modeling import build_model, pretrain_on_corpus, save_pretrained, train_tokenizer

    out = policy_base_dir(world)
    marker = out / "embedded.json"
    if preset is None and vocab_size is None and marker.exists():
        return out  # whatever base exists is the one services and jobs share
    default_preset, default_vocab = DEFAULT_POLICY.get(world, ("cpu", 8192))
    preset = preset or default_preset
    vocab_size = vocab_size or default_vocab
    want = {"world": world, "preset": preset, "vocab_size": vocab_size, "seed": seed, "pretrain_steps": pretrain_steps}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    ensure_world(world)
    wdir = paths.world_dir(world)
    corpus = [d.contents for d in iter_corpus(wdir / "corpus.jsonl")]
    questions = [q.question for split in ("train", "dev") for q in load_split(wdir, split)]
    subs = [s.question for q in load_split(wdir, "train") for s in q.decomposition]
    tokenizer = train_tokenizer(corpus + questions + subs, vocab_size=vocab_size)
    model = build_model(preset, tokenizer, seed=seed)
    if pretrain_steps:
        pretrain_on_corpus(model, tokenizer, corpus, steps=pretrain_steps, seed=seed)
    save_pretrained(model, tokenizer, out)
    from prorag.io import write_json

    write_json(marker, want)
    return out
