"""The worked example: `python -m mla_ext demo`.

For now it plans the KV cache of DeepSeek-V3 with fp8_ds_mla layers and the
first two and the last layer kept in bf16 (the skip-layer setup that upstream
engines refuse because 656- and 1152-byte pages do not divide), in 60 GiB.
"""
from __future__ import annotations

import argparse

from mla_ext.models import get_model_config
from mla_ext.planner import render_plan
from mla_ext.policy import CacheConfig

MODEL = "deepseek-v3"
KV_CACHE_DTYPE = "fp8_ds_mla"
SKIP_LAYERS = (0, 1, 60)
BLOCK_SIZE = 64
MEMORY_BYTES = 60 * 2**30


def run_demo(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_ext demo", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv or [])
    cfg = CacheConfig(KV_CACHE_DTYPE, SKIP_LAYERS, BLOCK_SIZE)
    print(render_plan(get_model_config(MODEL), cfg, MEMORY_BYTES, as_json=args.json))
    return 0
