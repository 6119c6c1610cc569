"""Literate reference implementations of KVpop, QuoKA and OVAL: sparse and bounded KV caches for transformer LLMs

Modules:

- `sparsekv.attention`: Dense reference attention that returns the log-sum-exp normalizer, the GQA layout, masks, a memory-bounded chunked variant, the merge of partial results over key blocks, and FlexAttention/SDPA backends that agree with the reference.
- `sparsekv.kvpop.loss`: The teacher's keep/drop decision for the newly eligible token, the boundary token it is compared against, the boundary-aware pairwise loss (Eq. 5–7) and its optional weights (Eq. 22–25).
- `sparsekv.kvpop.scorers`: Headwise stateless scorers (linear, two-layer SiLU MLP) and the stateful mLSTM scorer with Hedgehog features and delayed readout (§3.3, Eq. 10–11, 35–42), in parallel and recurrent form."""

__version__ = "0.1.0"
