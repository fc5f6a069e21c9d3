#!/bin/sh
# Runs inside the builder stage of the Dockerfile (never on a host).
#   build_venv.sh deps     the virtual environment /opt/venv with the third-party dependencies, installed from the
#                          hashed lockfile requirements/$LOCK (pip --require-hashes --no-deps: exactly what it lists,
#                          each file checked against its sha256; a cached layer while requirements/ is unchanged)
#   build_venv.sh project  the gRPC stubs and the project itself into that venv (no dependencies)
#
# LOCK (requirements/*.lock, written by scripts/lock.py; docs/DEPLOY.md "Images"):
#   cpu.lock             FLAVOR=cpu: everything, torch's CPU build included (from /wheels when its wheel lies there,
#                        else from TORCH_INDEX_URL)
#   cuda.lock, cuda-faiss-gpu.lock, vllm.lock
#                        FLAVOR=gpu: a venv over the base image's own site-packages (--system-site-packages): torch,
#                        vLLM and the CUDA wheels come from the base (pinned by digest) and are never re-installed;
#                        the lock holds what prorag needs besides, resolved together with the base's pins. What the
#                        base ships of torch & co is recorded and checked again after the project is installed.
# FLASH_ATTN_VERSION (built with --no-build-isolation against the venv's torch) and EXTRA_PIP (extra requirement
# specs) are outside the lock: a build that sets them is not reproducible from the lock alone.
# A venv, not the system pip: Ubuntu 24.04 bases refuse system installs (PEP 668).
set -eu
VENV=/opt/venv
PY="$VENV/bin/python"
FLAVOR="${FLAVOR:-cpu}"
LOCK="${LOCK:-cpu.lock}"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

pip_install() { "$PY" -m pip install --no-compile --find-links /wheels "$@"; }

deps() {
  LOCKFILE="/src/requirements/$LOCK"
  [ -f "$LOCKFILE" ] || { echo "LOCK=$LOCK: no such lock in requirements/" >&2; exit 1; }
  SYSTEM_PYTHON="$(command -v python3)"
  case "$FLAVOR:$LOCK" in
    cpu:cpu.lock|gpu:cuda.lock|gpu:cuda-faiss-gpu.lock|gpu:vllm.lock) ;;
    *) echo "FLAVOR=$FLAVOR does not go with LOCK=$LOCK (cpu: cpu.lock; gpu: cuda.lock, cuda-faiss-gpu.lock, vllm.lock)" >&2
       exit 1 ;;
  esac
  if [ "$FLAVOR" = gpu ]; then
    "$SYSTEM_PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null \
      || "$SYSTEM_PYTHON" -m venv --system-site-packages --without-pip "$VENV"
  else
    "$SYSTEM_PYTHON" -m venv "$VENV" 2>/dev/null || "$SYSTEM_PYTHON" -m venv --without-pip "$VENV"
  fi
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    # a venv without ensurepip (some CUDA bases): the base's pip installs pip into it
    "$SYSTEM_PYTHON" -m pip --python "$PY" install pip
  fi
  : > /tmp/constraints.txt
  if [ "$FLAVOR" = gpu ]; then
    # record whatever the base image brings (torch, torchvision, vllm, flashinfer, xformers ...)
    "$PY" - <<'PYEOF' >> /tmp/constraints.txt
import importlib.metadata as md
for name in ("torch", "torchvision", "torchaudio", "vllm", "xformers", "flashinfer-python", "triton"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PYEOF
    grep -q '^torch==' /tmp/constraints.txt || { echo "FLAVOR=gpu needs a base image with torch installed" >&2; exit 1; }
    pip_install --require-hashes --no-deps -r "$LOCKFILE"
  else
    INDEX=""
    [ -n "${TORCH_INDEX_URL:-}" ] && INDEX="--extra-index-url $TORCH_INDEX_URL"
    # shellcheck disable=SC2086
    pip_install $INDEX --require-hashes --no-deps -r "$LOCKFILE"
    "$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >> /tmp/constraints.txt
  fi
  echo "installed from requirements/$LOCK; the base's pins:"; cat /tmp/constraints.txt
  if [ -n "${FLASH_ATTN_VERSION:-}" ]; then
    # compiled against the torch already in the venv (a -devel BUILDER_BASE provides nvcc); not in the lock
    pip_install -c /tmp/constraints.txt ninja packaging wheel psutil
    MAX_JOBS="${MAX_JOBS:-4}" pip_install -c /tmp/constraints.txt --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"
  fi
  # shellcheck disable=SC2086
  [ -z "${EXTRA_PIP:-}" ] || pip_install -c /tmp/constraints.txt ${EXTRA_PIP}
  cp /tmp/constraints.txt "$VENV/constraints.txt"
  echo "$LOCK" > "$VENV/lock-name.txt"
}

project() {
  cd /src
  "$PY" -m prorag.rpc.protos --force            # stubs into prorag/v1, shipped inside the installed package
  pip_install --no-deps --no-build-isolation . 2>/dev/null || pip_install --no-deps .
  # the base's torch (gpu) or the CPU build (cpu) must still be the one installed
  "$PY" - <<'PYEOF'
import importlib.metadata as md
for line in open("/opt/venv/constraints.txt"):
    name, _, want = line.strip().partition("==")
    if name and md.version(name) != want:
        raise SystemExit(f"{name} changed from {want} to {md.version(name)} while installing the project")
import prorag.pb, prorag_app.cli  # noqa: F401  the stubs and the entry point import
import faiss
lock = open("/opt/venv/lock-name.txt").read().strip()
if "faiss-gpu" in lock and not hasattr(faiss, "StandardGpuResources"):
    raise SystemExit(f"{lock} installed a faiss without GPU support")
print("venv ok:", lock, ", ".join(l.strip() for l in open("/opt/venv/constraints.txt")), "faiss", faiss.__version__)
PYEOF
  if [ "$FLAVOR" = cpu ]; then
    "$PY" -m pip check        # the lock is the whole environment: it must be consistent
  else
    "$PY" -m pip check || echo "pip check (above): the base image's packages beside the lock's; not checked on a GPU image yet"
  fi
}

"$@"
