"""Argument checks shared by the public entry points: each raises a ValueError
that names the argument and the value it expected (errors are part of the API)."""
from __future__ import annotations

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
