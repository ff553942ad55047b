"""vLLM's CPU platform, honouring ``mla_prefill_backend=MLA_EXT`` (vLLM 0.32/0.33).

vLLM CPU does two things that make the MLA_EXT choice a silent no-op:

* its MLA prefill selector ignores an explicit backend on CPU platforms and asks
  the platform (``get_mla_prefill_backend_cls``), which knows only its own;
* ``CpuPlatform.check_and_update_config`` turns chunked prefill and prefix
  caching off for every MLA model without AMX (its own prefill cannot read a
  cached context well), so each turn re-prefills the whole prompt.

``MlaExtCpuPlatform`` overrides exactly those two platform hooks, and only when
the attention config selects mla_ext's backend (plugin.selected); otherwise it
is vLLM's CpuPlatform unchanged. It reaches vLLM through the platform-plugin
entry point (plugin.cpu_platform); where vLLM skips platform plugins
(VLLM_TARGET_DEVICE=cpu), the general plugin gives the resolved CpuPlatform
instance this class instead (``adopt``: a subclass with no state of its own).
"""
from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

from mla_ext.vllm import plugin


class MlaExtCpuPlatform(CpuPlatform):
    """vLLM's CpuPlatform, with the MLA_EXT prefill backend honoured."""

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        from vllm.config import get_current_vllm_config

        if not plugin.selected(get_current_vllm_config().attention_config):
            return super().get_mla_prefill_backend_cls(mla_selector_config)
        from mla_ext.vllm.prefill_backend import MlaExtPrefillBackend

        reasons = MlaExtPrefillBackend.validate_configuration(None, mla_selector_config)
        if reasons:
            raise ValueError(f"Selected MLA prefill backend {plugin.BACKEND_NAME} is not valid for this "
                             f"configuration. Reason: {reasons}")
        return MlaExtPrefillBackend

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        chosen = plugin.selected(vllm_config.attention_config)
        if chosen and vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            cls._leave_amx_mla(vllm_config.attention_config)
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        before = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)
        model = vllm_config.model_config
        if not (chosen and model is not None and model.use_mla):
            return
        # vLLM CPU's MLA rule turned both off (and widened the token budget to the
        # whole prompt); mla_ext's backend reads cached contexts: keep what was asked.
        turned_off = [name for name, was, now in (
            ("chunked prefill", before[0], sched.enable_chunked_prefill),
            ("prefix caching", before[1], cache.enable_prefix_caching)) if was and not now]
        if turned_off:
            sched.enable_chunked_prefill, cache.enable_prefix_caching = before[0], before[1]
            sched.max_num_batched_tokens = before[2]
            plugin.logger.info("mla_ext: vLLM CPU turns %s off for MLA; kept on for the MLA_EXT prefill backend "
                               "(max_num_batched_tokens=%s)", " and ".join(turned_off), before[2])


    @classmethod
    def _leave_amx_mla(cls, attention_config) -> None:
        """On AMX CPUs vLLM serves MLA with AMX_MLA, whose own forward_mha takes no prefill
        backend: MLA_EXT would be a silent no-op there. vLLM's CPU_MLA (its choice without AMX)
        hosts the prefill backend; it is chosen unless the user named another backend."""
        import torch
        from vllm.platforms.interface import CpuArchEnum
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        if not (cls.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()):
            return
        if attention_config.backend is None:
            attention_config.backend = AttentionBackendEnum.CPU_MLA
            plugin.logger.info("mla_ext: attention backend CPU_MLA for the MLA_EXT prefill backend (vLLM CPU "
                               "would pick AMX_MLA, whose prefill takes no prefill backend)")
        elif attention_config.backend != AttentionBackendEnum.CPU_MLA:
            raise ValueError(f"attention_config.backend: expected CPU_MLA or unset with mla_prefill_backend="
                             f"{plugin.BACKEND_NAME} on vLLM CPU, got {attention_config.backend.name} (its "
                             f"prefill takes no prefill backend)")


def adopt(platform) -> str:
    """Gives a resolved CpuPlatform instance MlaExtCpuPlatform's hooks; says what it did."""
    if isinstance(platform, MlaExtCpuPlatform):
        return "vLLM CPU via mla_ext's platform plugin (MLA_EXT honoured)"
    if type(platform) is not CpuPlatform:
        raise RuntimeError(f"mla_ext's vLLM plugin: the CPU platform is {type(platform).__qualname__}, not "
                           f"vLLM's CpuPlatform; mla_ext cannot make it honour MLA_EXT")
    platform.__class__ = MlaExtCpuPlatform
    return "vLLM CPU (VLLM_TARGET_DEVICE=cpu skipped platform plugins: its instance given mla_ext's hooks)"
