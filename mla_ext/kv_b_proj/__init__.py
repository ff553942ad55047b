"""kv_b_proj: the MLA latent up-projection for every checkpoint weight format (SPEC §5).

- `weights`: one class per format (dense, fp8 per-tensor/per-channel, fp8 block-128,
  Marlin-packed fp8, NVFP4, GPTQ-style int4 without `.weight`);
- `input_dtype.kv_b_proj_input_dtype`: the activation dtype policy (SPEC §5 table);
- `linear.KvBProj`: the layer, dispatching by (format, GPU capability, M); `explain(M)`;
- `from_module.weight_format_from_module`: the format of an nn.Linear or checkpoint-style module;
- `shard`: tensor-parallel shards (`shard_weight`, `shard_for`, `shard_rows`) of every format.
Kernels (`triton_fp8_block`, `triton_w4a16`, `quant`, `marlin`) load lazily.
"""
from mla_ext.kv_b_proj.from_module import weight_format_from_module  # noqa: F401
from mla_ext.kv_b_proj.input_dtype import kv_b_proj_input_dtype  # noqa: F401
from mla_ext.kv_b_proj.linear import DISPATCH, KvBProj, backend_report  # noqa: F401
from mla_ext.kv_b_proj.shard import shard_for, shard_rows, shard_weight  # noqa: F401
from mla_ext.kv_b_proj.weights import (  # noqa: F401
    DenseWeight,
    Fp8BlockWeight,
    Fp8Weight,
    Int4GroupWeight,
    MarlinFp8Weight,
    Nvfp4Weight,
    WeightFormat,
)
