"""`prorag setup` (what compose's setup services and the k8s setup Job run) and `prorag prepare-model`, on the CPU:
the gpu mode's whole path with stand-ins of the right kind (a tiny stock Qwen3 without the step tags for Qwen3-8B,
the bundled MiniLM directory for e5-base-v2, a jsonl corpus in the wiki-18 layout), imported from a mount the way a
GPU host imports them. Not run here: PRORAG_DOWNLOAD=1 (the Hugging Face hub) and CUDA (fp16 encoding)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from prorag.errors import FailedPrecondition

SETUP_VARS = ("PRORAG_WORLD", "WORLD_IMPORT", "POLICY_BASE_MODEL", "POLICY_PREPARED_MODEL", "E5_ENCODER",
              "WIKI18_CORPUS", "WIKI18_IMPORT", "RETRIEVER_INDEX_ROOT", "PRORAG_FAISS", "PRORAG_ENCODER_FP16",
              "PRORAG_DOWNLOAD", "PRORAG_MODELS_FROM", "POLICY_HF_REPO", "E5_HF_REPO", "WIKI18_HF_REPO",
              "WIKI18_HF_FILE", "PRORAG_DATA")


def stock_model(root: Path, spare_rows: int) -> Path:
    """A tiny Qwen3 saved with weights and a tokenizer that has no step tags, like a stock checkpoint;
    ``spare_rows`` embedding rows beyond the vocabulary (Qwen3-8B has 267)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import WORDS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(hf) + spare_rows, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=8, max_position_embeddings=128))
    root.mkdir(parents=True)
    model.save_pretrained(root)
    hf.save_pretrained(root)
    return root


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- prepare-model
def test_a_stock_model_with_spare_rows_is_prepared_by_its_tokenizer_alone(tmp_path):
    from prorag_app.deploy_setup import check_tags, prepare_policy_model

    base = stock_model(tmp_path / "hub" / "Qwen3-8B", spare_rows=32)
    before = {f.name: sha(f) for f in base.iterdir()}
    with pytest.raises(FailedPrecondition) as refused:
        check_tags(base)
    assert "prorag prepare-model" in str(refused.value)  # the refusal names this fix
    info = prepare_policy_model(base, tmp_path / "hub" / "Qwen3-8B-prorag")
    out = Path(info["model"])
    assert info["tags_added"] >= 10 and not info["embeddings_resized"]
    check_tags(out)  # vLLM would serve it now
    # the weights are the base's, not a copy (a hard link on one filesystem), and the base is untouched
    assert os.stat(out / "model.safetensors").st_ino == os.stat(base / "model.safetensors").st_ino
    assert {f.name: sha(f) for f in base.iterdir()} == before
    assert sha(out / "tokenizer.json") != before["tokenizer.json"]
    # the prepared tokenizer gives the tags the ids SFT's own add_format_tokens gives a stock tokenizer
    from transformers import AutoTokenizer

    from prorag.modeling import add_format_tokens
    from prorag.trajectory import TAGS

    stock = AutoTokenizer.from_pretrained(str(base))
    add_format_tokens(stock)
    prepared = AutoTokenizer.from_pretrained(str(out))
    assert [prepared.convert_tokens_to_ids(t) for t in TAGS] == [stock.convert_tokens_to_ids(t) for t in TAGS]


def test_a_stock_model_without_spare_rows_gets_its_embeddings_resized(tmp_path):
    from transformers import AutoModelForCausalLM

    from prorag_app.deploy_setup import check_tags, prepare_policy_model

    base = stock_model(tmp_path / "base", spare_rows=0)
    info = prepare_policy_model(base, tmp_path / "prepared")
    assert info["embeddings_resized"] and info["embedding_rows"] < info["vocab"]
    check_tags(tmp_path / "prepared")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "prepared"))
    assert model.get_input_embeddings().weight.shape[0] >= info["vocab"]


def test_prepare_model_refuses_what_is_not_a_model(tmp_path, capsys):
    from prorag_app.cli import main

    assert main(["prepare-model", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a model directory" in capsys.readouterr().err


# ---------------------------------------------------------------- prorag setup gpu, on the CPU
@pytest.fixture
def setup_env(tmp_path, monkeypatch):
    for var in SETUP_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PRORAG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRORAG_WORLD", "tiny")
    monkeypatch.setenv("PRORAG_FAISS", "flat")  # IVF-PQ needs more vectors than a test corpus has
    return tmp_path


@pytest.fixture
def mount(setup_env) -> Path:
    """What a host would mount for PRORAG_MODELS_FROM: the two models under their target names and the corpus."""
    from services.retriever.encoders import resolve_model_path

    src = setup_env / "mount"
    stock_model(src / "Qwen3-8B", spare_rows=32)
    shutil.copytree(resolve_model_path("minilm")[0], src / "e5-base-v2")  # a BERT encoder directory, as e5 is
    rows = [{"id": str(i), "contents": f'"Topic {i}"\nPassage {i} is about the river number {i} and its city.'}
            for i in range(120)]
    with gzip.open(src / "wiki-18.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return src


def test_setup_gpu_imports_everything_into_the_volume_and_then_does_nothing(setup_env, mount, monkeypatch, capsys):
    from prorag_app.deploy_setup import check_tags, run
    from services.retriever.engine import RetrievalEngine
    from services.retriever.docstore import read_meta

    data = (setup_env / "home" / "data").resolve()
    monkeypatch.setenv("PRORAG_MODELS_FROM", str(mount))
    assert run("gpu") == 0
    hub = data / "models" / "hub"
    assert (hub / "Qwen3-8B" / "model.safetensors").is_file() and (hub / "e5-base-v2" / "config.json").is_file()
    check_tags(hub / "Qwen3-8B-prorag")  # the policy's default model is servable by vLLM
    index = data / "indexes" / "wiki-18"
    store, dense = read_meta(index / "docstore"), read_meta(index / "dense")
    # the corpus was copied (and decompressed) into the data volume; the doc store reads it there
    assert store["corpus_path"] == str(data / "corpora" / "wiki-18.jsonl") and store["n_docs"] == 120
    assert dense["encoder"]["model"] == str(hub / "e5-base-v2")
    assert (dense["encoder"]["query_prefix"], dense["encoder"]["doc_prefix"], dense["encoder"]["fp16"]) == \
        ("query: ", "passage: ", True)
    assert (data / ".prorag-setup-done-gpu").is_file() and not (data / ".prorag-setup-failed-gpu").exists()
    # what the retriever container does at start: open the index and answer
    engine = RetrievalEngine.from_dir(index, default="dense")
    try:
        assert engine.search(["Passage 7 river"], 3, "dense")[0]
    finally:
        engine.close()

    # a second `up` runs it again with other variables: nothing is fetched, copied or rebuilt, and it succeeds
    stamps = {p: p.stat().st_mtime_ns for p in (index / "docstore" / "meta.json", index / "dense" / "meta.json",
                                                hub / "Qwen3-8B-prorag" / "tokenizer.json")}
    capsys.readouterr()
    monkeypatch.setenv("PRORAG_MODELS_FROM", str(setup_env / "not-mounted"))
    monkeypatch.setenv("WIKI18_IMPORT", "/import/not-there.jsonl")
    monkeypatch.setenv("PRORAG_DOWNLOAD", "1")
    monkeypatch.setenv("POLICY_HF_REPO", "no-such-org/no-such-model")  # would fail if anything were fetched
    assert run("gpu") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_setup_gpu_on_empty_volumes_fails_once_with_what_to_do(setup_env, capsys):
    from prorag_app.deploy_setup import EXIT_MISSING, run

    data = (setup_env / "home" / "data").resolve()
    assert run("gpu") == EXIT_MISSING
    out = capsys.readouterr().out
    assert "missing policy base model" in out and "PRORAG_DOWNLOAD=1" in out and "PRORAG_MODELS_FROM" in out
    # the reason is left where the k8s init containers look, and the services are not told to start
    assert "PRORAG_DOWNLOAD=1" in (data / ".prorag-setup-failed-gpu").read_text()
    assert not (data / ".prorag-setup-done-gpu").exists()


def test_setup_refuses_paths_outside_the_volume(setup_env, monkeypatch, capsys):
    from prorag_app.deploy_setup import EXIT_BAD_INPUT, run

    monkeypatch.setenv("WIKI18_CORPUS", "/import/wiki-18.jsonl")  # what the old documented command did
    assert run("gpu") == EXIT_BAD_INPUT
    assert "lies outside the data volume" in capsys.readouterr().out
    monkeypatch.delenv("WIKI18_CORPUS")
    monkeypatch.setenv("E5_ENCODER", "relative/e5")
    assert run("gpu") == EXIT_BAD_INPUT
    monkeypatch.delenv("E5_ENCODER")
    monkeypatch.setenv("PRORAG_DOWNLOAD", "maybe")
    assert run("gpu") == EXIT_BAD_INPUT
    assert "PRORAG_DOWNLOAD='maybe': give 1 or 0" in capsys.readouterr().out


def test_setup_cpu_indexes_an_imported_corpus_where_the_retriever_is_told_to_look(setup_env, mount, monkeypatch):
    from prorag_app.deploy_setup import EXIT_BAD_INPUT, run
    from services.retriever.docstore import read_meta

    data = (setup_env / "home" / "data").resolve()
    monkeypatch.setenv("WIKI18_IMPORT", str(mount / "wiki-18.jsonl.gz"))
    assert run("cpu") == EXIT_BAD_INPUT  # imported but served nowhere: said, not silently ignored
    monkeypatch.setenv("RETRIEVER_INDEX_ROOT", str(data / "indexes" / "wiki-18"))
    assert run("cpu") == 0
    store = read_meta(data / "indexes" / "wiki-18" / "docstore")
    assert store["corpus_path"] == str(data / "corpora" / "wiki-18.jsonl") and store["n_docs"] == 120
    assert read_meta(data / "indexes" / "wiki-18" / "dense")["encoder"]["model"] == "minilm"
    assert (data / "models" / "tiny" / "policy-base" / "config.json").is_file()
    monkeypatch.delenv("WIKI18_IMPORT")  # the next `up`: the defaults, the corpus already in the volume
    assert run("cpu") == 0


def test_setup_gpu_imports_a_dataset_folder_as_the_world_and_never_overwrites_it(setup_env, mount, monkeypatch):
    from prorag.data.loaders import load_split
    from prorag_app.deploy_setup import EXIT_BAD_INPUT, EXIT_MISSING, run

    data = (setup_env / "home" / "data").resolve()
    dataset = setup_env / "paper"  # the FlashRAG layout configs/paper's hotpotqa-musique has
    dataset.mkdir()
    for split in ("train", "dev", "test"):
        (dataset / f"{split}.jsonl").write_text(json.dumps(
            {"id": f"{split}-0", "question": "Which river?", "golden_answers": ["Topic 7"], "metadata": {}}) + "\n")
    monkeypatch.setenv("PRORAG_MODELS_FROM", str(mount))
    monkeypatch.setenv("PRORAG_WORLD", "paper")
    # a dataset's name without the dataset: not generated under that name (synthetic questions passed off as it)
    assert run("gpu") == EXIT_MISSING and not (data / "worlds" / "paper").exists()
    assert "WORLD_IMPORT" in (data / ".prorag-setup-failed-gpu").read_text()
    monkeypatch.setenv("WORLD_IMPORT", str(dataset))
    assert run("gpu") == 0
    world = data / "worlds" / "paper"
    assert not (world / "world.json").exists(), "copied, not generated"
    assert [q.id for q in load_split(world, "train")] == ["train-0"]
    monkeypatch.delenv("WORLD_IMPORT")  # the next `up`: used as it is
    assert run("gpu") == 0 and [q.id for q in load_split(world, "train")] == ["train-0"]
    # the cpu profile serves embedded worlds only: said, and the folder left alone
    assert run("cpu") == EXIT_BAD_INPUT and (world / "train.jsonl").is_file()


def test_prorag_index_fp16_is_recorded_with_the_index(setup_env, mount, capsys):
    from prorag_app.cli import main
    from services.retriever.docstore import read_meta

    corpus = setup_env / "c.jsonl"
    with gzip.open(mount / "wiki-18.jsonl.gz", "rb") as f:
        corpus.write_bytes(f.read())
    out = setup_env / "idx"
    assert main(["index", "--corpus", str(corpus), "--out", str(out), "--encoder", str(mount / "e5-base-v2"),
                 "--query-prefix", "query: ", "--doc-prefix", "passage: ", "--fp16"]) == 0
    # part of the index's identity: an index built in fp16 on a GPU is served with the encoder in fp16 there
    assert read_meta(out / "dense")["encoder"]["fp16"] is True


def test_a_failed_download_is_a_retryable_failure(setup_env, monkeypatch):
    """PRORAG_DOWNLOAD=1 against a hub that does not answer (a closed local port): exit 4, which the k8s Job retries
    (2 and 3 fail it at once), the reason left for the init containers, nothing half-written in the models volume."""
    from prorag_app.deploy_setup import EXIT_FETCH, run

    data = (setup_env / "home" / "data").resolve()
    monkeypatch.setenv("PRORAG_DOWNLOAD", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    assert run("gpu") == EXIT_FETCH
    assert "downloading Qwen/Qwen3-8B" in (data / ".prorag-setup-failed-gpu").read_text()
    hub = data / "models" / "hub"
    assert list(hub.iterdir()) == []
