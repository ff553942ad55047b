"""Device rules from issue 19 item 7 / item 5, decided from measured device facts:
the fp8 quantizer refuses (with the reason) where Triton has no fp8, and the latent
kernel's tile is chosen from the device's opt-in shared memory, not its capability.
No device needed: the device queries are stubbed."""
from types import SimpleNamespace

import pytest
import torch

from mla_ext.attention import triton_latent as TL
from mla_ext.kv_b_proj import quant

KB = 1024


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                    ((12, 0), True)])
def test_fp8_quantizer_reasons(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    why = quant.triton_reasons(torch.device("cuda", 0))
    assert (why == []) == ok
    if not ok:
        assert "sm_89+" in why[0] and f"sm_{cap[0]}{cap[1]}" in why[0]
    assert quant.triton_reasons("cpu") == []


def test_fp8_quantizer_refuses_a_forced_launch(monkeypatch):
    monkeypatch.setattr(quant, "triton_reasons", lambda device: ["no fp8 here"])
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="use_triton: no fp8 here"):
        quant.per_token_group_quant_fp8(x, use_triton=True)
    q, s = quant.per_token_group_quant_fp8(x)  # the default takes the torch path
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 1)


@pytest.mark.parametrize("cap,smem,big", [((8, 0), 163 * KB, True), ((8, 6), 99 * KB, False),
                                          ((8, 9), 99 * KB, False), ((9, 0), 227 * KB, True),
                                          ((10, 0), 227 * KB, True), ((12, 0), 99 * KB, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latent_tile_follows_shared_memory_not_capability(monkeypatch, cap, smem, big, dtype):
    monkeypatch.setattr(TL, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(shared_memory_per_block_optin=smem))
    got = TL.launch_config(64, dtype, torch.device("cuda", 0))
    assert got == TL.GPU_CONFIGS[(dtype == torch.float32, big)]
