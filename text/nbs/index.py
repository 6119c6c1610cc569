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
# What a fresh clone needs: Linux with Python ≥ 3.10 (with its `venv` module) and GNU make,
# and for `make test` (and `make docs`) also npm, which fetches MathJax into `.venv/` for the
# docs site, and Chromium, in which the docs test renders every page headless. Run as root on
# Debian or Ubuntu (a container, CI), `make test` installs Chromium and npm with apt when they
# are missing; otherwise it stops with the one `apt-get install` line to run (`make tools`
# does only this step). Each command creates `.venv` if it is missing and installs the CPU
# build of torch first from `constraints.txt`, then the package in editable mode, from PyPI:
#
# ```sh
# make reproduce            # run the experiment pipeline (PROFILE=cpu by default)
# make test                 # export, run every notebook's checks and the pytest suite
# ```
#
# `make test` took 4 min 51 s of wall time on a 2-core machine once `.venv` existed
# (measured while other jobs shared the machine; the first run adds the installation).
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
# Every method, its papers' baselines included, is one object found by name in `sparsekv.methods`;
# `budget` is the number of KV entries each query may attend to, per KV head, and the method's own
# parameters are keyword arguments with the papers' defaults. The cells below run on the tiny seeded
# test model so this page executes in seconds; `load_model("smollm2-135m")` gives the real one
# (bundled offline, converted once to a HF folder).

# %%
import torch

# %%
from sparsekv import chunked_prefill, load_model, methods, patch, PageRetrievalPolicy, QuokaPolicy

# %%
model, tok = load_model("tiny-llama")
prompt = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))

# %% [markdown]
# `methods.names()` lists them (`dense`, the eviction methods `streaming_llm`, `tova`, `h2o`,
# `streaming_llm_plus`, `dms`, `kvpop_mlp`, `kvpop_mlstm`; the prefill-selection methods `quoka`,
# `mean_scores`, `sample_attention`, `sparq`, `loki`, `lessismore`; the decode-retrieval methods `quest`,
# `arkvale`, `key_pca`, `oval`, `oracle_pages`). `generate` prefills (in chunks where the method needs it)
# and decodes; other keywords go to `transformers`' `generate`.

# %%
m = methods.make("tova", budget=48)
out = m.generate(model, prompt, max_new_tokens=20, do_sample=False)
assert out.shape == (2, 96 + 20)
m = methods.make("oval", budget=48, page_size=8, sink=8, recent=8, rank=4, eta=0.5)
out = m.generate(model, prompt, max_new_tokens=20)

# %% [markdown]
# A trained method takes `checkpoint=` (the `trained.pt` that `python -m sparsekv.distill` writes; without
# it the scorers are fresh and rank neutrally). For your own loop, `patch` gives the cache to pass:

# %%
m = methods.make("kvpop_mlstm", budget=52)  # 4 sinks + a window of 3 + 45 learned long-range slots
with torch.no_grad(), m.patch(model) as cache:
    model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=40,
                   do_sample=False)
assert all(layer.keys.shape[2] == 52 for layer in cache.layers)  # bounded: 52 entries per head after 135 tokens

# %% [markdown]
# Underneath, `sparsekv.hf` is one integration layer: `patch(model, policy)` routes each attention
# call to a policy and `chunked_prefill` reads a prompt in chunks, e.g. QuoKA's selection per chunk and
# OVAL's page retrieval at decode:

# %%
cache, last_logits = chunked_prefill(model, prompt, chunk_size=16, policy=QuokaPolicy(n_q=4, budget=32))
policy = PageRetrievalPolicy("oval", token_budget=48, page_size=8, sink=8, recent=8, rank=4, eta=0.5)
with torch.no_grad(), patch(model, policy):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)

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
