"""How the tests compare a result with its reference: the SPEC §9 metrics, in one place.

Two error metrics, named by what they measure (they are not interchangeable):

- `rel_fro(got, want)`: ||got - want||_F / ||want||_F in float64, the relative Frobenius
  error SPEC §9 bounds for attention, prefill, W8A8 GEMMs and dequantization
  (bf16 <= 1e-2, fp16 <= 5e-3).
- `rel_mean_abs(got, want)`: mean|got - want| / mean|want| in float64, the metric SPEC §9
  bounds for weight-only GEMMs (< 0.04 against the dequantized reference).

Assertions with a message that says what differed:

- `assert_close_rel(got, want, what, tol=None)`: `rel_fro` within `tol` (default: `REL_TOL`
  by the result's dtype), plus same shape, no NaN and the same infinities as the reference.
- `same_bits(a, b)` / `assert_same_bits`: bit-exact (any NaN matches any NaN);
  `same_bytes(a, b)`: byte-for-byte, NaN payloads included.
- `assert_within_one_ulp`: bit-exact, except 16-bit values may differ by one ulp.

A zero-norm reference (an empty batch, a fully masked output) is guarded: the ratio's
denominator is at least `TINY_NORM`, so equal empty/zero tensors measure 0 and anything else
measures huge; no metric here divides by zero or returns NaN for equal inputs.
"""
from __future__ import annotations

import torch

# The smallest reference norm the metrics divide by (a guard against 0/0, far below any
# norm a random, non-zero test input has).
TINY_NORM = 1e-30

# SPEC §9: relative Frobenius error by compute dtype (fp32: what float32 rounding allows).
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

# One ulp of the 16-bit float types, as a relative tolerance.
ULP_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def rel_fro(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_F / ||want||_F, both in float64 (SPEC §9's relative Frobenius error)."""
    g, w = got.detach().double(), want.detach().double()
    return float((g - w).norm() / w.norm().clamp_min(TINY_NORM))


def rel_mean_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    """mean|got - want| / mean|want|, both in float64 (SPEC §9's weight-only GEMM metric)."""
    g, w = got.detach().double(), want.detach().double()
    return float((g - w).abs().mean() / w.abs().mean().clamp_min(TINY_NORM))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 != 0.0), except that any NaN matches any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous(), b.contiguous()
    if a.dtype.is_floating_point:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality of two tensors of one dtype, NaN payloads included (stricter
    than `same_bits`: for caches whose poison or encoded bytes must survive exactly)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """`same_bits`, or an AssertionError naming `what` and the first row that differs."""
    if same_bits(got, want):
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    bad = (g != w).reshape(got.shape[0], -1).any(1).nonzero().reshape(-1) if got.dim() else torch.tensor([0])
    raise AssertionError(f"{what}: {bad.numel()} rows differ from the reference, the first is row "
                         f"{int(bad[0]) if bad.numel() else '?'}")


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-exact, except 16-bit values may differ by one ulp (the Triton interpreter
    truncates fp32 -> bf16/fp16 stores where the reference rounds to nearest)."""
    if same_bits(got, want) or got.dtype not in ULP_RTOL:
        assert_same_bits(got, want, what)
        return
    g, w = got.float(), want.float()
    if not torch.equal(g.isnan(), w.isnan()) or not torch.allclose(
            g, w, rtol=ULP_RTOL[got.dtype], atol=2.0**-24, equal_nan=True):
        raise AssertionError(f"{what}: differs from the reference by more than one ulp "
                             f"(max |diff| {float((g - w).nan_to_num(0).abs().max()):.3g})")


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, what: str, tol: float | None = None) -> None:
    """`rel_fro(got, want) <= tol` over the reference's finite entries (tol: `REL_TOL` by
    got's dtype unless given), after checking the shapes match, got has no NaN (SPEC §9:
    NaN anywhere fails) and got has the reference's infinities in the same places."""
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if bool(torch.isnan(got).any()):
        raise AssertionError(f"{what}: NaN in the result (SPEC §9: NaN anywhere fails)")
    tol = REL_TOL.get(got.dtype, 1e-5) if tol is None else tol
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(g[~finite], w[~finite]):
        raise AssertionError(f"{what}: infinities differ from the reference")
    g, w = g[finite], w[finite]
    norm = float(w.norm())
    err = float((g - w).norm())
    if err > tol * max(norm, TINY_NORM) and err > TINY_NORM:
        raise AssertionError(f"{what}: relative error {err / max(norm, TINY_NORM):.3g} > {tol:g}")
