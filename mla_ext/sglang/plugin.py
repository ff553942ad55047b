"""mla_ext as an SGLang plugin (entry point ``sglang.srt.plugins`` -> ``register``).

SGLang's ``load_plugins()`` calls ``register()`` in every process it starts
(before argument parsing and in each scheduler), then ``HookRegistry.apply_hooks()``.
This module imports nothing from SGLang at import time, and ``register()``
changes nothing unless asked:

* ``MLA_EXT_SGLANG=1`` (on/true/yes): on;  ``MLA_EXT_SGLANG=0``: off, whatever else;
* unset: on exactly when SGLang's own allow-list ``SGLANG_PLUGINS`` names
  ``mla_ext`` (an unset allow-list loads every installed plugin, so being
  installed is not being asked).

When on, two hooks are registered through SGLang's ``HookRegistry``:

* AROUND ``DeepseekMHAForwardMixin._chunked_prefix_attn_mha`` (the loop that
  gathers each prefix chunk from the KV pool, up-projects it through kv_b_proj,
  attends and merges with SGLang's ``merge_state``): mla_ext's
  ``MLAPrefill.forward_context`` does the whole context pass instead, reading
  SGLang's pool as it is, and merges with the new tokens' result
  (chunked_prefix.py). Layers it cannot serve (the FP4 pool, DCP, index
  translation, ROCm's packed FP8 prefix) run SGLang's loop; the reason is
  logged once per reason.
* AROUND ``AttentionBackendRegistry.get_handler``: for fa3, flashinfer and
  flashmla, a batch with a cached prefix below SGLang's fixed
  ``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD`` (8,192 tokens) is sent to the
  chunked MHA path too, where mla_ext's cost model chooses absorbed
  (latent-space) or up-projected attention per chunk (dispatch.py).
"""
from __future__ import annotations

import logging
import os
import threading

PLUGIN_NAME = "mla_ext"
ENV = "MLA_EXT_SGLANG"
SGLANG_ALLOW_LIST_ENV = "SGLANG_PLUGINS"

FORWARD_MHA = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha"
CHUNKED_TARGET = f"{FORWARD_MHA}.DeepseekMHAForwardMixin._chunked_prefix_attn_mha"
HANDLER_TARGET = ("sglang.srt.models.deepseek_common.attention_backend_handler."
                  "AttentionBackendRegistry.get_handler")
HOOK_TARGETS = (CHUNKED_TARGET, HANDLER_TARGET)

logger = logging.getLogger("mla_ext.sglang")
_lock = threading.Lock()
_registered = False


def mode() -> str:
    """'on', 'off' or 'allow-list' (unset: on iff SGLANG_PLUGINS names mla_ext); unknown values refused."""
    from mla_ext._args import env_switch

    return env_switch(ENV, "allow-list", f"on when {SGLANG_ALLOW_LIST_ENV} names {PLUGIN_NAME}")


def enabled() -> bool:
    m = mode()
    if m != "allow-list":
        return m == "on"
    allowed = {x.strip() for x in os.environ.get(SGLANG_ALLOW_LIST_ENV, "").split(",")}
    return PLUGIN_NAME in allowed


def register() -> None:
    """SGLang's general-plugin hook: idempotent; registers the hooks when enabled.
    SGLang's load_plugins() applies them right after (HookRegistry.apply_hooks())."""
    global _registered
    if not enabled():
        logger.debug("mla_ext: SGLang plugin loaded, not enabled (%s=1 or %s=%s to enable)",
                     ENV, SGLANG_ALLOW_LIST_ENV, PLUGIN_NAME)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from mla_ext.sglang import chunked_prefix, dispatch

    with _lock:
        if _registered:
            return
        HookRegistry.register(CHUNKED_TARGET, chunked_prefix.chunked_prefix_attn_mha, HookType.AROUND)
        HookRegistry.register(HANDLER_TARGET, dispatch.get_handler, HookType.AROUND)
        _registered = True
    logger.info("mla_ext: SGLang's DeepSeek chunked-prefix prefill and the fa3/flashinfer/flashmla "
                "absorbed-vs-MHA choice go to mla_ext")
