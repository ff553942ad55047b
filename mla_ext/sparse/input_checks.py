"""Up-front checks of a sparse layer's indexer inputs (mla_ext.sparse.layer.IndexInputs), called
by MLAPrefill.forward before the sparse path: what would otherwise fail deep inside the indexer
or the gathers with a message that names nothing (an index cache of another width or page size,
a meta tensor, a tensor on another device); the index cache's geometry is the layer's
plan check (mla_ext.sparse.layer.check_index_cache)."""
from __future__ import annotations

from torch import Tensor

from mla_ext._args import check_no_meta


def check_index_inputs(cfg, index, kv_cache: Tensor, q: Tensor) -> None:
    """`index` (IndexInputs or a selection tensor) for a layer of SparseConfig `cfg` whose latent
    cache is `kv_cache` and new-token queries `q`; shapes of the indexer inputs are checked by
    sparse_forward, the rest here."""
    from mla_ext.sparse.layer import IndexInputs

    if isinstance(index, Tensor):
        check_no_meta(index=index)
        return
    if not isinstance(index, IndexInputs):
        return  # sparse_forward names the expected types
    named = {"index.q": index.q, "index.weights": index.weights, "index.k": index.k, "index.cache": index.cache}
    for name, t in named.items():
        if t is not None and not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_no_meta(**named)
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    # index.cache's geometry (dtype, page size, width, blocks) is not re-checked here: MLAPrefill.forward
    # checked it against the latent plan first (mla_ext.sparse.layer.check_index_cache).
