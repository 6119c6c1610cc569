"""Literate reference implementations of KVpop, QuoKA and OVAL: sparse and bounded KV caches for transformer LLMs

Modules:

- `sparsekv.attention`: Dense reference attention that returns the log-sum-exp normalizer, the GQA layout, masks, a memory-bounded chunked variant, the merge of partial results over key blocks, and FlexAttention/SDPA backends that agree with the reference."""

__version__ = "0.1.0"
