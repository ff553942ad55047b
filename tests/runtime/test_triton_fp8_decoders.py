"""The integer-only fp8 / fp4 decoders every Triton loader uses (mla_ext/triton_fp8.py), on
every code, against torch's own float8 types and the e2m1 value table (interpreter)."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mla_ext.triton_fp8 import e2m1_to_f32, e2m1_to_f32_over_16384, e4m3_to_f32, e5m2_to_f32, launch_guard  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@triton.jit
def _decode_kernel(x_ptr, o_ptr, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    c = tl.load(x_ptr + i).to(tl.int32)
    if WHICH == 0:
        v = e4m3_to_f32(c)
    elif WHICH == 1:
        v = e5m2_to_f32(c)
    elif WHICH == 2:
        v = e2m1_to_f32(c & 15)
    else:
        v = e2m1_to_f32_over_16384(c & 15) * 16384.0
    tl.store(o_ptr + i, v)


def _decode(which: int) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.full((256,), float("nan"))
    with launch_guard(codes):
        _decode_kernel[(1,)](codes, out, WHICH=which, BLOCK=256)
    return out


@pytest.mark.parametrize("which,dtype", [(0, torch.float8_e4m3fn), (1, torch.float8_e5m2)])
def test_fp8_decoders_equal_torch_on_every_code(which, dtype):
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    got = _decode(which)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert same.all(), torch.nonzero(~same).flatten().tolist()
    assert torch.equal(torch.signbit(got[~torch.isnan(got)]), torch.signbit(want[~torch.isnan(want)]))


@pytest.mark.parametrize("which", [2, 3])
def test_e2m1_decoders_equal_the_value_table_with_signed_zero(which):
    got = _decode(which)[:16]
    want = torch.tensor(E2M1)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
