# %% [markdown]
# # Host synchronizations per step, every method
#
# > How many times each method's decode step and prefill chunk make the host wait for the device, and at which lines: what keeps a step from running at the speed of memory on an accelerator.

# %% [markdown]
# No paper figure. Each registered method runs on `model_name` (random weights suffice: the count
# depends on the code path, not on the values) with its default parameters at `budget`, and
# `sparsekv.syncs.step_syncs` counts the operators that read a device value on the host
# (`sparsekv.syncs.SYNC_OPS`, boolean-mask indexing) in the prefill of a `prompt_len`-token prompt
# and in the decode step after it, with the line of the library (or of transformers) that issued each.
# Counted on the CPU, these are exactly the points where a GPU stream would stall; dense attention
# through transformers reads none.

# %%
#| parameters
profile = "quick"
fig_dir = "../figures/quick"
out_dir = "runs/quick"
model_name = "tiny-llama"
device = "cpu"
prompt_len = 300
budget = 64
method_params = {"lessismore": {"selection_layers": [0]}}  # the tiny models have two layers

# %%
from pathlib import Path

import pandas as pd
import torch

from sparsekv import methods
from sparsekv.io import write_csv, write_text
from sparsekv.models import load_model
from sparsekv.syncs import step_syncs

model, tok = load_model(model_name, device=device)
n_layers = model.config.num_hidden_layers
ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)

# %%
rows, sites = [], []
for name in methods.names():
    m = methods.make(name) if name == "dense" else methods.make(name, budget, **method_params.get(name, {}))
    chunk = getattr(m, "chunk_size", None)
    for phase in ("prefill", "decode"):
        rec = step_syncs(m, model, ids, phase)
        calls = -(-(prompt_len - 1) // chunk) if phase == "prefill" and chunk else 1
        rows.append(dict(method=name, family=m.family, phase=phase, calls=calls, syncs=rec.total,
                         per_call_per_layer=rec.total / calls / n_layers))
        sites += [dict(method=name, phase=phase, line=where, op=op, n=n) for (op, where), n in rec.counts.items()]
syncs, sites = pd.DataFrame(rows), pd.DataFrame(sites, columns=["method", "phase", "line", "op", "n"])
syncs

# %%
# Dense attention is the control: transformers' own step reads nothing back.
assert syncs[syncs.method == "dense"].syncs.eq(0).all()
assert set(syncs.method) == set(methods.names())

# %%
decode = syncs[syncs.phase == "decode"]
free = sorted(decode[decode.syncs == 0].method)
top = (sites.groupby(["line", "op"]).agg(methods=("method", "nunique"), reads=("n", "sum"))
       .sort_values(["methods", "reads"], ascending=False).reset_index())
reading = decode[decode.syncs > 0]
lo, hi = reading.syncs.min(), reading.syncs.max()
rest = (f"; {', '.join(sorted(reading.method))} read{'s' if len(reading) == 1 else ''} "
        f"{lo if lo == hi else f'{lo} to {hi}'} value(s) per decode step ({reading.per_call_per_layer.max():.1f} "
        f"per layer at most)" if len(reading) else "")
summary = (f"{model_name}, {n_layers} layers, prompt {prompt_len} tokens, budget {budget}: {len(free)} of "
           f"{len(decode)} methods decode without reading a device value on the host ({', '.join(free)}){rest}.")
write_csv(Path(fig_dir)/"host_syncs.csv", syncs)
write_csv(Path(fig_dir)/"host_syncs_lines.csv", sites)
write_text(Path(out_dir)/"host_syncs.md", "\n\n".join([
    summary, syncs.to_markdown(index=False, floatfmt=".2f"),
    "The lines that read back, with how many methods pass through each and the reads over all of them:",
    top.to_markdown(index=False)]) + "\n")
print(summary)
top
