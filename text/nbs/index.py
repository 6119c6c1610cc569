# %% [markdown]
# # sparsekv
#
# > Literate reference implementations of KVpop, QuoKA and OVAL: sparse and bounded KV caches for transformer LLMs.

# %% [markdown]
# `sparsekv` teaches and reproduces three KV-cache methods for transformer language models,
# together with the baselines their papers compare against:
#
# | method | what it does |
# |---|---|
# | **KVpop** | learned, fixed-budget KV *eviction*: sinks + protected window + learned top-$k$, trained by distillation against a future-attention target |
# | **QuoKA** | training-free, query-oriented KV *selection* for chunked prefill |
# | **OVAL** | output-aware page bases for page-level sparse KV *retrieval* at decode |
#
# Every equation is derived step by step in the notebooks and checked numerically right
# beside the derivation; the same notebooks export the library you `import sparsekv`.

# %% [markdown]
# ## The two commands
#
# On a fresh clone (Linux, Python ≥ 3.10, `make`; nothing else), each command creates
# `.venv` if it is missing, installs the CPU build of torch first from `constraints.txt`,
# then the package in editable mode:
#
# ```sh
# make reproduce            # run the experiment pipeline (PROFILE=cpu by default)
# make test                 # export, run every notebook's checks and the pytest suite
# ```
#
# `make reproduce` runs the papermill pipeline declared in `reproduce/pipeline.yaml` and
# writes figures (PNG with the data behind them) to `figures/<profile>/` and a results
# summary to `reproduce/runs/<profile>/summary.md`. `PROFILE=quick` is a smoke test that
# runs in minutes, `PROFILE=cpu` the small-scale reproduction on a laptop-class CPU,
# `PROFILE=gpu` the papers' scale. `make reproduce ARGS="--only demo --force"` reruns one
# stage; stages whose outputs are up to date are skipped.
#
# ### On a GPU machine
#
# Install a CUDA build of torch 2.13.0 into `.venv` first; the same commands then keep it
# (it satisfies the pin) and run the GPU checks and the paper-scale profile:
#
# ```sh
# python3 -m venv .venv
# .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# make test-all             # also the slow and the GPU-only checks
# make reproduce PROFILE=gpu
# ```

# %% [markdown]
# ## Use it
#
# ```python
# from sparsekv.models import load_model
# model, tok = load_model("smollm2-135m")      # bundled offline, converted once to a HF folder
# ```
#
# Each method patches a Hugging Face `transformers` model through one integration layer
# (`sparsekv.hf`); see the method notebooks for their entry points.

# %% [markdown]
# ## Layout
#
# | path | what |
# |---|---|
# | `nbs/` | the literate source (nbdev 3): one notebook per topic, exported to `sparsekv/` |
# | `sparsekv/` | the generated library: edit the notebooks, then `nbdev-export` |
# | `reproduce/` | parameterized experiment notebooks and `pipeline.yaml`; runs land in `reproduce/runs/<profile>/` |
# | `figures/` | the figures the pipeline regenerates, with their data |
# | `tests/` | pytest: cross-module, property and integration tests |
# | `text/` | jupytext percent-format twins of every notebook, for diffs and reviews |
#
# The nbdev configuration lives in `pyproject.toml` under `[tool.nbdev]` and there is no
# `settings.ini`, because nbdev 3 moved its configuration into `pyproject.toml` and refuses
# the old file.
#
# Other commands: `make docs` builds the offline docs site into `_docs/` (nbdev's notebook
# processing, rendered by Sphinx with MyST-NB; math by a local MathJax); `make lab` opens
# the notebooks in JupyterLab (each notebook stays paired with its text twin under `text/`;
# `make sync` syncs them by hand); `make clean-nbs` strips outputs and metadata, which are
# never committed: the docs build executes the notebooks itself. See `CONTRIBUTING.md`.
