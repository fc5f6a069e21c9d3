#!/bin/sh
# prorag-setup: the one-shot setup that compose's `setup` / `setup-cpu` services and the k8s setup Job run
# before any service starts. Idempotent: what exists is reused (every prorag build step resumes or no-ops).
#
#   prorag-setup cpu   the embedded default: world, its dense + BM25 indexes, the embedded base policy
#   prorag-setup gpu   the paper's profile: the embedded world (the reference judge reads it), the policy
#                      model and the e5 encoder checked (or fetched when PRORAG_DOWNLOAD=1), and the
#                      e5 index of the wiki-18 corpus built on the GPU
#
# Settings (environment): PRORAG_WORLD (default), POLICY_MODEL, E5_ENCODER, WIKI18_CORPUS,
# RETRIEVER_INDEX_ROOT, PRORAG_FAISS (ivfpq), PRORAG_DOWNLOAD (0), POLICY_HF_REPO, E5_HF_REPO.
set -eu
WORLD="${PRORAG_WORLD:-default}"
MODELS="${PRORAG_HOME:-/data}/data/models/hub"

fetch_model() {  # $1 = directory, $2 = Hugging Face repo id
  if [ -f "$1/config.json" ]; then echo "model present: $1"; return 0; fi
  if [ "${PRORAG_DOWNLOAD:-0}" = 1 ]; then
    echo "downloading $2 into $1"
    HF_HUB_OFFLINE=0 python -c "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], local_dir=sys.argv[2])" "$2" "$1"
  else
    echo "missing model $1 ($2): copy it into the models volume, or run the setup once with PRORAG_DOWNLOAD=1" >&2
    exit 3
  fi
}

set -- "${1:-cpu}"
case "$1" in
  cpu)
    prorag index --world "$WORLD"
    prorag base --world "$WORLD"
    ;;
  gpu)
    prorag world --name "$WORLD" >/dev/null
    fetch_model "${POLICY_MODEL:-$MODELS/Qwen3-8B}" "${POLICY_HF_REPO:-Qwen/Qwen3-8B}"
    fetch_model "${E5_ENCODER:-$MODELS/e5-base-v2}" "${E5_HF_REPO:-intfloat/e5-base-v2}"
    CORPUS="${WIKI18_CORPUS:-${PRORAG_HOME:-/data}/data/corpora/wiki-18.jsonl}"
    if [ ! -f "$CORPUS" ]; then
      echo "missing corpus $CORPUS: put the wiki-18 corpus (jsonl, one {\"id\", \"contents\"} per line) there" >&2
      exit 3
    fi
    prorag index --corpus "$CORPUS" --out "${RETRIEVER_INDEX_ROOT:-${PRORAG_HOME:-/data}/data/indexes/wiki-18}" \
      --encoder "${E5_ENCODER:-$MODELS/e5-base-v2}" --pooling mean \
      --query-prefix 'query: ' --doc-prefix 'passage: ' --faiss "${PRORAG_FAISS:-ivfpq}"
    ;;
  *)
    echo "usage: prorag-setup cpu|gpu" >&2
    exit 2
    ;;
esac
# the k8s Deployments' wait-for-setup init containers wait for this file
touch "${PRORAG_HOME:-/data}/data/.prorag-setup-done-$1"
echo "setup done ($1)"
