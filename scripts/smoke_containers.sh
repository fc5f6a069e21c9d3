#!/usr/bin/env bash
# make smoke-containers: build the CPU images (the Dockerfile's five targets), import a tiny corpus into the data
# volume exactly as wiki-18 is imported on a GPU host (`compose run -v FILE:/import/... -e WIKI18_IMPORT=... setup`),
# bring up compose's `cpu` profile (its setup runs again and must do nothing), answer one question end to end through
# the containers (a client in the trainer's container -> prorag-policy:50052 Rollout -> prorag-retriever:50051, the
# names that resolve in Kubernetes too), then tear everything down (containers, network and the smoke's volumes).
#
# Where no Docker engine can be had it says exactly why and exits 0, unless STRICT=1 (then 1).
#
# Settings (environment):
#   STRICT=1              a missing engine, compose or base image fails instead of skipping
#   START_DOCKERD=1       start dockerd here when none answers and we are root (default 1; 0 = never)
#   PRORAG_CPU_BASE=IMG   base of the CPU images (default python:3.11-slim when present or pullable, else a
#                         local Debian bookworm image from scripts/build_base_image.sh)
#   PRORAG_TORCH_WHEEL=F  the torch 2.13.0 CPU wheel to build with (default: found on disk; else the PyTorch
#                         CPU index is used)
#   SMOKE_WORLD=tiny      embedded world of the smoke (tiny: seconds to build; default: ~10 minutes on 2 cores)
#   SMOKE_SECURE=1        run with compose.secure.yaml too (TLS + tokens from scripts/make_secrets.sh)
#   SMOKE_TRAIN=0         skip the tiny SFT job through the trainer (then the untrained base answers)
#   KEEP=1                leave the stack running for a look (tear down with the printed command)
#   SMOKE_TIMEOUT=1800    seconds to wait for the stack to be healthy
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
STRICT="${STRICT:-0}"
WORLD="${SMOKE_WORLD:-tiny}"
PROJECT="prorag-smoke"
LOG_DIR="${SMOKE_LOG_DIR:-$ROOT/build/smoke}"
mkdir -p "$LOG_DIR"
T0=$(date +%s)
say() { printf '[smoke %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
skip() {  # no engine / tools: a clear reason, exit 0 unless STRICT=1
  say "SKIPPED: $*"
  if [ "$STRICT" = 1 ]; then say "STRICT=1: failing"; exit 1; fi
  exit 0
}
fail() { say "FAILED: $*"; exit 1; }

# ---------------------------------------------------------------- engine
command -v docker >/dev/null || skip "no docker client on PATH (Debian: apt-get install docker.io)"
if ! docker info >/dev/null 2>&1; then
  if [ "${START_DOCKERD:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null; then
    say "no Docker engine answers; starting dockerd (host networking for builds, no iptables, no docker0)"
    nohup dockerd --iptables=false --ip-masq=false --bridge=none >"$LOG_DIR/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || skip "dockerd did not start: $(tail -3 "$LOG_DIR/dockerd.log" | tr '\n' ' ')"
  else
    why="$(docker info 2>&1 | grep -iE 'cannot connect|error|permission' | head -1)"
    skip "no Docker engine: ${why:-docker info failed} (root with Debian's docker.io can start one: dockerd)"
  fi
fi
say "engine: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"
# a Docker CLI >= 23 without the buildx plugin would refuse to build (BuildKit is its default): the classic
# builder then (the Dockerfile is plain syntax)
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then COMPOSE=(docker-compose)
else skip "no compose: neither 'docker compose' nor docker-compose (Debian: apt-get install docker-compose)"; fi
say "compose: $("${COMPOSE[@]}" version 2>/dev/null | head -1)"

# ---------------------------------------------------------------- base image and torch wheel
BASE="${PRORAG_CPU_BASE:-}"
if [ -z "$BASE" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
    BASE=python:3.11-slim
  else
    say "python:3.11-slim cannot be pulled (no registry); using a local Debian bookworm base (built if missing)"
    BASE=prorag-local/python:3.11-bookworm
    bash scripts/build_base_image.sh "$BASE" >"$LOG_DIR/base-image.log" 2>&1 \
      || skip "no base image: python:3.11-slim unreachable and the local build failed ($(tail -2 "$LOG_DIR/base-image.log" | tr '\n' ' '))"
  fi
fi
say "CPU base image: $BASE"

TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
WHEEL="${PRORAG_TORCH_WHEEL:-}"
if [ -z "$WHEEL" ]; then
  WHEEL="$(ls /opt/wheels/torch-2.13.0+cpu-*.whl build/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1)"
fi
if [ -n "$WHEEL" ] && [ -f "$WHEEL" ]; then
  mkdir -p build/wheels
  [ "$(realpath "$WHEEL")" = "$(realpath -m "build/wheels/$(basename "$WHEEL")")" ] || cp "$WHEEL" build/wheels/
  TORCH_INDEX_URL=""   # the wheel in the build context is the torch; nothing else to reach
  say "torch CPU wheel from $WHEEL (build context build/wheels/)"
fi

# ---------------------------------------------------------------- build
build() {  # $1 service (the Dockerfile's target), $2 tag
  local t=$(date +%s)
  docker build --network host -f Dockerfile --target "$1" -t "$2" \
    --build-arg BASE="$BASE" --build-arg FLAVOR=cpu --build-arg LOCK=cpu.lock \
    --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" . >"$LOG_DIR/build-$1.log" 2>&1 \
    || fail "docker build of $1 (last lines of $LOG_DIR/build-$1.log): $(tail -5 "$LOG_DIR/build-$1.log")"
  say "built $2 in $(( $(date +%s) - t ))s ($(docker image inspect "$2" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}'))"
}
build retriever prorag-retriever:smoke
build judge prorag-judge:smoke
build policy prorag-policy-cpu:smoke
build prm prorag-prm-cpu:smoke
build trainer prorag-trainer-cpu:smoke

# ---------------------------------------------------------------- a corpus to import, in the wiki-18 layout
# The tiny world's passages ({"id", "contents"} per line, gzipped like Search-R1's wiki-18.jsonl.gz), written by a
# throwaway container from the image just built, so the host needs nothing but Docker.
IMPORT_DIR="$LOG_DIR/import"
rm -rf "$IMPORT_DIR" && mkdir -p "$IMPORT_DIR" && chmod 777 "$IMPORT_DIR"
docker run --rm --network none -u 10001:10001 -e PRORAG_HOME=/out -v "$IMPORT_DIR:/out" --entrypoint prorag \
  prorag-retriever:smoke world --name "$WORLD" >"$LOG_DIR/import-world.log" 2>&1 \
  || fail "writing the corpus to import: $(tail -5 "$LOG_DIR/import-world.log")"
gzip -c "$IMPORT_DIR/data/worlds/$WORLD/corpus.jsonl" >"$IMPORT_DIR/wiki-18.jsonl.gz"
say "corpus to import: $IMPORT_DIR/wiki-18.jsonl.gz ($(gzip -dc "$IMPORT_DIR/wiki-18.jsonl.gz" | wc -l) passages)"

# ---------------------------------------------------------------- up
export PRORAG_TAG=smoke PRORAG_VOLUMES="$PROJECT" PRORAG_WORLD="$WORLD"
export POLICY_MODEL_CPU="/data/data/models/$WORLD/policy-base"
export PRORAG_BIND=127.0.0.1
# the retriever serves the imported corpus's index, where the setup builds it (as wiki-18 on a GPU host)
export RETRIEVER_INDEX_ROOT=/data/data/indexes/wiki-18
FILES=(-f compose.yaml)
if [ "${SMOKE_SECURE:-0}" = 1 ]; then
  [ -f secrets/tokens.yaml ] || bash scripts/make_secrets.sh >"$LOG_DIR/secrets.log" 2>&1 || fail "make_secrets.sh"
  FILES+=(-f compose.secure.yaml)
fi
DC=("${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" --profile cpu)
teardown() {
  if [ "${KEEP:-0}" = 1 ]; then say "KEEP=1: left running; stop with: ${DC[*]} down -v"; return; fi
  "${DC[@]}" logs --no-color >"$LOG_DIR/compose.log" 2>&1
  "${DC[@]}" down -v --remove-orphans >"$LOG_DIR/down.log" 2>&1
  say "torn down (containers, network, volumes); logs in $LOG_DIR/compose.log"
}
trap teardown EXIT
"${DC[@]}" down -v --remove-orphans >/dev/null 2>&1
T_UP=$(date +%s)
say "import: ${DC[*]} run --rm -v .../wiki-18.jsonl.gz:/import/wiki-18.jsonl.gz:ro -e WIKI18_IMPORT=... setup-cpu"
"${DC[@]}" run --rm -v "$IMPORT_DIR/wiki-18.jsonl.gz:/import/wiki-18.jsonl.gz:ro" \
  -e WIKI18_IMPORT=/import/wiki-18.jsonl.gz setup-cpu >"$LOG_DIR/setup-import.log" 2>&1 \
  || fail "the setup with the import: $(grep -v '^[a-z0-9-]*: [0-9]*/[0-9]*$' "$LOG_DIR/setup-import.log" | tail -8)"
grep '^\[prorag setup\]' "$LOG_DIR/setup-import.log" | while read -r line; do say "  $line"; done
say "up: ${DC[*]} up -d --no-build (world $WORLD; setup-cpu runs again with the defaults)"
"${DC[@]}" up -d --no-build >"$LOG_DIR/up.log" 2>&1 || fail "compose up: $(tail -5 "$LOG_DIR/up.log")"

container() { "${DC[@]}" ps -q "$1" 2>/dev/null | head -1; }
state() {  # health status, or the run state when the container has no health check
  local c; c="$(container "$1")"
  [ -n "$c" ] || { echo missing; return; }
  docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}:{{.State.ExitCode}}{{end}}' "$c"
}
deadline=$(( $(date +%s) + ${SMOKE_TIMEOUT:-1800} ))
while :; do
  s_setup="$(state setup-cpu)"
  case "$s_setup" in exited:0|missing) ;; exited:*) fail "setup-cpu exited ($s_setup): $("${DC[@]}" logs --no-color --tail 20 setup-cpu)";; esac
  all=1; line=""
  for svc in retriever-cpu policy-cpu prm-cpu judge-cpu trainer-cpu; do
    st="$(state "$svc")"; line="$line $svc=$st"
    [ "$st" = healthy ] || all=0
    case "$st" in unhealthy|exited:*) fail "$svc is $st: $("${DC[@]}" logs --no-color --tail 30 "$svc")";; esac
  done
  [ "$all" = 1 ] && break
  [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy after ${SMOKE_TIMEOUT:-1800}s:$line"
  sleep 5
done
say "all five services healthy in $(( $(date +%s) - T_UP ))s after the import (setup-cpu included)"
# the second setup (the `up`, without WIKI18_IMPORT) must have found everything and done nothing
"${DC[@]}" logs --no-color setup-cpu 2>/dev/null | grep -q "nothing to do" \
  || fail "setup-cpu did work again on up: $("${DC[@]}" logs --no-color --tail 10 setup-cpu)"
say "setup-cpu on up: nothing to do (the imported corpus and its index were found in the volume)"

# ---------------------------------------------------------------- train an agent through the trainer
# The embedded base only warms up on text: it does not write the step format yet, so its first step is invalid and
# the policy never searches. The tiny profile's SFT job (SMOKE_SFT_STEPS=200 steps, a few minutes on 2 cores) runs
# in the trainer container,
# reads the retriever by its Service name and publishes a model the policy is then restarted on.
if [ "${SMOKE_TRAIN:-1}" = 1 ]; then
  T_SFT=$(date +%s)
  MODEL="$("${DC[@]}" exec -T trainer-cpu python - "$WORLD" "${SMOKE_SFT_STEPS:-200}" <<'PYEOF' 2>"$LOG_DIR/sft.err"
import sys
from prorag.rpc.clients_trainer import TrainerClient, state_name
from prorag_app.profiles import PROFILES

world = sys.argv[1]
config = {"world": world, "base_model": f"/data/data/models/{world}/policy-base", "retriever": "prorag-retriever:50051",
          "publish_name": "sft", **PROFILES["tiny"].sft_for("sft"), "max_steps": int(sys.argv[2])}
with TrainerClient("prorag-trainer:50055", timeout=60) as tc:
    job = tc.start("sft", config)
    job = tc.wait(job.job_id, timeout=1800)
    if state_name(job.state) != "SUCCEEDED":
        raise SystemExit(f"sft job {job.job_id} {state_name(job.state)}: {job.error}")
    print(job.outputs["model"])
PYEOF
)" || fail "the SFT job through the trainer: $(tail -20 "$LOG_DIR/sft.err")"
  MODEL="$(echo "$MODEL" | tail -1)"
  say "SFT job through the trainer published $MODEL in $(( $(date +%s) - T_SFT ))s; restarting the policy on it"
  export POLICY_MODEL_CPU="$MODEL"
  "${DC[@]}" up -d --no-build --no-deps policy-cpu >>"$LOG_DIR/up.log" 2>&1 || fail "restarting policy-cpu"
  deadline=$(( $(date +%s) + 600 ))
  until [ "$(state policy-cpu)" = healthy ]; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "policy-cpu not healthy on $MODEL: $("${DC[@]}" logs --no-color --tail 30 policy-cpu)"
    sleep 5
  done
  say "policy-cpu healthy on $MODEL"
fi

# ---------------------------------------------------------------- one question end to end
# A client in the trainer's container (not the policy's): the call crosses the compose network by service name,
# the policy runs the whole trajectory and calls the retriever for every subquery.
T_Q=$(date +%s)
ANSWER="$("${DC[@]}" exec -T trainer-cpu python - "$WORLD" <<'PYEOF' 2>"$LOG_DIR/question.err"
import json, sys, time
from prorag import paths
from prorag.rpc.clients import PolicyClient, RetrieverClient
from prorag.data.loaders import load_split

world = sys.argv[1]
qs = load_split(paths.world_dir(world), "test")[:4]
with RetrieverClient("prorag-retriever:50051") as r:
    docs = r.search([qs[0].question], topk=1)[0]
t = time.time()
with PolicyClient("prorag-policy:50052", timeout=600) as p:
    events = list(p.rollout([(q.id, q.question) for q in qs], sampling=p.sampling(n=1, temperature=0.0), topk=1))
trajs = {e.question_id: e for e in events if hasattr(e, "steps")}
others = [{"q": q.question, "gold": q.golden_answers, "answer": trajs[q.id].answer,
           "finish": trajs[q.id].finish_reason, "docs": sum(len(s.retrieved) for s in trajs[q.id].steps)} for q in qs[1:]]
q, traj = qs[0], trajs[qs[0].id]
print(json.dumps({"question": q.question, "gold": q.golden_answers, "answer": traj.answer,
                  "finish_reason": traj.finish_reason, "steps": len(traj.steps),
                  "step_contents": [s.content for s in traj.steps][:8],
                  "documents_inserted": sum(len(s.retrieved) for s in traj.steps),
                  "retriever_top1": docs[0].title if docs else None,
                  "rollout_s": round(time.time() - t, 2), "documents_inserted_all": sum(o["docs"] for o in others)
                  + sum(len(s.retrieved) for s in traj.steps), "others": others}))
PYEOF
)"
rc=$?
[ $rc = 0 ] && [ -n "$ANSWER" ] || fail "the question did not come back (rc $rc): $(tail -20 "$LOG_DIR/question.err")"
say "answered in $(( $(date +%s) - T_Q ))s: $ANSWER"
echo "$ANSWER" >"$LOG_DIR/answer.json"
docs_in="$(echo "$ANSWER" | python3 -c 'import json,sys; print(json.load(sys.stdin)["documents_inserted_all"])')"
say "PASSED: CPU images built, a corpus imported into the volume, compose cpu profile healthy, setup idempotent, one question answered through the policy's Rollout (4 questions, $docs_in documents from the retriever inserted)"
