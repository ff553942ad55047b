"""DeepSeek Sparse Attention (DSA) ops: indexer scores, top-k selection and sparse latent attention
(DeepSeek-V3.2, GLM-5 and kin). The layer that runs them is mla_ext/prefill/sparse.py; the indexer's
facts (SparseConfig) and the index cache formats are in mla_ext/config/.

reference.py               float64 oracle of the whole path (indexer -> top-k -> sparse MLA), the tie rule
index_cache.py             the indexer key cache per layer: writer and gathers (ops over a dispatcher)
index_cache_backends.py    their backends (CUDA, Triton, C++ CPU, torch)
index_cache_torch.py       the cache's geometry, host offset checks and the torch backend (the reference)
triton_index_cache.py      the Triton writer (exact integer e4m3 encoder) and gather (used on CUDA)
topk.py                    chunked indexer scoring + running top-k in a bounded workspace
triton_indexer.py          Triton scorer reading the paged index cache (merged by topk.py)
sparse_attention.py        absorbed queries attend a per-query list of positions straight from the
                           paged latent cache (dispatcher: Triton, torch)
slot_attention.py          the same over vLLM's flat physical top-k slots, token-major (the vLLM
                           sparse backend's kernel hook; dispatcher: Triton flat-slot mode, torch)
triton_sparse.py           the Triton kernels (the absorbed kernel's loader: every cache format)
"""
