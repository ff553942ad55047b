"""DeepSeek Sparse Attention (DSA) prefill with context: indexer scores, top-k selection and
sparse latent attention (DeepSeek-V3.2, GLM-5 and kin).

reference.py            float64 oracle of the whole path (indexer -> top-k -> sparse MLA), the tie rule
index_cache.py          the indexer key cache per layer: formats, page size, writer, gathers (torch)
triton_index_cache.py   its Triton writer (exact integer e4m3 encoder) and gather (used on CUDA)
topk.py                 chunked indexer scoring + running top-k in a bounded workspace
triton_indexer.py       Triton scorer reading the paged index cache (merged by topk.py)
sparse_attention.py     absorbed queries attend a per-query list of positions straight from the
                        paged latent cache (dispatcher: Triton, torch)
triton_sparse.py        the Triton kernel (the absorbed kernel's loader: every cache format)
layer.py                SparseConfig / IndexInputs / sparse_forward: MLAPrefill(sparse=...)
from_transformers.py    the indexer's weights (module or checkpoint) and float64 projections
"""
