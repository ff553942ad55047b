"""Reusable buffers for attention backends that need a materialised operand.

Most of the MLA path never builds the keys `[Tk, N, P+R]`: `varlen_attention`
takes them split (k_nope `[Tk, N, P]` and the per-token k_rope `[Tk, R]`), and
the Triton backend reads both in its own loads. Backends that take one key
tensor (flex_attention, FlashAttention-2 through `varlen_attn`) assemble it,
and FA2 also needs V padded to the QK head dim. They write into an
`AttentionScratch` when the caller gives one, so a layer that runs many
context chunks allocates each buffer once, not once per chunk.

One flat buffer per (name, dtype, device), grown only when a request exceeds
it; `min_rows` sizes the first allocation (MLAPrefill passes its workspace
rows, the largest chunk it can see). Not thread-safe: one scratch per stream of
calls (MLAPrefill keeps one per device). A view returned by `take` is valid
until the next `take` of the same name.
"""
from __future__ import annotations

import math

import torch


class AttentionScratch:
    """Named, grow-only device buffers (see the module docstring)."""

    def __init__(self, min_rows: int = 0):
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
            raise ValueError(f"min_rows: expected an int >= 0, got {min_rows!r}")
        self.min_rows = min_rows
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0  # how many buffers were (re)allocated: tests and reports

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A contiguous `shape` view of the `name` buffer (uninitialised contents)."""
        device = torch.device(device)
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            want = max(numel, self.min_rows * row)
            if buf is not None:
                want = max(want, buf.numel())
            del buf
            self._bufs.pop(key, None)  # free the old one before the new one is made
            buf = torch.empty(want, dtype=dtype, device=device)
            self._bufs[key] = buf
            self.allocations += 1
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def __repr__(self) -> str:
        names = ", ".join(f"{n} {tuple(b.shape)} {d}" for (n, d, _), b in self._bufs.items())
        return f"AttentionScratch(min_rows={self.min_rows}, [{names}])"
