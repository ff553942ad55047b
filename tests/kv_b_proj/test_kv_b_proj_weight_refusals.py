"""Weight formats refuse what would silently poison the output:
e4m3 NaN bytes in fp8 weights, non-integer group sizes."""
import pytest
import torch

from mla_ext.kv_b_proj import weights as W


def _fp8_with_nan(n=256, k=256, where=(130, 7), byte=0x7F):
    torch.manual_seed(0)
    q = (torch.randn(n, k) * 0.3).to(torch.float8_e4m3fn)
    raw = q.view(torch.uint8).clone()
    raw[where] = byte
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
@pytest.mark.parametrize("build", [
    lambda w: W.Fp8Weight(w, torch.rand(w.shape[0]) + 0.5, torch.bfloat16),
    lambda w: W.Fp8Weight(w, torch.tensor([0.7]), torch.bfloat16),
    lambda w: W.Fp8BlockWeight(w, torch.rand(2, 2) + 0.5, torch.bfloat16),
    lambda w: W.MarlinFp8Weight.from_checkpoint(w, torch.rand(w.shape[0]) + 0.5, torch.bfloat16),
    lambda w: W.MarlinFp8Weight.from_checkpoint(w, torch.rand(2, 2) + 0.5, torch.bfloat16,
                                                block_size=(128, 128)),
], ids=["per_channel", "per_tensor", "block", "marlin", "marlin_block"])
def test_fp8_nan_bytes_are_refused_with_their_place(build, byte):
    with pytest.raises(ValueError, match=r"weight: expected finite e4m3 values; found 1 NaN bytes "
                                         r"\(0x7F/0xFF\), the first at \[130, 7\]"):
        build(_fp8_with_nan(byte=byte))


def test_finite_fp8_weights_still_accepted():
    torch.manual_seed(1)
    w = (torch.randn(256, 256) * 0.3).to(torch.float8_e4m3fn)
    assert W.Fp8Weight(w, torch.tensor([0.5]), torch.bfloat16).N == 256
    assert W.Fp8BlockWeight(w, torch.rand(2, 2) + 0.5, torch.bfloat16).K == 256


@pytest.mark.parametrize("group_size", [64.0, True, "64", 0, -64])
def test_int4_group_size_must_be_a_positive_int(group_size):
    torch.manual_seed(2)
    ok = W.Int4GroupWeight.from_dense(torch.randn(64, 128), group_size=64,
                                      params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"group_size: expected an int >= 1, got {group_size!r}"):
        W.Int4GroupWeight(ok.qweight, ok.scales, group_size, torch.bfloat16)


def test_int4_from_dense_checks_group_size_first():
    with pytest.raises(ValueError, match=r"group_size: expected an int >= 1, got 64.0"):
        W.Int4GroupWeight.from_dense(torch.randn(64, 128), group_size=64.0,
                                     params_dtype=torch.bfloat16)


def test_kv_b_proj_out_overlapping_x_is_an_error():
    from mla_ext.kv_b_proj.linear import KvBProj

    torch.manual_seed(3)
    lin = KvBProj(W.DenseWeight.from_dense(torch.randn(64, 32), torch.float32))
    buf = torch.randn(8, 96)
    x = buf[:, :32]
    with pytest.raises(ValueError, match="out.*x"):
        lin(x, out=buf[:, 16:80])          # shares columns 16..31 with x
    with pytest.raises(ValueError, match="out: its elements overlap"):
        lin(x, out=torch.empty(1, 64).expand(8, 64))
    ok = lin(x, out=buf[:, 32:96])          # disjoint column slice of the same buffer
    torch.testing.assert_close(ok, x @ lin.weight_format.dequantize_fp32().t())


def test_dense_weight_is_built_once_under_a_lock_and_prepare_builds_it():
    import threading

    from mla_ext.kv_b_proj.linear import KvBProj

    torch.manual_seed(4)
    lin = KvBProj(W.Fp8BlockWeight.from_dense(torch.randn(256, 128) / 11, torch.bfloat16))
    assert lin.prepare() is lin and len(lin._dense_cache) == 1
    got = []
    threads = [threading.Thread(target=lambda: got.append(lin.dense_weight(torch.float16, "cpu")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is got[0] for g in got) and len(lin._dense_cache) == 2


def test_vllm_marlin_nvfp4_layer_is_refused_not_read_as_marlin_fp8():
    import types

    from mla_ext.kv_b_proj.from_module import weight_format_from_module

    layer = types.SimpleNamespace(
        weight=torch.randint(-2**31, 2**31 - 1, (512 // 16, 4 * 256), dtype=torch.int32),
        weight_scale=torch.rand(512 // 16, 256).to(torch.bfloat16),
        weight_scale_2=torch.tensor([0.01]), workspace=torch.zeros(4, dtype=torch.int32),
        params_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Marlin NVFP4 layout, which is not supported"):
        weight_format_from_module(layer)
