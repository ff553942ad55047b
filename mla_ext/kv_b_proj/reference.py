"""Float32 reference for kv_b_proj: bit-level decoders, quantizers and the GEMM.

Everything here is plain torch and runs on the CPU. The decoders work from the
raw bits (not from torch's fp8 casts) so that the tests check torch, Triton and
the checkpoint layouts against one independent definition.

Layouts (SPEC §5):
- fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN;
  largest finite value 448.
- e2m1 (NVFP4 element): 1 sign, 2 exponent (bias 1), 1 mantissa bit; values
  0, 0.5, 1, 1.5, 2, 3, 4, 6. Two per byte, the LOW nibble holds the EVEN
  element along K.
- NVFP4 weight [N, K]: packed uint8 [N, K/2]; one e4m3 scale per 16 values
  along K ([N, K/16]); one fp32 global scale. value = e2m1 * scale * global.
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
FP8_BLOCK = 128

# The eight non-negative e2m1 magnitudes, indexed by the 3 low bits.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_e4m3(bits: torch.Tensor) -> torch.Tensor:
    """fp32 value of each e4m3fn byte (uint8 or float8_e4m3fn tensor)."""
    if bits.dtype == torch.float8_e4m3fn:
        bits = bits.view(torch.uint8)
    b = bits.to(torch.int32)
    sign = torch.where((b >> 7) & 1 == 1, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = (1.0 + man / 8.0) * torch.exp2(exp.to(torch.float32) - 7.0)
    subnormal = (man / 8.0) * 2.0 ** -6
    val = sign * torch.where(exp == 0, subnormal, normal)
    return torch.where((exp == 0xF) & ((b & 0x7) == 0x7), torch.nan, val)


def decode_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """fp32 value of each 4-bit e2m1 code (integer tensor holding 0..15)."""
    n = nibbles.to(torch.int64) & 0xF
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=n.device)
    mag = table[n & 0x7]
    return torch.where((n >> 3) == 1, -mag, mag)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already scaled into [-6, 6]) to the nearest e2m1 code (uint8 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mids = (table[1:] + table[:-1]) / 2
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.bucketize(mag, mids)  # index of the nearest magnitude
    sign = ((x < 0) & (code > 0)).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def unpack_nvfp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> e2m1 codes [N, K]; low nibble is the even element."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_nvfp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [N, K] (K even) -> uint8 [N, K/2]."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def quantize_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest fp32 -> float8_e4m3fn."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def expand_block_scales(scales: torch.Tensor, n: int, k: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """[ceil(n/block), ceil(k/block)] scales -> one scale per element [n, k]."""
    return scales.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


# -- dequantizers (fp32, [N, K]) --------------------------------------------


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [N, K] with a per-tensor [1] or per-channel [N] scale."""
    s = scale.float().reshape(-1)
    s = s.reshape(-1, 1) if s.numel() > 1 else s
    return decode_e4m3(weight) * s


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    n, k = weight.shape
    return decode_e4m3(weight) * expand_block_scales(scale, n, k, block)


def dequant_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    codes = unpack_nvfp4(packed)
    s = decode_e4m3(block_scale).repeat_interleave(NVFP4_BLOCK, 1)[:, : codes.shape[1]]
    return decode_e2m1(codes) * s * global_scale.float().reshape(())


def dequant_int4_grouped(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         group_size: int) -> torch.Tensor:
    """GPTQ-style int32 qweight [K/8, N] (8 nibbles along K per word, lowest first)."""
    k8, n = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [K/8, 8, N]
    q = q.reshape(k8 * 8, n).float()
    z = torch.full_like(scales, 8.0, dtype=torch.float32) if zeros is None else zeros.float()
    z = z.repeat_interleave(group_size, 0)[: k8 * 8]
    s = scales.float().repeat_interleave(group_size, 0)[: k8 * 8]
    return ((q - z) * s).t().contiguous()  # [N, K]


# -- activation quantization and the GEMM ---------------------------------


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = FP8_BLOCK, eps: float = 1e-10):
    """Dynamic 1 x group fp8 quantization: returns (fp8 [M, K], fp32 scales [M, ceil(K/group)]).

    scale = max(amax(group), eps) / 448, q = saturate(x / scale).
    """
    m, k = x.shape
    g = -(-k // group)
    xf = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.float()
    amax = xf.view(m, g, group).abs().amax(dim=-1).clamp(min=eps)
    scale = amax / FP8_E4M3_MAX
    q = quantize_e4m3(xf.view(m, g, group) / scale.unsqueeze(-1)).view(m, g * group)[:, :k]
    return q.contiguous(), scale


def dequant_activation(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of per_token_group_quant_fp8_ref (fp32)."""
    k = q.shape[1]
    return decode_e4m3(q) * scale.float().repeat_interleave(group, 1)[:, :k]


def linear_ref(x: torch.Tensor, w_dequant: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ W [N, K]^T."""
    return x.float() @ w_dequant.float().t()
