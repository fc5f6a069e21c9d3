# Two commands for users: `make run` and `make test`. Both set themselves up.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export WANDB_MODE ?= offline

.PHONY: run test install proto bench clean-data

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
	$(PY) -m prorag.protos

run: install
	$(VENV)/bin/prorag run

test: install
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/prorag bench retriever --json

clean-data:
	rm -rf data runs
