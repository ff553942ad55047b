"""Dispatch by measurement (mla_ext.dispatch): a per-device table of measured
buckets picks the fastest usable backend; without a measurement the stated order
(with its heuristics) decides; `explain()` says which, naming the table file, the
key and the numbers. Synthetic tables only: no GPU measurement exists yet."""
import json

import pytest
import torch

from mla_ext import dispatch as D
from mla_ext.dispatch import Backend, Dispatcher, NoBackendError

DEVICE = "Fake GPU 9000"


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch):
    monkeypatch.delenv(D.TABLES_ENV, raising=False)
    D.clear_table_cache()
    yield
    D.clear_table_cache()


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def _table(entries, device=DEVICE, op="toy"):
    return {"format": 1, "device": device, "ops": {op: {"source": "synthetic", "entries": entries}}}


def _toy(tmp_path, key=lambda x: (DEVICE, [f"M={x['M']}", f"M={x['M'] * 2}"])):
    """a: usable but its heuristic says no above M=8; b: usable; c: never usable."""
    return Dispatcher("toy", [
        Backend("a", lambda x: [], lambda x: "a", lambda x: ["M > A_MAX_M=8"] if x["M"] > 8 else []),
        Backend("b", lambda x: [], lambda x: "b"),
        Backend("c", lambda x: ["c needs a device this is not"], lambda x: "c"),
    ], table_key=key, tables_dir=str(tmp_path))


def test_device_slug_and_pow2_buckets():
    assert D.device_slug("NVIDIA H200") == "nvidia_h200"
    assert D.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    with pytest.raises(ValueError, match="device name: expected a non-empty str"):
        D.device_slug("")
    assert D.pow2_buckets(3000, 0) == [4096]
    assert D.pow2_buckets(4096, 2) == [4096, 2048, 8192, 1024, 16384]
    assert D.pow2_buckets(1, 1) == [1, 2] and D.pow2_buckets(0, 0) == [1]


def test_no_table_for_the_device_means_the_stated_order(tmp_path):
    d = _toy(tmp_path)
    assert d({"M": 4}) == "a"
    assert d({"M": 64}) == "b"  # a's heuristic applies
    text = d.explain({"M": 64})
    assert f"choice: no measurement for {DEVICE}: stated order" in text
    assert "[x] a: M > A_MAX_M=8" in text and "[*] b" in text


def test_the_measured_fastest_usable_backend_wins_over_the_heuristics(tmp_path):
    path = _write(tmp_path / "fake_gpu_9000.json",
                  _table({"M=64": {"order": ["c", "a", "b"], "us": {"c": 1.0, "a": 2.0, "b": 3.5}}}))
    d = _toy(tmp_path)
    assert d({"M": 64}) == "a"  # c cannot serve; a's M rule is not applied: it was measured faster
    dec = d.decide({"M": 64})
    assert dec.entry is not None and dec.entry.key == "M=64" and dec.entry.path == str(path)
    text = d.explain({"M": 64})
    assert "uses 'a'" in text
    assert f"dispatch table {path} [toy] 'M=64': measured c 1 us, a 2 us, b 3.5 us" in text
    assert "[*] a\n" in text + "\n" and "A_MAX_M" not in text  # rules not applied are not listed
    assert d({"M": 4}) == "a"  # no entry for M=4 (nor M=8): stated order
    assert "no measurement for Fake GPU 9000 in" in d.explain({"M": 4})


def test_the_nearest_listed_bucket_is_used_and_named(tmp_path):
    _write(tmp_path / "fake_gpu_9000.json", _table({"M=64": {"order": ["b", "a"], "us": {"b": 1, "a": 2}}}))
    d = _toy(tmp_path)
    assert d({"M": 32}) == "b"  # "M=32" is missing, its fallback "M=64" is there
    assert "'M=64' (nearest measured bucket to 'M=32')" in d.explain({"M": 32})


def test_a_measurement_with_no_usable_backend_falls_back_to_the_stated_order(tmp_path):
    _write(tmp_path / "fake_gpu_9000.json", _table({"M=64": {"order": ["c", "zzz"], "us": {"c": 1}}}))
    d = _toy(tmp_path)
    assert d({"M": 64}) == "b"  # unknown names are skipped; a's heuristic applies again
    assert "none of these can serve these inputs: stated order" in d.explain({"M": 64})


def test_forcing_beats_the_table_and_the_table_can_be_turned_off(tmp_path, monkeypatch):
    _write(tmp_path / "fake_gpu_9000.json", _table({"M=64": {"order": ["a", "b"], "us": {}}}))
    d = _toy(tmp_path)
    with d.force("b"):
        assert d({"M": 64}) == "b"
        assert "choice: forced" in d.explain({"M": 64})
    with d.force("c"), pytest.raises(NoBackendError, match="forced backend 'c'"):
        d({"M": 64})
    with d.force("c"):
        assert "forced 'c', which cannot serve these inputs" in d.explain({"M": 64})
    d.tables_dir = None
    monkeypatch.setenv(D.TABLES_ENV, str(tmp_path))
    assert d({"M": 64}) == "a"
    monkeypatch.setenv(D.TABLES_ENV, "off")
    assert d({"M": 64}) == "b" and "dispatch tables are off" in d.explain({"M": 64})


@pytest.mark.parametrize("bad", [
    "{not json",
    json.dumps({"format": 2, "ops": {}}),
    json.dumps({"format": 1, "ops": {"toy": {"entries": {"M=64": {"order": []}}}}}),
    json.dumps({"format": 1, "ops": {"toy": {"entries": {"M=64": {"order": ["a"], "us": {"a": "fast"}}}}}}),
])
def test_an_unusable_table_is_reported_and_ignored(tmp_path, bad):
    (tmp_path / "fake_gpu_9000.json").write_text(bad)
    d = _toy(tmp_path)
    assert d({"M": 64}) == "b"
    assert "is unusable (" in d.explain({"M": 64}) and "stated order" in d.explain({"M": 64})


def test_a_table_of_another_device_or_op_is_not_used(tmp_path):
    _write(tmp_path / "fake_gpu_9000.json", _table({"M=64": {"order": ["a"]}}, device="Fake GPU 9000 NVL"))
    d = _toy(tmp_path)
    assert d({"M": 64}) == "b" and "was measured on 'Fake GPU 9000 NVL'" in d.explain({"M": 64})
    D.clear_table_cache()
    _write(tmp_path / "fake_gpu_9000.json", _table({"M=64": {"order": ["a"]}}, op="other"))
    assert d({"M": 64}) == "b" and "for op 'toy'" in d.explain({"M": 64})


def test_a_failing_table_key_never_fails_dispatch(tmp_path):
    def boom(x):
        raise RuntimeError("no device name")

    d = _toy(tmp_path, key=boom)
    assert d({"M": 64}) == "b"
    assert "dispatch table key failed (RuntimeError: no device name): stated order" in d.explain({"M": 64})


def test_dispatchers_without_a_table_key_explain_as_before():
    d = Dispatcher("plain", [Backend("x", lambda _: [], lambda _: 1)])
    assert d.explain(None) == "plain: uses 'x'\n  [*] x"


def test_write_table_entries_merges_by_op_and_key(tmp_path):
    path = str(tmp_path / "t" / "fake_gpu_9000.json")
    D.write_table_entries(path, DEVICE, "op1", {"k1": {"order": ["a", "b"], "us": {"a": 1, "b": 2}}}, "run 1")
    D.write_table_entries(path, DEVICE, "op2", {"k1": {"order": ["x"]}})
    data = D.write_table_entries(path, DEVICE, "op1", {"k1": {"order": ["b", "a"]}, "k2": {"order": ["a"]}})
    assert data == json.load(open(path))
    assert data["device"] == DEVICE and data["format"] == D.TABLE_FORMAT
    assert data["ops"]["op1"]["source"] == "run 1"
    assert data["ops"]["op1"]["entries"] == {"k1": {"order": ["b", "a"]}, "k2": {"order": ["a"]}}
    assert data["ops"]["op2"]["entries"] == {"k1": {"order": ["x"]}}
    entry, _ = D.lookup("op1", DEVICE, ["k9", "k2"], str(tmp_path / "t"))
    assert entry.key == "k2" and entry.order == ("a",)
    with pytest.raises(ValueError, match="order must be a non-empty list"):
        D.write_table_entries(path, DEVICE, "op1", {"k3": {"order": []}})


# -- kv_b_proj on a (pretended) H200 ---------------------------------------------------

from mla_ext.kv_b_proj import KvBProj  # noqa: E402
from mla_ext.kv_b_proj import linear as L  # noqa: E402
from mla_ext.kv_b_proj import scaled_mm_block as S  # noqa: E402
from mla_ext.kv_b_proj import weights as W  # noqa: E402
from mla_ext.compat import triton_interpreter_reasons  # noqa: E402


@pytest.fixture
def h200(monkeypatch, tmp_path):
    """A pretended sm_90 'NVIDIA H200' whose blockwise probe passed (only choices are
    tested, nothing runs on it) and a tables folder under tmp_path."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(L, "_DEVICE_NAMES", {})
    monkeypatch.setitem(S._PROBED, ("cuda", 0, torch.bfloat16), None)
    monkeypatch.setenv(D.TABLES_ENV, str(tmp_path))
    return tmp_path


def _layer(recipe, n=256, k=512):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
    return KvBProj(W.quantize(recipe, w, torch.bfloat16))


def _key(layer, m):
    return L.table_bucket(layer.weight_format.name, torch.bfloat16, torch.bfloat16, layer.K, layer.N, m)


def test_kv_b_proj_without_a_table_uses_the_stated_order(h200):
    layer = _layer("fp8_block")
    assert layer.backend_for(4096, device="cuda") == "scaled_mm_block"
    assert "choice: no measurement for NVIDIA H200: stated order" in layer.explain(4096, device="cuda")


def test_kv_b_proj_table_picks_the_measured_fastest_and_explains_it(h200):
    layer = _layer("fp8_block")
    key = _key(layer, 16384)
    assert key == "fp8_block/bfloat16/x=bfloat16/K=512/N=256/M=16384"
    path = _write(h200 / "nvidia_h200.json", {"format": 1, "device": "NVIDIA H200", "ops": {"kv_b_proj": {
        "entries": {key: {"order": ["dequant_dense", "scaled_mm_block", "triton_fp8_block"],
                          "us": {"dequant_dense": 40.0, "scaled_mm_block": 41.5, "triton_fp8_block": 60.0}}}}}})
    assert layer.backend_for(16384, device="cuda") == "dequant_dense"
    assert layer.backend_for(3 << 15, device="cuda") == "dequant_dense"  # bucket 131072: 3 octaves away
    text = layer.explain(10000, device="cuda")  # bucket 16384
    assert f"dispatch table {path} [kv_b_proj] '{key}': measured dequant_dense 40 us, scaled_mm_block 41.5 us" in text
    assert "uses 'dequant_dense'" in text
    assert layer.backend_for(1 << 20, device="cuda") == "scaled_mm_block"  # too far from any measurement
    assert layer.backend_for(16384, device="cuda", act_dtype=torch.float8_e4m3fn) == "scaled_mm_block"  # other bucket


def test_kv_b_proj_measurement_overrides_an_m_threshold(h200):
    layer = _layer("marlin_fp8")
    m = 4 * L.MARLIN_MAX_M
    assert layer.backend_for(m, device="cuda") == "dequant_dense"  # M > MARLIN_MAX_M
    _write(h200 / "nvidia_h200.json", {"format": 1, "device": "NVIDIA H200", "ops": {"kv_b_proj": {
        "entries": {_key(layer, m): {"order": ["marlin_w8a16", "dequant_dense"], "us": {}}}}}})
    D.clear_table_cache()
    if L._marlin_module()[0] is None:
        pytest.skip(L._marlin_module()[1])
    assert layer.backend_for(m, device="cuda") == "marlin_w8a16"


def test_kv_b_proj_table_skips_a_measured_backend_that_cannot_serve(h200, monkeypatch):
    layer = _layer("fp8_block")
    _write(h200 / "nvidia_h200.json", {"format": 1, "device": "NVIDIA H200", "ops": {"kv_b_proj": {
        "entries": {_key(layer, 4096): {"order": ["scaled_mm_block", "triton_fp8_block", "dequant_dense"]}}}}})
    monkeypatch.setitem(S._PROBED, ("cuda", 0, torch.bfloat16), "torch._scaled_mm of torch 0.0 does not take it")
    want = "dequant_dense" if triton_interpreter_reasons() else "triton_fp8_block"
    assert layer.backend_for(4096, device="cuda") == want
    assert "measured fastest usable backend" in layer.explain(4096, device="cuda")


def test_the_committed_tables_are_valid():
    """Every table committed in mla_ext/dispatch_tables/ reads without error and names
    only registered backends for the ops it has."""
    import glob
    import os

    known = {"kv_b_proj": {b.name for b in L.DISPATCH.backends}}
    for path in glob.glob(os.path.join(D.TABLES_DIR, "*.json")):
        data, err = D.read_table(path)
        assert err is None, (path, err)
        assert os.path.basename(path) == D.device_slug(data["device"]) + ".json"
        for op, sec in data["ops"].items():
            for key, e in sec["entries"].items():
                assert set(e["order"]) <= known.get(op, set(e["order"])), (path, op, key)
