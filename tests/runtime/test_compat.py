"""mla_ext.compat: the software-stack probes, and how the dispatchers use them.

The suite runs on torch 2.14 / triton 3.8 (the pins) and on the GPU machine's
torch 2.11 / triton 3.6 / numpy 2.5; these tests hold on both.
"""
import pytest
import torch

from mla_ext import compat
from mla_ext.dispatch import Backend, Dispatcher, NoBackendError, is_triton_backend


def test_interpreter_probe_passes_here_shim_or_not():
    """Under TRITON_INTERPRET=1 (no GPU) the interpreter works after the probe: natively,
    or with the __index__ shim (triton 3.6 + numpy >= 2.4)."""
    if not compat.interpreting():
        pytest.skip("TRITON_INTERPRET is not set (a GPU run)")
    reasons = compat.triton_interpreter_reasons()
    if reasons:  # MLA_EXT_TRITON_SHIM=0 on an incompatible stack: stated, and named
        assert reasons[0].startswith("triton ") and "interpreter is incompatible with numpy" in reasons[0]
        assert compat.triton_interpreter_error() in reasons[0]
        return
    assert compat.triton_interpreter_error() is None
    assert compat._run_interpreter_probe() is None  # still fine on a second run


def test_index_shim_wraps_once_and_keeps_the_original():
    interp = pytest.importorskip("triton.runtime.interpreter")
    if not compat.triton_interpreter_shimmed():
        pytest.skip("the __index__ shim was not installed (not needed here, or MLA_EXT_TRITON_SHIM=0)")
    assert compat._install_index_shim()
    patched = interp._patch_lang_tensor
    assert patched._mla_ext_index_shim and not getattr(patched.__wrapped__, "_mla_ext_index_shim", False)


def test_cpu_rowwise_scaled_mm_reason_matches_what_torch_does():
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        works = True
    except RuntimeError:
        works = False
    reasons = compat.cpu_rowwise_scaled_mm_reasons()
    assert (reasons == []) == works
    if reasons:
        assert torch.__version__ in reasons[0] and "per-tensor scales only" in reasons[0]


def test_triton_backends_carry_the_interpreter_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compat, "_interp_probed", True)
    monkeypatch.setattr(compat, "_interp_error", "TypeError('boom')")
    monkeypatch.setattr(compat, "_interp_reason", "triton 0.0 interpreter is incompatible with numpy 9.9: boom")
    d = Dispatcher("probe_op", [Backend("triton", lambda _: [], lambda _: "triton"),
                                Backend("triton_fast", lambda _: [], lambda _: "triton_fast"),
                                Backend("torch", lambda _: [], lambda _: "torch")])
    assert d(None) == "torch"  # falls back past both Triton backends
    text = d.explain(None)
    assert text.count("interpreter is incompatible with numpy 9.9") == 2 and "[*] torch" in text
    with d.force("triton"), pytest.raises(NoBackendError, match="numpy 9.9"):
        d(None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # not interpreting: nothing to say
    assert d(None) == "triton"


def test_triton_backend_naming_convention():
    assert is_triton_backend("triton") and is_triton_backend("triton_fp8_block")
    assert not is_triton_backend("tritonish") and not is_triton_backend("torch")
