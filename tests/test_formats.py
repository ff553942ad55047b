"""The Python format registry (mla_ext/formats.py) agrees with the C++ one
(csrc/common/cache_layout.h) as the kernels see it, through mla_ext::format_info."""
import pytest
import torch

from mla_ext import _ext
from mla_ext.formats import ALL_NAMES, DsMla, get_format

# The last two are past int32: C++ must not wrap them into supported dims.
DIMS = [(512, 64), (512, 0), (256, 64), (128, 32), (2**32 + 512, 64), (512, 2**31)]
MODEL_DTYPE_BY_SIZE = {2: torch.bfloat16, 4: torch.float32}


@pytest.fixture(scope="module")
def ops():
    # A missing build is a failure here, not a skip: these checks are the only proof
    # that kernels and Python read the same layout.
    assert _ext.available(), _ext.load_error()
    return _ext.ops()


def python_info(name, L, R, elem):
    f = get_format(name)
    dtype = MODEL_DTYPE_BY_SIZE[elem]
    supported = f.supports_dims(L, R)
    return [
        f.id,
        f.bytes_per_token(L, R, dtype) if supported else -1,
        int(f.quant_mode),
        int(f.scale_kind),
        f.storage_dtype(dtype).itemsize,
        # C++ reports the format's entry width even for dims it cannot hold;
        # Python refuses those dims, so compare only where both are defined.
        f.entry_elems(L, R) if supported else None,
    ]


@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("L,R", DIMS)
@pytest.mark.parametrize("name", ALL_NAMES)
def test_format_info_matches(ops, name, L, R, elem):
    cpp = list(ops.format_info(name, L, R, elem))
    py = python_info(name, L, R, elem)
    if py[5] is None:
        cpp[5] = None
    assert cpp == py, f"{name} L={L} R={R} elem={elem}: C++ {cpp} != Python {py}"


def test_every_format_has_a_name_in_both(ops):
    ids = {ops.format_info(n, 512, 64, 2)[0] for n in ALL_NAMES}
    assert ids == {get_format(n).id for n in ALL_NAMES} == set(range(6))


def test_ds_mla_layout_matches(ops):
    assert list(ops.ds_mla_layout()) == [
        DsMla.LATENT_DIM, DsMla.ROPE_DIM, DsMla.TILE_SIZE, DsMla.NUM_TILES,
        DsMla.LATENT_OFFSET, DsMla.SCALE_OFFSET, DsMla.ROPE_OFFSET, DsMla.ENTRY_BYTES,
    ]
    # The offsets tile the row exactly: 512 e4m3 + 4 fp32 scales + 64 bf16.
    assert DsMla.SCALE_OFFSET == DsMla.LATENT_OFFSET + DsMla.LATENT_DIM
    assert DsMla.ROPE_OFFSET == DsMla.SCALE_OFFSET + 4 * DsMla.NUM_TILES
    assert DsMla.ENTRY_BYTES == DsMla.ROPE_OFFSET + 2 * DsMla.ROPE_DIM
    assert DsMla.NUM_TILES * DsMla.TILE_SIZE == DsMla.LATENT_DIM


@pytest.mark.parametrize("bad", ["fp9", "", "FP8", "auto "])
def test_unknown_name_is_a_value_error_naming_the_argument(ops, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ops.format_info(bad, 512, 64, 2)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        get_format(bad)


@pytest.mark.parametrize("elem", [0, 1, 3, 8])
def test_bad_model_elem_bytes(ops, elem):
    with pytest.raises(ValueError, match="model_elem_bytes"):
        ops.format_info("auto", 512, 64, elem)
