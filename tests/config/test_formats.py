"""The Python format registry (mla_ext/config/formats.py) agrees with the C++ one
(csrc/common/cache_layout.h) as the kernels see it, through mla_ext::format_info."""
import pytest
import torch

from mla_ext import _ext
from mla_ext.config.formats import ALL_NAMES, DsMla, Nvfp4DsMla, get_format

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
    assert ids == {get_format(n).id for n in ALL_NAMES} == set(range(7))


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


def test_nvfp4_ds_mla_layout_matches(ops):
    """The C++ layout (common/cache_layout.h, as the CPU writer places bytes) is the
    Python mirror's: one crafted row whose every scale, rope and latent byte is
    distinct lands exactly at the offsets formats.Nvfp4DsMla gives."""
    nv = Nvfp4DsMla
    assert nv.ROPE_OFFSET == nv.LATENT_OFFSET + nv.LATENT_DIM // 2
    assert nv.SCALE_OFFSET == nv.ROPE_OFFSET + nv.ROPE_DIM
    assert nv.ENTRY_BYTES == nv.SCALE_OFFSET + nv.NUM_BLOCKS
    assert nv.NUM_BLOCKS * nv.BLOCK_SIZE == nv.LATENT_DIM
    assert sorted(nv.scale_byte(s) for s in range(nv.NUM_BLOCKS)) == list(range(nv.NUM_BLOCKS))
    # Block s: scale byte 0x30 + s (e4m3 (1 + (s % 8) / 8) * 2^(s // 8 - 1)), reached by
    # amax = 6 * scale; its other values are code (j % 7) + 1 times the scale, so the
    # latent bytes spell the codes. Rope value i is the e4m3 byte 0x10 + i.
    e4m3 = lambda b: float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())  # noqa: E731
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    kv_c = torch.empty(1, nv.LATENT_DIM)
    codes = []
    for s in range(nv.NUM_BLOCKS):
        scale = e4m3(0x30 + s)
        c = [7] + [(j % 7) + 1 for j in range(1, nv.BLOCK_SIZE)]
        codes += c
        kv_c[0, s * 16:(s + 1) * 16] = torch.tensor([grid[k] * scale for k in c])
    k_pe = torch.tensor([[e4m3(0x10 + i) for i in range(nv.ROPE_DIM)]])
    cache = torch.full((1, 1, nv.ENTRY_BYTES), 0xAA, dtype=torch.uint8)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0]), "nvfp4_ds_mla", torch.ones(1))
    row = cache[0, 0].tolist()
    for s in range(nv.NUM_BLOCKS):
        assert row[nv.SCALE_OFFSET + nv.scale_byte(s)] == 0x30 + s, s
    assert row[nv.ROPE_OFFSET:nv.ROPE_OFFSET + nv.ROPE_DIM] == [0x10 + i for i in range(nv.ROPE_DIM)]
    assert row[nv.LATENT_OFFSET:nv.LATENT_OFFSET + nv.LATENT_DIM // 2] == [
        codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(nv.LATENT_DIM // 2)]


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
