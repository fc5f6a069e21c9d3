#!/usr/bin/env bash
# The research run (`prorag run --profile research`, issue 47) across machines whose state does not survive.
#
# The run needs about 20 hours of two CPU cores; a working session here lasts three, and twice the machine under it
# was replaced between sessions with everything outside the repository lost. So the run's finished work is carried
# in the repository (research/home: a copy of its PRORAG_HOME without what is rebuilt cheaply) and resumed from
# there: every finished job is reused by id, an unfinished one resumes from its checkpoint.
#
#   scripts/research.sh start    unpack research/home if the home is missing, check out the frozen code, run (niced)
#   scripts/research.sh unpack   research/home into the home, which must not exist yet
#   scripts/research.sh stop     stop it (jobs resume from their checkpoints)
#   scripts/research.sh pack     copy the home's carried part into research/home (commit it afterwards)
#   scripts/research.sh status   where it is
#
# research/MANIFEST holds what must not change while the run lasts: the code's commit (the evaluation cache is keyed
# by the committed code) and the home's absolute path (job ids hash the paths in their configs).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
research=${RESEARCH_DIR:-$repo/research}  # another directory only in tests
manifest="$research/MANIFEST"
carried="$research/home"
field() { sed -n "s/^$1=//p" "$manifest"; }
commit=$(field commit)
home=$(field home)
code=$(field code)
log="$home.log"
pidfile="$home.pid"
running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

case "${1:-}" in
start)
  if running; then echo "already running (pid $(cat "$pidfile"))"; exit 0; fi
  if [ ! -d "$home" ] && [ -d "$carried" ]; then "$0" unpack; fi
  if [ ! -d "$code" ]; then git -C "$repo" worktree add --detach "$code" "$commit"; fi
  [ "$(git -C "$code" rev-parse HEAD)" = "$(git -C "$repo" rev-parse "$commit^{commit}")" ] \
    || { echo "$code is not at $commit"; exit 1; }
  make -C "$repo" install >/dev/null
  (cd "$code" && PYTHONPATH="$code" "$repo/.venv/bin/python" -m prorag.rpc.protos >/dev/null)
  # autogroup 19: under autogroup scheduling nice only ranks processes inside their own group (terminal, session)
  nohup setsid bash -c "echo 19 > /proc/self/autogroup 2>/dev/null; cd '$code' && \
    echo \"=== \$(date -u +%FT%TZ) start $commit\" && \
    PYTHONPATH='$code' PRORAG_HOME='$home' HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline \
    exec nice -n 19 '$repo/.venv/bin/prorag' run --profile research --port-offset 1000" >>"$log" 2>&1 </dev/null &
  echo $! >"$pidfile"
  echo "started (pid $!); log: $log"
  ;;
unpack)
  [ -d "$carried" ] || { echo "nothing carried: no $carried"; exit 1; }
  [ ! -e "$home" ] || { echo "$home exists: unpacking would mix two runs' states"; exit 1; }
  mkdir -p "$(dirname "$home")" && cp -a "$carried" "$home.tmp" && mv "$home.tmp" "$home"
  echo "unpacked $carried into $home"
  ;;
stop)
  # SIGTERM: `prorag run` stops the services it started (each in a session of its own) before it exits
  if ! running; then echo "not running"; exit 0; fi
  kill "$(cat "$pidfile")"
  for _ in $(seq 120); do running || break; sleep 1; done
  if running; then echo "still running after 120 s"; exit 1; fi
  rm -f "$pidfile"
  ;;
pack)
  [ -d "$home" ] || { echo "no home at $home"; exit 1; }
  # a live run rewrites checkpoints under the copy's feet
  if running; then echo "stop the run first (scripts/research.sh stop)"; exit 1; fi
  # Left out: the shipped base (installed again from prorag_app/bases), offline wandb files, the services' logs, the
  # SFT data cache (built again through the retriever), and a finished job's checkpoints (its outputs are the model).
  tmp="$carried.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  (cd "$home" && find . -path ./data/models/default/policy-base-4l -prune -o -name wandb -prune -o -name logs -prune \
      -o -path './runs/jobs/*/checkpoints' -prune -o -name '*.lock' -o -type f -print) | sed 's|^\./||' >"$tmp.list"
  for job in "$home"/runs/jobs/*/; do  # an unfinished job keeps its newest checkpoint and journals, not the data cache
    state=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["state"])' "$job/job.json" 2>/dev/null \
      || true)
    [ "$state" = SUCCEEDED ] || [ ! -d "$job/checkpoints" ] && continue
    ckpt="runs/jobs/$(basename "$job")/checkpoints"
    newest=$(cd "$home/$ckpt" && { ls -d step-* 2>/dev/null || true; } | sort | tail -n 1)
    (cd "$home" && { find "$ckpt" -type f ! -name sft_data.pt | grep -vE '/step-[0-9]{9}(\.pt$|/)' || true
                     [ -z "$newest" ] || find "$ckpt/$newest" -type f; }) >>"$tmp.list"
  done
  (cd "$home" && tar -cf - -T "$tmp.list") | tar -xf - -C "$tmp"
  rm -rf "$carried" "$tmp.list" && mv "$tmp" "$carried"
  du -sh "$carried"
  ;;
status)
  if running; then echo "running (pid $(cat "$pidfile"))"; else echo "not running"; fi
  tail -c 600 "$log" 2>/dev/null; echo
  ls "$home/runs/jobs" 2>/dev/null | grep -v '^\.' || true
  ;;
*)
  sed -n '2,/^set /{/^#/p}' "$0"; exit 2
  ;;
esac
