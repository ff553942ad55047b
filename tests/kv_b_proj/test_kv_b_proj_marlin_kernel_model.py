"""A lane-level model of the CUDA Marlin FP8 GEMM (csrc/kv_b_proj/marlin_fp8_gemm.cu).

The CUDA kernel has never run on this project's GPU-less machines, and the CPU
reference GEMM reads the packed layout through a different loop
(`for_each_decoded_column`). This model follows the kernel's own per-lane
steps instead: the split-K slices, the swizzled cp.async copies into shared
memory (from vLLM's Marlin layout), the ldmatrix A reads and B fragment reads,
the mask-and-shift dequant and the group-scale epilogue; the m16n8k16 fragments
are turned back into matrices with the PTX ISA's fragment definitions (not the
packing's documentation), so a kernel whose index math disagrees with the
hardware layout fails here. It also replays the cp.async commit / wait_group
bookkeeping of the pipeline.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_ext import _ext
from mla_ext.kv_b_proj.marlin import marlin_fp8_repack

pytestmark = pytest.mark.skipif(not _ext.available(), reason="mla_ext._C is not built")

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


# ---------------------------------------------------------------------------
# The kernel: split-K, 16*mb x 32*ws CTA tiles, warps split the columns, one
# swizzled CTA-wide cp.async pipeline
# ---------------------------------------------------------------------------

GEMM_THREADS, GEMM_STAGES, GEMM_KT = 128, 4, 2  # kThreads, kStages, kStageTiles


def swz(h, r):
    """16-byte chunk slot of chunk h of row / lane r (marlin_fp8_gemm.cu swz)."""
    return h ^ ((np.asarray(r) >> 2) & 1)


def gemm_scale_base(grouped, jb, t):
    return 16 * t + jb if grouped else 8 * t + 32 * (jb // 4) + 2 * (jb % 4)


def gemm_scale_off(grouped, j, e):
    return 8 * e + j if grouped else 32 * (j // 4) + 2 * (j % 4) + e


def ldmatrix_x4(smem_rows, addr_of_lane):
    """PTX ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the 8 row addresses of matrix i
    (`addr_of_lane(lane)` -> the row's 8 values); register i of lane L holds
    (row L/4, columns 2(L%4), +1) of matrix i. Returns regs[i] = (lo, hi) per lane."""
    mats = [np.stack([addr_of_lane(8 * i + r) for r in range(8)]) for i in range(4)]  # 4 x [8, 8]
    return [(mats[i][G, 2 * T], mats[i][G, 2 * T + 1]) for i in range(4)]


def model_gemm(a_bits, act, qweight, scales, M, N, K, group_size, plan, events=None):
    """C[M, N] as marlin_fp8_gemm_kernel computes it under `plan` (a
    marlin.GemmPlan), float64 arithmetic. `events` (a list) records the
    copies and reads of each stage slot, for the ordering checks."""
    q = qweight.view(-1).numpy().view(np.uint32)
    s_flat = scales.view(-1).double().numpy()
    dt = torch.float16 if act == torch.float16 else torch.bfloat16
    a_f = torch.from_numpy(a_bits.astype(np.int16)).view(dt).double().numpy()
    mb_n, ws_n = plan.mb, plan.ws
    np_, rows_t, cols = ws_n // 2, 16 * mb_n, 32 * ws_n
    wpp = 8 // ws_n
    n_pad = (N + 63) // 64 * 64
    n_tiles, k_tiles = n_pad // 64, K // 16
    gt = group_size // 16 if group_size > 0 else k_tiles
    grouped = 0 < group_size < K
    tiles = plan.n_ctiles * plan.m_tiles
    kacc = mb_n * ws_n * 4
    workspace = np.full(plan.split * tiles * kacc * GEMM_THREADS, np.nan)
    counters = np.zeros(tiles, np.int64)
    C = np.full((M, N), np.nan)
    tid = np.arange(GEMM_THREADS)
    # CTAs in an arbitrary order: the ordered reduction must not depend on it.
    rng = np.random.default_rng(M * 7 + N)
    ctas = [(n_ct, mt, sl) for n_ct in range(plan.n_ctiles) for mt in range(plan.m_tiles)
            for sl in range(plan.split)]
    for idx in rng.permutation(len(ctas)):
        n_ct, mt, sl = ctas[idx]
        kt0 = sl * plan.slice_tiles
        kt1 = min(kt0 + plan.slice_tiles, k_tiles)
        n_stages = -(-(kt1 - kt0) // GEMM_KT) if kt1 > kt0 else 0

        def group_end(kt):
            return kt + 1 == kt1 or (kt + 1) % gt == 0

        smem = [dict(w=np.full((GEMM_KT, np_, 256), 0xDEADBEEF, np.uint32), a=np.full((GEMM_KT, rows_t, 16), np.nan),
                     s=np.full(cols, np.nan), s_group=None) for _ in range(GEMM_STAGES)]

        def issue(i, st):
            stage = smem[st]
            stage["s_group"] = None
            if events is not None:
                events.append(("copy", (n_ct, mt, sl), st, i))
            for kk in range(GEMM_KT):
                kt = kt0 + i * GEMM_KT + kk
                if kt >= kt1:
                    break
                for qq in range(-(-np_ * 64 // GEMM_THREADS)):  # weight chunks tid + 128 q
                    c = tid + qq * GEMM_THREADS
                    for ci in c[c < np_ * 64]:
                        pp, lane, h = ci // 64, (ci % 64) // 2, ci % 2
                        panel = n_ct * np_ + pp
                        dst = slice(lane * 8 + 4 * swz(h, lane), lane * 8 + 4 * swz(h, lane) + 4)
                        if panel < n_tiles:
                            src = (kt * n_tiles + panel) * 256 + lane * 8 + 4 * h
                            stage["w"][kk, pp, dst] = q[src:src + 4]
                        else:
                            stage["w"][kk, pp, dst] = 0
                for ci in tid[tid < rows_t * 2]:  # A: chunk (row, half)
                    r, h = ci // 2, ci % 2
                    m = mt * rows_t + r
                    vals = a_f[m, kt * 16 + 8 * h: kt * 16 + 8 * h + 8] if m < M else np.zeros(8)
                    stage["a"][kk, r, 8 * swz(h, r): 8 * swz(h, r) + 8] = vals
                if group_end(kt):
                    assert stage["s_group"] is None, "two scale-group ends in one stage (one scale slot)"
                    stage["s_group"] = kt // gt
                    for ci in tid[tid < cols // 8]:
                        ok = n_ct * np_ + ci // 8 < n_tiles
                        src = (kt // gt) * n_pad + n_ct * cols + 8 * ci
                        stage["s"][8 * ci: 8 * ci + 8] = s_flat[src:src + 8] if ok else 0.0

        for i in range(GEMM_STAGES - 1):
            if i < n_stages:
                issue(i, i)
        acc = np.zeros((4, mb_n, ws_n, 4, 32))  # [warp, mb, j, e, lane]
        part = np.zeros_like(acc)
        for i in range(n_stages):
            if i + GEMM_STAGES - 1 < n_stages:
                issue(i + GEMM_STAGES - 1, (i + GEMM_STAGES - 1) % GEMM_STAGES)
            stage = smem[i % GEMM_STAGES]
            if events is not None:
                events.append(("read", (n_ct, mt, sl), i % GEMM_STAGES, i))
            for kk in range(GEMM_KT):
                kt = kt0 + i * GEMM_KT + kk
                if kt >= kt1:
                    break
                for warp in range(4):
                    pw, jb = warp // wpp, (warp % wpp) * ws_n
                    wl = stage["w"][kk, pw]
                    base = LANES * 8
                    if ws_n == 8:
                        words = np.concatenate([wl[(base + 4 * swz(0, LANES))[:, None] + np.arange(4)],
                                                wl[(base + 4 * swz(1, LANES))[:, None] + np.arange(4)]], 1)
                    elif ws_n == 4:
                        words = wl[(base + 4 * swz(jb // 4, LANES))[:, None] + np.arange(4)]
                    else:
                        words = wl[(base + 4 * swz(jb // 4, LANES) + jb % 4)[:, None] + np.arange(2)]
                    for mb in range(mb_n):
                        def row_vals(lane, mb=mb):
                            r = mb * 16 + lane % 8 + 8 * ((lane // 8) % 2)
                            c0 = 8 * swz(lane // 16, r)
                            return stage["a"][kk, r, c0:c0 + 8]
                        A = ptx_a_matrix(ldmatrix_x4(stage["a"], row_vals))
                        for j in range(ws_n):
                            b = [halves(r, act) for r in dequant_word_device(words[:, j], act)]
                            D = A @ ptx_b_matrix(b)
                            tgt = part if grouped else acc
                            for e, v in enumerate(ptx_d_scatter(D)):
                                tgt[warp, mb, j, e] += v
                    if group_end(kt):
                        assert stage["s_group"] == kt // gt, "the stage's scale row is not this group's"
                        sbase = pw * 64 + gemm_scale_base(grouped, jb, T)
                        for j in range(ws_n):
                            for e in range(4):
                                pos = sbase + gemm_scale_off(grouped, j, e & 1)
                                want = pw * 64 + np.array([scale_pos(8 * (jb + j) + 2 * t + (e & 1), grouped)
                                                           for t in T])
                                assert np.array_equal(pos, want), "scale_base + scale_off != scale_pos"
                                sc = stage["s"][pos]
                                if grouped:
                                    acc[warp, :, j, e] += part[warp, :, j, e] * sc
                                    part[warp, :, j, e] = 0.0
                                else:
                                    acc[warp, :, j, e] *= sc
        # Thread-major accumulators: thread = warp * 32 + lane, element (mb * ws + j) * 4 + e.
        acc_t = acc.transpose(1, 2, 3, 0, 4).reshape(kacc, GEMM_THREADS)
        if plan.split > 1:
            tile = mt * plan.n_ctiles + n_ct
            base_ws = (sl * tiles + tile) * kacc * GEMM_THREADS
            workspace[base_ws + np.arange(kacc)[:, None] * GEMM_THREADS + tid[None, :]] = acc_t
            ticket = counters[tile]
            counters[tile] += 1
            if ticket != plan.split - 1:
                continue
            counters[tile] = 0
            out = np.zeros_like(acc_t)
            for s2 in range(plan.split):
                got = workspace[(s2 * tiles + tile) * kacc * GEMM_THREADS
                                + np.arange(kacc)[:, None] * GEMM_THREADS + tid[None, :]]
                assert not np.isnan(got).any(), "a slice's partial was read before it was written"
                out = out + got
            acc_t = out
        acc = acc_t.reshape(mb_n, ws_n, 4, 4, 32).transpose(3, 0, 1, 2, 4)
        for warp in range(4):
            pw, jb = warp // wpp, (warp % wpp) * ws_n
            col0 = (n_ct * np_ + pw) * 64 + 8 * jb + 2 * T
            for mb in range(mb_n):
                for j in range(ws_n):
                    for e in range(4):
                        row = mt * rows_t + mb * 16 + G + (8 if e >= 2 else 0)
                        col = col0 + 8 * j + (e & 1)
                        ok = (row < M) & (col < N)
                        C[row[ok], col[ok]] = acc[warp, mb, j, e][ok]
    assert not counters.any(), "a tile counter was left non-zero"
    return C


def scale_pos(c, grouped):
    from mla_ext.kv_b_proj.marlin import scale_position

    return scale_position(c, grouped)


def _dense_case(M, N, K, group_size, act, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * 60).clamp(-440, 440).to(torch.float8_e4m3fn)
    sshape = (N,) if group_size == -1 else (K // 128, N)
    scales = torch.rand(sshape, generator=gen) * 0.02 + 1e-3
    a = torch.randn(M, K, generator=gen).to(act)
    packed = marlin_fp8_repack(w, scales, act, group_size)
    fold = 2.0 ** (8 if act == torch.float16 else 120)
    held = (scales * fold).to(act).double() / fold
    wd = w.double() * (held[:, None] if group_size == -1 else held.repeat_interleave(128, 0).t())
    return a, packed, a.double().numpy() @ wd.numpy().T


# Every tiling ((mb, ws) by M and scale kind), ragged N (not a multiple of
# the CTA's columns), odd k-tile counts, and 1, several or automatic slices.
GEMM_CASES = [
    # M, N, K, group_size, split_k, sm_count
    (5, 200, 256, 128, 0, 132),    # mb 1 ws 8, grouped, auto split (slices inside groups)
    (16, 72, 512, -1, 3, 0),       # mb 1 ws 8, per-channel, 3 slices of 12 k-tiles
    (20, 136, 384, 128, 2, 0),     # mb 2 ws 4, grouped, 2 slices
    (31, 264, 48, -1, 0, 0),       # mb 2 ws 8, per-channel, K = 3 k-tiles (odd, one slice)
    (40, 130, 256, 128, 0, 132),   # mb 4 ws 2, grouped, auto
    (70, 72, 128, 128, 4, 0),      # mb 4 ws 4 (one group: per-channel permutation), 2 row tiles
    (3, 64, 16, -1, 0, 132),       # K = 16: one k-tile, no split possible
]


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,group_size,split_k,sms", GEMM_CASES)
def test_gemm_kernel_model_matches_dense_reference(act, M, N, K, group_size, split_k, sms):
    from mla_ext.kv_b_proj.marlin import plan_gemm

    a, packed, ref = _dense_case(M, N, K, group_size, act, seed=M * 1000 + N + K)
    plan = plan_gemm(M, N, K, group_size, sms, split_k)
    C = model_gemm(a.view(torch.int16).numpy(), act, packed.qweight, packed.scales, M, N, K, group_size, plan)
    assert not np.isnan(C).any(), "an output element was never written"
    np.testing.assert_allclose(C, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def test_gemm_cases_cover_every_tiling_and_a_split():
    from mla_ext.kv_b_proj.marlin import plan_gemm

    plans = [plan_gemm(M, N, K, g, sms, s) for M, N, K, g, s, sms in GEMM_CASES]
    tilings = {(p.mb, p.ws, 0 < g < K) for p, (M, N, K, g, s, sms) in zip(plans, GEMM_CASES)}
    assert tilings >= {(1, 8, True), (2, 4, True), (4, 2, True), (1, 8, False), (2, 8, False), (4, 4, False)}
    assert any(p.split > 2 for p in plans) and any(p.split == 1 for p in plans)
    assert any(p.slice_tiles % 8 for p, c in zip(plans, GEMM_CASES) if p.split > 1 and c[3] == 128)


@pytest.mark.parametrize("M,N,K,group_size,split_k", [(9, 136, 512, 128, 5), (33, 200, 256, -1, 3)])
def test_gemm_stage_slots_are_read_after_their_copy_and_refilled_after_their_read(M, N, K, group_size, split_k):
    """Replays the model's copy/read events per CTA against the kernel's ordering:
    a slot's k-tile is read after it was copied and before it is copied again."""
    from mla_ext.kv_b_proj.marlin import plan_gemm

    a, packed, _ = _dense_case(M, N, K, group_size, torch.bfloat16, seed=3)
    plan = plan_gemm(M, N, K, group_size, 0, split_k)
    events = []
    model_gemm(a.view(torch.int16).numpy(), torch.bfloat16, packed.qweight, packed.scales, M, N, K,
                  group_size, plan, events)
    last_copy, read = {}, set()
    for kind, cta, slot, stage in events:
        if kind == "copy":
            prev = last_copy.get((cta, slot))
            assert prev is None or (cta, prev) in read, f"slot {slot} of {cta} refilled before stage {prev} was read"
            last_copy[(cta, slot)] = stage
        else:
            assert last_copy.get((cta, slot)) == stage, f"stage {stage} read from slot {slot} of {cta} before its copy"
            read.add((cta, stage))
    stages = -(-plan.slice_tiles // GEMM_KT)
    assert plan.split > 2 and len(read) >= plan.n_ctiles * plan.m_tiles * (plan.split - 1) * stages


@pytest.mark.parametrize("n_stages", range(0, 11))
def test_gemm_pipeline_bookkeeping(n_stages):
    """The loop: prologue issues stages 0..S-2 (one commit each), then per
    stage i: wait_group<S-2>, __syncthreads, issue stage i+S-1 into slot
    (i-1) % S, commit, compute slot i % S. Stage i's group is complete when it
    is read, and a slot is refilled only after the barrier that follows its read."""
    S = GEMM_STAGES
    groups, pending, slot_reader = [], [], {}
    for i in range(S - 1):
        if i < n_stages:
            pending.append(i)
        groups.append(list(pending))
        pending.clear()
    for i in range(n_stages):
        done = groups[: len(groups) - (S - 2)]  # wait_group<S-2>
        assert any(i in g for g in done), f"stage {i} read before its copies completed"
        # __syncthreads: every warp finished iteration i-1 (its reads of slot (i-1) % S).
        if i + S - 1 < n_stages:
            slot = (i + S - 1) % S
            assert slot_reader.get(slot, -1) < i, "slot refilled while it may still be read"
            pending.append(i + S - 1)
        groups.append(list(pending))
        pending.clear()
        slot_reader[i % S] = i


_PLAN_MAIN = r"""
#include <cstdio>
#include "kv_b_proj/marlin_fp8.h"
int main() {
  using namespace mla_ext::marlin_fp8;
  long long m, n, k, g, sms, s;
  while (std::scanf("%lld %lld %lld %lld %lld %lld", &m, &n, &k, &g, &sms, &s) == 6) {
    const GemmPlan p = plan_gemm(m, n, k, g, sms, s);
    std::printf("%d %d %lld %lld %lld %lld %lld %lld %lld\n", p.tiling.mb, p.tiling.ws, (long long)p.n_ctiles,
                (long long)p.m_tiles, (long long)p.k_tiles, (long long)p.split, (long long)p.slice_tiles,
                (long long)p.workspace_floats, (long long)p.counters);
  }
}
"""


def test_gemm_plan_mirror_equals_the_header(tmp_path):
    """mla_ext.kv_b_proj.marlin.plan_gemm (used by this model and the benchmark) is
    plan_gemm of csrc/kv_b_proj/marlin_fp8.h (used by the op), over a grid of shapes."""
    import shutil
    import subprocess

    from mla_ext.kv_b_proj.marlin import plan_gemm

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    src = tmp_path / "plan.cpp"
    src.write_text(_PLAN_MAIN)
    exe = tmp_path / "plan"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{root / 'csrc'}", str(src), "-o", str(exe)], check=True)
    cases = [(m, n, k, g, sms, s) for m in (1, 16, 17, 32, 33, 64, 65, 128, 300, 5_000_000)
             for n, k, g in ((4096, 512, 128), (4096, 512, -1), (32768, 512, 128), (200, 48, -1), (64, 16, -1),
                             (576, 128, 128), (1000, 1024, 128))
             for sms in (0, 72, 132) for s in (0, 1, 3, 64)]
    out = subprocess.run([str(exe)], input="\n".join(" ".join(map(str, c)) for c in cases), text=True,
                         capture_output=True, check=True).stdout.split("\n")
    assert len(out) == len(cases) + 1
    for case, line in zip(cases, out):
        p = plan_gemm(*case)
        want = [p.mb, p.ws, p.n_ctiles, p.m_tiles, p.k_tiles, p.split, p.slice_tiles, p.workspace_floats,
                p.counters]
        assert [int(x) for x in line.split()] == want, case
        assert p.split == 1 or (p.slice_tiles % GEMM_KT == 0 and (p.split - 1) * p.slice_tiles < p.k_tiles), case
    # The slice count alone fixes the slicing (the CPU reference is asked for the split a GPU plan chose).
    for kt in range(1, 130):
        for s in range(0, 65):
            p = plan_gemm(16, 4096, 16 * kt, -1, 132, s)
            q = plan_gemm(16, 4096, 16 * kt, -1, 0, p.split)
            assert (q.split, q.slice_tiles) == (p.split, p.slice_tiles), (kt, s)
    # DeepSeek-V3 TP8 (N = 4096, K = 512) at M <= 16 on an H200 (132 SMs): 4 slices, 64 CTAs
    # (8 would move 4 MB of partials through L2 for 2 MB of weights).
    p = plan_gemm(16, 4096, 512, 128, 132)
    assert (p.n_ctiles * p.m_tiles * p.split, p.split) == (64, 4)
    # No automatic split moves more bytes in its reduction than the weight holds.
    for case in cases:
        p = plan_gemm(*case)
        if case[-1] == 0 and p.split > 1:
            m, n, k = case[:3]
            assert 2 * p.workspace_floats * 4 <= -(-n // 64) * 64 * k, case
