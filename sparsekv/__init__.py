"""Literate reference implementations of KVpop, QuoKA and OVAL: sparse and bounded KV caches for transformer LLMs"""

__version__ = "0.1.0"
