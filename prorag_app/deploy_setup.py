"""`prorag setup cpu|gpu`: the one-shot setup before any service starts (compose's `setup` / `setup-cpu`, the k8s
`prorag-setup` Job; scripts/docker/setup.sh runs it as `prorag-setup`).

Idempotent: when what the services read is present it does nothing, whatever its variables say (a later
`docker compose up` reruns it with the defaults; that must not fail nor redo hours of indexing). Everything it
writes lands inside the data root (PRORAG_HOME/data, the volumes): an imported corpus is copied in first, so the doc
store never points at a mount the services lack.

  cpu  the embedded world, its dense + BM25 indexes and the embedded base policy; and, when RETRIEVER_INDEX_ROOT is
       set, an imported corpus indexed there (the smoke imports a tiny corpus exactly as wiki-18 is imported)
  gpu  the embedded world (the reference judge reads it), the policy base model and the e5 encoder acquired, the
       prepared policy model (the base with the step format's tags as tokens: vLLM serves it from the first start),
       and the e5 index of the wiki-18 corpus, encoded in fp16 on the GPU

The world PRORAG_WORLD (the questions the judge and the stages read): an embedded world (tiny, small, default, large)
is generated; a dataset folder (FlashRAG layout: train/dev/test.jsonl, e.g. the paper's hotpotqa-musique) is copied
in from WORLD_IMPORT, and one already in the volume is used as it is (never overwritten by a generated world).

Where the other inputs come from, first match wins: already in the volume; WIKI18_IMPORT (the corpus file, e.g. a bind
mount at /import/wiki-18.jsonl[.gz]); PRORAG_MODELS_FROM (a directory holding <name>/ for each model, named as its
target directory, and wiki-18.jsonl[.gz]), copied; PRORAG_DOWNLOAD=1, fetched with huggingface_hub. Nothing of these for
a missing input: exit 3 with what to do, and the reason in data/.prorag-setup-failed-<mode> (the k8s init containers
print it instead of waiting forever).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prorag import paths
from prorag.errors import FailedPrecondition
from prorag.io import atomic_dir, atomic_path
from prorag.progress import progress_bars
from prorag_app.embedded import (TOKENIZER_VERSION, WORLD_SIZES, ensure_indexes, ensure_policy_model, ensure_world,
                                 policy_base_dir, world_is_complete)
from services.policy.vllm_engine import _model_vocab_size, check_format_tags
from services.retriever.encoders import EncoderConfig

EXIT_BAD_INPUT = 2  # a variable that cannot work (a path outside the volume): fix it, retrying does not help
EXIT_MISSING = 3  # an input is missing and nothing says where to get it
EXIT_FETCH = 4  # a download failed (network, the hub): worth retrying, unlike 2 and 3 (the k8s Job retries only it)
MODES = ("cpu", "gpu")
#: files a model download skips: other frameworks' weights and exports nobody here loads
HF_IGNORE = ["onnx/*", "openvino/*", "*.onnx", "*.h5", "*.msgpack", "*.ot", "tf_model*", "flax_model*", "rust_model*"]


class SetupError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _env(name: str, default: str = "") -> str:
    value = os.environ.get(name, "")
    return value.strip() if value.strip() else default


def _flag(name: str) -> bool:
    value = _env(name, "0").lower()
    if value not in ("0", "1", "true", "false", "yes", "no"):
        raise SetupError(f"{name}={os.environ[name]!r}: give 1 or 0", EXIT_BAD_INPUT)
    return value in ("1", "true", "yes")


@dataclass
class Settings:
    mode: str
    data: Path
    world: str
    policy_base: Path
    policy_prepared: Path
    e5: Path
    corpus: Path
    corpus_import: Path | None
    world_import: Path | None
    index_root: Path | None
    faiss: str
    fp16: bool
    download: bool
    models_from: Path | None
    policy_repo: str
    e5_repo: str
    corpus_repo: str
    corpus_file: str

    @classmethod
    def from_env(cls, mode: str) -> "Settings":
        if mode not in MODES:
            raise SetupError(f"setup mode {mode!r}: use cpu or gpu", EXIT_BAD_INPUT)
        data = paths.data_dir().resolve()
        hub = data / "models" / "hub"
        index_root = _env("RETRIEVER_INDEX_ROOT", str(data / "indexes" / "wiki-18") if mode == "gpu" else "")
        models_from = _env("PRORAG_MODELS_FROM")
        corpus_import = _env("WIKI18_IMPORT")
        world_import = _env("WORLD_IMPORT")
        s = cls(mode=mode, data=data, world=_env("PRORAG_WORLD", "default"),
                policy_base=Path(_env("POLICY_BASE_MODEL", str(hub / "Qwen3-8B"))),
                policy_prepared=Path(_env("POLICY_PREPARED_MODEL", str(hub / "Qwen3-8B-prorag"))),
                e5=Path(_env("E5_ENCODER", str(hub / "e5-base-v2"))),
                corpus=Path(_env("WIKI18_CORPUS", str(data / "corpora" / "wiki-18.jsonl"))),
                corpus_import=Path(corpus_import) if corpus_import else None,
                world_import=Path(world_import) if world_import else None,
                index_root=Path(index_root) if index_root else None,
                faiss=_env("PRORAG_FAISS", "ivfpq" if mode == "gpu" else "flat"),
                fp16=_flag("PRORAG_ENCODER_FP16") if "PRORAG_ENCODER_FP16" in os.environ else mode == "gpu",
                download=_flag("PRORAG_DOWNLOAD"), models_from=Path(models_from) if models_from else None,
                policy_repo=_env("POLICY_HF_REPO", "Qwen/Qwen3-8B"), e5_repo=_env("E5_HF_REPO", "intfloat/e5-base-v2"),
                corpus_repo=_env("WIKI18_HF_REPO", "PeterJinGo/wiki-18-corpus"),
                corpus_file=_env("WIKI18_HF_FILE", "wiki-18.jsonl.gz"))
        s.check()
        return s

    def check(self) -> None:
        """Every path the services read later must lie inside the data root: a file elsewhere (a bind mount of
        this one container) is gone when the retriever or the policy starts."""
        inside = [("WIKI18_CORPUS", self.corpus)]
        if self.index_root is not None:
            inside.append(("RETRIEVER_INDEX_ROOT", self.index_root))
        if self.mode == "gpu":
            inside += [("POLICY_BASE_MODEL", self.policy_base), ("POLICY_PREPARED_MODEL", self.policy_prepared),
                       ("E5_ENCODER", self.e5)]
        for name, p in inside:
            if not p.is_absolute() or not p.resolve().is_relative_to(self.data):
                raise SetupError(
                    f"{name}={p} lies outside the data volume ({self.data}): the services read it later from their "
                    f"own containers, which do not have this one's mounts. Name a path under {self.data}; to bring a "
                    f"file in from a mount use WIKI18_IMPORT (the corpus) or PRORAG_MODELS_FROM (models and corpus), "
                    "which copy into the volume", EXIT_BAD_INPUT)
        if self.policy_base.resolve() == self.policy_prepared.resolve():
            raise SetupError("POLICY_PREPARED_MODEL must differ from POLICY_BASE_MODEL (the prepared copy is written "
                             "beside the base, which stays as it was downloaded)", EXIT_BAD_INPUT)
        if self.corpus_import is not None and self.index_root is None:
            raise SetupError("WIKI18_IMPORT without RETRIEVER_INDEX_ROOT: the cpu setup indexes an imported corpus "
                             "only where the retriever is told to serve it", EXIT_BAD_INPUT)

    @property
    def done_marker(self) -> Path:
        # the k8s Deployments' wait-for-setup init containers wait for this file
        return self.data / f".prorag-setup-done-{self.mode}"

    @property
    def failed_marker(self) -> Path:
        return self.data / f".prorag-setup-failed-{self.mode}"


def say(msg: str) -> None:
    print(f"[prorag setup] {msg}", flush=True)


# ---------------------------------------------------------------- what is present
def index_present(root: Path) -> bool:
    """A finished doc store, dense and BM25 index under ``root``, and the corpus the doc store reads, unchanged
    in size. (Cheap: no scan of a 13 GB corpus.)"""
    from services.retriever.docstore import DocStore, read_meta  # its read_meta, not the indexes' one

    if not all(read_meta(root / part) for part in ("docstore", "dense", "bm25")):
        return False
    try:
        DocStore(root / "docstore").close()  # finds the corpus and checks its size
    except Exception:  # noqa: BLE001 - any reason it cannot open is "not present": the build says why
        return False
    return True


def model_present(path: Path) -> bool:
    return (path / "config.json").is_file()


def prepared_present(path: Path) -> bool:
    if not model_present(path):
        return False
    try:
        check_tags(path)
    except FailedPrecondition:
        return False
    return True


SPLITS = ("train", "dev", "test")


def dataset_folder(world: str) -> bool:
    """A dataset folder in the FlashRAG layout (not a generated world): it has splits and no world.json."""
    d = paths.world_dir(world)
    return not (d / "world.json").exists() and any((d / f"{split}.jsonl{gz}").is_file()
                                                     for split in SPLITS for gz in ("", ".gz"))


def world_present(s: Settings) -> bool:
    if not (world_is_complete(s.world) or dataset_folder(s.world)):
        return False
    if s.mode == "cpu":
        marker = policy_base_dir(s.world) / "embedded.json"
        if not (index_present(paths.index_dir(s.world)) and marker.is_file()
                and json.loads(marker.read_text()).get("tokenizer") == TOKENIZER_VERSION):
            return False
    return True


def everything_present(s: Settings) -> bool:
    if not world_present(s):
        return False
    if s.mode == "gpu" and not (model_present(s.policy_base) and model_present(s.e5)
                                and prepared_present(s.policy_prepared)):
        return False
    return s.index_root is None or index_present(s.index_root)


# ---------------------------------------------------------------- acquiring inputs
def _copy_tree(src: Path, dest: Path) -> None:
    with atomic_dir(dest) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True, symlinks=False)


def _hub_env() -> dict[str, str]:
    # a child process: huggingface_hub reads HF_HUB_OFFLINE (1 in every image) when it is imported. Its own cache
    # (HF_HOME; hf_xet keeps a chunk cache of up to 10 GB there) goes to the data volume, not the containers' home,
    # a tmpfs held in memory
    return {**os.environ, "HF_HUB_OFFLINE": "0", "HF_HOME": str(paths.data_dir() / ".cache" / "huggingface")}


def _download_model(repo: str, dest: Path) -> None:
    with atomic_dir(dest) as tmp:
        code = ("import sys; from huggingface_hub import snapshot_download; "
                "snapshot_download(sys.argv[1], local_dir=sys.argv[2], ignore_patterns=sys.argv[3].split(','))")
        r = subprocess.run([sys.executable, "-c", code, repo, str(tmp), ",".join(HF_IGNORE)], env=_hub_env())
        if r.returncode != 0:
            raise SetupError(f"downloading {repo} from the Hugging Face hub failed (exit {r.returncode}, above); "
                             "check the network and HF_TOKEN for gated repos, or copy the model in with "
                             "PRORAG_MODELS_FROM", EXIT_FETCH)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's download metadata


def _check_models_from(s: Settings) -> None:
    # checked only when something is to be copied: a rerun with everything present ignores the variable
    if s.models_from is not None and not s.models_from.is_dir():
        raise SetupError(f"PRORAG_MODELS_FROM={s.models_from} is not a directory (mount the directory holding "
                         f"{s.policy_base.name}/, {s.e5.name}/ and {s.corpus.name} there)", EXIT_BAD_INPUT)


def acquire_model(s: Settings, target: Path, repo: str, what: str) -> str:
    if model_present(target):
        return f"{what} present: {target}"
    _check_models_from(s)
    source = s.models_from / target.name if s.models_from else None
    if source is not None and model_present(source):
        say(f"copying {what} from {source} into {target}")
        _copy_tree(source, target)
        return f"{what} copied from {source}"
    if s.download:
        say(f"downloading {what} {repo} into {target}")
        _download_model(repo, target)
        return f"{what} downloaded from {repo}"
    looked = f"; PRORAG_MODELS_FROM={s.models_from} has no {target.name}/config.json" if s.models_from else ""
    raise SetupError(f"missing {what}: {target} has no config.json{looked}. Copy it into the models volume, or run "
                     f"the setup once with PRORAG_MODELS_FROM=<a mount holding {target.name}/> or PRORAG_DOWNLOAD=1 "
                     f"(fetches {repo} from the Hugging Face hub)", EXIT_MISSING)


def _copy_corpus(src: Path, dest: Path) -> None:
    """``src`` (plain or .gz) into ``dest`` as plain jsonl, through a temporary file renamed in last, so a copy
    cut short is never taken for the corpus."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        opener = gzip.open if src.name.endswith(".gz") else open
        with opener(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 24)


def _download_corpus(s: Settings) -> None:
    work = Path(tempfile.mkdtemp(prefix=".download.", dir=s.corpus.parent))
    try:
        code = ("import sys; from huggingface_hub import hf_hub_download; "
                "print(hf_hub_download(sys.argv[1], sys.argv[2], repo_type='dataset', local_dir=sys.argv[3]))")
        r = subprocess.run([sys.executable, "-c", code, s.corpus_repo, s.corpus_file, str(work)],
                           env=_hub_env(), capture_output=True, text=True)
        if r.returncode != 0:
            raise SetupError(f"downloading {s.corpus_file} of the dataset {s.corpus_repo} failed: "
                             f"{r.stderr.strip()[-500:]}", EXIT_FETCH)
        _copy_corpus(Path(r.stdout.strip().splitlines()[-1]), s.corpus)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def acquire_corpus(s: Settings) -> str:
    if s.corpus.is_file():
        if s.corpus_import is not None:
            say(f"WIKI18_IMPORT={s.corpus_import} ignored: {s.corpus} is already in the volume (delete it to import "
                "another corpus)")
        return f"corpus present: {s.corpus}"
    _check_models_from(s)
    sources = [s.corpus_import] if s.corpus_import is not None else []
    if s.models_from is not None:
        sources += [s.models_from / s.corpus.name, s.models_from / (s.corpus.name + ".gz")]
    for src in sources:
        if src.is_file():
            say(f"copying the corpus {src} into {s.corpus}")
            _copy_corpus(src, s.corpus)
            return f"corpus copied from {src}"
    if s.corpus_import is not None:
        raise SetupError(f"WIKI18_IMPORT={s.corpus_import} is not a file (mount it into the setup container, e.g. "
                         f"-v \"$PWD/wiki-18.jsonl:{s.corpus_import}:ro\")", EXIT_MISSING)
    if s.download:
        s.corpus.parent.mkdir(parents=True, exist_ok=True)
        say(f"downloading {s.corpus_file} of {s.corpus_repo} into {s.corpus}")
        _download_corpus(s)
        return f"corpus downloaded from {s.corpus_repo}"
    raise SetupError(f"missing corpus {s.corpus}: run the setup once with WIKI18_IMPORT=<the wiki-18 jsonl, mounted>, "
                     f"PRORAG_MODELS_FROM=<a mount holding {s.corpus.name}[.gz]> or PRORAG_DOWNLOAD=1 (fetches "
                     f"{s.corpus_file} of {s.corpus_repo}); one {{\"id\", \"contents\"}} object per line", EXIT_MISSING)


def acquire_world(s: Settings) -> str:
    target = paths.world_dir(s.world)
    if world_is_complete(s.world) or dataset_folder(s.world):
        if s.world_import is not None:
            say(f"WORLD_IMPORT={s.world_import} ignored: {target} is already in the volume")
        return f"world {s.world} present"
    if s.world_import is not None:
        if not any((s.world_import / f"{split}.jsonl{gz}").is_file() for split in SPLITS for gz in ("", ".gz")):
            raise SetupError(f"WORLD_IMPORT={s.world_import} holds no train/dev/test.jsonl[.gz] (a FlashRAG-layout "
                             "dataset folder, mounted into the setup container)", EXIT_MISSING)
        say(f"copying the dataset {s.world_import} into {target}")
        _copy_tree(s.world_import, target)
        return f"world {s.world} copied from {s.world_import}"
    if target.is_dir() and any(target.iterdir()) and not (target / "world.json").exists():
        raise SetupError(f"{target} holds files but neither a generated world nor train/dev/test.jsonl: not "
                         "overwritten; remove it, or import the dataset with WORLD_IMPORT", EXIT_BAD_INPUT)
    if s.world not in WORLD_SIZES and not (target / "world.json").exists():
        # a dataset's name (the paper's hotpotqa-musique): generating an embedded world under it would pass off
        # synthetic questions as the dataset
        raise SetupError(f"missing world {s.world}: {target} is empty. Bring the dataset folder (FlashRAG layout: "
                         f"train/dev/test.jsonl) with WORLD_IMPORT=<its mount>, or name an embedded world "
                         f"({', '.join(WORLD_SIZES)}) in PRORAG_WORLD", EXIT_MISSING)
    ensure_world(s.world)
    return f"world {s.world} generated (the embedded benchmark)"


# ---------------------------------------------------------------- the prepared policy model
def check_tags(model_dir: Path) -> None:
    """FailedPrecondition unless vLLM can serve ``model_dir`` (the format's tags one token each, inside the
    embeddings): the check the vLLM engine makes at start."""
    from transformers import AutoTokenizer  # transformers loads in seconds: only the steps that read a model

    check_format_tags(AutoTokenizer.from_pretrained(str(model_dir)), model_dir, _model_vocab_size(model_dir))


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)  # same volume: no second copy of 16 GB of weights
    except OSError:
        shutil.copy2(src, dest)


def prepare_policy_model(src: str | Path, out: str | Path) -> dict:
    """``src`` (a stock causal LM, e.g. Qwen3-8B) with the step format's tags added as special tokens, written to
    ``out``: what vLLM needs to serve it (it cannot resize embeddings at load, the transformers engine can).

    When the checkpoint's embedding matrix already has spare rows for the new ids (Qwen3-8B: 151,936 rows for a
    151,669-token vocabulary) only the tokenizer changes: the other files are hard-linked (copied across
    filesystems) and the weights are bit for bit the base's. Otherwise the model is loaded on the CPU (its full
    size in memory), its embeddings resized, and saved. The new tags are untrained either way: the model writes
    the step format only after SFT (which adds the same ids in the same order), so a policy on it starts and
    serves, and its rollouts end invalid_format until then."""
    from transformers import AutoTokenizer  # transformers loads in seconds: only the steps that read a model

    from prorag.modeling import add_format_tokens
    src, out = Path(src), Path(out)
    if not model_present(src):
        raise SetupError(f"prepare-model: {src} is not a model directory (no config.json)", EXIT_BAD_INPUT)
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    added = add_format_tokens(tokenizer)
    rows = _model_vocab_size(src)
    resized = not rows or len(tokenizer) > rows
    with atomic_dir(out) as tmp:
        # the tokenizer first: linking its files and then saving over them would rewrite the base's own (one inode)
        tokenizer.save_pretrained(tmp)
        if resized:
            from transformers import AutoModelForCausalLM  # only the steps that read a model load it

            model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
            add_format_tokens(tokenizer, model)
            model.save_pretrained(tmp)
        else:
            for f in sorted(src.iterdir()):
                if f.is_file() and not f.name.startswith(".") and not (tmp / f.name).exists():
                    _link_or_copy(f, tmp / f.name)
    check_tags(out)
    return {"model": str(out), "from": str(src), "tags_added": added, "embeddings_resized": resized,
            "vocab": len(tokenizer), "embedding_rows": rows}


def prepare_policy(s: Settings) -> str:
    if prepared_present(s.policy_prepared):
        return f"prepared policy present: {s.policy_prepared}"
    say(f"preparing {s.policy_prepared} from {s.policy_base} (the step format's tags as tokens)")
    info = prepare_policy_model(s.policy_base, s.policy_prepared)
    return f"prepared policy {s.policy_prepared} ({info['tags_added']} tokens added, " \
           f"{'embeddings resized' if info['embeddings_resized'] else 'weights linked unchanged'})"


# ---------------------------------------------------------------- indexes
def build_corpus_index(s: Settings) -> str:
    from services.retriever.indexing import BM25Config, DenseIndexConfig, build_all, read_meta  # see above

    assert s.index_root is not None
    if s.mode == "gpu":  # e5 (Search-R1's retriever), fp16 on a GPU (ignored on a CPU)
        enc = EncoderConfig.e5(str(s.e5), fp16=s.fp16, batch_size=int(_env("PRORAG_ENCODER_BATCH", "256")))
    else:  # the bundled MiniLM: what a CPU-only host can encode
        enc = EncoderConfig(model="minilm")
    dense = DenseIndexConfig(encoder=enc, faiss_type=s.faiss)
    t0 = time.time()
    with progress_bars() as progress:
        build_all(s.corpus, s.index_root, dense, BM25Config(), progress=progress)
    store = read_meta(s.index_root / "docstore") or {}
    recorded = Path(store.get("corpus_path", ""))
    if not recorded.resolve().is_relative_to(s.data):  # the retriever reads it: it must be in the volume
        raise SetupError(f"the doc store at {s.index_root} reads {recorded}, outside {s.data}", EXIT_BAD_INPUT)
    return f"index {s.index_root} ({store.get('n_docs')} documents, encoder {enc.model}, fp16={enc.fp16}, " \
           f"{s.faiss}) in {time.time() - t0:.0f}s"


def run(mode: str) -> int:
    """The whole setup; returns the exit code (0, 2 bad input, 3 a missing input, 4 a failed download)."""
    try:
        s = Settings.from_env(mode)
    except SetupError as e:
        say(f"FAILED: {e}")
        return e.code
    s.data.mkdir(parents=True, exist_ok=True)  # the markers live there (a volume: present in containers)
    if everything_present(s):
        # whatever PRORAG_DOWNLOAD, WIKI18_IMPORT or PRORAG_MODELS_FROM say: nothing to fetch, copy or rebuild
        s.failed_marker.unlink(missing_ok=True)
        s.done_marker.touch()
        say(f"setup done ({mode}): world, models and indexes present, nothing to do")
        return 0
    s.done_marker.unlink(missing_ok=True)  # the services must not start on a half-built setup
    s.failed_marker.unlink(missing_ok=True)
    try:
        say(acquire_world(s))
        if mode == "cpu" and dataset_folder(s.world):
            raise SetupError(f"PRORAG_WORLD={s.world} is a dataset folder: the cpu profile serves an embedded world "
                             "(its own corpus, indexes and base policy); name one (default, tiny)", EXIT_BAD_INPUT)
        if mode == "cpu":
            ensure_indexes(s.world)
            say(f"indexes of world {s.world} present")
            say(f"embedded base policy {ensure_policy_model(s.world)}")
        else:
            say(acquire_model(s, s.policy_base, s.policy_repo, "policy base model"))
            say(acquire_model(s, s.e5, s.e5_repo, "e5 encoder"))
            say(prepare_policy(s))
        if s.index_root is not None:
            say(acquire_corpus(s))
            say(build_corpus_index(s))
    except SetupError as e:
        say(f"FAILED: {e}")
        s.failed_marker.write_text(f"{e}\n")
        return e.code
    except BaseException as e:
        # a crash (the k8s Job retries it): said where the waiting init containers look, then raised as it was
        s.failed_marker.write_text(f"setup crashed ({type(e).__name__}: {e}); a retry clears this\n")
        raise
    s.done_marker.touch()
    say(f"setup done ({mode})")
    return 0


__all__ = ["Settings", "SetupError", "run", "prepare_policy_model", "index_present", "everything_present",
           "EXIT_BAD_INPUT", "EXIT_MISSING", "EXIT_FETCH"]
