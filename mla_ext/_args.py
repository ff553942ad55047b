"""Argument checks shared by the public entry points: each raises a ValueError
that names the argument and the value it expected (errors are part of the API)."""
from __future__ import annotations

import os

import torch


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value, arg: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int within [minimum, maximum]; bools and floats are refused."""
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        lo = "" if minimum is None else f" >= {minimum}"
        hi = "" if maximum is None else f" <= {maximum}"
        both = " and" if lo and hi else ""
        raise ValueError(f"{arg}: expected an int{lo}{both}{hi}, got {value!r}")
    return value


def one_line_parser(**kwargs):
    """An argparse.ArgumentParser whose usage errors are one line on stderr (exit 2),
    naming the flag: "<prog>: error: argument --seed: ... (see --help)", without the
    multi-line usage block; its subparsers are built the same way."""
    import argparse

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message: str):
            self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")

    return OneLineParser(**kwargs)


def int_flag(minimum: int, maximum: int):
    """An argparse `type=` for an integer flag within [minimum, maximum]: anything else
    (a float, 10**23, a word) is a usage error argparse names by flag, before the
    command prints anything, never an OverflowError deep inside it."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 40 else None
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            shown = text if len(text) <= 40 else text[:20] + "..."
            raise argparse.ArgumentTypeError(f"expected an integer in [{minimum}, {maximum}], got {shown!r}")
        return value

    return parse


def as_device(value, arg: str = "device") -> torch.device:
    """A torch.device from a device or its name; unknown names are a ValueError."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            pass
    raise ValueError(f"{arg}: expected a torch.device or a device name such as 'cpu', 'cuda' or "
                     f"'cuda:0', got {value!r}")


def check_tensor(value, arg: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{arg}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_no_meta(**tensors) -> None:
    """Each named tensor holds data: a meta tensor (shape only) has nothing to compute on and
    would fail deep inside (a copy out of meta, a backend for no device) naming nothing.
    Non-tensors and None are left to the callers' own checks."""
    for arg, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{arg}: a meta tensor (shape only, no data) cannot be computed on; "
                             "expected a CPU or CUDA tensor")


def env_switch(name: str, unset: str, unset_means: str) -> str:
    """A tri-state opt-in variable: "on" (1/on/true/yes), "off" (0/off/false/no) or
    `unset` when empty, unset or "auto"; any other value is a ValueError naming the
    variable and saying what unset means (`unset_means`)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return unset
    if value in ("1", "on", "true", "yes"):
        return "on"
    if value in ("0", "off", "false", "no"):
        return "off"
    raise ValueError(f"{name}: expected 1/on, 0/off or unset ({unset_means}), got {value!r}")
