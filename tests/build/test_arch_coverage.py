"""Which binary of the library a GPU runs, decided from the binaries in it.

No device needed: the fatbin entries and the device capability are given, the way
`_fatbin.entries()` and `torch.cuda.get_device_capability()` would report them.
"""
import pytest
import torch

from mla_ext import _ext, _fatbin
from mla_ext._fatbin import Target

SASS = lambda sm, a=False: Target(sm, False, a)  # noqa: E731
PTX = lambda sm, a=False: Target(sm, True, a)  # noqa: E731

NEW_DEFAULT = [SASS(80), SASS(86), SASS(89), SASS(90, True), PTX(90)]
OLD_DEFAULT = [SASS(86), SASS(90, True)]
DEVICES = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0), "sm_100": (10, 0),
           "sm_120": (12, 0)}


@pytest.mark.parametrize("device,want", [
    ("sm_80", "sm_80"), ("sm_86", "sm_86"), ("sm_89", "sm_89"), ("sm_90", "sm_90a"),
    ("sm_100", "compute_90"), ("sm_120", "compute_90"),
])
def test_new_default_list_serves_every_device(device, want):
    assert str(_fatbin.runs_on(NEW_DEFAULT, DEVICES[device])) == want


@pytest.mark.parametrize("device,want", [
    ("sm_80", None), ("sm_86", "sm_86"), ("sm_89", "sm_86"), ("sm_90", "sm_90a"),
    ("sm_100", None), ("sm_120", None),
])
def test_old_list_rules(device, want):
    """sm_86 SASS runs on sm_89 (same major, higher minor) but not on sm_80; sm_90a only on sm_90."""
    got = _fatbin.runs_on(OLD_DEFAULT, DEVICES[device])
    assert (None if got is None else str(got)) == want


def test_rules_in_detail():
    assert _fatbin.runs_on([SASS(90, True)], (9, 0)) == SASS(90, True)
    assert _fatbin.runs_on([SASS(90, True)], (9, 1)) is None  # 'a' = exact arch only
    assert _fatbin.runs_on([PTX(90, True)], (10, 0)) is None  # 'a' PTX too
    assert _fatbin.runs_on([PTX(80)], (8, 0)) == PTX(80)
    assert _fatbin.runs_on([PTX(90)], (8, 9)) is None  # PTX never runs on an older arch
    assert _fatbin.runs_on([SASS(80), PTX(86)], (8, 9)) == SASS(80)  # SASS before a JIT
    assert _fatbin.runs_on([SASS(90), SASS(90, True)], (9, 0)) == SASS(90, True)
    assert _fatbin.runs_on([PTX(80), PTX(90)], (12, 0)) == PTX(90)  # newest PTX that fits
    assert _fatbin.runs_on([], (9, 0)) is None
    assert str(SASS(90, True)) == "sm_90a" and str(PTX(90)) == "compute_90"


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA build holding `targets`, and a visible device of capability `cap`."""
    def install(targets, cap):
        info = {"loaded": True, "cuda": True, "archs": [], "ptx_arch": "", "targets": targets,
                "cubins": [str(t) for t in targets if not t.ptx],
                "ptx": [str(t) for t in targets if t.ptx]}
        monkeypatch.setattr(_ext, "build_info", lambda: info)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return install


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("targets,name", [(NEW_DEFAULT, "new"), (OLD_DEFAULT, "old")])
def test_cuda_kernels_usable_and_the_note(fake_gpu, device, targets, name):
    fake_gpu(targets, DEVICES[device])
    ok, why = _ext.cuda_kernels_usable()
    want = _fatbin.runs_on(targets, DEVICES[device])
    assert ok == (want is not None)
    note = _ext.cuda_target_note()
    if ok:
        assert why == "" and f"{device} runs {want}" in note
        assert ("JIT-compiled from PTX" in note) == want.ptx
    else:
        assert device in why and "sm_86" in why and "not usable" in note


class _OnCuda:
    """Stands in for a CUDA tensor where only the device is read."""
    device = torch.device("cuda", 0)


@pytest.mark.parametrize("device", list(DEVICES))
def test_cache_dispatch_uses_cuda_only_where_a_binary_runs(fake_gpu, device):
    from mla_ext.cache import api

    fake_gpu(NEW_DEFAULT, DEVICES[device])
    inp = api.TensorInputs((_OnCuda(),))
    assert api.WRITE.get("cuda_vector").not_supported_reasons(inp) == []
    fake_gpu(OLD_DEFAULT, DEVICES[device])
    reasons = api.WRITE.get("cuda_vector").not_supported_reasons(inp)
    assert (reasons == []) == (device in ("sm_86", "sm_89", "sm_90"))


def test_this_library_reports_its_targets():
    info = _ext.build_info()
    if not info["cuda"]:
        pytest.skip("built without CUDA kernels")
    assert info["targets"] and all(isinstance(t, Target) for t in info["targets"])
    assert info["cubins"] == [str(t) for t in info["targets"] if not t.ptx]
