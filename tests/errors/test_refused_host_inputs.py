"""Host-side inputs (Python API and CLI) found by fuzzing that hung, gave silently
wrong results, or failed with a vague error (AttributeError, UnicodeDecodeError,
RecursionError, a traceback in the CLI). Each must now be a prompt ValueError
naming the argument and what was expected, or a documented, correct result."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from mla_ext import cli
from mla_ext.prefill import context_parallel as cp
from mla_ext.kv_b_proj.input_dtype import kv_b_proj_input_dtype
from mla_ext.config.models import MAX_NUM_LAYERS, MLAModelConfig, get_model_config, load_hf_config
from mla_ext.config.planner import MAX_NUM_BLOCKS, plan_model, plan_pool, render_plan
from mla_ext.config.policy import CacheConfig, check_bool, resolve_layer, resolve_model
from mla_ext.prefill.chunking import (
    INT32_MAX,
    MAX_CONTEXT_CHUNKS,
    host_to_device,
    plan_context_chunks,
    workspace_rows,
)
from mla_ext.prefill.layer import MLAPrefill, PrefillMetadata
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.numeric import rel_fro
from helpers.prefill import BLOCK, TINY, Batch, make_weight

V3_JSON = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "num_attention_heads": 16, "num_hidden_layers": 4,
           "max_position_embeddings": 4096}
NATIVE = CacheConfig("auto", block_size=BLOCK)


@contextlib.contextmanager
def within(seconds: int):
    """Fails (instead of hanging the suite) if the body runs longer than `seconds`."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s (a loop whose length comes from input)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _weight(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(TINY.num_heads * (TINY.P + TINY.V), TINY.L, generator=gen) / math.sqrt(TINY.L)
    return make_weight("dense", w)


def _layer(**kw) -> MLAPrefill:
    kw.setdefault("workspace_rows_override", 32)
    return MLAPrefill(TINY, NATIVE, _weight(), layer=1, **kw)


def _reference(batch, layer, cache):
    kv_c, k_pe = batch.cached_rows(layer, cache)
    return mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new, kv_c, k_pe, batch.q_lens,
                                 layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                 layer.softmax_scale)


def _inputs(batch):
    return batch.q, batch.kv_c_new, batch.k_pe_new


# -- hangs ---------------------------------------------------------------------

@pytest.mark.parametrize("ctx", [10**12, 2**31])
def test_forward_with_huge_context_lens_and_a_3_block_table_raises_at_once(ctx):
    batch = Batch(ctx_lens=[40], q_lens=[2], seed=1)  # table: 3 blocks of 16
    layer = _layer(workspace_rows_override=65536)
    cache = batch.fill_cache(layer, None)
    meta = PrefillMetadata(batch.block_table, [ctx], [2])
    with within(10), pytest.raises(ValueError, match=r"context_lens\[0\].*block_table"):
        layer(*_inputs(batch), cache, meta)


def test_plan_of_an_absurd_context_is_a_prompt_error():
    with within(5), pytest.raises(ValueError, match=r"context_lens\[0\]: expected .*2147483647"):
        plan_context_chunks([10**12], [1], 65536, 64)


def test_chunk_count_is_bounded_with_a_clear_error():
    # Within int32, but 33 million chunks of a 64-row workspace.
    with within(5), pytest.raises(ValueError, match="workspace_rows: .* chunks"):
        plan_context_chunks([INT32_MAX], [1], 64, 64)
    # Just at the limit still plans, in time proportional to the chunks.
    with within(10):
        plan = plan_context_chunks([MAX_CONTEXT_CHUNKS * 64], [1], 64, 64)
    assert plan.num_chunks == MAX_CONTEXT_CHUNKS


def test_query_rows_must_fit_int32():
    with pytest.raises(ValueError, match="query_lens: .*int32"):
        plan_context_chunks([1, 1], [2**30, 2**30], 64, 16)


def test_workspace_rows_fit_int32():
    with pytest.raises(ValueError, match="workspace_rows: expected .*2147483647"):
        plan_context_chunks([1], [1], 2**31, 16)
    with pytest.raises(ValueError, match="override .*2147483647"):
        workspace_rows(4096, 8, 16, override=10**12)


def _config_file(tmp_path, **over):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**V3_JSON, **over}))
    return path


def test_config_with_a_billion_layers_is_rejected_at_once(tmp_path, capsys):
    path = _config_file(tmp_path, num_hidden_layers=10**9, sliding_window=4)
    with within(5), pytest.raises(ValueError, match=f"num_hidden_layers .*<= {MAX_NUM_LAYERS}"):
        load_hf_config(path)
    with within(5):
        rc = cli.main(["plan", "--model", str(path), "--memory", "1GiB"])
    _, err = capsys.readouterr()
    assert rc == 2 and str(path) in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="num_layers must be an integer <= 1024"):
        MLAModelConfig("m", L=8, R=0, P=8, V=8, num_heads=1, num_layers=10**9)


def test_plan_model_with_a_billion_layers_is_rejected():
    with pytest.raises(ValueError, match="num_layers"):
        plan_model(NATIVE, MLAModelConfig("m", L=8, R=0, P=8, V=8, num_heads=1,
                                          num_layers=MAX_NUM_LAYERS + 1), 2**30)


# -- silently wrong results ----------------------------------------------------

def test_block_table_narrower_than_the_context_raises():
    batch = Batch(ctx_lens=[40, 20], q_lens=[2, 3], seed=1)
    layer = _layer(validate=False)  # the host check is always on
    cache = batch.fill_cache(layer, None)
    narrow = batch.block_table[:, :2].contiguous()  # 32 tokens, request 0 has 40
    with pytest.raises(ValueError, match=r"context_lens\[0\]: 40 tokens need 3 blocks of 16, "
                                         r"but metadata.block_table has 2 columns"):
        layer(*_inputs(batch), cache, PrefillMetadata(narrow, batch.ctx_lens, batch.q_lens))
    out = layer(*_inputs(batch), cache, PrefillMetadata(batch.block_table, batch.ctx_lens,
                                                        batch.q_lens))
    assert rel_fro(out, _reference(batch, layer, cache)) <= 1e-2


def test_bad_block_id_is_caught_by_validate():
    batch = Batch(ctx_lens=[40, 20], q_lens=[2, 3], seed=1)
    cache = batch.fill_cache(_layer(), None)
    bad = batch.block_table.clone()
    bad[0, 1] = cache.shape[0]  # one past the last block
    meta = PrefillMetadata(bad, batch.ctx_lens, batch.q_lens)
    match = rf"block_table: request 0, logical block 1 holds block id {cache.shape[0]}, outside"
    for layer, kw in ((_layer(validate=True), {}), (_layer(), {"validate": True}),
                      (_layer(), {})):  # default: checked when the table is on the CPU (free)
        with pytest.raises(ValueError, match=match):
            layer(*_inputs(batch), cache, meta, **kw)
    # Off on request: the gather's documented out-of-range result (zero rows), no error.
    out = _layer()(*_inputs(batch), cache, meta, validate=False)
    assert out.shape == (5, TINY.num_heads, TINY.V)


def test_validate_must_be_a_bool():
    with pytest.raises(ValueError, match="validate: expected a bool"):
        _layer(validate="no")
    batch = Batch(ctx_lens=[8], q_lens=[2], seed=3)
    layer = _layer()
    with pytest.raises(ValueError, match="validate: expected a bool"):
        layer(*_inputs(batch), batch.fill_cache(layer, None), batch.metadata(), validate=1)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 2.0, torch.tensor(False)])
def test_booleans_must_be_bool(value):
    with pytest.raises(ValueError, match="use_fp8_prefill: expected a bool"):
        MLAPrefill(TINY, NATIVE, _weight(), layer=1, use_fp8_prefill=value)
    with pytest.raises(ValueError, match="use_fp8_prefill: expected a bool"):
        kv_b_proj_input_dtype(make_weight("fp8_block", torch.randn(128, 512)), value)
    with pytest.raises(ValueError, match="calculate_kv_scales: expected a bool"):
        CacheConfig("fp8", calculate_kv_scales=value)


def test_numpy_bools_are_bools():
    assert check_bool(np.bool_(True), "x") is True
    assert CacheConfig("fp8", calculate_kv_scales=np.True_).calculate_kv_scales is True
    layer = MLAPrefill(TINY, NATIVE, make_weight("fp8_block", torch.randn(128, 512)), layer=1,
                       use_fp8_prefill=np.False_)
    assert layer.use_fp8_prefill is False and layer.activation_dtype == torch.bfloat16
    w = make_weight("fp8_block", torch.randn(128, 512))
    assert kv_b_proj_input_dtype(w, np.True_) == torch.float8_e4m3fn


def test_plan_model_caps_blocks_at_int32_ids(capsys):
    model = MLAModelConfig("one-layer", L=8, R=0, P=8, V=8, num_heads=1, num_layers=1)
    plan = plan_model(CacheConfig("auto", block_size=1), model, 10**18)
    assert plan.num_blocks == MAX_NUM_BLOCKS == 2**31 - 1 and plan.block_id_limited
    assert plan.bytes_used <= plan.budget
    assert plan.to_dict()["block_id_limited"] is True
    assert "int32 block ids" in plan.format_table()
    rc = cli.main(["plan", "--model", "deepseek-v3", "--block-size", "1", "--memory", "1000TiB"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "2,147,483,647 of 1 tokens" in out and "int32 block ids" in out


def test_plan_within_int32_is_not_flagged():
    plan = plan_model(NATIVE, TINY, 2**30)
    assert not plan.block_id_limited and "int32" not in plan.format_table()


def test_metadata_is_immutable():
    batch = Batch(ctx_lens=[40, 20], q_lens=[2, 3], seed=1)
    layer = _layer()
    cache = batch.fill_cache(layer, None)
    meta = batch.metadata()
    layer(*_inputs(batch), cache, meta)  # caches a chunk plan
    with pytest.raises(ValueError, match="context_lens: PrefillMetadata is immutable.*new PrefillMetadata"):
        meta.context_lens = (20, 20)
    for name in ("block_table", "query_lens", "k_scale", "block_size", "_plans"):
        with pytest.raises(ValueError, match="immutable"):
            setattr(meta, name, None)
    with pytest.raises(ValueError, match="immutable"):
        del meta.query_lens
    assert meta.context_lens == (40, 20)
    # The right way: a new metadata, a new plan, a correct result.
    short = PrefillMetadata(batch.block_table, (20, 20), batch.q_lens)
    kv_c, k_pe = batch.cached_rows(layer, cache)
    ref = mla_prefill_reference(batch.q, batch.kv_c_new, batch.k_pe_new,
                                [kv_c[0][:20], kv_c[1]], [k_pe[0][:20], k_pe[1]], batch.q_lens,
                                layer.kv_b_proj.weight_format.dequantize_fp32(), TINY.P, TINY.V,
                                layer.softmax_scale)
    assert rel_fro(layer(*_inputs(batch), cache, short), ref) <= 1e-2


def test_metadata_built_for_another_block_size_is_rejected():
    batch = Batch(ctx_lens=[40, 20], q_lens=[2, 3], seed=1)
    meta16 = PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, block_size=16)
    layer32 = MLAPrefill(TINY, CacheConfig("auto", block_size=32), _weight(), layer=1,
                         workspace_rows_override=64)
    cache32 = torch.randn(8, 32, TINY.L + TINY.R).to(torch.bfloat16)
    with pytest.raises(ValueError, match="metadata: built for block_size 16, but layer 1 has block_size 32"):
        layer32(*_inputs(batch), cache32, meta16)
    with pytest.raises(ValueError, match="block_size: expected a positive integer"):
        PrefillMetadata(batch.block_table, batch.ctx_lens, batch.q_lens, block_size=16.0)


def test_cached_plans_are_keyed_on_rows_and_alignment():
    meta = PrefillMetadata(torch.zeros(1, 8, dtype=torch.int32), [100], [1])
    a, b, c = meta.plan(32, 16), meta.plan(64, 16), meta.plan(32, 32)
    assert (a.workspace_rows, a.alignment) == (32, 16) and a.num_chunks == 4
    assert (b.workspace_rows, b.alignment) == (64, 16) and b.num_chunks == 2
    assert (c.workspace_rows, c.alignment) == (32, 32) and c.num_chunks == 4
    assert meta.plan(32, 16) is a


# -- vague errors --------------------------------------------------------------

def test_wrong_config_objects_name_the_argument():
    w = _weight()
    with pytest.raises(ValueError, match="model: expected an MLAModelConfig"):
        MLAPrefill({"L": 512}, NATIVE, w, layer=1)
    with pytest.raises(ValueError, match="cache_config: expected a CacheConfig"):
        MLAPrefill(TINY, {"kv_cache_dtype": "auto"}, w, layer=1)
    with pytest.raises(ValueError, match="context_parallel: expected a ContextParallel"):
        MLAPrefill(TINY, NATIVE, w, layer=1, context_parallel={"cp_size": 2})
    with pytest.raises(ValueError, match="cache_config: expected a CacheConfig"):
        resolve_layer({"kv_cache_dtype": "auto"}, TINY, layer=0)
    with pytest.raises(ValueError, match="model_config: expected an MLAModelConfig"):
        resolve_model(NATIVE, "deepseek-v3")
    with pytest.raises(ValueError, match="cache_config: expected a CacheConfig"):
        plan_model({}, TINY, 2**30)
    with pytest.raises(ValueError, match="model_config: expected an MLAModelConfig"):
        render_plan({}, NATIVE, 2**30)
    with pytest.raises(ValueError, match="layer_specs: expected an iterable"):
        plan_pool(5, 2**30)


def test_non_tensor_arguments_name_the_argument():
    batch = Batch(ctx_lens=[8], q_lens=[2], seed=3)
    layer = _layer()
    cache = batch.fill_cache(layer, None)
    meta = batch.metadata()
    q, kv, pe = _inputs(batch)
    cases = [
        ("q", (q.tolist(), kv, pe, cache, meta)),
        ("kv_c_normed", (q, kv.tolist(), pe, cache, meta)),
        ("k_pe", (q, kv, pe.tolist(), cache, meta)),
        ("kv_cache", (q, kv, pe, cache.tolist(), meta)),
        ("metadata", (q, kv, pe, cache, {"context_lens": [8]})),
    ]
    for name, args in cases:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            layer(*args)
    with pytest.raises(ValueError, match="clock: expected"):
        layer(q, kv, pe, cache, meta, clock=object())
    with pytest.raises(ValueError, match="k_scale: expected"):
        MLAPrefill(TINY, CacheConfig("fp8", block_size=BLOCK), _weight(), layer=1)(
            q, kv, pe, torch.randint(0, 120, (4, BLOCK, TINY.L + TINY.R), dtype=torch.uint8), meta,
            k_scale=[0.5])


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_table=[[0, 1]]), "block_table: expected an int32 tensor"),
    (dict(context_lens=8), r"context_lens: expected a sequence of ints >= 0 .*, got int"),
    (dict(query_lens=None), r"query_lens: expected a sequence of ints >= 0 .*, got NoneType"),
    (dict(k_scale=0.5), "k_scale: expected a float32 tensor"),
])
def test_metadata_arguments_are_checked(kwargs, match):
    args = dict(block_table=torch.zeros(1, 2, dtype=torch.int32), context_lens=[8], query_lens=[2])
    with pytest.raises(ValueError, match=match):
        PrefillMetadata(**{**args, **kwargs})


@pytest.mark.parametrize("args, match", [
    ((8, [1], 64, 16), "context_lens: expected a sequence"),
    (([8], "8", 64, 16), r"query_lens: expected a sequence of ints .*, got str"),
    (([8], [1.0], 64, 16), r"query_lens\[0\]: expected an int >= 0, got 1.0"),
    (([8], [1], 64.0, 16), "workspace_rows: expected a positive integer"),
])
def test_plan_arguments_are_checked(args, match):
    with pytest.raises(ValueError, match=match):
        plan_context_chunks(*args)


def test_config_json_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"kv_lora_rank": 512, "name": "\xff\xfe"}')
    with pytest.raises(ValueError, match=f"model config {path}: cannot read JSON"):
        get_model_config(str(path))


def test_deeply_nested_config_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=f"model config {path}: cannot read JSON .*nested"):
        get_model_config(str(path))


def test_huge_config_json_is_not_read(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: no disk used
    with pytest.raises(ValueError, match=f"model config {path}: .* bytes, more than"):
        get_model_config(str(path))


@pytest.mark.parametrize("content", [
    b'{"kv_lora_rank": 512, "x": "\xff"}',
    b"[" * 100_000,
    json.dumps({**V3_JSON, "num_hidden_layers": 10**9}).encode(),
    json.dumps({**V3_JSON, "num_hidden_layers": 7}).encode().replace(b"7", b"9" * 5000),
    json.dumps({**V3_JSON, "rope_scaling": [1, 2]}).encode(),
    json.dumps({**V3_JSON, "rope_scaling": {"type": "yarn", "factor": "40", "mscale_all_dim": 1}}).encode(),
    json.dumps({**V3_JSON, "text_config": 5, "kv_lora_rank": None}).encode(),
    json.dumps({**V3_JSON, "layer_types": "sliding"}).encode(),
    b"null",
])
def test_cli_bad_config_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    rc = cli.main(["plan", "--model", str(path), "--memory", "1GiB"])  # any other error: raised
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1
    assert lines[0].startswith("error: ") and str(path) in lines[0]


def test_cli_as_a_process_prints_no_traceback(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"kv_lora_rank": ' + b"[" * 100_000)
    proc = subprocess.run([sys.executable, "-m", "mla_ext", "plan", "--model", str(path),
                           "--memory", "1GiB"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: model config {path}: cannot read JSON")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, match", [
    (["--skip-layers", "9" * 5000], "kv_cache_dtype_skip_layers"),
    (["--memory", "9" * 5000], "--memory"),
    (["--alignment", "0"], "alignment"),
    (["--block-size", "-1"], "--block-size"),
])
def test_cli_bad_arguments_are_one_line_and_exit_2(capsys, argv, match):
    try:  # a ValueError returns 2; an argparse usage error exits 2
        rc = cli.main(["plan", "--model", "deepseek-v3", "--memory", "1GiB", *argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err and match in err
    assert len([line for line in err.splitlines() if "error: " in line]) == 1


# -- context parallelism: host-to-device copies through pinned memory ------------

def test_host_to_device_copies_values():
    t = host_to_device([0, 5, 2**31 - 1], "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [0, 5, 2**31 - 1]
    assert host_to_device([3], "cpu", torch.int64).dtype == torch.int64


def test_cp_gather_context_stages_metadata_through_the_shared_helper(monkeypatch):
    calls = []

    def recording(values, device, dtype=torch.int32):
        calls.append(list(values))
        return host_to_device(values, device, dtype)

    monkeypatch.setattr(cp, "host_to_device", recording)
    seen = {}

    def gather(src, dst, table, cu, num_reqs, fmt, scale, starts):
        seen.update(cu=cu.tolist(), starts=starts.tolist())
        dst.zero_()

    cache = torch.randn(4, 4, 8)
    dst = torch.empty(6, 8)
    cp.cp_gather_context(cache, dst, torch.zeros(2, 2, dtype=torch.int32), [4, 2], "auto", None,
                         cp_size=1, rank=0, interleave=1, seq_starts=[0, 4], gather=gather)
    assert calls == [[0, 4, 6], [0, 4]] and seen == {"cu": [0, 4, 6], "starts": [0, 4]}


def test_cp_gather_context_rejects_non_tensors_and_passes_validate():
    cache = torch.randn(4, 4, 8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="dst: expected a torch.Tensor"):
        cp.cp_gather_context(cache, [[0.0] * 8], table, [4], "auto", None, cp_size=1, rank=0,
                             interleave=1)
    table[0, 1] = 7  # outside [0, 4)
    with pytest.raises(ValueError, match="block_table: request 0, logical block 1 holds block id 7"):
        cp.cp_gather_context(cache, torch.empty(8, 8), table, [8], "auto", torch.ones(1), cp_size=1,
                             rank=0, interleave=1, validate=True)


def test_context_parallel_checks_the_local_table_against_the_local_share():
    from mla_ext.prefill.layer import ContextParallel

    batch = Batch(ctx_lens=[40, 20], q_lens=[2, 3], seed=1)
    cache = torch.randn(4, BLOCK, TINY.L + TINY.R).to(torch.bfloat16)
    table = torch.tensor([[1], [2]], dtype=torch.int32)  # one local block (16 tokens) each
    meta = PrefillMetadata(table, batch.ctx_lens, batch.q_lens)

    def layer(rank):
        return MLAPrefill(TINY, NATIVE, _weight(), layer=1, workspace_rows_override=64,
                          context_parallel=ContextParallel(None, cp_size=2, rank=rank,
                                                           interleave=16))

    # Rank 0 holds positions 0-15 and 32-39 of request 0: 24 tokens, 2 blocks.
    with pytest.raises(ValueError, match=r"context_lens\[0\]: 40 tokens \(24 of them on "
                                         r"context-parallel rank 0\) need 2 blocks"):
        layer(0)(*_inputs(batch), cache, meta)
    # Rank 1 holds 16 (positions 16-31) and 4: one block each is enough; its ids are
    # then checked against the local lengths.
    bad = PrefillMetadata(torch.tensor([[1], [9]], dtype=torch.int32), batch.ctx_lens,
                          batch.q_lens)
    with pytest.raises(ValueError, match="request 1, logical block 0 holds block id 9"):
        layer(1)(*_inputs(batch), cache, bad)


def test_write_cache_checks_slots_like_forward_checks_block_ids():
    layer = _layer()
    cache = torch.randn(2, BLOCK, TINY.L + TINY.R).to(torch.bfloat16)
    kv_c = torch.randn(3, TINY.L).to(torch.bfloat16)
    k_pe = torch.randn(3, TINY.R).to(torch.bfloat16)
    slots = torch.tensor([0, 5, 2 * BLOCK])  # the last is past the cache
    with pytest.raises(ValueError, match=f"slot_mapping: token 2 has slot {2 * BLOCK}"):
        layer.write_cache(kv_c, k_pe, cache, slots)  # default: checked on the CPU (free)
    before = cache.clone()
    layer.write_cache(kv_c, k_pe, cache, slots, validate=False)  # skipped, as documented
    assert torch.equal(cache[0, 0, :TINY.L], kv_c[0]) and torch.equal(cache[0, 5, TINY.L:], k_pe[1])
    assert torch.equal(cache[1], before[1])
    with pytest.raises(ValueError, match="kv_c: expected a torch.Tensor"):
        layer.write_cache(kv_c.tolist(), k_pe, cache, slots)


def _cp_gather(**kw):
    args = dict(src_cache=torch.randn(4, 4, 8), dst=torch.empty(8, 8),
                block_table=torch.tensor([[0, 1]], dtype=torch.int32), seq_lens=[4],
                kv_cache_dtype="auto", k_scale=None, cp_size=1, rank=0, interleave=1)
    args.update(kw)
    return cp.cp_gather_context(**args)


@pytest.mark.parametrize("call, match", [
    (lambda: load_hf_config(123), "path: expected a path to config.json"),
    (lambda: __import__("mla_ext.config.models").config.models.config_from_dict([1], "x"),
     "model config x: expected a JSON object"),
    (lambda: kv_b_proj_input_dtype(type("Layer", (), {"weight": 5})(), False),
     r"kv_b_proj layer Layer: `.weight` must be a tensor"),
    (lambda: MLAModelConfig("m", L=8, R=0, P=8, V=8, num_heads=1, num_layers=1,
                            sliding_window_layers=5), "sliding_window_layers must be a set"),
    (lambda: MLAModelConfig(5, L=8, R=0, P=8, V=8, num_heads=1, num_layers=1),
     "name: expected a str"),
    (lambda: NATIVE.check_against({}), "model: expected an MLAModelConfig"),
    (lambda: _cp_gather(seq_starts=3), "seq_starts: expected a sequence of ints"),
    (lambda: _cp_gather(seq_lens=[1.5]), r"seq_lens\[0\]: expected an int >= 0, got 1.5"),
    (lambda: _cp_gather(seq_lens=[4], seq_starts=[True]), r"seq_starts\[0\]: expected an int"),
    (lambda: cp.cp_local_lens("12", 2, 0, 1), "ctx_lens: expected an int, a sequence"),
    (lambda: cp.cp_reorder([[1.0]], [1], None, 1, 1), "gathered: expected a torch.Tensor"),
])
def test_more_vague_errors_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
