"""DSA (DeepSeek-V3.2 / GLM-5 sparse MLA) in vLLM 0.32/0.33 on GPUs it has no sparse kernel for.

vLLM's sparse MLA backends (FlashMLA sparse, FlashAttention sparse, FlashInfer sparse) all
require compute capability 9.x or newer; its DSA indexer calls DeepGEMM's MQA-logits kernels
(SM90+); and the V3.2 model file's fused norm/RoPE/quant Triton kernels convert to fp8e4nv,
which Triton has only from sm_89. So on an A100, A6000, A10G, L40S or RTX 4090 a DSA model
fails at construction ("No valid attention backend found ... use_sparse=True") or at its
first forward. `register_sparse()` (called by mla_ext's vLLM plugin in every vLLM process)
fills exactly those gaps, and nothing else:

* the sparse MLA backend ``MLA_EXT_SPARSE`` (mla_ext/vllm/sparse_backend.py) is registered
  under vLLM's ``CUSTOM`` attention backend (``--attention-backend CUSTOM``, any capability
  >= 8.0) and, on capability 8.x only, under ``FLASHMLA_SPARSE`` -- a member of vLLM's own
  8.x candidate list that vLLM cannot serve there -- so ``vllm serve <DSA model>`` picks it
  with no flag. The override is made per process from that process's capability (a spawned
  engine core or worker registers again before it builds the model: spawn-safe).
* vLLM functions are rebound to mla_ext's only where this GPU lacks them (``ROUTES``): the
  DeepGEMM indexer ops on 8.x (DeepGEMM's are SM90+), the fp8e4nv Triton kernels below 8.9
  (the model file's fused norm/RoPE/quant, the indexer's fp8 query padding and its JIT warmup,
  which would stop the engine at start-up), and vLLM's compiled ops only when vLLM's library does
  not have them (the CPU tests).
  On 9.x and newer vLLM's kernels stay. On any GPU, vLLM's kv-cache-dtype canonicalisation is
  wrapped so that "fp8" means fp8_ds_mla for mla_ext's backend too (vLLM decides it by backend
  name, for FLASHMLA_SPARSE); every other backend keeps vLLM's answer.
  A routed module not imported yet is patched the moment it is imported (a post-import
  hook), so a name bound with ``from ... import`` inside vLLM is replaced before use.

``MLA_EXT_VLLM_SPARSE=0`` turns all of it off; unset (or ``auto``) is the behaviour above.
"""
from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
import threading
from dataclasses import dataclass

SPARSE_BACKEND_PATH = "mla_ext.vllm.sparse_backend.MlaExtSparseMLABackend"
SPARSE_BACKEND_NAME = "MLA_EXT_SPARSE"
CUSTOM_MEMBER = "CUSTOM"
# In vLLM's 8.x MLA candidate list (platforms/cuda.py _get_backend_priorities) and the member
# vLLM's own messages point fp8_ds_mla users to; its class refuses 8.x.
OVERRIDDEN_MEMBER = "FLASHMLA_SPARSE"
SPARSE_ENV = "MLA_EXT_VLLM_SPARSE"

logger = logging.getLogger("vllm.mla_ext")


@dataclass(frozen=True)
class Route:
    module: str  # the vLLM module whose global is rebound
    attr: str
    provider: str  # "mla_ext module:function" taking its place
    need: str  # when: "no-deep-gemm" (cc 8.x), "no-triton-fp8" (cc < 8.9), "no-c-op" (vLLM's library lacks it),
    #            "backend" (any GPU: it changes vLLM's behaviour only for mla_ext's own backend)
    c_op: str = ""  # "no-c-op": the torch.ops name vLLM's wrapper calls, e.g. "_C_cache_ops.indexer_k_quant_and_cache"
    wraps: bool = False  # the provider takes vLLM's object and returns its stand-in (a wrapper)


_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
_INDEXER_BUILDER = "vllm.v1.attention.backends.mla.indexer"
_V32_ATTENTION = "vllm.models.deepseek_v32.attention"
_V2_MODEL = "vllm.model_executor.models.deepseek_v2"
_OPS = "vllm._custom_ops"
_COMMON_OPS = "vllm.v1.attention.ops.common"
_MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"

ROUTES = (
    # `--kv-cache-dtype fp8` means DeepSeek's fp8_ds_mla for the sparse backend, as vLLM decides for
    # FLASHMLA_SPARSE by name; only mla_ext's backend is affected.
    Route(_MLA_ATTENTION, "_canonicalize_sparse_mla_kv_cache_dtype", "mla_ext.vllm.sparse_plugin:fp8_means_ds_mla",
          "backend", wraps=True),
    Route(_INDEXER, "fp8_fp4_mqa_logits", "mla_ext.vllm.deep_gemm_ops:fp8_fp4_mqa_logits", "no-deep-gemm"),
    Route(_INDEXER, "fp8_fp4_paged_mqa_logits", "mla_ext.vllm.deep_gemm_ops:fp8_fp4_paged_mqa_logits",
          "no-deep-gemm"),
    # SparseAttnIndexer.__init__ refuses CUDA without DeepGEMM; mla_ext serves its two ops here.
    Route(_INDEXER, "has_deep_gemm", "mla_ext.vllm.sparse_plugin:deep_gemm_served", "no-deep-gemm"),
    Route(_INDEXER_BUILDER, "get_paged_mqa_logits_metadata",
          "mla_ext.vllm.deep_gemm_ops:get_paged_mqa_logits_metadata", "no-deep-gemm"),
    Route(_V32_ATTENTION, "fused_norm_rope", "mla_ext.vllm.dsa_model_ops:fused_norm_rope", "no-triton-fp8"),
    Route(_V32_ATTENTION, "fused_q", "mla_ext.vllm.dsa_model_ops:fused_q", "no-triton-fp8"),
    Route(_V2_MODEL, "fused_indexer_q_rope_quant", "mla_ext.vllm.indexer_quant:fused_indexer_q_rope_quant",
          "no-triton-fp8"),
    # The indexer's fp8 query padding and its JIT-warmup registration (mla_ext/vllm/seq_pack.py).
    Route(_INDEXER, "pack_seq_triton", "mla_ext.vllm.seq_pack:pack_seq_triton", "no-triton-fp8"),
    Route(_COMMON_OPS, "_PACK_SEQ_TRITON_KERNEL", "mla_ext.vllm.seq_pack:without_fp8_warmup", "no-triton-fp8",
          wraps=True),
    # vLLM's wrappers in _custom_ops call these torch ops (namespaces as vLLM 0.33 registers them).
    Route(_OPS, "indexer_k_quant_and_cache", "mla_ext.vllm._indexer_ops:indexer_k_quant_and_cache", "no-c-op",
          "_C_cache_ops.indexer_k_quant_and_cache"),
    Route(_OPS, "cp_gather_indexer_k_quant_cache", "mla_ext.vllm._indexer_ops:cp_gather_indexer_k_quant_cache",
          "no-c-op", "_C_cache_ops.cp_gather_indexer_k_quant_cache"),
    Route(_OPS, "top_k_per_row_prefill", "mla_ext.vllm._indexer_ops:top_k_per_row_prefill", "no-c-op",
          "_C.top_k_per_row_prefill"),
    Route(_OPS, "top_k_per_row_decode", "mla_ext.vllm._indexer_ops:top_k_per_row_decode", "no-c-op",
          "_C.top_k_per_row_decode"),
)

_lock = threading.RLock()
_originals: dict[tuple[str, str], object] = {}
_scheduled: set[tuple[str, str]] = set()


def deep_gemm_served() -> bool:
    """Stands for vLLM's has_deep_gemm() in its DSA indexer where mla_ext serves the indexer's
    DeepGEMM ops (capability 8.x): the indexer may be built."""
    return True


def fp8_means_ds_mla(canonicalize):
    """Wraps vLLM's _canonicalize_sparse_mla_kv_cache_dtype(attn_backend, kv_cache_dtype): with
    mla_ext's sparse backend, "fp8" / "fp8_e4m3" become "fp8_ds_mla" (what vLLM makes of them for
    FlashMLA sparse, the backend users of these models know); anything else is vLLM's answer."""

    def canonical(attn_backend, kv_cache_dtype):
        if attn_backend.get_name() == SPARSE_BACKEND_NAME and kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return "fp8_ds_mla"
        return canonicalize(attn_backend, kv_cache_dtype)

    canonical.__wrapped__ = canonicalize
    return canonical


def sparse_mode() -> str:
    from mla_ext._args import env_switch

    return env_switch(SPARSE_ENV, "auto", "serve DSA on capability 8.x")


def _capability(platform) -> tuple[int, int] | None:
    if platform.is_cpu():
        return None  # vLLM CPU runs DSA through its own forward_cpu
    cap = platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def _c_op_available(qualified: str) -> bool:
    """Whether vLLM's compiled library registered torch.ops.<namespace>.<op> in this process."""
    import torch

    namespace, op = qualified.split(".")
    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return False
    return True


def needed(route: Route, capability: tuple[int, int] | None) -> bool:
    """Whether this process's GPU lacks what `route` replaces (a "no-c-op" route is checked
    again when applied: vLLM's own _C may have the op)."""
    if capability is None:
        return False
    if route.need == "backend":
        return True
    if capability[0] != 8:
        return False
    if route.need == "no-deep-gemm":
        return True
    if route.need == "no-triton-fp8":
        return capability < (8, 9)
    if route.need == "no-c-op":
        return True  # decided in _apply: vLLM's _C is loaded by vllm._custom_ops' own import
    raise ValueError(f"Route.need: unknown condition {route.need!r}")


def _provider(route: Route):
    module, name = route.provider.split(":")
    return getattr(importlib.import_module(module), name)


def _apply(route: Route, module) -> None:
    key = (route.module, route.attr)
    with _lock:
        if key in _originals or (route.need == "no-c-op" and _c_op_available(route.c_op)):
            return
        if not hasattr(module, route.attr):
            raise RuntimeError(f"{route.module}.{route.attr}: not found; mla_ext's sparse routes expect the "
                               f"layout of vLLM 0.32/0.33")
        original = _originals[key] = getattr(module, route.attr)
        setattr(module, route.attr, _provider(route)(original) if route.wraps else _provider(route))
    logger.info("mla_ext: %s.%s -> %s (pid %d)", route.module, route.attr, route.provider, os.getpid())


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it."""

    def __init__(self, inner, callbacks):
        self._inner, self._callbacks = inner, callbacks

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for fn in self._callbacks:
            fn(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with waiting callbacks it asks the finders after it
    and wraps the loader they return."""

    def __init__(self):
        self.waiting: dict[str, list] = {}

    def find_spec(self, fullname, path, target=None):
        callbacks = self.waiting.get(fullname)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        del self.waiting[fullname]
        spec.loader = _HookedLoader(spec.loader, callbacks)
        return spec


_finder = _PostImportFinder()


def when_imported(module_name: str, fn) -> None:
    """fn(module) now if `module_name` is imported, else right after it is."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _finder.waiting.setdefault(module_name, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    fn(module)


def route_sparse_ops(capability: tuple[int, int] | None) -> list[str]:
    """Schedules every route this capability needs (applied now or at the module's import);
    the dotted names, idempotent."""
    names = []
    for route in ROUTES:
        if not needed(route, capability):
            continue
        key = (route.module, route.attr)
        names.append(f"{route.module}.{route.attr}")
        with _lock:
            if key in _scheduled:
                continue
            _scheduled.add(key)
        when_imported(route.module, lambda module, r=route: _apply(r, module))
    return names


def routed() -> list[str]:
    """The dotted vLLM names currently served by mla_ext's sparse routes."""
    return [f"{m}.{a}" for m, a in _originals]


def unroute_sparse_ops() -> None:
    """Puts vLLM's functions back and forgets routes not applied yet."""
    with _lock:
        for (module_name, attr), original in list(_originals.items()):
            setattr(sys.modules[module_name], attr, original)
        _originals.clear()
        _scheduled.clear()
        _finder.waiting.clear()


def _claim(enum_cls, member_name: str) -> str:
    """Registers the backend under `member_name` unless another plugin holds it."""
    from vllm.v1.attention.backends.registry import register_backend

    member = enum_cls[member_name]
    if member.is_overridden() and member.get_path() != SPARSE_BACKEND_PATH:
        logger.warning("mla_ext: vLLM attention backend %s is already registered to %s (another plugin); "
                       "mla_ext's sparse backend is not registered there", member_name, member.get_path())
        return ""
    register_backend(member, SPARSE_BACKEND_PATH)
    return member_name


def register_sparse() -> str:
    """Registers the sparse backend and the routes this process's GPU needs; a note for the log."""
    if sparse_mode() == "off":
        return f"; DSA sparse backend off ({SPARSE_ENV}=0)"
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    capability = _capability(current_platform)
    claimed = [_claim(AttentionBackendEnum, CUSTOM_MEMBER)]
    if capability is not None and capability[0] == 8:
        claimed.append(_claim(AttentionBackendEnum, OVERRIDDEN_MEMBER))
    claimed = [c for c in claimed if c]
    routes = route_sparse_ops(capability)
    cc = "no GPU capability" if capability is None else f"capability {capability[0]}.{capability[1]}"
    return (f"; DSA sparse backend {SPARSE_BACKEND_NAME} as {', '.join(claimed) or 'nothing'} ({cc}), "
            f"{len(routes)} vLLM functions served by mla_ext")
