"""Plumbing for the vLLM runner scripts: vLLM's UnspecifiedPlatform with tensors on the CPU (dispatch
key CPU, no pinned memory) stating a GPU compute capability, installed as vLLM's current platform
before the plugins load (so mla_ext's plugin decides its DSA routes from that capability)."""
from __future__ import annotations


def install_stated_platform(stated: str) -> None:
    """stated: "8.6"-style capability, or "none" for a platform without one."""
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform

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

    vllm.platforms._current_platform = StatedPlatform()
    vllm.platforms.current_platform = vllm.platforms._current_platform
