"""Random paged layouts for the sparse tests: shuffled block ids per request."""
import torch


def paged_layout(lens: list[int], block_size: int, seed: int = 0, spare: int = 2):
    """(block_table int32 [n, max_blocks], num_blocks, slots per request (int64 lists)) with
    shuffled, non-overlapping blocks and a few unused ones."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need + [1]) + 1
    table = torch.full((len(lens), width), num_blocks + 5, dtype=torch.int32)  # junk past the used part
    slots, at = [], 0
    for r, (n, k) in enumerate(zip(lens, need)):
        table[r, :k] = perm[at:at + k].to(torch.int32)
        at += k
        pos = torch.arange(n)
        slots.append(table[r, pos // block_size].to(torch.int64) * block_size + pos % block_size)
    return table, num_blocks, slots
