"""The embedded default: build whatever is missing (world, indexes) and nothing that exists."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from prorag import paths
from prorag.config import from_dict
from prorag.data.world import WorldConfig, build_world
from prorag.errors import InvalidArgument
from prorag.io import atomic_dir, sha256_file, write_json
from prorag.progress import progress_bars
from prorag.training.context import local_context
from services.retriever.encoders import EncoderConfig
from services.retriever.indexing import BM25Config, DenseIndexConfig, build_all

WORLD_SIZES = ("tiny", "small", "default", "large")


def world_is_complete(name: str) -> bool:
    return (paths.world_dir(name) / "DONE").exists()


def ensure_world(name: str = "default", size: str | None = None, seed: int | None = None,
                 force: bool = False) -> dict:
    """Generate the embedded benchmark ``name`` unless it is complete.

    With neither ``size`` nor ``seed`` given, a complete world of that name is used as it was built (any
    seed, any size): `prorag run --world W` trains on W as `prorag world --name W --seed S` made it. When
    missing, it is built with seed 0 and ``size`` defaulting to ``name`` when that is a size (so worlds
    "tiny" and "default" are what they say). An explicit size or seed that differs from a complete
    build rebuilds it."""
    out = paths.world_dir(name)
    if size is None and seed is None and world_is_complete(name):
        built = json.loads((out / "world.json").read_text()).get("config", {})
        size, seed = built.get("size"), built.get("seed")
    size = size or (name if name in WORLD_SIZES else "default")
    cfg = from_dict(WorldConfig, {"name": name, "size": size, "seed": 0 if seed is None else seed})
    with progress_bars() as progress:
        summary = build_world(cfg, out, progress=progress, force=force)  # reuses a finished build of this config
    return summary if isinstance(summary, dict) else summary.to_dict()


def ensure_indexes(world: str = "default", size: str | None = None, faiss_type: str = "flat",
                   encoder: str = "minilm", pooling: str = "mean", query_prefix: str = "",
                   doc_prefix: str = "", corpus: str | None = None, out: str | None = None,
                   fp16: bool = False, dense: bool = True, bm25: bool = True) -> dict:
    """Build dense + BM25 indexes (+ docstore) for a corpus; resumes an interrupted build. ``dense`` / ``bm25``
    False skip that index (a retriever serving BM25 alone needs neither faiss nor the encoder's weights)."""
    if corpus is None:
        ensure_world(world, size)
        corpus_path = paths.world_dir(world) / "corpus.jsonl"
    else:
        corpus_path = Path(corpus)
        if not corpus_path.exists():
            raise SystemExit(f"corpus not found: {corpus_path}")
    index_root = Path(out) if out else paths.index_dir(world)
    dense_cfg = DenseIndexConfig(encoder=EncoderConfig(model=encoder, pooling=pooling, query_prefix=query_prefix,
                                                       doc_prefix=doc_prefix, fp16=fp16), faiss_type=faiss_type)
    with progress_bars() as progress:
        return build_all(corpus_path, index_root, dense_cfg, BM25Config(), progress=progress, dense=dense, bm25=bm25)


def policy_base_dir(world: str = "default", variant: str = "") -> Path:
    """Where the world's embedded base lives; a named variant (another preset or warm-up) gets its own
    directory so building it never replaces the base the other profiles and jobs use."""
    return paths.data_dir() / "models" / world / (f"policy-base-{variant}" if variant else "policy-base")


#: bumped whenever train_tokenizer changes how text maps to ids, so an older base is rebuilt
TOKENIZER_VERSION = 3

#: embedded base policy per world size when nobody asks for a specific one: for default-size worlds the
#: `cpu` shape with three layers and a previous-token and an induction head wired in at init (prorag.init_circuits),
#: so the agent can copy the question's entity into its subqueries (docs/BENCHMARKS.md, "Induction wired in at
#: init"; three layers, not four, since the forty-fourth session)
DEFAULT_POLICY = {"tiny": ("tiny", 2048), "default": ("cpu-induction-3l", 8192)}
#: warm-up per world size. The tiny world is for tests: a few steps of each phase, seconds on CPU. The default
#: world's keeps copying alive through the reading phases (copy_mix), ramps the learning rate so Adam's first
#: steps do not disturb the wired circuit, and adds the gap and paraphrase phases (reading behind the format's
#: tags, names copied into restated questions): the base the SFT figure was reached on.
DEFAULT_WARMUP = {"tiny": {"copy_steps": 6, "sentence_steps": 2, "document_steps": 2, "batch_size": 4},
                  "default": {"copy_mix": 4, "lr_warmup_steps": 50, "copy_min_length": 8, "gap_steps": 200,
                              # the copy task again at the end: the reading phases wear copying down by an amount
                              # that varies with the world (seed 2's base copied 38% of names, 73% after 200 such
                              # steps, and its agent's dev F1 on 2+ hops went 6 -> 20; docs/BENCHMARKS.md)
                              "paraphrase_steps": 150, "copy_final_steps": 200}}


#: where a base comes from when one is missing: "shipped" installs the base shipped with this code for the world
#: (:data:`SHIPPED_BASES`) when it is the one that would be built, else builds it; "build" always warms one up here
BASE_SOURCES = ("shipped", "build")
#: bases trained by this code and shipped with it, one directory per base (a world's profiles may train several
#: models; :func:`shipped_base` picks by spec): what a hub checkpoint is to a GPU
#: deployment. Why: the default world's warm-up takes ~11 of `make run`'s minutes on 2 cores, and its outcome is a
#: draw that the CPU changes (an Intel machine's base gave an agent of 15-25 F1 where this one's reaches 62 on
#: test; docs/BENCHMARKS.md), so a shipped base makes `make run` shorter and its agent the same on every machine.
#: Each directory holds the base's files and provenance.json (spec, world fingerprint, sha256 per file, how and
#: where it was built); scripts/ship_base.py writes it.
SHIPPED_BASES = Path(__file__).resolve().parent / "bases"
PROVENANCE = "provenance.json"
#: written beside an installed shipped base, so that asking for a base built here replaces it
SHIPPED_MARKER = "shipped.json"
#: the world files a base is built from: the tokenizer's texts and the warm-up's documents and facts
BASE_WORLD_FILES = ("corpus.jsonl", "train.jsonl", "dev.jsonl")


def world_fingerprint(world: str) -> str:
    """sha256 over the world files a base is built from (:data:`BASE_WORLD_FILES`): two builds of a world with
    the same fingerprint give the tokenizer and the warm-up the same text."""
    h = hashlib.sha256()
    for name in BASE_WORLD_FILES:
        h.update(f"{name}\0{sha256_file(paths.world_dir(world) / name)}\n".encode())
    return h.hexdigest()


def base_spec(world: str, size: str, preset: str | None = None, vocab_size: int | None = None, seed: int = 0,
              warmup: dict | None = None) -> dict:
    """What a base is built from (the marker embedded.json holds): the world, the model's shape, the tokenizer's
    version and the warm-up, with the defaults of the world's ``size`` for what is not given."""
    from prorag.modeling import WarmupConfig, model_config  # torch: only a base needs it, not a world or its indexes

    default_preset, default_vocab = DEFAULT_POLICY.get(size, ("cpu", 8192))
    preset = preset or default_preset
    wcfg = from_dict(WarmupConfig, warmup if warmup is not None else DEFAULT_WARMUP.get(size, {}))
    return {"world": world, "preset": preset, "model": asdict(model_config(preset)),
            "vocab_size": vocab_size or default_vocab, "seed": seed, "warmup": asdict(wcfg),
            "tokenizer": TOKENIZER_VERSION}


def shipped_bases(world: str) -> dict[Path, dict]:
    """{directory: provenance} of the bases shipped for ``world``, by name."""
    found = {}
    for src in sorted(SHIPPED_BASES.iterdir()) if SHIPPED_BASES.is_dir() else []:
        if (src / PROVENANCE).is_file():
            prov = json.loads((src / PROVENANCE).read_text())
            if prov["spec"].get("world") == world:
                found[src] = prov
    return found


def shipped_base(world: str, spec: dict) -> tuple[Path | None, str]:
    """(the base shipped for ``world`` that ``spec`` would build from this world's files, else None; why not, for a
    person: "" when none is shipped for the world). A world may ship several, one per model its profiles train
    (the default profile's and the research profile's)."""
    candidates = shipped_bases(world)
    if not candidates:
        return None, ""
    same = [src for src, prov in candidates.items() if prov["spec"] == spec]
    if not same:
        first, shipped = next(iter(candidates.items()))
        changed = sorted(k for k in {*spec, *shipped["spec"]} if spec.get(k) != shipped["spec"].get(k))
        names = ", ".join(str(src) for src in candidates)
        return None, f"no base shipped for {world!r} ({names}) was built with these settings ({', '.join(changed)} " \
                     f"differ from {first.name}'s)"
    src = same[0]
    prov = candidates[src]
    if prov["world_fingerprint"] != world_fingerprint(world):
        return None, (f"the base shipped in {src} was built from other {world!r} world files "
                      f"({', '.join(BASE_WORLD_FILES)} differ)")
    for name, digest in prov["files"].items():
        if not (src / name).is_file() or sha256_file(src / name) != digest:
            return None, f"{src / name} is missing or does not match its recorded sha256 (a damaged checkout?)"
    return src, ""


def install_shipped_base(src: Path, out: Path) -> dict:
    """Copy the shipped base ``src`` into ``out`` in one atomic step; returns its provenance."""
    prov = json.loads((src / PROVENANCE).read_text())
    with atomic_dir(out) as tmp:
        for name in prov["files"]:
            shutil.copyfile(src / name, tmp / name)  # not its mode: the checkout's may be private
        write_json(tmp / "embedded.json", prov["spec"])
        write_json(tmp / SHIPPED_MARKER, prov)
    return prov


def ensure_policy_model(world: str = "default", preset: str | None = None, vocab_size: int | None = None,
                        seed: int = 0, warmup: dict | None = None, progress=None, variant: str = "",
                        source: str = "shipped", say: Callable[[str], None] = print) -> Path:
    """The embedded policy: a BPE tokenizer trained on the world's corpus, questions and the format's
    text (plus its special tokens), and a Qwen3-architecture model warmed up from random init with the
    copy task and reading curriculum (prorag.modeling.WarmupConfig; ``warmup`` overrides it,
    {"copy_steps": 0, ...} turns phases off), saved in HF format. Rebuilt when any setting changes.
    variant: build into :func:`policy_base_dir` (world, variant) instead of the world's default base.
    source: "shipped" installs the base shipped for the world when it is the one these settings would build from
    this world's files (:func:`shipped_base`), "build" warms one up here (and replaces an installed shipped one).
    progress(stage, done, total) reports the warm-up, which is the trainer's `warmup` stage run in this
    process: its checkpoints are kept beside the base until it is done, so a killed build resumes.
    say: where a line about the shipped base goes."""
    from services.trainer.stage_warmup import WarmupStageConfig, run_warmup  # torch: as in base_spec

    if source not in BASE_SOURCES:
        raise InvalidArgument(f"base source {source!r}: expected one of {', '.join(BASE_SOURCES)}")
    out = policy_base_dir(world, variant)
    marker = out / "embedded.json"
    usable = marker.exists() and (source == "shipped" or not (out / SHIPPED_MARKER).exists())
    if preset is None and vocab_size is None and warmup is None and usable \
            and json.loads(marker.read_text()).get("tokenizer") == TOKENIZER_VERSION:
        return out  # whatever current base exists is the one services and jobs share
    size = ensure_world(world)["size"]  # the defaults follow the world's size, whatever its name
    want = base_spec(world, size, preset, vocab_size, seed, warmup)
    if usable and json.loads(marker.read_text()) == want:
        return out
    if source == "shipped":
        src, why = shipped_base(world, want)
        if src is not None:
            prov = install_shipped_base(src, out)
            say(f"base policy: installed the one shipped for world {world!r} (built by `{prov['built']['command']}` "
                f"at {prov['built']['commit'][:10]} on {prov['built']['machine']}); `--set base_source=build` "
                "warms one up here instead")
            return out
        if why:
            say(f"base policy: {why}, so it is warmed up here")
    cfg = from_dict(WarmupStageConfig, {"world": world, "preset": want["preset"], "vocab_size": want["vocab_size"],
                                        "seed": seed, "warmup": want["warmup"], "output": str(out)})

    def emit(event: dict) -> None:
        if progress and event.get("loss") is not None:
            progress("warm up base policy", event["step"], event["total_steps"])

    # a base this build replaces stops being one before the build writes into its directory, so a build killed
    # half way is never taken for it
    for stale in (marker, out / SHIPPED_MARKER):
        stale.unlink(missing_ok=True)
    work = out.with_name(f".{out.name}.build")  # a dot name: model listings skip it
    run_warmup(local_context(work, cfg, emit=emit if progress else None, stage="warmup"))
    write_json(marker, want)
    shutil.rmtree(work, ignore_errors=True)
    return out
