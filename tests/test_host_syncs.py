"""No host syncs in the hot paths: every registered method decodes a token, and every selection method prefills its
chunks, without an operator that reads a device value back on the host (`sparsekv.syncs`), on the tiny models (DMS's
one read by design, and the eigendecompositions of Loki's and OVAL's bases, not removed yet, are asserted exactly); and
the functions of those paths hold no read that the operator count cannot see (`.tolist()`, `.numpy()`, `.cpu()`).
Every method's steady decode step traces as one graph for `torch.compile` (`fullgraph=True` compiles it), and is
compiled once for every length: its compiled steps give the eager logits."""
import importlib
import inspect
import re

import pytest
import torch

from sparsekv import methods
from sparsekv.syncs import decode_seconds, step_graph_breaks, step_syncs

# the quick profile of the host_syncs stage: a prompt of 300 tokens, a budget of 64 keys per head (each selection
# and retrieval method drops keys, each eviction method evicts)
PROMPT, BUDGET = 300, 64
PARAMS = {"lessismore": {"selection_layers": [0]}}  # the tiny models have two layers
SELECTION = [n for n in methods.names() if methods.get(n).family == "selection"]
# every registered method, and compositions whose decode method evicts (the prompt handed over at the first step)
DECODE = methods.names() + ["quoka+kvpop_mlstm", "dense+streaming_llm"]


def make(name: str):
    "Method `name` as the host_syncs stage runs it."
    return methods.make(name) if name == "dense" else methods.make(name, BUDGET, **PARAMS.get(name, {}))


def prompt(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def where(rec) -> dict:
    "The reads by (operator, line), for the failure message."
    return {f"{op} at {line}": n for (op, line), n in rec.counts.items()}


def line_of(fn, text: str) -> str:
    "'sparsekv/x.py:N', the line of `fn`'s source holding `text` (as the operator count names lines)."
    lines, first = inspect.getsourcelines(fn)
    n = first + next(i for i, line in enumerate(lines) if text in line)
    return f"sparsekv/{inspect.getsourcefile(fn).rsplit('/sparsekv/', 1)[1]}:{n}"


def allowed(name: str) -> dict:
    "The reads a decode step of `name` makes by design."
    if name != "dms": return {}
    # DMS has no budget: its cache is as long as the busiest head's live entries, which the learned decisions decide,
    # so a step reads that one count (the compaction's size) for all layers, and nothing else
    from sparsekv.kvpop.dms import DMSCache
    return {f"aten._local_scalar_dense at {line_of(DMSCache.compact, 'M = int(')}": 1}


# Not removed yet: an eigendecomposition checks its solver's status on the host (`torch.linalg.eigh`, inside its
# kernel: `HostSyncs` finds it with the profiler). Loki's principal directions of the keys so far take one per layer
# and call; OVAL's page bases (and key PCA's, the same pages) one per layer that completes pages: the prompt's at the
# first decode step, then one call in `page_size`.
EIGH = "aten._local_scalar_dense at inside aten::_linalg_eigh"
BASES = {"loki": "every call", "oval": "pages", "key_pca": "pages", "prefill_decode": "pages"}


@pytest.mark.parametrize("name", DECODE)
def test_a_decode_step_reads_nothing_back(tiny_model, name):
    "The first decode step after the prefill, and the third (the steady state of generation)."
    reads = {f"decode step {steps}": where(step_syncs(make(name), tiny_model, prompt(tiny_model), "decode", steps))
             for steps in (1, 3)}
    if name not in BASES: assert reads == {step: allowed(name) for step in reads}, reads
    elif BASES[name] == "pages":  # the prompt's pages at the first step; none completes at the third
        assert list(reads["decode step 1"]) == [EIGH] and reads["decode step 3"] == {}, reads
    else:  # one basis per layer and step
        L = tiny_model.config.num_hidden_layers
        assert reads == {step: {EIGH: L} for step in reads}, reads


@pytest.mark.parametrize("name", DECODE)
def test_a_decode_step_is_one_graph(tiny_model, name):
    "The third decode step after the prefill (the first ones build per-layer state: unit keys, page summaries)."
    breaks = step_graph_breaks(make(name), tiny_model, prompt(tiny_model), steps=3)
    if name == "dms":  # its one read (the compaction's size, see `allowed`) splits the step, and nothing else
        assert breaks and all("item()" in b and "sparsekv/kvpop/dms.py" in b for b in breaks), breaks
    else: assert breaks == [], breaks


@pytest.mark.parametrize("name", DECODE)
def test_decode_steps_compile_once(tiny_llama, name):
    "Five steps compiled with fullgraph and dynamic shapes (TorchDynamo's tracing, run as traced): no recompilation."
    ids = prompt(tiny_llama)[:, :200]
    eager = decode_seconds(make(name), tiny_llama, ids, 6)
    traced = decode_seconds(make(name), tiny_llama, ids, 6, "eager")
    if name == "dms":  # the compaction's size is read back (see `allowed`): no one graph
        assert traced["error"] and "data-dependent" in traced["error"], traced["error"]
        return
    assert (traced["error"], traced["recompiled"], len(traced["step_seconds"])) == (None, [], 5)
    torch.testing.assert_close(traced["logits"], eager["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DECODE)
def test_generate_compiles_the_decode_steps(tiny_llama, name):
    """`Method.generate(compile=...)`: transformers' generate compiles the decode steps (TorchDynamo, run as traced)
    and gives the eager tokens. A few graphs, not one per step: the first decode step (it builds per-layer state:
    page summaries), the steady step, and a buffer's growth or a page boundary compile their own."""
    ids = prompt(tiny_llama)[:, :200]
    eager = make(name).generate(tiny_llama, ids, max_new_tokens=7, do_sample=False)
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    if name == "dms":  # its decode step reads the compaction's size back (see `allowed`): refused, not run eagerly
        with pytest.raises(ValueError, match="compile: the decode step of dms does not compile"):
            make(name).generate(tiny_llama, ids, max_new_tokens=7, do_sample=False, compile="eager")
        return
    compiled = make(name).generate(tiny_llama, ids, max_new_tokens=7, do_sample=False, compile="eager")
    assert torch.equal(compiled, eager)
    assert 1 <= stats["unique_graphs"] - before <= 3, stats["unique_graphs"] - before


@pytest.mark.parametrize("name", SELECTION)
def test_a_prefill_chunk_reads_nothing_back(tiny_model, name):
    m = make(name)
    assert getattr(m, "chunk_size", None) and m.chunk_size < PROMPT - 1  # several chunks, the later ones select
    rec = step_syncs(m, tiny_model, prompt(tiny_model), "prefill")
    if BASES.get(name) == "every call": assert list(where(rec)) == [EIGH], where(rec)  # see BASES
    else: assert rec.total == 0, where(rec)  # (page bases are built at decode)


# the functions of the per-step and per-chunk paths made free of reads back, by module
HOT_PATH = {
    "sparsekv.attention": ["require_finite", "content_checks"],
    "sparsekv.select": ["_check_top", "top_mask", "_order_keys", "top_budget_indices", "anchored_top_indices"],
    "sparsekv.hf": ["dense_attention", "_check_indices", "attend_selected", "AttentionContext.real_keys", "_context",
                    "_plain_causal", "_sparsekv_attention", "_record_call", "_end_call", "SelectionPolicy.attend"],
    "sparsekv.cache": ["EvictionRule.keep", "SinkWindowRule.count", "SinkWindowRule.next_keep", "TopScoreRule.visible",
                       "TopScoreRule.count", "TopScoreRule.pending_from", "TopScoreRule.eligible_span",
                       "TopScoreRule.worst_eligible", "TopScoreRule.next_keep", "EvictingLayer.scored_entries",
                       "EvictingLayer.rings", "EvictingLayer.overwrite_oldest", "EvictingLayer.update",
                       "EvictingLayer.evict", "EvictingLayer.compact"],
    "sparsekv.kvpop.scorers": ["check_kv", "scorer_input"],
    "sparsekv.kvpop.cache": ["KVpopRule.visible", "KVpopRule.pending_from", "KVpopRule.count", "KVpopRule.keep",
                             "KVpopRule._recurrent_scores", "KVpopLayer.update", "KVpopLayer.evict",
                             "KVpopPolicy.decode"],
    "sparsekv.kvpop.dms": ["DMSRule.visible", "DMSLayer.evict", "DMSCache.live", "DMSCache.compact"],
    "sparsekv.quoka.select": ["check_chunk", "check_unit_keys", "UnitKeyCache.update", "kept_positions",
                              "quoka_select", "_quoka_scores", "quoka_decode_select"],
    "sparsekv.oval.basis": ["check_page", "_gram_right_singular", "_orthonormalize", "_gram_basis", "page_basis"],
    "sparsekv.oval.pages": ["top_pages", "page_tokens", "PageRetrievalPolicy.track", "PageRetrievalPolicy.page_ids",
                            "PageRetrievalPolicy.select", "PackedPages.append", "PackedPages.scores"],
    "sparsekv.quoka.baselines": ["loki_basis", "KeyMoments.update", "lessismore_select", "sparq_select",
                                 "mean_score_select", "sample_attention_select", "loki_select",
                                 "_loki_projection", "_merge_ranked", "sample_query_positions"],
}
UNSEEN_READS = re.compile(r"\.(tolist|numpy|cpu)\(")  # reads back that bypass the dispatcher


@pytest.mark.parametrize("module", list(HOT_PATH))
def test_hot_path_functions_hold_no_read_the_count_cannot_see(module):
    mod = importlib.import_module(module)
    for qualname in HOT_PATH[module]:
        obj = mod
        for part in qualname.split("."): obj = getattr(obj, part)
        src = inspect.getsource(obj)
        assert not UNSEEN_READS.search(src), f"{module}.{qualname}: {UNSEEN_READS.search(src).group()}"
