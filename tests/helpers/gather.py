"""Random inputs for the gather tests: filled caches, batches, poisoned outputs.

Caches are filled through `reference.concat_and_cache_mla_ref` from random
latent rows, so every format holds realistic encodings (never zeros), and can
be strided views into a larger poisoned buffer, like one layer of a
cross-layer allocation.
"""
from __future__ import annotations

import random

import torch

from mla_ext.cache import reference as ref
from mla_ext.config.formats import get_format

# A byte that decodes to a large, finite value in every format: reading it
# instead of a real entry shows up as a mismatch (0x5A as e4m3 = 208).
POISON_BYTE = 0x5A


def make_cache(fmt_name: str, num_blocks: int, block_size: int, L: int, R: int,
               model_dtype=torch.bfloat16, k_scale=None, strided: bool = False,
               gen: torch.Generator | None = None, device="cpu"):
    """A filled `[num_blocks, block_size, entry]` cache (a strided view when `strided`)."""
    fmt = get_format(fmt_name)
    entry = fmt.entry_elems(L, R)
    dtype = fmt.storage_dtype(model_dtype)
    if strided:
        # Layer 1 of a 2-layer buffer, with padding after each entry and block.
        buf = torch.empty(2, num_blocks, block_size + 1, entry + 8, dtype=dtype)
        buf.view(torch.uint8).fill_(POISON_BYTE)
        cache = buf[1, :, :block_size, :entry]
    else:
        cache = torch.empty(num_blocks, block_size, entry, dtype=dtype)
    n = num_blocks * block_size
    kv_c = torch.randn(n, L, generator=gen) * 2.0
    k_pe = torch.randn(n, R, generator=gen)
    if k_scale is None:
        k_scale = torch.tensor([0.03], dtype=torch.float32)
    ref.concat_and_cache_mla_ref(kv_c.to(model_dtype), k_pe.to(model_dtype), cache,
                                 torch.arange(n), fmt.name, k_scale)
    return cache.to(device), k_scale.to(device)


def strided_copy(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` with the same strides (`.to()` would compact a strided view);
    the gaps between its elements hold POISON_BYTE."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    flat = torch.empty(span * t.element_size(), dtype=torch.uint8, device=device).fill_(POISON_BYTE)
    out = flat.view(t.dtype).as_strided(t.shape, t.stride())
    out.copy_(t)
    return out


def make_batch(rng: random.Random, num_reqs: int, num_blocks: int, block_size: int,
               max_blocks: int, bad_ids: bool = False, lens=None):
    """block_table (shuffled block ids), cu_seq_lens, seq_starts for `num_reqs` requests.

    Lengths include 0 and 1; starts are unaligned; every (start + len) fits in
    the table. With `bad_ids`, some table entries are out of range (-1,
    num_blocks, a huge id) so that their rows must come back as zeros.
    """
    cap = max_blocks * block_size
    if lens is None:
        lens = [rng.choice([0, 1, rng.randint(0, cap)]) for _ in range(num_reqs)]
    starts = [rng.randint(0, cap - n) for n in lens]
    ids = list(range(num_blocks))
    table = []
    for _ in range(num_reqs):
        rng.shuffle(ids)
        row = (ids * (max_blocks // num_blocks + 1))[:max_blocks]
        if bad_ids:
            for _ in range(max(1, max_blocks // 4)):
                row[rng.randrange(max_blocks)] = rng.choice([-1, num_blocks, 2**31 - 1])
        table.append(row)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    i32 = dict(dtype=torch.int32)
    return (torch.tensor(table, **i32), torch.tensor(cu, **i32), torch.tensor(starts, **i32))


def poisoned_dst(rows: int, width: int, dtype, guard: int = 3, pad_cols: int = 0):
    """(dst view, whole buffer): dst has `guard` poisoned rows above and below it and,
    with `pad_cols`, poisoned columns after each row (a row stride > width)."""
    buf = torch.empty(rows + 2 * guard, width + pad_cols, dtype=dtype)
    if dtype.is_floating_point:
        buf.fill_(float("nan"))
    else:
        buf.fill_(0xFF)
    return buf[guard: guard + rows, :width], buf
