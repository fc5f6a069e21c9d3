#!/bin/sh
# prorag-setup: the one-shot setup that compose's `setup` / `setup-cpu` services and the k8s setup Job run before
# any service starts: `prorag setup cpu|gpu` (prorag_app/deploy_setup.py has what it does, its variables and exit
# codes). It does nothing when the world, models and indexes are present, whatever its variables say.
#
#   prorag-setup cpu   the embedded world, its indexes and base policy (+ an imported corpus's index when
#                      RETRIEVER_INDEX_ROOT is set)
#   prorag-setup gpu   the world, Qwen3-8B and e5-base-v2 (copied from PRORAG_MODELS_FROM or fetched when
#                      PRORAG_DOWNLOAD=1), the prepared policy model, the e5 index of wiki-18 (fp16 on the GPU)
set -eu
case "${1:-}" in
  cpu|gpu) exec prorag setup "$1" ;;
  *) echo "usage: prorag-setup cpu|gpu" >&2; exit 2 ;;
esac
