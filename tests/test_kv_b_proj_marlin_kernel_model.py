"""A lane-level model of the CUDA Marlin FP8 GEMM (csrc/kv_b_proj/marlin_fp8_gemm.cu).

The CUDA kernel has never run on this project's GPU-less machines, and the CPU
reference GEMM reads the packed layout through a different loop
(`for_each_decoded_column`). This model follows the kernel's own per-lane
steps instead: the warp split of K, the cp.async copies into shared memory (from
vLLM's Marlin layout: tile kt of a panel one qweight row further), the A/B
fragment reads, the mask-and-shift dequant, the per-lane scale runs of the
group-scale epilogue and the cross-warp reduction; the m16n8k16 fragments are turned back into matrices
with the PTX ISA's fragment definitions (not the packing's documentation), so
a kernel whose index math disagrees with the hardware layout fails here.
It also replays the cp.async commit / wait_group bookkeeping of the pipeline.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_ext import _ext
from mla_ext.kv_b_proj.marlin import marlin_fp8_repack

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

WARPS, STAGES, ROWS, TILE_N, TILE_K = 4, 4, 16, 64, 16
LANES = np.arange(32)
G, T = LANES // 4, LANES % 4  # groupID, threadID_in_group


def dequant_word_device(q, act):
    """marlin_fp8.h dequant_word: two 32-bit B registers (b0 from q << 8, b1 from q)."""
    shift = np.uint32(1 if act == torch.float16 else 4)
    q = np.asarray(q, np.uint32)
    regs = []
    for r in ((q << np.uint32(8)).astype(np.uint32), q):
        regs.append((r & np.uint32(0x80008000)) | ((r & np.uint32(0x7F007F00)) >> shift))
    return regs


def halves(reg, act):
    """(low, high) 16-bit halves of a register as float64."""
    lo = (reg & np.uint32(0xFFFF)).astype(np.uint16)
    hi = (reg >> np.uint32(16)).astype(np.uint16)
    dt = torch.float16 if act == torch.float16 else torch.bfloat16

    def dec(h):
        return torch.from_numpy(h.astype(np.int16)).view(dt).double().numpy()

    return dec(lo), dec(hi)


def ptx_a_matrix(a_regs):
    """16x16 A from the 4 per-lane registers (PTX m16n8k16 .f16/.bf16 A fragment)."""
    A = np.full((16, 16), np.nan)
    for i in range(8):  # element a_i lives in register i // 2, half i % 2
        row = G + (0 if (i < 2 or 4 <= i < 6) else 8)
        col = T * 2 + (i & 1) + (8 if i >= 4 else 0)
        A[row, col] = a_regs[i // 2][i % 2]
    assert not np.isnan(A).any()
    return A


def ptx_b_matrix(b_regs):
    """16x8 B (k x n) from the 2 per-lane registers (PTX m16n8k16 B fragment)."""
    B = np.full((16, 8), np.nan)
    for i in range(4):
        row = T * 2 + (i & 1) + (8 if i >= 2 else 0)
        B[row, G] = b_regs[i // 2][i % 2]
    assert not np.isnan(B).any()
    return B


def ptx_d_scatter(D):
    """Per-lane c0..c3 of a 16x8 result (PTX m16n8k16 C/D fragment)."""
    return [D[G + (0 if i < 2 else 8), T * 2 + (i & 1)] for i in range(4)]


def lane_scale_run(grouped, t, r):
    """marlin_fp8.h lane_scale_run / _which / _elem: lane t's scales are two runs of 8."""
    return 16 * t + 8 * r if grouped else 32 * r + 8 * t


def lane_scale_slot(grouped, j, e):
    return (e, j) if grouped else (j // 4, 2 * (j % 4) + e)


def model_gemm(a_bits, act, qweight, scales, M, N, K, group_size):
    """C[M, N] as marlin_fp8_gemm_kernel computes it (float64 arithmetic)."""
    q = qweight.view(-1).numpy().view(np.uint32)
    s = scales.view(-1).double().numpy()  # act-dtype scales, widened exactly
    k_tiles = K // TILE_K
    n_pad = (N + 63) // 64 * 64
    n_tiles = n_pad // TILE_N
    gt = group_size // TILE_K if group_size > 0 else k_tiles
    grouped = 0 < group_size < K
    dt = torch.float16 if act == torch.float16 else torch.bfloat16
    a_f = torch.from_numpy(a_bits.astype(np.int16)).view(dt).double().numpy()  # [M, K]
    a_row, a_col = LANES // 2, (LANES % 2) * 8
    C = np.full((M, N), np.nan)
    for nt in range(n_pad // TILE_N):
        w_lane = nt * 256 + LANES * 8  # tile (0, nt); tile kt is kt * n_tiles * 256 further
        runs = [nt * TILE_N + lane_scale_run(grouped, T, r) for r in (0, 1)]
        for mb in range((M + ROWS - 1) // ROWS):
            red = np.zeros((WARPS, ROWS, TILE_N))
            for warp in range(WARPS):
                my_tiles = (k_tiles - warp + WARPS - 1) // WARPS if k_tiles > warp else 0
                acc = np.zeros((8, 4, 32))
                part = np.zeros((8, 4, 32))
                m = mb * ROWS + a_row
                for i in range(my_tiles):
                    kt = warp + i * WARPS
                    # cp.async: 8 words per lane; 8 A elements per lane (zero-fill past M).
                    sw = q[(w_lane + kt * n_tiles * 256)[:, None] + np.arange(8)]  # [32, 8]
                    sa = np.zeros(ROWS * TILE_K)
                    for lane in range(32):
                        if m[lane] < M:
                            src = a_f[m[lane], kt * TILE_K + a_col[lane]: kt * TILE_K + a_col[lane] + 8]
                            sa[a_row[lane] * TILE_K + a_col[lane]: a_row[lane] * TILE_K + a_col[lane] + 8] = src
                    # A fragment reads, exactly as the kernel indexes shared memory.
                    af = [
                        (sa[G * 16 + 2 * T], sa[G * 16 + 2 * T + 1]),
                        (sa[(G + 8) * 16 + 2 * T], sa[(G + 8) * 16 + 2 * T + 1]),
                        (sa[G * 16 + 2 * T + 8], sa[G * 16 + 2 * T + 9]),
                        (sa[(G + 8) * 16 + 2 * T + 8], sa[(G + 8) * 16 + 2 * T + 9]),
                    ]
                    A = ptx_a_matrix(af)
                    for j in range(8):
                        b = [halves(r, act) for r in dequant_word_device(sw[:, j], act)]
                        D = A @ ptx_b_matrix(b)
                        for e, v in enumerate(ptx_d_scatter(D)):
                            part[j, e] += v
                    if i + 1 == my_tiles or (kt + WARPS) // gt != kt // gt:
                        sc = [s[((kt // gt) * n_pad + run)[:, None] + np.arange(8)] for run in runs]  # 2x[32, 8]
                        for j in range(8):
                            for e in range(4):
                                which, el = lane_scale_slot(grouped, j, e & 1)
                                acc[j, e] += part[j, e] * sc[which][:, el]
                        part[:] = 0.0
                for j in range(8):
                    col = j * 8 + 2 * T
                    red[warp, G, col] = acc[j, 0]
                    red[warp, G, col + 1] = acc[j, 1]
                    red[warp, G + 8, col] = acc[j, 2]
                    red[warp, G + 8, col + 1] = acc[j, 3]
            tot = red.sum(0)
            for r in range(ROWS):
                mm = mb * ROWS + r
                if mm < M:
                    cols = nt * TILE_N + np.arange(TILE_N)
                    ok = cols < N
                    C[mm, cols[ok]] = tot[r, ok]
    return C


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,group_size", [(5, 72, 256, 128), (17, 64, 48, -1), (11, 130, 384, -1),
                                              (3, 128, 128, 128)])
def test_kernel_model_matches_dense_reference(act, M, N, K, group_size):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    w = (torch.randn(N, K, generator=gen) * 60).clamp(-440, 440).to(torch.float8_e4m3fn)
    sshape = (N,) if group_size == -1 else (K // 128, N)
    scales = torch.rand(sshape, generator=gen) * 0.02 + 1e-3
    a = torch.randn(M, K, generator=gen).to(act)
    packed = marlin_fp8_repack(w, scales, act, group_size)
    C = model_gemm(a.view(torch.int16).numpy(), act, packed.qweight, packed.scales, M, N, K, group_size)
    # The scales the packed weight holds: scale * 2^fold rounded to `act`, / 2^fold.
    fold = 2.0 ** (8 if act == torch.float16 else 120)
    held = (scales * fold).to(act).double() / fold
    wd = w.double() * (held[:, None] if group_size == -1 else held.repeat_interleave(128, 0).t())
    ref = a.double().numpy() @ wd.numpy().T
    assert not np.isnan(C).any(), "an output element was never written"
    np.testing.assert_allclose(C, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


@pytest.mark.parametrize("my_tiles", range(0, 11))
def test_cp_async_pipeline_bookkeeping(my_tiles):
    """Replays the kernel's issue / commit / wait_group<STAGES-1> sequence: tile i's
    copies are complete when it is consumed, and no stage is refilled before the
    (warp-synchronised) iteration that read it has finished."""
    groups = []  # committed groups: list of tile ids
    pending = []
    stage_of = {}
    last_read = {}  # stage -> iteration that last read it

    def issue(i):
        st = i % STAGES
        if st in last_read:
            assert last_read[st] < current, "stage refilled while its tile is still being read"
        stage_of[i] = st
        pending.append(i)

    def commit():
        groups.append(list(pending))
        pending.clear()

    current = -1
    for s in range(STAGES - 1):
        if s < my_tiles:
            issue(s)
        commit()
    for i in range(my_tiles):
        current = i
        if i + STAGES - 1 < my_tiles:
            issue(i + STAGES - 1)
        commit()
        done = groups[: len(groups) - (STAGES - 1)]  # wait_group N: all but the newest N complete
        assert any(i in g for g in done), f"tile {i} consumed before its cp.async group completed"
        last_read[stage_of[i]] = i
