#!/bin/sh
# Runs inside the builder stage of the Dockerfile (never on a host).
#   build_venv.sh deps     the virtual environment /opt/venv with torch and the project's third-party
#                          dependencies (a cached layer while pyproject.toml is unchanged)
#   build_venv.sh project  the gRPC stubs and the project itself into that venv (no dependencies)
#
# FLAVOR=cpu  a plain venv; torch is the CPU build TORCH_VERSION (from /wheels when a wheel lies
#             there, else from TORCH_INDEX_URL), never a CUDA build.
# FLAVOR=gpu  a venv over the base image's own site-packages (--system-site-packages): torch, and in
#             the vLLM image vllm, come from the base and are never re-installed; what the base ships
#             is pinned as a constraint, so a dependency cannot pull another torch.
# TRANSFORMERS_VERSION, FAISS (the faiss requirement: faiss-cpu, or faiss-gpu-cu12==X in its place for the GPU
# retriever), FLASH_ATTN_VERSION (built with --no-build-isolation against the venv's torch) and EXTRA_PIP (extra
# requirement specs) apply to both.
# A venv, not the system pip: Ubuntu 24.04 bases refuse system installs (PEP 668).
set -eu
VENV=/opt/venv
PY="$VENV/bin/python"
FLAVOR="${FLAVOR:-cpu}"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

pip_install() { "$PY" -m pip install --no-compile --find-links /wheels "$@"; }

deps() {
  SYSTEM_PYTHON="$(command -v python3)"
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
    # pin whatever the base image brings (torch, torchvision, vllm, flashinfer, xformers ...)
    "$PY" - <<'PYEOF' >> /tmp/constraints.txt
import importlib.metadata as md
for name in ("torch", "torchvision", "torchaudio", "vllm", "xformers", "flashinfer-python", "triton"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PYEOF
    grep -q '^torch==' /tmp/constraints.txt || { echo "FLAVOR=gpu needs a base image with torch installed" >&2; exit 1; }
  else
    INDEX=""
    [ -n "${TORCH_INDEX_URL:-}" ] && INDEX="--extra-index-url $TORCH_INDEX_URL"
    # shellcheck disable=SC2086
    pip_install $INDEX "torch==${TORCH_VERSION}"
    "$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >> /tmp/constraints.txt
  fi
  [ -n "${TRANSFORMERS_VERSION:-}" ] && echo "transformers==${TRANSFORMERS_VERSION}" >> /tmp/constraints.txt
  echo "constraints:"; cat /tmp/constraints.txt
  # the project's dependencies from pyproject.toml, torch left to the step above / the base image, faiss-cpu
  # replaced by FAISS when that names another build (both install the module `faiss`: never both)
  FAISS="${FAISS:-faiss-cpu}" "$PY" - <<'PYEOF' > /tmp/requirements.txt
import os, re, tomllib
deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]
faiss = os.environ["FAISS"]
for d in deps:
    name = re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].strip().lower()
    if name == "torch":
        continue
    if name == "faiss-cpu" and re.split(r"[<>=!~ \[;]", faiss, maxsplit=1)[0].strip().lower() != "faiss-cpu":
        d = faiss
    print(d)
PYEOF
  # shellcheck disable=SC2086
  pip_install -c /tmp/constraints.txt -r /tmp/requirements.txt ${EXTRA_PIP:-}
  if [ -n "${FLASH_ATTN_VERSION:-}" ]; then
    # compiled against the torch already in the venv (a -devel BUILDER_BASE provides nvcc)
    pip_install -c /tmp/constraints.txt ninja packaging wheel psutil
    MAX_JOBS="${MAX_JOBS:-4}" pip_install -c /tmp/constraints.txt --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"
  fi
  cp /tmp/constraints.txt "$VENV/constraints.txt"
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
import os, faiss
if "gpu" in os.environ.get("FAISS", "") and not hasattr(faiss, "StandardGpuResources"):
    raise SystemExit(f"FAISS={os.environ['FAISS']} installed a faiss without GPU support")
print("venv ok:", ", ".join(l.strip() for l in open("/opt/venv/constraints.txt")), "faiss", faiss.__version__)
PYEOF
  "$PY" -m pip check || true
}

"$@"
