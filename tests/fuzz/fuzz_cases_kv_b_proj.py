"""Fuzz cases of kv_b_proj (SPEC §5): the layer (KvBProj and its forward), the
weight formats, formats read from modules, tensor-parallel shards, the
activation-dtype policy and the raw Marlin ops.

References: the bit-level decoders and the fp32 GEMM of
mla_ext.kv_b_proj.reference. A Marlin weight is checked against the fp8
weight and scales it was packed from (its own dequantizer is the code under
test), dense results within the SPEC §9 relative error, quantized ones within
mean|out - ref| / mean|ref| < 0.04 of the dequantized reference.
"""
from __future__ import annotations

import functools
import types

import numpy as np
import torch

from fuzz_harness import QUICK, Call, add, report_rows_case
from helpers.numeric import assert_close_rel, rel_mean_abs
from mla_ext.compat import cpu_rowwise_scaled_mm_reasons
from mla_ext.kv_b_proj import from_module, input_dtype, linear, shard
from mla_ext.kv_b_proj import reference as ref
from mla_ext.kv_b_proj import weights as W
from mla_ext.config.models import MLAModelConfig

BF16, F32 = torch.bfloat16, torch.float32
E4M3 = torch.float8_e4m3fn
META = torch.device("meta")
N, K = 96, 128

LIN = "mla_ext.kv_b_proj.linear"
KVB = f"{LIN}:KvBProj"
WTS = "mla_ext.kv_b_proj.weights"
FROM = "mla_ext.kv_b_proj.from_module:weight_format_from_module"
SHARD = "mla_ext.kv_b_proj.shard"
ROWS = "mla_ext.kv_b_proj.rows"
IDT = "mla_ext.kv_b_proj.input_dtype"
OPS = "torch.ops.mla_ext"


def _fail(msg: str):
    raise AssertionError(msg)


def _w(seed: int = 5, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / 10


def _x(m: int = 5, dtype=BF16, seed: int = 6) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fp8_source(kind: str, w: torch.Tensor):
    """(fp8 format, its independent fp32 dequantization) for a Marlin source."""
    if kind == "block":
        f = W.Fp8BlockWeight.from_dense(w, BF16)
        return f, ref.dequant_fp8_block(f.weight, f.weight_scale_inv)
    f = W.Fp8Weight.from_dense(w, per_channel=True, params_dtype=BF16)
    return f, ref.dequant_fp8(f.weight, f.weight_scale)


def independent_dequant(fmt: W.WeightFormat) -> torch.Tensor:
    """fp32 [N, K] of a format from the reference decoders (not from the format's own code)."""
    if isinstance(fmt, W.DenseWeight):
        return fmt.weight.float()
    if isinstance(fmt, W.Fp8Weight):
        return ref.dequant_fp8(fmt.weight, fmt.weight_scale)
    if isinstance(fmt, W.Fp8BlockWeight):
        return ref.dequant_fp8_block(fmt.weight, fmt.weight_scale_inv)
    if isinstance(fmt, W.Nvfp4Weight):
        return ref.dequant_nvfp4(fmt.weight, fmt.weight_scale, fmt.weight_scale_2)
    if isinstance(fmt, W.Int4GroupWeight):
        return ref.dequant_int4_grouped(fmt.qweight, fmt.scales, fmt.zeros, fmt.group_size)
    raise AssertionError(f"no independent decoder for {type(fmt).__name__}")


def make_format(kind: str, w: torch.Tensor | None = None):
    """(format, fp32 reference weight) of a weight-format kind."""
    w = _w() if w is None else w
    if kind == "marlin_fp8":
        src, want = fp8_source("channel", w)
        return W.MarlinFp8Weight.from_fp8(src), want
    if kind == "marlin_fp8_g128":
        src, want = fp8_source("block", w)
        return W.MarlinFp8Weight.from_fp8(src), want
    fmt = W.quantize(kind, w, BF16)
    return fmt, independent_dequant(fmt)


KINDS = ("dense", "fp8_per_tensor", "fp8_per_channel", "fp8_block", "marlin_fp8", "marlin_fp8_g128", "nvfp4",
         "int4_group")


def assert_linear(y: torch.Tensor, x: torch.Tensor, w_ref: torch.Tensor, dense: bool, what: str = "y",
                  x_scale=None) -> None:
    xf = ref.decode_e4m3(x) * (1.0 if x_scale is None else float(x_scale)) if x.dtype == E4M3 else x.float()
    want = xf.double() @ w_ref.double().t()
    if want.numel() == 0:
        assert tuple(y.shape) == tuple(want.shape), f"{what}: shape {tuple(y.shape)}, want {tuple(want.shape)}"
        return
    if dense:
        assert_close_rel(y, want, what)
        return
    assert not bool(torch.isnan(y).any()), f"{what}: NaN (SPEC §9)"
    err = rel_mean_abs(y, want)
    assert err < 0.04, f"{what}: mean relative error {err:.3g} >= 0.04 (SPEC §9)"


# ---------------------------------------------------------------------------
# KvBProj and its forward
# ---------------------------------------------------------------------------

def forward_case(kind: str = "dense", *, m: int = 5, backend: str | None = None, mutate=None, x_kw=None,
                 expect: str = "accept"):
    def build(g):
        fmt, w_ref = make_format(kind, g.put(_w(), "w"))
        layer = linear.KvBProj(fmt)
        a = dict(x=g.put(_x(m), "x", **(x_kw or {})), x_scale=None, out=None)
        if mutate is not None:
            mutate(g, a, layer)

        def fn():
            with linear.DISPATCH.force(backend):
                return layer(a["x"], a["x_scale"], a["out"])

        def check(y):
            assert y.dtype == layer.params_dtype and tuple(y.shape) == (a["x"].shape[0], N), \
                f"y: {y.dtype} {tuple(y.shape)}"
            if a["out"] is not None:
                assert y.data_ptr() == a["out"].data_ptr(), "y is not `out`"
            assert_linear(y, a["x"], w_ref, kind == "dense", x_scale=a["x_scale"])
        return Call(fn, check if expect != "reject" else None)
    return build


def F(name, expect="accept", args=(), **kw):
    add(KVB, name, forward_case(expect=expect, **kw), expect, args, also=(f"{KVB}.forward",))


for _k in KINDS:
    F(f"valid_{_k}", kind=_k)
FORCED = [("marlin_w8a16", "marlin_fp8"), ("marlin_w8a16", "marlin_fp8_g128"), ("triton_w4a16", "nvfp4"),
          ("triton_fp8_block", "fp8_block")]
if not cpu_rowwise_scaled_mm_reasons():  # torch 2.11's CPU _scaled_mm is per-tensor only (the backend says so)
    FORCED.append(("scaled_mm_fp8", "fp8_per_tensor"))
for _b, _k in FORCED:
    F(f"forced_{_b}_{_k}", kind=_k, backend=_b)
F("zero_rows", m=0)
F("workspace_row_stride", kind="fp8_block", x_kw=dict(pad=64, misalign=1))
F("marlin_row_stride", kind="marlin_fp8", backend="marlin_w8a16", x_kw=dict(pad=8, misalign=1))


def _fp8_x(g, a, layer):
    a["x"] = g.put(ref.quantize_e4m3(_x().float() * 4), "x8")
    a["x_scale"] = g.put(torch.tensor([0.25]), "x_scale")


F("fp8_activation_with_scale", kind="fp8_block", mutate=_fp8_x)
F("fp8_activation_triton", kind="fp8_block", mutate=_fp8_x, backend="triton_fp8_block")
F("out_given", mutate=lambda g, a, l: a.update(out=g.put(torch.zeros(5, N, dtype=BF16), "out", writable=True)))
F("x_last_dim_strided", "either", ("x",), kind="fp8_block",
  mutate=lambda g, a, l: a.update(x=g.put(a["x"], "x2", strides=(2 * K, 2))))
F("x_wrong_dtype", "reject", ("x",), mutate=lambda g, a, l: a.update(x=a["x"].float()))
F("x_wrong_k", "reject", ("x",), mutate=lambda g, a, l: a.update(x=a["x"][:, :64]))
F("x_1d", "reject", ("x",), mutate=lambda g, a, l: a.update(x=a["x"][0]))
F("x_not_a_tensor", "reject", ("x",), mutate=lambda g, a, l: a.update(x=[[0.0] * K]))
F("x_on_meta", "reject", ("x",), mutate=lambda g, a, l: a.update(x=a["x"].to(META)))
F("x_fp8_for_dense", "reject", ("x",), mutate=lambda g, a, l: a.update(x=a["x"].to(E4M3)))
F("x_fp8_for_nvfp4", "reject", ("x",), kind="nvfp4", mutate=lambda g, a, l: a.update(x=a["x"].to(E4M3)))
for _label, _v in (("nan", float("nan")), ("zero", 0.0), ("negative", -1.0), ("inf", float("inf"))):
    F(f"x_scale_{_label}", "reject", ("x_scale",), kind="fp8_block",
      mutate=lambda g, a, l, v=_v: (_fp8_x(g, a, l), a["x_scale"].fill_(v)))
F("x_scale_two_elements", "reject", ("x_scale",), kind="fp8_block",
  mutate=lambda g, a, l: (_fp8_x(g, a, l), a.update(x_scale=torch.tensor([1.0, 1.0]))))
F("x_scale_per_row_wrong_rows", "reject", ("x_scale",), kind="fp8_block",  # per-row scales are [M, 1]
  mutate=lambda g, a, l: (_fp8_x(g, a, l), a.update(x_scale=torch.ones(a["x"].shape[0] + 1, 1))))
F("x_scale_int", "reject", ("x_scale",), kind="fp8_block",
  mutate=lambda g, a, l: (_fp8_x(g, a, l), a.update(x_scale=torch.tensor([1]))))
F("x_scale_python_float", "reject", ("x_scale",), kind="fp8_block",
  mutate=lambda g, a, l: (_fp8_x(g, a, l), a.update(x_scale=0.5)))
F("x_scale_on_meta", "reject", ("x_scale",), kind="fp8_block",
  mutate=lambda g, a, l: (_fp8_x(g, a, l), a.update(x_scale=a["x_scale"].to(META))))
F("out_wrong_shape", "reject", ("out",),
  mutate=lambda g, a, l: a.update(out=g.put(torch.zeros(4, N, dtype=BF16), "out", writable=True)))
F("out_wrong_dtype", "reject", ("out",),
  mutate=lambda g, a, l: a.update(out=g.put(torch.zeros(5, N), "out", writable=True)))
F("out_not_a_tensor", "reject", ("out",), mutate=lambda g, a, l: a.update(out=[[0.0]]))
F("out_expanded", "reject", ("out",),
  mutate=lambda g, a, l: a.update(out=g.put(torch.zeros(1, N, dtype=BF16), "out", writable=True).expand(5, N)))


def _out_over_x(g, a, layer):
    buf = g.put(torch.zeros(5, N + K, dtype=BF16), "x_and_out", writable=True)
    buf[:, :K].copy_(_x())
    a.update(x=buf[:, :K], out=buf[:, K - 32:K - 32 + N])
F("out_overlaps_x", "either", ("out", "x"), mutate=_out_over_x)


def _kvb_ctor(value_fn, expect="reject", args=("weight_format",)):
    def build(g):
        value = value_fn()

        def check(layer):
            assert isinstance(layer, linear.KvBProj) and (layer.N, layer.K) == (N, K), layer
        return Call(lambda: linear.KvBProj(value), check)
    return build


add(KVB, "from_nn_linear", _kvb_ctor(lambda: torch.nn.Linear(K, N, bias=False).to(BF16)), "accept")
add(KVB, "weight_format_none", _kvb_ctor(lambda: None), "reject", ("weight_format",))
add(KVB, "weight_format_str", _kvb_ctor(lambda: "dense"), "reject", ("weight_format",))
add(KVB, "weight_format_tensor", _kvb_ctor(lambda: _w()), "reject", ("weight_format",))


def _kvb_method(method: str, *margs):
    def build(g):
        layer = linear.KvBProj(W.DenseWeight(_w().to(BF16)))

        def check(text):
            assert isinstance(text, str) and text, text
        return Call(lambda: getattr(layer, method)(*margs), check)
    return build


for _meth in ("explain", "backend_for"):
    add(KVB, f"{_meth}_valid", _kvb_method(_meth, 4096), "accept")
    for _label, _m in (("negative", -1), ("float", 1.5), ("bool", True), ("str", "64"), ("huge", 2**80)):
        add(KVB, f"{_meth}_M_{_label}", _kvb_method(_meth, _m), "either" if _label == "huge" else "reject",
            ("M",), timeout=QUICK)
add(KVB, "explain_device_str_garbage", _kvb_method("explain", 64, "tpu9"), "reject", ("device",))
add(KVB, "explain_act_dtype_int", _kvb_method("explain", 64, None, torch.int32), "either", ("act_dtype",))


add(f"{LIN}:backend_report", "rows", report_rows_case(linear.backend_report), "accept")


# ---------------------------------------------------------------------------
# Weight formats
# ---------------------------------------------------------------------------

def assert_dequant(got: torch.Tensor, want: torch.Tensor, marlin: bool, what: str) -> None:
    """Exact against the reference decoder; a Marlin weight within the bf16 tolerance of
    SPEC §9 (its folded scales may be stored in the activation dtype)."""
    if marlin:
        assert_close_rel(got, want, what, 1e-2)
    else:
        assert torch.equal(got, want), (f"{what} differs from the reference decoder (max |diff| "
                                        f"{float((got.float() - want).abs().max()):.3g})")


def _roundtrip(kind: str):
    def build(g):
        fmt, want = make_format(kind, g.put(_w(), "w"))  # quantized from a guarded weight

        def check(_):
            assert_dequant(fmt.dequantize_fp32(), want, kind.startswith("marlin"), "dequantize_fp32")
            assert fmt.dequantize().dtype == BF16 and fmt.N == N and fmt.K == K
        return Call(lambda: fmt, check)
    return build


_CLS = {"dense": "DenseWeight", "fp8_per_tensor": "Fp8Weight", "fp8_per_channel": "Fp8Weight",
        "fp8_block": "Fp8BlockWeight", "marlin_fp8": "MarlinFp8Weight", "marlin_fp8_g128": "MarlinFp8Weight",
        "nvfp4": "Nvfp4Weight", "int4_group": "Int4GroupWeight"}
for _k in KINDS:
    add(f"{WTS}:{_CLS[_k]}", f"roundtrip_{_k}", _roundtrip(_k), "accept",
        also=(f"{WTS}:WeightFormat", f"{WTS}:quantize"))


def _nan_weight(byte: int) -> torch.Tensor:
    w = ref.quantize_e4m3(_w())
    w.view(torch.uint8)[3, 7] = byte
    return w


def ctor(entry: str, name: str, fn, expect: str = "reject", args=(), **kw) -> None:
    def build(g):
        return Call(fn)
    add(entry, name, build, expect, args, **kw)


_q8 = ref.quantize_e4m3(_w())
_chan = torch.full((N,), 0.01)
_blk = torch.full((1, 1), 0.01)
DW, FW, BW, MW, NW, IW = (f"{WTS}:{c}" for c in ("DenseWeight", "Fp8Weight", "Fp8BlockWeight", "MarlinFp8Weight",
                                                 "Nvfp4Weight", "Int4GroupWeight"))
ctor(DW, "int_weight", lambda: W.DenseWeight(torch.zeros(N, K, dtype=torch.int32)), args=("weight",))
ctor(DW, "weight_1d", lambda: W.DenseWeight(torch.zeros(K)), args=("weight",))
ctor(DW, "weight_not_a_tensor", lambda: W.DenseWeight([[0.0] * K]), args=("weight",))
ctor(DW, "from_dense_fp8_dtype", lambda: W.DenseWeight.from_dense(_w(), E4M3), args=("weight", "dtype"))
for _byte in (0x7F, 0xFF):
    ctor(FW, f"nan_byte_{_byte:#x}", lambda b=_byte: W.Fp8Weight(_nan_weight(b), _chan, BF16), args=("weight",))
    ctor(BW, f"nan_byte_{_byte:#x}", lambda b=_byte: W.Fp8BlockWeight(_nan_weight(b), _blk, BF16),
         args=("weight",))
    ctor(MW, f"nan_byte_{_byte:#x}", lambda b=_byte: W.MarlinFp8Weight.from_checkpoint(_nan_weight(b), _chan, BF16),
         args=("weight", "w_fp8"))
for _label, _v in (("nan", float("nan")), ("zero", 0.0), ("negative", -0.01), ("inf", float("inf"))):
    ctor(FW, f"scale_{_label}", lambda v=_v: W.Fp8Weight(_q8, torch.full((N,), v), BF16), args=("weight_scale",))
    ctor(BW, f"scale_{_label}", lambda v=_v: W.Fp8BlockWeight(_q8, torch.full((1, 1), v), BF16),
         args=("weight_scale_inv",))
    ctor(MW, f"scale_{_label}", lambda v=_v: W.MarlinFp8Weight.from_checkpoint(_q8, torch.full((N,), v), BF16),
         args=("weight_scale", "scales"))
ctor(MW, "scale_overflows_folded_bias", lambda: W.MarlinFp8Weight.from_checkpoint(_q8, torch.full((N,), 1e37),
                                                                                    BF16),
     args=("weight_scale", "scales"))
ctor(FW, "scale_count", lambda: W.Fp8Weight(_q8, torch.full((N - 1,), 0.01), BF16), args=("weight_scale",))
ctor(FW, "scale_not_a_tensor", lambda: W.Fp8Weight(_q8, 0.01, BF16), args=("weight_scale",))
ctor(FW, "weight_bf16", lambda: W.Fp8Weight(_w().to(BF16), _chan, BF16), args=("weight",))
ctor(FW, "params_dtype_int8", lambda: W.Fp8Weight(_q8, _chan, torch.int8), args=("params_dtype",))
ctor(FW, "params_dtype_fp8", lambda: W.Fp8Weight(_q8, _chan, E4M3), args=("params_dtype",))
ctor(FW, "params_dtype_str", lambda: W.Fp8Weight(_q8, _chan, "bfloat16"), args=("params_dtype",))
ctor(BW, "scale_shape", lambda: W.Fp8BlockWeight(_q8, torch.full((2, 1), 0.01), BF16), args=("weight_scale_inv",))
ctor(BW, "block_size_64", lambda: W.Fp8BlockWeight(_q8, _blk, BF16, block_size=(64, 64)), args=("block_size",))
ctor(BW, "block_size_int", lambda: W.Fp8BlockWeight(_q8, _blk, BF16, block_size=128), args=("block_size",))
ctor(MW, "params_dtype_fp32", lambda: W.MarlinFp8Weight.from_checkpoint(_q8, _chan, F32), args=("params_dtype",))
ctor(MW, "group_size_64", lambda: W.MarlinFp8Weight.from_dense(_w(), BF16, group_size=64), args=("group_size",))
ctor(MW, "group_size_str", lambda: W.MarlinFp8Weight.from_dense(_w(), BF16, group_size="128"),
     args=("group_size",))
ctor(MW, "k_not_multiple_of_16", lambda: W.MarlinFp8Weight.from_checkpoint(_q8[:, :100], _chan, BF16),
     args=("K", "weight", "w_fp8"))
ctor(MW, "from_fp8_of_dense", lambda: W.MarlinFp8Weight.from_fp8(W.DenseWeight(_w())), args=("fmt",))


def _packed_for_fp16():
    return W.MarlinFp8Weight.from_dense(_w(), torch.float16).packed


ctor(MW, "packed_dtype_mismatch", lambda: W.MarlinFp8Weight(_packed_for_fp16(), BF16), args=("params_dtype",))
@functools.cache
def _nv():
    return W.Nvfp4Weight.from_dense(_w(), BF16)


ctor(NW, "odd_k", lambda: W.Nvfp4Weight(_nv().weight[:, :60], _nv().weight_scale, _nv().weight_scale_2, BF16),
     args=("K", "weight"))
ctor(NW, "weight_int8", lambda: W.Nvfp4Weight(_nv().weight.view(torch.int8), _nv().weight_scale, _nv().weight_scale_2,
                                               BF16), args=("weight",))
ctor(NW, "scale_nan_byte", lambda: W.Nvfp4Weight(
    _nv().weight, _nv().weight_scale.view(torch.uint8).clone().fill_(0x7F).view(E4M3), _nv().weight_scale_2, BF16),
    args=("weight_scale",))
ctor(NW, "scale_bf16", lambda: W.Nvfp4Weight(_nv().weight, _nv().weight_scale.to(BF16), _nv().weight_scale_2, BF16),
     args=("weight_scale",))
for _label, _v in (("zero", 0.0), ("nan", float("nan")), ("negative", -1.0)):
    ctor(NW, f"global_scale_{_label}", lambda v=_v: W.Nvfp4Weight(_nv().weight, _nv().weight_scale,
                                                                   torch.tensor([v]), BF16),
         args=("weight_scale_2",))
@functools.cache
def _i4():
    return W.Int4GroupWeight.from_dense(_w(), 64, BF16)


for _label, _gs in (("zero", 0), ("negative", -1), ("str", "64"), ("not_dividing", 48), ("bool", True),
                    ("float", 64.0)):
    ctor(IW, f"group_size_{_label}", lambda gs=_gs: W.Int4GroupWeight(_i4().qweight, _i4().scales, gs, BF16),
         args=("group_size",))
ctor(IW, "scales_nan", lambda: W.Int4GroupWeight(_i4().qweight, _i4().scales.clone().fill_(float("nan")), 64, BF16),
     args=("scales",))
ctor(IW, "scales_shape", lambda: W.Int4GroupWeight(_i4().qweight, _i4().scales[:1], 64, BF16), args=("scales",))
ctor(IW, "zeros_shape", lambda: W.Int4GroupWeight(_i4().qweight, _i4().scales, 64, BF16,
                                                  zeros=torch.zeros(1, N, dtype=torch.int32)), args=("zeros",))
ctor(IW, "qweight_int64", lambda: W.Int4GroupWeight(_i4().qweight.long(), _i4().scales, 64, BF16), args=("qweight",))
ctor(f"{WTS}:quantize", "unknown_recipe", lambda: W.quantize("fp4_magic", _w(), BF16), args=("recipe",))
ctor(f"{WTS}:quantize", "recipe_none", lambda: W.quantize(None, _w(), BF16), args=("recipe",))
ctor(f"{ROWS}:check_row_cut", "cut_through_block", lambda: W.check_row_cut(3, 200, 256, 128, "128-row block"),
     args=("rows",))
ctor(f"{ROWS}:check_row_cut", "clean_cut", lambda: W.check_row_cut(128, 256, 256, 128, "128-row block"),
     expect="accept")
ctor(f"{WTS}:WeightFormat", "slice_rows_reversed", lambda: W.DenseWeight(_w()).slice_rows(50, 10),
     args=("start", "stop", "rows"))
ctor(f"{WTS}:WeightFormat", "slice_rows_float", lambda: W.DenseWeight(_w()).slice_rows(0, 10.0), args=("stop",))
ctor(f"{WTS}:WeightFormat", "slice_rows_past_n", lambda: W.DenseWeight(_w()).slice_rows(0, N + 1),
     args=("stop", "rows"))
ctor(f"{WTS}:WeightFormat", "fp8_block_cut_through_block",
     lambda: W.Fp8BlockWeight.from_dense(_w(n=256), BF16).slice_rows(0, 100), args=("rows",))
ctor(f"{WTS}:WeightFormat", "marlin_cut_through_tile",
     lambda: W.MarlinFp8Weight.from_dense(_w(n=256), BF16).slice_rows(0, 100), args=("rows",))


# ---------------------------------------------------------------------------
# weight_format_from_module
# ---------------------------------------------------------------------------

def module_case(make, *, params_dtype=None, want=None, expect="accept"):
    def build(g):
        module = make()

        def check(fmt):
            assert isinstance(fmt, W.WeightFormat), type(fmt)
            if want is not None:
                cls, w_ref = want()
                assert isinstance(fmt, cls), f"read as {type(fmt).__name__}, expected {cls.__name__}"
                got = independent_dequant(fmt)
                assert torch.equal(got, w_ref), "the format's weights differ from the module's"
        kw = {} if params_dtype is None else {"params_dtype": params_dtype}
        return Call(lambda: from_module.weight_format_from_module(module, **kw), check)
    return build


def _linear(bias=False):
    torch.manual_seed(0)
    return torch.nn.Linear(K, N, bias=bias).to(BF16)


def _ns(**kw):
    return types.SimpleNamespace(**kw)


@functools.cache
def _fb():
    return W.Fp8BlockWeight.from_dense(_w(), BF16)


@functools.cache
def _fc():
    return W.Fp8Weight.from_dense(_w(), per_channel=True, params_dtype=BF16)


add(FROM, "nn_linear", module_case(_linear, want=lambda: (W.DenseWeight, _linear().weight.detach().float())),
    "accept")
add(FROM, "fp8_block_object", module_case(
    lambda: _ns(weight=_fb().weight, weight_scale_inv=_fb().weight_scale_inv, params_dtype=BF16),
    want=lambda: (W.Fp8BlockWeight, independent_dequant(_fb()))), "accept")
add(FROM, "fp8_channel_mapping", module_case(
    lambda: {"weight": _fc().weight, "weight_scale": _fc().weight_scale, "orig_dtype": BF16},
    want=lambda: (W.Fp8Weight, independent_dequant(_fc()))), "accept")
add(FROM, "fp8_transposed_with_sizes", module_case(
    lambda: _ns(weight=_fc().weight.t(), weight_scale=_fc().weight_scale, params_dtype=BF16,
                output_size_per_partition=N, input_size_per_partition=K),
    want=lambda: (W.Fp8Weight, independent_dequant(_fc()))), "accept")
add(FROM, "nvfp4_object", module_case(
    lambda: _ns(weight=_nv().weight, weight_scale=_nv().weight_scale, weight_scale_2=_nv().weight_scale_2,
                params_dtype=BF16), want=lambda: (W.Nvfp4Weight, independent_dequant(_nv()))), "accept")
add(FROM, "gptq_object", module_case(
    lambda: _ns(qweight=_i4().qweight, scales=_i4().scales, group_size=64, params_dtype=BF16),
    want=lambda: (W.Int4GroupWeight, independent_dequant(_i4()))), "accept")
add(FROM, "weight_format_itself", module_case(lambda: _fb()), "accept")


def reject_module(name, make, args=("module",), params_dtype=None):
    add(FROM, name, module_case(make, params_dtype=params_dtype, expect="reject"), "reject", args)


reject_module("none", lambda: None)
reject_module("str", lambda: "kv_b_proj")
reject_module("int", lambda: 7)
reject_module("tensor", lambda: _w())
reject_module("empty_object", lambda: _ns())
reject_module("linear_with_bias", lambda: _linear(bias=True), args=("bias",))
reject_module("fp8_without_params_dtype", lambda: _ns(weight=_fb().weight, weight_scale_inv=_fb().weight_scale_inv),
              args=("params_dtype",))
reject_module("fp8_nan_byte", lambda: _ns(weight=_nan_weight(0x7F), weight_scale=_chan, params_dtype=BF16),
              args=("weight",))
reject_module("fp8_both_scales", lambda: _ns(weight=_fb().weight, weight_scale=_chan,
                                             weight_scale_inv=_fb().weight_scale_inv, params_dtype=BF16))
reject_module("fp8_no_scale", lambda: _ns(weight=_fb().weight, params_dtype=BF16))
reject_module("int32_weight", lambda: _ns(weight=torch.zeros(N, K, dtype=torch.int32), params_dtype=BF16),
              args=("weight",))
reject_module("weight_3d", lambda: _ns(weight=torch.zeros(2, N, K)))
reject_module("dense_with_stray_scale", lambda: _ns(weight=_w(), weight_scale=_chan))
reject_module("bits_8", lambda: _ns(qweight=_i4().qweight, scales=_i4().scales, bits=8, params_dtype=BF16))
reject_module("act_order_g_idx", lambda: _ns(qweight=_i4().qweight, scales=_i4().scales, params_dtype=BF16,
                                              g_idx=torch.randperm(K)), args=("g_idx",))
reject_module("stated_sizes_disagree", lambda: _ns(weight=_w(), out_features=N + 1, in_features=K),
              args=("weight",))
reject_module("params_dtype_int8", lambda: _linear(), args=("params_dtype",), params_dtype=torch.int8)
reject_module("params_dtype_str", lambda: _linear(), args=("params_dtype",), params_dtype="bf16")
reject_module("weight_is_a_list", lambda: _ns(weight=[[0.0] * K], params_dtype=BF16))
reject_module("params_dtype_attr_str", lambda: _ns(weight=_fb().weight, weight_scale_inv=_fb().weight_scale_inv,
                                                   params_dtype="bfloat16"), args=("params_dtype",))


# ---------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------

HEADS, HEAD_ROWS = 4, 64  # N = 256: every format cuts cleanly at TP2 (128-row blocks, 64-row tiles)


def shard_case(kind: str, tp: int, rank: int):
    def build(g):
        w = _w(n=HEADS * HEAD_ROWS)
        fmt, full = make_format(kind, w)

        def check(part):
            assert type(part) is type(fmt), type(part)
            rows = HEADS * HEAD_ROWS // tp
            want = full[rank * rows:(rank + 1) * rows]
            marlin = isinstance(part, W.MarlinFp8Weight)
            got = part.dequantize_fp32() if marlin else independent_dequant(part)
            assert_dequant(got, want, marlin, "the shard's weights (against the full weight's rows)")
        return Call(lambda: shard.shard_weight(fmt, HEADS, HEAD_ROWS, tp, rank), check)
    return build


for _k in KINDS:
    add(f"{SHARD}:shard_weight", f"tp2_rank1_{_k}", shard_case(_k, 2, 1), "accept")
add(f"{SHARD}:shard_weight", "tp4_rank3_dense", shard_case("dense", 4, 3), "accept")


def shard_bad(name, fn, args, entry="shard_weight"):
    ctor(f"{ROWS if entry == 'shard_rows' else SHARD}:{entry}", name, fn, args=args)


@functools.cache
def _full():
    return W.DenseWeight(_w(n=HEADS * HEAD_ROWS))


shard_bad("tp_not_dividing", lambda: shard.shard_weight(_full(), HEADS, HEAD_ROWS, 3, 0), ("tp_size",))
shard_bad("rank_past_tp", lambda: shard.shard_weight(_full(), HEADS, HEAD_ROWS, 2, 2), ("rank",))
shard_bad("rank_negative", lambda: shard.shard_weight(_full(), HEADS, HEAD_ROWS, 2, -1), ("rank",))
shard_bad("tp_zero", lambda: shard.shard_weight(_full(), HEADS, HEAD_ROWS, 0, 0), ("tp_size",))
shard_bad("tp_bool", lambda: shard.shard_weight(_full(), HEADS, HEAD_ROWS, True, 0), ("tp_size",))
shard_bad("heads_disagree_with_n", lambda: shard.shard_weight(_full(), 8, HEAD_ROWS, 2, 0), ("fmt", "num_heads"))
shard_bad("fmt_is_a_module", lambda: shard.shard_weight(_linear(), HEADS, HEAD_ROWS, 2, 0), ("fmt",))
shard_bad("fp8_block_cut", lambda: shard.shard_weight(W.Fp8BlockWeight.from_dense(_w(n=8 * 48), BF16), 8, 48, 4, 1),
          ("tp_size", "rank", "rows"))
add(f"{ROWS}:shard_rows", "huge_heads", lambda g: Call(lambda: shard.shard_rows(2**80, 64, 2**79, 1),
                                                      lambda rows: None if rows == (128, 256) else
                                                      _fail(f"rows {rows}, expected (128, 256)")),
    "either", ("num_heads", "tp_size"), timeout=QUICK)
ctor(f"{ROWS}:shard_rows", "valid", lambda: shard.shard_rows(16, 256, 8, 7), expect="accept")
shard_bad("num_heads_zero", lambda: shard.shard_rows(0, 64, 1, 0), ("num_heads",), entry="shard_rows")
shard_bad("head_rows_float", lambda: shard.shard_rows(4, 64.0, 1, 0), ("head_rows",), entry="shard_rows")

_TINY = MLAModelConfig(name="tiny", L=K, R=16, P=32, V=32, num_heads=HEADS, num_layers=2)


def _shard_for_valid(g):
    fmt = W.DenseWeight(_w(n=HEADS * HEAD_ROWS))

    def check(part):
        assert torch.equal(part.weight, fmt.weight[HEAD_ROWS * 2:]), "rank 1 of 2 holds the wrong rows"
    return Call(lambda: shard.shard_for(fmt, _TINY.shard(2, 1)), check)


add(f"{SHARD}:shard_for", "per_rank_config", _shard_for_valid, "accept")
shard_bad("model_config_none", lambda: shard.shard_for(_full(), None, 2, 0), ("model_config",), entry="shard_for")
shard_bad("tp_disagrees_with_config", lambda: shard.shard_for(_full(), _TINY.shard(2, 1), 4, 1), ("tp_size",),
          entry="shard_for")
shard_bad("full_config_without_tp", lambda: shard.shard_for(_full(), _TINY), ("tp_size", "rank"), entry="shard_for")


# ---------------------------------------------------------------------------
# kv_b_proj_input_dtype (SPEC §5 table) and declared_compute_dtype
# ---------------------------------------------------------------------------

def _policy(make_layer, flag, want):
    def build(g):
        layer = make_layer()

        def check(got):
            assert got == want, f"activation dtype {got}, SPEC §5 says {want}"
        return Call(lambda: input_dtype.kv_b_proj_input_dtype(layer, flag), check)
    return build


_layers = {
    "dense_bf16": (lambda: W.DenseWeight(_w().to(BF16)), BF16, BF16),
    "dense_fp32": (lambda: W.DenseWeight(_w()), F32, F32),
    "fp8": (lambda: W.Fp8Weight.from_dense(_w(), params_dtype=BF16), None, E4M3),
    "marlin_int32": (lambda: W.MarlinFp8Weight.from_dense(_w(), torch.float16), torch.float16, torch.float16),
    "nvfp4_uint8": (lambda: W.Nvfp4Weight.from_dense(_w(), BF16), None, BF16),
    "int4_no_weight": (lambda: W.Int4GroupWeight.from_dense(_w(), 64, BF16), BF16, BF16),
    "kvbproj_fp8_block": (lambda: linear.KvBProj(W.Fp8BlockWeight.from_dense(_w(), BF16)), None, E4M3),
    "duck_int8_packed": (lambda: _ns(weight=torch.zeros(2, 2, dtype=torch.int8), params_dtype=torch.float16),
                         torch.float16, torch.float16),
    "duck_no_weight": (lambda: _ns(params_dtype=BF16), BF16, BF16),
}
IDF = f"{IDT}:kv_b_proj_input_dtype"
for _name, (_make, _off, _on) in _layers.items():
    add(IDF, f"{_name}_off", _policy(_make, False, _off), "accept")
    add(IDF, f"{_name}_on", _policy(_make, True, _on), "accept")
add(IDF, "numpy_bool", _policy(_layers["fp8"][0], np.bool_(True), E4M3), "accept")
for _label, _flag in (("str_no", "no"), ("str_false", "False"), ("int_0", 0), ("int_1", 1), ("none", None),
                      ("tensor", torch.tensor(False)), ("float", 0.0)):
    add(IDF, f"use_fp8_prefill_{_label}", _policy(_layers["fp8"][0], _flag, None), "reject", ("use_fp8_prefill",))
add(IDF, "int32_weight_without_params_dtype", _policy(lambda: _ns(weight=torch.zeros(2, 2, dtype=torch.int32)),
                                                       False, None), "reject", ("params_dtype",))
add(IDF, "params_dtype_is_fp8", _policy(lambda: _ns(params_dtype=E4M3), False, None), "reject", ("params_dtype",))
add(IDF, "layer_none", _policy(lambda: None, False, None), "reject", ("layer", "params_dtype"))
add(IDF, "bool_weight", _policy(lambda: _ns(weight=torch.zeros(2, dtype=torch.bool), params_dtype=BF16), False,
                                None), "reject", ("weight", "layer"))
add(IDF, "weight_not_a_tensor", _policy(lambda: _ns(weight="fp8", params_dtype=BF16), False, None), "reject",
    ("weight", "layer"))


def _declared(obj, want):
    def build(g):
        def check(got):
            assert got == want, f"declared_compute_dtype: {got}, expected {want}"
        return Call(lambda: input_dtype.declared_compute_dtype(obj), check)
    return build


add(f"{IDT}:declared_compute_dtype", "compute_dtype_first", _declared(_ns(compute_dtype=F32, params_dtype=BF16),
                                                                      F32), "accept")
add(f"{IDT}:declared_compute_dtype", "string_is_not_a_dtype", _declared(_ns(params_dtype="bfloat16"), None),
    "accept")
add(f"{IDT}:declared_compute_dtype", "none", _declared(None, None), "accept")


# ---------------------------------------------------------------------------
# Raw Marlin ops
# ---------------------------------------------------------------------------

def ops():
    return torch.ops.mla_ext


def _repacked(group: int = -1, act=BF16):
    src, want = fp8_source("block" if group == 128 else "channel", _w())
    if group == 128:
        scales = src.weight_scale_inv.repeat_interleave(128, 0)[:N].t().contiguous()  # [K/128, N]
    else:
        scales = src.channel_scales()
    return src.weight, scales, want


def _repack_case(group, act=BF16, mutate=None, expect="accept"):
    def build(g):
        w8, scales, want = _repacked(group, act)
        a = dict(w=g.put(w8, "w_fp8"), s=g.put(scales, "scales"), group=group, act=act)
        if mutate is not None:
            mutate(g, a)

        def check(res):
            qweight, packed = res
            got = ops().marlin_fp8_dequantize(qweight, packed, N, K, group, act)
            assert_dequant(got, want, True, "dequantize(repack(w, s)) against w * s")
        return Call(lambda: ops().marlin_fp8_repack(a["w"], a["s"], a["group"], a["act"]),
                    check if expect != "reject" else None)
    return build


REPACK, DEQ, GEMM = f"{OPS}.marlin_fp8_repack", f"{OPS}.marlin_fp8_dequantize", f"{OPS}.marlin_fp8_gemm"
add(REPACK, "valid_per_channel_bf16", _repack_case(-1), "accept", also=(DEQ,))
add(REPACK, "valid_group128_fp16", _repack_case(128, torch.float16), "accept", also=(DEQ,))
add(REPACK, "w_strided", _repack_case(-1, mutate=lambda g, a: a.update(w=g.put(a["w"], "w2", pad=16))), "accept")
for _name, _mut, _args in (
        ("nan_byte", lambda g, a: a["w"].view(torch.uint8).__setitem__((1, 2), 0x7F), ("w_fp8",)),
        ("w_bf16", lambda g, a: a.update(w=a["w"].to(BF16)), ("w_fp8",)),
        ("w_1d", lambda g, a: a.update(w=a["w"][0]), ("w_fp8",)),
        ("k_not_multiple_of_16", lambda g, a: a.update(w=a["w"][:, :100]), ("K",)),
        ("group_64", lambda g, a: a.update(group=64), ("group_size",)),
        ("act_fp32", lambda g, a: a.update(act=F32), ("act_dtype",)),
        ("scales_shape", lambda g, a: a.update(s=a["s"][:10]), ("scales",)),
        ("scales_nan", lambda g, a: a["s"].__setitem__(3, float("nan")), ("scales",)),
        ("scales_overflow_fold", lambda g, a: a["s"].fill_(1e37), ("scales",)),
        ("scales_fp16", lambda g, a: a.update(s=a["s"].half()), ("scales",)),
        ("scales_on_meta", lambda g, a: a.update(s=a["s"].to(META)), ("scales",)),
        ("w_on_meta", lambda g, a: a.update(w=a["w"].to(META)), ("w_fp8",)),
        ("w_not_a_tensor", lambda g, a: a.update(w=1.0), ("w_fp8",)),
        ("group_str", lambda g, a: a.update(group="128"), ("group_size",)),
        ("n_zero", lambda g, a: a.update(w=a["w"][:0], s=a["s"][:0]), ("N",)),
):
    add(REPACK, _name, _repack_case(-1, mutate=_mut, expect="reject"), "reject", _args)


def _packed_setup(g, group=-1):
    w8, scales, want = _repacked(group)
    qweight, packed = ops().marlin_fp8_repack(w8, scales, group, BF16)
    return dict(q=g.put(qweight, "qweight"), s=g.put(packed, "scales"), n=N, k=K, group=group, act=BF16), want


def deq(name, mutate=None, expect="reject", args=(), timeout=60.0):
    def build(g):
        a, want = _packed_setup(g)
        if mutate is not None:
            mutate(g, a)

        def check(got):
            assert_dequant(got, want, True, "dequantize against w * s")
        return Call(lambda: ops().marlin_fp8_dequantize(a["q"], a["s"], a["n"], a["k"], a["group"], a["act"]),
                    check if expect != "reject" else None)
    add(DEQ, name, build, expect, args, timeout=timeout)


deq("n_disagrees_with_qweight", lambda g, a: a.update(n=N + 64), args=("qweight", "N"))
deq("k_disagrees_with_qweight", lambda g, a: a.update(k=K + 16), args=("qweight", "K"))
deq("n_huge", lambda g, a: a.update(n=2**40), args=("qweight", "N"), timeout=QUICK)
deq("k_negative", lambda g, a: a.update(k=-16), args=("K",))
deq("qweight_strided", lambda g, a: a.update(q=g.put(a["q"], "q2", pad=4)), args=("qweight",))
deq("qweight_float", lambda g, a: a.update(q=a["q"].float()), args=("qweight",))
deq("scales_transposed", lambda g, a: a.update(s=a["s"].t()), args=("scales",))
deq("qweight_on_meta", lambda g, a: a.update(q=a["q"].to(META)), args=("qweight", "scales"))


def gemm(name, expect="reject", args=(), mutate=None, *, m=5, group=-1, a_kw=None, timeout=60.0):
    def build(g):
        p, want = _packed_setup(g, group)
        a = dict(p, a=g.put(_x(m), "a", **(a_kw or {})), out_dtype=None)
        if mutate is not None:
            mutate(g, a)

        def check(y):
            assert y.dtype == BF16 and tuple(y.shape) == (a["a"].shape[0], N), f"{y.dtype} {tuple(y.shape)}"
            assert_linear(y, a["a"], want, dense=False)
        return Call(lambda: ops().marlin_fp8_gemm(a["a"], a["q"], a["s"], a["n"], a["k"], a["group"], a["act"],
                                                  a["out_dtype"]), check if expect != "reject" else None)
    add(GEMM, name, build, expect, args, timeout=timeout)


gemm("valid", "accept")
gemm("valid_group128", "accept", group=128)
gemm("row_strided_misaligned", "accept", a_kw=dict(pad=8, misalign=1))
gemm("zero_rows", "accept", m=0)
gemm("a_fp16", args=("a",), mutate=lambda g, a: a.update(a=a["a"].half()))
gemm("a_1d", args=("a",), mutate=lambda g, a: a.update(a=a["a"][0]))
gemm("a_wrong_k", args=("a",), mutate=lambda g, a: a.update(a=a["a"][:, :64]))
gemm("a_last_dim_strided", args=("a",), mutate=lambda g, a: a.update(a=g.put(a["a"], "a2", strides=(2 * K, 2))))
gemm("a_on_meta", args=("a",), mutate=lambda g, a: a.update(a=a["a"].to(META)))
gemm("out_dtype_int", args=("out_dtype",), mutate=lambda g, a: a.update(out_dtype=torch.int32))
gemm("qweight_scales_swapped", args=("qweight", "scales"), mutate=lambda g, a: a.update(q=a["s"], s=a["q"]))
gemm("n_huge", args=("qweight", "N"), mutate=lambda g, a: a.update(n=2**40), timeout=QUICK)


# ---------------------------------------------------------------------------
# marlin_vllm_layer: a vLLM Marlin fp8 layer after process_weights_after_loading
# ---------------------------------------------------------------------------

MVL = "mla_ext.kv_b_proj.from_module:marlin_vllm_layer"


def _vllm_layer(**over):
    """A duck-typed vLLM Marlin fp8 layer (N = 128: vLLM needs a multiple of 64) and its reference."""
    src, want = fp8_source("channel", _w(n=128))
    packed = W.MarlinFp8Weight.from_fp8(src).packed
    attrs = dict(weight=packed.qweight, weight_scale=packed.scales, workspace=torch.zeros(4, dtype=torch.int32),
                 params_dtype=BF16, output_size_per_partition=128, input_size_per_partition=K)
    attrs.update(over)
    return {k: v for k, v in attrs.items() if v is not None}, want


def _mvl(over=None, as_dict=False, expect="accept"):
    def build(g):
        attrs, want = _vllm_layer(**(over or {}))
        layer = attrs if as_dict else types.SimpleNamespace(**attrs)

        def check(fmt):
            assert isinstance(fmt, W.MarlinFp8Weight), type(fmt)
            assert_dequant(fmt.dequantize_fp32(), want, True, "the layer's weights")
        return Call(lambda: from_module.marlin_vllm_layer(layer), check if expect != "reject" else None)
    return build


add(MVL, "valid_object", _mvl(), "accept")
add(MVL, "valid_mapping", _mvl(as_dict=True), "accept")
add(MVL, "none", lambda g: Call(lambda: from_module.marlin_vllm_layer(None)), "reject", ("layer",))
add(MVL, "weight_fp8", _mvl(dict(weight=ref.quantize_e4m3(_w(n=128))), expect="reject"), "reject", ("weight",))
add(MVL, "no_scale", _mvl(dict(weight_scale=None), expect="reject"), "reject", ("weight_scale", "layer"))
add(MVL, "both_scales", _mvl(dict(weight_scale_inv=torch.ones(1, 128, dtype=BF16)), expect="reject"), "reject",
    ("weight_scale", "layer"))
add(MVL, "no_params_dtype", _mvl(dict(params_dtype=None), expect="reject"), "reject", ("params_dtype",))
add(MVL, "block_size_garbage", _mvl(dict(weight_block_size="128x128"), expect="reject"), "reject",
    ("weight_block_size",))
add(MVL, "sizes_disagree", _mvl(dict(output_size_per_partition=192), expect="reject"), "reject",
    ("qweight", "size_n", "weight"))
add(MVL, "scales_fp32", _mvl(dict(weight_scale=torch.ones(1, 128)), expect="either"), "either",
    ("scales", "weight_scale"))


# ---------------------------------------------------------------------------
# Scale layouts: block-FP8 scale layouts, NVFP4 128x4 swizzle
# ---------------------------------------------------------------------------

def swizzled_position(r: int, c: int, kp: int) -> int:
    """Flat index of NVFP4 block scale (r, c) in the 128x4 swizzled layout (CUTLASS / vLLM's
    swizzle_blockscale; cuBLAS: NVFP4 A of 128 x 128, scale (5, 2) at 82, (5, 5) at 593)."""
    return ((r // 128) * (kp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _swizzle_reference(linear: torch.Tensor) -> torch.Tensor:
    n, kb = linear.shape
    mp, kp = -(-n // 128) * 128, -(-kb // 4) * 4
    flat = torch.zeros(mp * kp, dtype=linear.dtype)
    for r in range(n):
        for c in range(kb):
            flat[swizzled_position(r, c, kp)] = linear[r, c]
    return flat.view(mp, kp)


def _scales(n: int, kb: int) -> torch.Tensor:
    return torch.randn(n, kb, generator=torch.Generator().manual_seed(n * 131 + kb)).abs()


def _swizzle_case(n: int, kb: int):
    def build(g):
        lin = g.put(_scales(n, kb), "linear")
        want = _swizzle_reference(lin.clone())

        def check(got):
            assert torch.equal(got, want), "swizzled layout differs from the 128x4 formula"
            back = W.unswizzle_nvfp4_scales(got, n, kb * 16)
            assert torch.equal(back, lin), "unswizzle(swizzle(s)) != s"
        return Call(lambda: W.swizzle_nvfp4_scales(lin), check)
    return build


SWZ, UNSWZ, SWZ_SHAPE = (f"{WTS}:{n}" for n in ("swizzle_nvfp4_scales", "unswizzle_nvfp4_scales",
                                                "nvfp4_swizzled_scale_shape"))
add(SWZ, "cublas_example_128x8", _swizzle_case(128, 8), "accept", also=(UNSWZ,))
add(SWZ, "padded_200x6", _swizzle_case(200, 6), "accept", also=(UNSWZ,))
add(SWZ, "one_row", _swizzle_case(1, 1), "accept", also=(UNSWZ,))
ctor(SWZ, "linear_1d", lambda: W.swizzle_nvfp4_scales(torch.ones(32)), args=("linear",))
ctor(SWZ, "linear_list", lambda: W.swizzle_nvfp4_scales([[1.0]]), args=("linear",))
ctor(UNSWZ, "wrong_numel", lambda: W.unswizzle_nvfp4_scales(torch.ones(128, 3), 128, 64), args=("weight_scale",))
ctor(UNSWZ, "3d", lambda: W.unswizzle_nvfp4_scales(torch.ones(1, 128, 4), 128, 64), args=("weight_scale",))
ctor(UNSWZ, "not_a_tensor", lambda: W.unswizzle_nvfp4_scales(None, 128, 64), args=("weight_scale",))
add(SWZ_SHAPE, "padded", lambda g: Call(lambda: W.nvfp4_swizzled_scale_shape(200, 48),
                                        lambda got: None if got == (256, 4) else _fail(f"{got}, expected (256, 4)")),
    "accept")
ctor(SWZ_SHAPE, "n_negative", lambda: W.nvfp4_swizzled_scale_shape(-5, 64), args=("n",))


def _nvfp4_swizzled(g):
    fmt = W.Nvfp4Weight.from_dense(_w(n=200), BF16)
    swz = g.put(W.swizzle_nvfp4_scales(fmt.weight_scale.view(torch.uint8)).view(E4M3), "weight_scale")
    want = independent_dequant(fmt)

    def check(f):
        assert torch.equal(independent_dequant(f), want), "swizzled scales read back wrong"
    return Call(lambda: W.Nvfp4Weight(fmt.weight, swz, fmt.weight_scale_2, BF16, scale_layout="swizzled"), check)


add(NW, "swizzled_scales", _nvfp4_swizzled, "accept")
ctor(NW, "scale_layout_unknown", lambda: W.Nvfp4Weight(_nv().weight, _nv().weight_scale, _nv().weight_scale_2, BF16,
                                                       scale_layout="128x4"), args=("scale_layout",))

F2L = f"{WTS}:fp8_block_scales_to_linear"


def _f2l(layout: str, make, want_fn=None, expect="accept", args=()):
    def build(g):
        s = g.put(make(), "weight_scale_inv")
        want = want_fn(s.clone()) if want_fn else None

        def check(got):
            assert torch.equal(got, want), f"{layout}: {got} != {want}"
        return Call(lambda: W.fp8_block_scales_to_linear(s, 300, 200, layout), check if want_fn else None)
    add(F2L, layout if expect == "accept" else f"{layout}_bad", build, expect, args)


def _lin():
    return torch.arange(6.0).view(3, 2) + 1  # [ceil(300/128), ceil(200/128)]


_f2l("linear", _lin, lambda s: s)
_f2l("transposed", lambda: _lin().t().contiguous(), lambda s: s.t())
_f2l("linear_padded", lambda: torch.arange(20.0).view(4, 5), lambda s: s[:3, :2])
_f2l("transposed_padded", lambda: torch.arange(20.0).view(4, 5), lambda s: s[:2, :3].t())
_f2l("transposed", _lin, expect="reject", args=("weight_scale_inv",))
_f2l("column", _lin, expect="reject", args=("scale_layout",))
_f2l("linear_padded", lambda: torch.ones(2, 2), expect="reject", args=("weight_scale_inv",))
ctor(F2L, "scale_not_a_tensor", lambda: W.fp8_block_scales_to_linear(0.5, 300, 200, "linear"),
     args=("weight_scale_inv",))
ctor(F2L, "layout_none", lambda: W.fp8_block_scales_to_linear(_lin(), 300, 200, None), args=("scale_layout",))


def _fp8_block_layout(g):
    fmt = W.Fp8BlockWeight.from_dense(_w(n=300), BF16)
    st = g.put(fmt.weight_scale_inv.t().contiguous(), "weight_scale_inv")

    def check(f):
        assert torch.equal(independent_dequant(f), independent_dequant(fmt)), "transposed scales read back wrong"
    return Call(lambda: W.Fp8BlockWeight(fmt.weight, st, BF16, scale_layout="transposed"), check)


add(BW, "transposed_scales", _fp8_block_layout, "accept")


TB = f"{LIN}:table_bucket"
add(TB, "rounded_to_pow2", lambda g: Call(
    lambda: linear.table_bucket("fp8_block", BF16, E4M3, 512, 4096, 100),
    lambda key: None if key == "fp8_block/bfloat16/x=float8_e4m3fn/K=512/N=4096/M=128" else _fail(key)), "accept")
ctor(TB, "M_str", lambda: linear.table_bucket("fp8_block", BF16, BF16, 512, 4096, "100"), args=("M",))
ctor(TB, "M_negative", lambda: linear.table_bucket("fp8_block", BF16, BF16, 512, 4096, -1), args=("M",))

AQ = f"{LIN}:activation_quantization"  # explain() says when a backend quantizes activations
add(AQ, "w8a8_block", lambda g: Call(
    lambda: linear.activation_quantization("triton_fp8_block", BF16),
    lambda t: None if "1x128 group to e4m3" in t else _fail(t)), "accept")
add(AQ, "dense", lambda g: Call(
    lambda: linear.activation_quantization("dequant_dense", BF16),
    lambda t: None if t.startswith("not quantized") else _fail(t)), "accept")
ctor(AQ, "act_dtype_str", lambda: linear.activation_quantization("triton_fp8_block", "bf16"), args=("act_dtype",))
ctor(AQ, "backend_none", lambda: linear.activation_quantization(None, BF16), args=("backend",))
