# %% [markdown]
# # SmolLM2-135M on this machine: loading, prefill and perplexity
#
# > The dense baseline every method is compared against: how long the bundled model takes to load and to prefill, and its perplexity on held-out prose.

# %% [markdown]
# The CPU profile runs every method on SmolLM2-135M-Instruct, shipped offline as a GGUF file
# and converted once into a plain Hugging Face folder (`sparsekv.models`). This stage records
# the costs and quality of the dense model:
#
# - load time, the one-time conversion (into a scratch cache folder, so the real cache stays
#   untouched; skipped when `time_conversion` is off, as in the quick profile, since parsing the GGUF file alone
#   takes about 20 s) against a later load of the converted folder;
# - prefill time (one forward pass without gradients, logits of the last position only) for
#   each context length;
# - perplexity $\exp\big(\tfrac{1}{N}\sum_i -\log p(x_{i+1} \mid x_{\le i})\big)$ on the first
#   validation window of the prose corpus (the tail of the World English Bible, never used for
#   training).

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
prefill_lengths = [512]
ppl_length = 512
time_conversion = True  # the one-time GGUF conversion takes ~20 s of GGUF parsing, too long for the quick profile

# %%
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from sparsekv.data import packed_sequences
from sparsekv.eval import perplexity
from sparsekv.io import write_csv, write_text
from sparsekv.models import convert_gguf_to_hf, load_model, model_info, smollm2_gguf_path


# %%
def seconds(f) -> float:
    "Wall time of one call of `f`."
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0

convert_text = "not timed (time_conversion is off)"
if time_conversion:
    with tempfile.TemporaryDirectory() as d:
        convert_text = f"{seconds(lambda: convert_gguf_to_hf(smollm2_gguf_path(), Path(d)/'smollm2')):.1f} s"
model, tok = load_model()  # also makes sure the real cache holds the converted folder
load_s = seconds(load_model)
info = model_info(model)
print(f"conversion {convert_text}, later load {load_s:.1f} s; {info}")


# %%
def prefill_seconds(S: int) -> float:
    ids = packed_sequences(tok, S, "train", n=1)
    with torch.no_grad(): return seconds(lambda: model(ids, logits_to_keep=1))

prefill = pd.DataFrame({"tokens": prefill_lengths, "seconds": [prefill_seconds(S) for S in prefill_lengths]})
prefill["tokens_per_s"] = prefill.tokens / prefill.seconds
prefill

# %%
ids = packed_sequences(tok, ppl_length, "validation", n=1)
with torch.no_grad(): logits = model(ids).logits
ppl = perplexity(logits, ids).item()
del logits
print(f"perplexity on {ppl_length} validation tokens: {ppl:.2f}")

# %% [markdown]
# **Paper vs ours.** No paper reports numbers for this model: the baseline is the scale the CPU profile can afford.

# %%
last = prefill.iloc[-1]
paper_vs_ours = [
    "| claim | paper | ours | why they differ |", "|---|---|---|---|",
    "| the dense model every method is measured against | QuoKA §4: Llama3.2-3B-Instruct, Qwen2.5-3B-Instruct, "
    "SmolLM3, Qwen3-4B, Qwen3-30B-A3B, GPT-OSS-20B; no paper reports SmolLM2-135M or a perplexity | SmolLM2-135M: "
    f"perplexity {ppl:.2f} on {ppl_length} held-out tokens, prefill {last.tokens_per_s:.0f} tokens/s at "
    f"{int(last.tokens)} tokens | a 135M model is what runs offline on 2 CPU cores; the gpu profile loads the "
    "papers' models |"]

# %%
write_csv(Path(fig_dir)/"smollm2_prefill.csv", prefill)
rows = [f"| {r.tokens} | {r.seconds:.1f} s | {r.tokens_per_s:.0f} |" for r in prefill.itertuples()]
summary = "\n".join([
    f"SmolLM2-135M-Instruct ({info.num_layers} layers, {info.num_q_heads} query / {info.num_kv_heads} KV heads, "
    f"head dim {info.head_dim}), float32, {torch.get_num_threads()} threads.", "",
    f"- one-time GGUF conversion: {convert_text}; later loads: {load_s:.1f} s",
    f"- perplexity on {ppl_length} held-out prose tokens: {ppl:.2f}", "",
    "| prefill tokens | time | tokens/s |", "|---|---|---|", *rows, "",
    "**Paper vs ours**", "", *paper_vs_ours]) + "\n"
write_text(Path(out_dir)/"smollm2_baseline.md", summary)
print(summary)
