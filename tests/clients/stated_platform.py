"""Plumbing for the vLLM runner scripts: vLLM's UnspecifiedPlatform, CPU-typed, stating a GPU compute
capability (or none), installed as vLLM's current platform before any vLLM module binds it."""
from __future__ import annotations

import vllm.platforms
from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform


def install_stated_platform(stated: str) -> None:
    """stated: "8.6"-style capability, or "none" for a platform without one."""

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
