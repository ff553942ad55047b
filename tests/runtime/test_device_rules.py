"""Device rules decided from measured device facts:
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


@pytest.mark.parametrize("cap,smem,wgmma", [((8, 0), 163 * KB, False), ((8, 6), 99 * KB, False),
                                            ((8, 9), 99 * KB, False), ((9, 0), 227 * KB, True),
                                            ((9, 0), 99 * KB, False), ((10, 0), 227 * KB, False),
                                            ((12, 0), 99 * KB, False), ((8, 6), 64 * KB, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [TL.MODE_DS_MLA, TL.MODE_NVFP4_DS_MLA])
@pytest.mark.parametrize("heads", [1, 2, 3, 16, 128])
def test_latent_tile_follows_the_mma_instruction_and_shared_memory(monkeypatch, cap, smem, wgmma, dtype, mode,
                                                                    heads):
    """64-row wgmma tiles only where wgmma exists (sm_90), the shared memory holds them and
    they compile without spills (not for 1-2 heads per token); every tile a
    device gets fits its measured opt-in shared memory (a 64 KB device gets the small tile,
    an sm_90 limited to 99 KB the mma.sync one)."""
    monkeypatch.setattr(TL, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(shared_memory_per_block_optin=smem))
    got = TL.launch_config(64, dtype, torch.device("cuda", 0), mode, heads)
    nvfp4 = mode == TL.MODE_NVFP4_DS_MLA
    wgmma = wgmma and heads >= 3
    if dtype == torch.float32:
        assert got == TL.FP32_TILE  # 72 KB: every sm_80+ device has at least 99 KB
    elif wgmma:
        assert got == TL.WGMMA_TILE
    elif smem < 99 * KB:
        assert got == TL.SMALL_TILE
    else:
        assert got == (TL.MMA_TILE_NVFP4 if nvfp4 else TL.MMA_TILE)
    if dtype != torch.float32:
        assert TL.TILE_SMEM[got] <= smem
