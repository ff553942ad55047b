"""mla_ext as a vLLM plugin (entry point ``vllm.general_plugins`` -> ``register``).

vLLM calls ``register()`` in every process it starts (engine, workers, the CLI
before it parses arguments). This module imports nothing from vLLM at import
time, and ``register()`` changes no behaviour by itself: it only adds the
choice ``MLA_EXT`` to vLLM's MLA prefill backends, so that

    vllm serve ... --attention-config.mla_prefill_backend=MLA_EXT

parses. What the choice, or the environment, turns on:

* ``MLA_EXT`` selected: vLLM's chunked MLA prefill runs its new-token and
  per-chunk context attention through ``mla_ext.attention.varlen_attention``
  (``MlaExtPrefillBackend`` in mla_ext/vllm/prefill_backend.py), and, when
  the first such backend is built, vLLM's MLA cache ops and the merge are
  routed to mla_ext's (``route_ops``).
* ``MLA_EXT_VLLM_OPS=1``: the ops are routed at ``register()`` whatever the
  backend (so mla_ext's cache formats and gathers serve any prefill backend);
  ``MLA_EXT_VLLM_OPS=0``: never routed, even with ``MLA_EXT`` selected (its
  attention only). Unset: routed exactly when ``MLA_EXT`` is selected.

What is routed (``ROUTED_OPS``): vLLM's ``vllm._custom_ops`` functions
concat_and_cache_mla, gather_and_maybe_dequant_cache, cp_gather_cache,
cp_gather_and_upconvert_fp8_kv_cache, cp_gather_and_upconvert_nvfp4_kv_cache
(vLLM's MLA code looks ``ops.<name>`` up at call time, so rebinding the module
attribute is enough), and ``merge_attn_states`` in vLLM's mla_attention
module, which imported it by name (patching ``_custom_ops`` alone would reach
it only on CUDA, through vLLM's dispatcher). Every replacement has vLLM 0.33's
signature (mla_ext/vllm/_custom_ops.py). ``unroute_ops()`` restores vLLM's.
"""
from __future__ import annotations

import logging
import threading

BACKEND_NAME = "MLA_EXT"
BACKEND_PATH = "mla_ext.vllm.prefill_backend.MlaExtPrefillBackend"
OPS_ENV = "MLA_EXT_VLLM_OPS"

# (vLLM module, attribute) -> the mla_ext function (in mla_ext.vllm._custom_ops) taking its place.
CUSTOM_OPS_MODULE = "vllm._custom_ops"
MLA_ATTENTION_MODULE = "vllm.model_executor.layers.attention.mla_attention"
ROUTED_OPS = (
    (CUSTOM_OPS_MODULE, "concat_and_cache_mla"),
    (CUSTOM_OPS_MODULE, "gather_and_maybe_dequant_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_and_upconvert_fp8_kv_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_and_upconvert_nvfp4_kv_cache"),
    (MLA_ATTENTION_MODULE, "merge_attn_states"),
)

logger = logging.getLogger("mla_ext.vllm")
_lock = threading.Lock()
_originals: dict[tuple[str, str], object] = {}


def ops_mode() -> str:
    """'on', 'off' or 'with-backend' from MLA_EXT_VLLM_OPS (unknown values refused)."""
    from mla_ext._args import env_switch

    return env_switch(OPS_ENV, "with-backend", "route with the MLA_EXT backend")


def register() -> None:
    """vLLM's general-plugin hook: idempotent, called in every vLLM process."""
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )

    if BACKEND_NAME not in MLAPrefillBackendEnum.__members__:
        register_mla_prefill_backend(BACKEND_NAME, BACKEND_PATH)
    if ops_mode() == "on":
        route_ops()


def _mla_ext_op(name: str):
    from mla_ext.vllm import _custom_ops

    op = getattr(_custom_ops, name, None)
    if op is None:  # only cp_gather_and_upconvert_nvfp4_kv_cache can be absent
        raise ValueError(f"mla_ext.vllm._custom_ops has no {name} (this build's formats lack it)")
    return op


def route_ops() -> list[str]:
    """Rebinds vLLM's MLA cache ops and mla_attention's merge to mla_ext's (idempotent).
    Returns the dotted names routed by this call."""
    import importlib

    done = []
    with _lock:
        for module_name, attr in ROUTED_OPS:
            key = (module_name, attr)
            if key in _originals:
                continue
            module = importlib.import_module(module_name)
            if not hasattr(module, attr):
                raise ValueError(f"{module_name}.{attr}: not found; mla_ext's plugin expects vLLM 0.33's layout")
            _originals[key] = getattr(module, attr)
            setattr(module, attr, _mla_ext_op(attr))
            done.append(f"{module_name}.{attr}")
    if done:
        logger.info("mla_ext: vLLM's MLA cache ops and merge routed to mla_ext: %s", ", ".join(done))
    return done


def unroute_ops() -> None:
    """Puts vLLM's own functions back."""
    import importlib

    with _lock:
        for (module_name, attr), original in list(_originals.items()):
            setattr(importlib.import_module(module_name), attr, original)
            del _originals[(module_name, attr)]


def routed() -> list[str]:
    """The dotted vLLM names currently served by mla_ext."""
    return [f"{m}.{a}" for m, a in _originals]
