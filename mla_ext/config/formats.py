"""The KV-cache format registry (SPEC §2), mirror of csrc/common/cache_layout.h.

One entry per format with its names, storage dtype, bytes per token, quant mode
and scale kind. Kernels read the C++ header; Python reads this module;
tests/config/test_formats.py proves both agree through the `mla_ext::format_info` op.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mla_ext._args import check_int

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    FP8_PER_TILE = 2
    NVFP4_PER_BLOCK = 3


class ScaleKind(enum.IntEnum):
    NONE = 0  # no scale
    PER_TENSOR = 1  # one fp32 K scale beside the cache
    PER_TILE = 2  # fp32 scales stored inside each cache row
    PER_BLOCK = 3  # e4m3 scales stored inside each cache row, one per 16 values


class DsMla:
    """fp8_ds_mla row layout in bytes (only for L = 512, R in {64, 0})."""

    LATENT_DIM = 512
    ROPE_DIM = 64
    TILE_SIZE = 128
    NUM_TILES = 4
    LATENT_OFFSET = 0  # 512 x e4m3
    SCALE_OFFSET = 512  # 4 x fp32, one per 128-value tile
    ROPE_OFFSET = 528  # 64 x bf16, unquantized (zero-filled when R = 0)
    ENTRY_BYTES = 656
    E4M3_MAX = 448.0
    MIN_SCALE = 1e-4


class Nvfp4DsMla:
    """nvfp4_ds_mla row layout in bytes (only for L = 512, R = 64).

    bytes [0, 256): the 512 latent values as e2m1, two per byte, element 2j in
    the low nibble of byte j (sign in bit 3; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6);
    bytes [256, 320): the 64 rope values as e4m3, no scale (saturating cast);
    bytes [320, 352): the 32 e4m3 block scales, one per 16 latent values, the
    scale of block s at byte 320 + scale_byte(s) = 320 + 8 * (s & 3) + (s >> 2).

    Block scale = e4m3(max(amax16 / 6, 2^-9)) (round to nearest even, saturating
    at 448); a latent value is stored as x / scale rounded to the nearest e2m1
    value, ties to the even code (the lower-magnitude one except between 0.5
    and 1, 1.5 and 2, 3 and 4), saturating at +-6, with the sign of x (so -0.0
    and negatives that round to 0 store code 8). A block holding NaN or +-inf
    stores the e4m3 NaN byte 0x7F as its scale and zero codes: it decodes to NaN.
    """

    LATENT_DIM = 512
    ROPE_DIM = 64
    BLOCK_SIZE = 16
    NUM_BLOCKS = 32
    LATENT_OFFSET = 0  # 256 bytes of e2m1 pairs
    ROPE_OFFSET = 256  # 64 x e4m3
    SCALE_OFFSET = 320  # 32 x e4m3, permuted
    ENTRY_BYTES = 352
    E2M1_MAX = 6.0
    MIN_SCALE = 2.0**-9  # the smallest e4m3 subnormal
    NAN_SCALE_BYTE = 0x7F

    @staticmethod
    def scale_byte(s: int) -> int:
        """Byte (relative to SCALE_OFFSET) holding the scale of latent block s."""
        return 8 * (s & 3) + (s >> 2)


E4M3_MAX = 448.0
E5M2_MAX = 57344.0


@dataclass(frozen=True)
class CacheFormat:
    id: int  # same number as mla_ext::CacheFormat in cache_layout.h
    name: str  # canonical spelling
    aliases: tuple[str, ...]
    storage: str  # "model" (the model dtype), "bfloat16", "float16" or "uint8"
    # Encoding of the stored bytes of fp8 formats (a uint8 cache may also be this
    # float8 view for per-tensor formats); None for nvfp4_ds_mla, whose rows mix
    # e2m1 pairs and e4m3 bytes.
    fp8_dtype: torch.dtype | None
    quant_mode: QuantMode
    scale_kind: ScaleKind

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,) + self.aliases

    @property
    def is_quantized(self) -> bool:
        return self.quant_mode != QuantMode.NONE

    @property
    def is_native(self) -> bool:
        return not self.is_quantized

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the cache tensor for this format under `model_dtype`."""
        _check_model_dtype(model_dtype)
        if self.storage == "model":
            return model_dtype
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}[
            self.storage
        ]

    @property
    def fixed_entry_bytes(self) -> int | None:
        """Row size of the formats with a fixed byte layout (fp8_ds_mla 656,
        nvfp4_ds_mla 352); None for the element-per-value formats."""
        if self.quant_mode == QuantMode.FP8_PER_TILE:
            return DsMla.ENTRY_BYTES
        if self.quant_mode == QuantMode.NVFP4_PER_BLOCK:
            return Nvfp4DsMla.ENTRY_BYTES
        return None

    def supports_dims(self, L: int, R: int) -> bool:
        if L <= 0 or R < 0:
            return False
        if self.quant_mode == QuantMode.FP8_PER_TILE:
            return L == DsMla.LATENT_DIM and R in (DsMla.ROPE_DIM, 0)
        if self.quant_mode == QuantMode.NVFP4_PER_BLOCK:
            return L == Nvfp4DsMla.LATENT_DIM and R == Nvfp4DsMla.ROPE_DIM
        return True

    def check_dims(self, L: int, R: int) -> None:
        check_int(L, "L", minimum=1)
        check_int(R, "R", minimum=0)
        if not self.supports_dims(L, R):
            if self.quant_mode == QuantMode.FP8_PER_TILE:
                raise ValueError(
                    f"kv_cache_dtype '{self.name}' needs kv_lora_rank L=512 and "
                    f"qk_rope_head_dim R in (64, 0); got L={L}, R={R}"
                )
            if self.quant_mode == QuantMode.NVFP4_PER_BLOCK:
                raise ValueError(
                    f"kv_cache_dtype '{self.name}' needs kv_lora_rank L=512 and "
                    f"qk_rope_head_dim R=64; got L={L}, R={R}"
                    + (" (its 352-byte row has a fixed 64-value e4m3 rope section and no "
                       "layout without one; a model without rope can use fp8_ds_mla, fp8 "
                       "or auto)" if R == 0 else "")
                )
            raise ValueError(f"cache dims must be L > 0 and R >= 0; got L={L}, R={R}")

    def entry_elems(self, L: int, R: int) -> int:
        """Last-dim size of the `[num_blocks, B, entry]` cache tensor."""
        self.check_dims(L, R)
        fixed = self.fixed_entry_bytes
        return fixed if fixed is not None else L + R

    def bytes_per_token(self, L: int, R: int, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes one token takes in a page (SPEC §4)."""
        self.check_dims(L, R)
        fixed = self.fixed_entry_bytes
        if fixed is not None:
            return fixed
        return (L + R) * self.storage_dtype(model_dtype).itemsize

    def dequant_widths(self) -> tuple[int, ...] | None:
        """dst widths a dequantizing gather of the fixed-layout formats writes
        (None: the cache entry width, for the other formats)."""
        if self.quant_mode == QuantMode.FP8_PER_TILE:
            return (DsMla.LATENT_DIM + DsMla.ROPE_DIM, DsMla.LATENT_DIM)
        if self.quant_mode == QuantMode.NVFP4_PER_BLOCK:
            return (Nvfp4DsMla.LATENT_DIM + Nvfp4DsMla.ROPE_DIM,)
        return None

    def cache_shape(self, num_blocks: int, block_size: int, L: int, R: int) -> tuple[int, int, int]:
        check_int(num_blocks, "num_blocks", minimum=0)
        check_int(block_size, "block_size", minimum=1)
        return (num_blocks, block_size, self.entry_elems(L, R))


FORMATS: tuple[CacheFormat, ...] = (
    CacheFormat(0, "auto", (), "model", None, QuantMode.NONE, ScaleKind.NONE),
    CacheFormat(1, "bfloat16", ("bf16",), "bfloat16", None, QuantMode.NONE, ScaleKind.NONE),
    CacheFormat(2, "float16", ("fp16", "half"), "float16", None, QuantMode.NONE, ScaleKind.NONE),
    CacheFormat(
        3, "fp8", ("fp8_e4m3",), "uint8", torch.float8_e4m3fn,
        QuantMode.FP8_PER_TENSOR, ScaleKind.PER_TENSOR,
    ),
    CacheFormat(
        4, "fp8_e5m2", (), "uint8", torch.float8_e5m2,
        QuantMode.FP8_PER_TENSOR, ScaleKind.PER_TENSOR,
    ),
    CacheFormat(
        5, "fp8_ds_mla", (), "uint8", torch.float8_e4m3fn,
        QuantMode.FP8_PER_TILE, ScaleKind.PER_TILE,
    ),
    CacheFormat(
        6, "nvfp4_ds_mla", (), "uint8", None,
        QuantMode.NVFP4_PER_BLOCK, ScaleKind.PER_BLOCK,
    ),
)

_BY_NAME = {n: f for f in FORMATS for n in f.names}
ALL_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def get_format(name: str | CacheFormat, arg: str = "kv_cache_dtype") -> CacheFormat:
    """The format for a name or alias; a ValueError naming `arg` otherwise."""
    if isinstance(name, CacheFormat):
        return name
    if not isinstance(name, str):
        raise ValueError(f"{arg}: expected a format name (str), got {type(name).__name__}")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"{arg}: unknown KV-cache format {name!r}; expected one of: {', '.join(ALL_NAMES)}"
        ) from None


def _check_model_dtype(dtype: torch.dtype) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(
            f"model_dtype: expected one of torch.bfloat16, torch.float16, torch.float32; got {dtype}"
        )
