"""DeepSeek Sparse Attention (DSA) prefill with context: indexer scores, top-k
selection and sparse latent attention (DeepSeek-V3.2, GLM-5 and kin).

reference.py      float64 oracle of the whole path (indexer -> top-k -> sparse MLA)
topk.py           chunked indexer scoring + running top-k in a bounded workspace (torch)
triton_indexer.py Triton scoring kernel (one chunk of keys -> scores), merged by topk.py
sparse_attention.py  absorbed queries attend a per-query list of token positions
                  straight from the paged cache (torch path; Triton in triton_sparse.py)
from_transformers.py  the indexer's weights and projections from a transformers module
"""
