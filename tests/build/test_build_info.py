"""The library says honestly what it was built with."""
import os

import pytest
import torch

from mla_ext import _ext, _fatbin


def test_library_loaded():
    assert _ext.available(), _ext.load_error()


def test_cubins_match_the_arch_list():
    info = _ext.build_info()
    if not info["cuda"]:
        pytest.skip("built without CUDA kernels")
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;8.6;8.9;9.0a"
    ptx = os.environ.get("MLA_EXT_CUDA_PTX", "9.0")
    want = {"sm_" + a.replace(".", "").replace("+PTX", "") for a in archs.replace(",", ";").split(";") if a}
    # The compiled-in list and the cubins actually in the .so agree.
    assert {"sm_" + a.replace(".", "").replace("+PTX", "") for a in info["archs"]} == want
    assert set(info["cubins"]) == want, info["cubins"]
    want_ptx = {"compute_" + a.replace(".", "").replace("+PTX", "")
                for a in archs.replace(",", ";").split(";") if a.endswith("+PTX")}
    if ptx:
        want_ptx.add("compute_" + ptx.replace(".", ""))
    assert info["ptx_arch"] == ptx and set(info["ptx"]) == want_ptx, info["ptx"]


def test_fatbin_reader_on_a_non_cuda_file(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf")
    assert _fatbin.targets(str(p)) == []


def test_cuda_usable_reason_is_stated():
    ok, why = _ext.cuda_kernels_usable()
    assert ok == (torch.cuda.is_available() and _ext.build_info()["cuda"]) or why
