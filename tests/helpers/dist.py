"""Runs a test body on N CPU processes joined in a gloo process group."""
from __future__ import annotations

import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, world: int, body) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        body(rank, world)
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(body, world: int = 2) -> None:
    """Calls `body(rank, world)` (a module-level function) on `world` processes;
    an assertion failing on any rank fails the caller."""
    mp.spawn(_entry, args=(_free_port(), world, body), nprocs=world, join=True)
