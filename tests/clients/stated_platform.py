"""Plumbing for the vLLM runner scripts: vLLM's UnspecifiedPlatform, CPU-typed, stating a GPU compute
capability (or none), installed as vLLM's current platform before any vLLM module binds it; and
no-op streams/events for vLLM's sparse index group (the CPU has one stream)."""
from __future__ import annotations

import sys
import types

import vllm.platforms
from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform


def _cuda_platform_base():
    # vLLM's compiled library is not in the pure-Python client tree; cuda.py only imports it.
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms.cuda import CudaPlatformBase

    return CudaPlatformBase


def install_stated_platform(stated: str, cuda_backend_selection: bool = False) -> None:
    """stated: "8.6"-style capability, or "none" for a platform without one.
    cuda_backend_selection: the attention backend is chosen by CudaPlatformBase's own
    get_attn_backend_cls / get_valid_backends (CUDA's candidate list for the stated capability,
    each candidate validated), not UnspecifiedPlatform's (none)."""

    class StatedPlatform(UnspecifiedPlatform):
        device_type = "cpu"
        device_name = "cpu"
        dispatch_key = "CPU"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            if stated == "none":
                return None
            major, minor = stated.split(".")
            return DeviceCapability(int(major), int(minor))

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 4  # sizes vLLM's per-SM buffers (the indexer's schedule metadata)

        if cuda_backend_selection:
            @classmethod
            def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
                return _cuda_platform_base().get_attn_backend_cls.__func__(cls, selected_backend,
                                                                            attn_selector_config, num_heads)

            @classmethod
            def get_valid_backends(cls, device_capability, attn_selector_config, num_heads=None):
                return _cuda_platform_base().get_valid_backends.__func__(cls, device_capability,
                                                                          attn_selector_config, num_heads)

    vllm.platforms._current_platform = StatedPlatform()
    vllm.platforms.current_platform = vllm.platforms._current_platform


class _CpuStream:
    """No-op stream/event (stand-in for torch.Stream / torch.Event on the CPU's single stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install_cpu_streams() -> None:
    """vLLM's SparseMLAIndexGroup orders its top-k -> slot conversion on a side stream with events:
    no-op objects here; and no CUDA graph is ever being captured (torch's query needs a driver)."""
    import torch
    from vllm.v1.attention.backends.mla import index_group

    index_group._create_side_stream = lambda device: _CpuStream()
    index_group._create_event = lambda: _CpuStream()
    index_group.current_stream = lambda: _CpuStream()
    torch.cuda.is_current_stream_capturing = lambda: False
