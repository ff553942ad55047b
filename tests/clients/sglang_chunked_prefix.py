"""Runs SGLang 0.5.23's own DeepSeek chunked-prefix prefill, without and with mla_ext's plugin.

Run in a subprocess by tests/clients/test_sglang_plugin.py, with the SGLang client tree
(tests/clients/client_tree.py) on PYTHONPATH and TRITON_INTERPRET=1:

    python tests/clients/sglang_chunked_prefix.py OUT.json

What is SGLang's own code here: ``ServerArgs`` + ``runtime_context.publish``
(the scheduler's configuration), the plugin loader ``load_plugins`` (which
finds mla_ext through its ``sglang.srt.plugins`` entry point) and its
``HookRegistry``, the ``MLATokenToKVPool`` (bf16 and fp8) written by its own
``set_kv_buffer``, the ``ReqToTokenPool``, the ``ForwardBatch`` and its
``prepare_chunked_prefix_cache_info`` / ``prepare_chunked_kv_indices`` (a
Triton kernel, under the interpreter), ``DeepseekV2AttentionMLA`` built from
a tiny DeepSeek-V3 config (its ``kv_b_proj``, ``o_proj``, ``RadixAttention``),
and ``forward_normal_chunked_kv_core`` with ``_chunked_prefix_attn_mha``
(its pool gather, kv_b_proj, key concat and ``merge_state``, Triton on the
CPU), plus the handler registry ``AttentionBackendRegistry``.

What is not SGLang's:
* Configuration plumbing: a local tiny config.json; ``torchvision`` entries
  in sys.modules that raise if used (SGLang's config package imports an
  InternVL image helper at import time; nothing here touches images); a
  temporary ``.dist-info`` declaring mla_ext's entry point when the installed
  mla_ext predates it (see `_entry_point_dir`); the TP group stated as None
  (one rank, no process group); ``skip_rope`` (q and k_pe come with RoPE
  applied, as forward_normal_prepare hands them to the core).
* The ragged attention kernel behind ``attn_mha``: SGLang calls it from
  FlashInfer / FA3 / TRT-LLM, CUDA libraries with no CPU build, and its CPU
  backends (torch_native, triton) have no prefix-chunk MHA. ``RaggedStandIn``
  below is an SGLang ``AttentionBackend`` whose ``forward_extend`` serves
  exactly that call (causal new tokens, or a prefix chunk by SGLang's
  ``prefix_chunk_cu_seq_lens``; LSE [T, H] natural log) with
  ``mla_ext.attention.varlen_attention``, which is tested against the oracle
  on its own. Both runs use it for the new tokens; the run without the plugin
  also uses it for every prefix chunk.

Results, one record per (pool, batch): SGLang without the plugin and with it,
each against the float64 oracle (``mla_prefill_reference`` on the context as
the pool holds it, through o_proj in float64), and the two against each other.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: clients.sglang_cases, helpers.numeric
os.environ.setdefault("SGLANG_PLUGINS", "mla_ext")  # SGLang's allow-list: only mla_ext, and it asks for it

import torch  # noqa: E402
import transformers.image_utils  # noqa: E402,F401  (decides "no torchvision" before the entries below)
from helpers.numeric import rel_fro  # noqa: E402


class _Absent(types.ModuleType):
    """Plumbing: torchvision is not installed; SGLang's config package imports
    an image helper that names it. Any use raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*a, **k):
            raise RuntimeError(f"torchvision is not installed ({self.__name__}.{name})")
        return type(name, (), {"__init__": absent, "__call__": absent})


for _name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io"):
    if _name not in sys.modules:
        _mod = _Absent(_name)
        _mod.__path__ = []
        sys.modules[_name] = _mod

TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 2, "kv_lora_rank": 512, "q_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64, "v_head_dim": 32, "vocab_size": 256, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
# DeepSeek-V3's yarn: its mscale makes SGLang's softmax scale differ from
# (P+R)^-0.5, as in the real model. The rotary embedding itself is not built
# (skip_rope: the runner gives q and k_pe with RoPE applied, as
# forward_normal_prepare hands them to the core).
ROPE_SCALING = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
LAYER_ID = 1


def _entry_point_dir(tmp: str) -> str | None:
    """A folder declaring mla_ext's ``sglang.srt.plugins`` entry point, for
    importlib.metadata, when the installed mla_ext (an editable install made
    before the entry point was added to setup.py) does not declare it yet;
    None when it does. Its distribution name differs from mla_ext's."""
    import importlib.metadata as md

    if any(ep.value == "mla_ext.sglang.plugin:register" for ep in md.entry_points(group="sglang.srt.plugins")):
        return None
    info = Path(tmp) / "ep" / "mla_ext_sglang_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mla_ext_sglang_entry_point\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nmla_ext = mla_ext.sglang.plugin:register\n")
    return str(info.parent)


def setup_sglang(tmp: str):
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    model = Path(tmp) / "tiny-deepseek-v3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    args = ServerArgs(model_path=str(model), device="cpu", skip_tokenizer_init=True)
    runtime_context.publish(args, role="scheduler")
    # One rank, no process group: o_proj (RowParallelLinear) reads the TP group
    # only to decide on symmetric memory, off here.
    runtime_context.get_parallel().override_permanently(tp_group=None)
    return model


def build_attention(model_dir: Path):
    """SGLang's DeepSeek attention module for the tiny config, with random weights."""
    from transformers import AutoConfig

    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

    cfg = AutoConfig.from_pretrained(str(model_dir))
    attn = DeepseekV2AttentionMLA(
        cfg, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        rope_theta=TINY_CONFIG["rope_theta"], rope_scaling=dict(ROPE_SCALING),
        max_position_embeddings=cfg.max_position_embeddings, quant_config=None, layer_id=LAYER_ID,
        skip_rope=True, prefix=f"model.layers.{LAYER_ID}.self_attn")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])).to(p.dtype))
    return attn.to(torch.bfloat16)


def ragged_stand_in_class():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from mla_ext.attention.api import varlen_attention

    class RaggedStandIn(AttentionBackend):
        """attn_mha's ragged prefill (FlashInfer/FA3 on a GPU) on mla_ext's varlen attention."""

        def __init__(self, token_to_kv_pool, req_to_token_pool):
            from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

            self.token_to_kv_pool = token_to_kv_pool
            self.req_to_token_pool = req_to_token_pool
            # SGLang's own translator, as ModelRunner.init_kv_index_translator builds it
            # (no allocator: a plain, non-unified pool, whose ids need no translation).
            self.kv_index_translator = None if req_to_token_pool is None else KVIndexTranslator(
                req_to_token=req_to_token_pool.req_to_token, token_to_kv_pool_allocator=None,
                token_to_kv_pool=token_to_kv_pool, page_size=token_to_kv_pool.page_size, device="cpu")
            self.calls = {"new_tokens": 0, "prefix_chunk": 0}

        def init_forward_metadata(self, forward_batch):
            pass

        def forward_decode(self, *args, **kwargs):
            raise NotImplementedError("decode is not run here")

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            lens = forward_batch.extend_seq_lens_cpu
            cu_q = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
            if forward_batch.attn_attend_prefix_cache:
                i = forward_batch.prefix_chunk_idx
                cu_k = forward_batch.prefix_chunk_cu_seq_lens[i]
                max_k, causal = forward_batch.prefix_chunk_max_seq_lens[i], False
                self.calls["prefix_chunk"] += 1
            else:
                cu_k, max_k, causal = cu_q, max(lens), True
                self.calls["new_tokens"] += 1
            o, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lens), int(max_k), layer.scaling, causal, True)
            if forward_batch.mha_return_lse:
                return o, lse.transpose(0, 1).contiguous()  # SGLang's LSE layout: [T, H], natural log
            return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    return RaggedStandIn


class Case:
    """One batch on one SGLang pool: the pool written by SGLang, the ForwardBatch,
    the new tokens' q/k/v as SGLang's forward_normal_prepare makes them."""

    def __init__(self, attn, pool_dtype: torch.dtype, page_size: int, prefix_lens, new_lens, seed: int,
                 dsa: bool = False, fp4: bool = False):
        from sglang.srt.mem_cache.memory_pool import (
            KVWriteLoc,
            MLATokenToKVPool,
            MLATokenToKVPoolFP4,
            ReqToTokenPool,
        )

        gen = torch.Generator().manual_seed(seed)
        self.attn, self.prefix_lens, self.new_lens = attn, list(prefix_lens), list(new_lens)
        L, R = attn.kv_lora_rank, attn.qk_rope_head_dim
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        pages_per_req = [-(-s // page_size) for s in seq_lens]
        num_pages = sum(pages_per_req) + 3
        # dsa: the sparse-attention pool's fp8 rows (656 bytes: 512 e4m3, 4 fp32 tile scales, 64 bf16).
        self.dsa = dsa
        # fp4: SGLang's FP4 pool (e2m1 data and block scales in separate tensors).
        pool_class = MLATokenToKVPoolFP4 if fp4 else MLATokenToKVPool
        self.pool = pool_class(num_pages * page_size, page_size, pool_dtype, L, R, layer_num=LAYER_ID + 1,
                               device="cpu", enable_memory_saver=False, use_dsa=dsa,
                               override_kv_cache_dim=656 if dsa else None)
        B = len(seq_lens)
        self.req_pool = ReqToTokenPool(B + 2, max(seq_lens) + page_size, "cpu", False)
        # Shuffled pages from 1 (page 0 holds SGLang's padding slot), a request's tokens in page order.
        pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        self.req_idx = torch.arange(1, B + 1, dtype=torch.int64)
        slots = []
        for r, (s, npg) in enumerate(zip(seq_lens, pages_per_req)):
            mine, pages = pages[:npg], pages[npg:]
            pos = torch.arange(s)
            row = torch.tensor(mine)[pos // page_size] * page_size + pos % page_size
            self.req_pool.req_to_token[int(self.req_idx[r]), :s] = row.to(torch.int32)
            slots.append(row)
        T = sum(new_lens)
        # The latent of every token (context and new), as kv_a_layernorm + rope would give it.
        self.latent = [torch.randn(s, L + R, generator=gen).to(torch.bfloat16) for s in seq_lens]
        self.q = (torch.randn(T, attn.num_local_heads, attn.qk_head_dim, generator=gen)).to(torch.bfloat16)
        ctx_slots = torch.cat([sl[:p] for sl, p in zip(slots, prefix_lens)])
        new_slots = torch.cat([sl[p:] for sl, p in zip(slots, prefix_lens)])
        ctx_latent = torch.cat([lat[:p] for lat, p in zip(self.latent, prefix_lens)])
        new_latent = torch.cat([lat[p:] for lat, p in zip(self.latent, prefix_lens)])
        # SGLang's own writes: its CPU path of _set_mla_kv_buffer (set_kv_buffer of the
        # latent); the DSA pool only has set_mla_kv_buffer (SGLang's quantize_k_cache_separate).
        for loc, lat in ((ctx_slots, ctx_latent), (new_slots, new_latent)):
            if loc.numel() and dsa:
                self.pool.set_mla_kv_buffer(attn.attn_mha, KVWriteLoc(loc.long()), lat[:, None, :L].contiguous(),
                                            lat[:, None, L:].contiguous())
            elif loc.numel():
                self.pool.set_kv_buffer(attn.attn_mha, KVWriteLoc(loc.long()), lat.unsqueeze(1), None)
        self.new_latent, self.slots, self.new_slots = new_latent, slots, new_slots
        self.seq_lens = seq_lens

    def forward_batch(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        B, T = len(self.seq_lens), sum(self.new_lens)
        i32 = torch.int32
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=torch.zeros(T, dtype=torch.int64),
            req_pool_indices=self.req_idx, seq_lens=torch.tensor(self.seq_lens, dtype=i32),
            out_cache_loc=self.new_slots.long(), seq_lens_sum=sum(self.seq_lens),
            seq_lens_cpu=torch.tensor(self.seq_lens, dtype=i32),
            extend_prefix_lens=torch.tensor(self.prefix_lens, dtype=i32), extend_prefix_lens_cpu=self.prefix_lens,
            extend_seq_lens=torch.tensor(self.new_lens, dtype=i32), extend_seq_lens_cpu=self.new_lens,
            extend_num_tokens=T)

    def new_qkv(self, fb):
        """k, v of the new tokens as SGLang's forward_normal_prepare builds them."""
        attn, L = self.attn, self.attn.kv_lora_rank
        kv = attn.kv_b_proj(self.new_latent[:, :L].contiguous())[0]
        kv = kv.view(-1, attn.num_local_heads, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope, v = kv[..., : attn.qk_nope_head_dim], kv[..., attn.qk_nope_head_dim:]
        k = attn._concat_and_cast_mha_k(k_nope, self.new_latent[:, L:].unsqueeze(1), fb)
        return self.q.clone(), k, v

    def pool_values(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, L+R] float: what the pool holds at `slots`, decoded by SGLang (fp8: its plain
        cast; FP4: its get_key_buffer's dequantization; DSA rows: its
        dequantize_k_cache_paged_dsa, a Triton kernel)."""
        buf = self.pool.get_key_buffer(LAYER_ID)
        if not self.dsa:
            return buf[slots.long(), 0].float()
        from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache_paged_dsa

        if slots.numel() == 0:
            return torch.zeros(0, self.attn.kv_lora_rank + self.attn.qk_rope_head_dim)
        return dequantize_k_cache_paged_dsa(buf, slots.to(torch.int32))[:, 0].float()

    def mla_ext_decode(self, slots: torch.Tensor) -> torch.Tensor:
        """The same rows decoded by mla_ext's fp8_ds_mla reference, from the plugin's view."""
        from mla_ext.cache.reference import decode_cache_rows
        from mla_ext.sglang.pool_view import kv_cache_format, paged_cache

        fmt, view_dtype = kv_cache_format(self.pool, torch.bfloat16, self.attn.kv_lora_rank,
                                          self.attn.qk_rope_head_dim)
        rows = paged_cache(self.pool, LAYER_ID, view_dtype).reshape(-1, 656)[slots.long()]
        return fmt, decode_cache_rows(rows, fmt).float()

    def oracle(self) -> torch.Tensor:
        """float64 attention output through o_proj, with the context as the pool holds it."""
        from mla_ext.prefill.reference import mla_prefill_reference

        attn, L = self.attn, self.attn.kv_lora_rank
        ctx = [self.pool_values(sl[:p]) for sl, p in zip(self.slots, self.prefix_lens)]
        new = self.new_latent.float()
        o = mla_prefill_reference(self.q.float(), new[:, :L], new[:, L:], [c[:, :L] for c in ctx],
                                  [c[:, L:] for c in ctx], self.new_lens, attn.kv_b_proj.weight.float(),
                                  attn.qk_nope_head_dim, attn.v_head_dim, attn.attn_mha.scaling)
        return o.reshape(o.shape[0], -1).double() @ attn.o_proj.weight.double().t()


def run_core(case: Case, backend, capacity: int) -> torch.Tensor:
    """SGLang's forward_normal_chunked_kv_core on a fresh ForwardBatch."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    os.environ["SGLANG_MAX_KV_CHUNK_CAPACITY"] = str(capacity)
    fb = case.forward_batch()
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        q, k, v = case.new_qkv(fb)
        with torch.no_grad():
            out = case.attn.forward_normal_chunked_kv_core(q, k, v, fb)
    return out, fb


def dispatch_table(attn, backend) -> dict:
    """What SGLang's fa3/flashinfer/flashmla/triton handlers choose for three prefix sizes."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    os.environ["SGLANG_MAX_KV_CHUNK_CAPACITY"] = str(128 * 1024)
    got = {}
    for prefix in (4000, 9000, 200000):
        fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_prefix_lens_cpu=[prefix],
                                   seq_lens_cpu=torch.tensor([prefix + 100]),
                                   get_max_chunk_capacity=lambda: 128 * 1024)
        with forward_context(ForwardContext(attn_backend=backend)):
            for name in ("fa3", "flashinfer", "flashmla", "triton"):
                got[f"{name}/{prefix}"] = AttentionBackendRegistry.get_handler(name)(attn, fb).name
    return got


def fp8_kv_b_proj_check(model_dir: Path) -> dict:
    """SGLang's block-FP8 kv_b_proj (Fp8Config, 128x128 blocks, its own
    process_weights_after_loading) as the plugin reads it, against SGLang's own
    block_quant_dequant (what its DeepSeek weight loader dequantizes it with).
    SGLang's fp8 linear itself does not run on a CPU, so this checks the format only."""
    from transformers import AutoConfig

    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

    from mla_ext.kv_b_proj import weights as W
    from mla_ext.sglang.chunked_prefix import kv_b_proj_format

    cfg = AutoConfig.from_pretrained(str(model_dir))
    attn = DeepseekV2AttentionMLA(
        cfg, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        rope_theta=TINY_CONFIG["rope_theta"], rope_scaling=None, max_position_embeddings=cfg.max_position_embeddings,
        quant_config=Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]),
        layer_id=LAYER_ID, skip_rope=True, prefix=f"model.layers.{LAYER_ID}.self_attn")
    kb = attn.kv_b_proj
    dense = torch.randn(kb.weight.shape, generator=torch.Generator().manual_seed(11)) / 20
    ckpt = W.Fp8BlockWeight.from_dense(dense)  # a checkpoint's tensors
    with torch.no_grad():
        kb.weight.copy_(ckpt.weight)
        kb.weight_scale_inv.copy_(ckpt.weight_scale_inv)
    kb.quant_method.process_weights_after_loading(kb)
    fmt = kv_b_proj_format(kb, torch.bfloat16)
    theirs = block_quant_dequant(kb.weight, kb.weight_scale_inv, [128, 128], torch.float32)
    return {"format": type(fmt).__name__, "scale_shape": list(kb.weight_scale_inv.shape),
            "vs_sglang_dequant": float((fmt.dequantize_fp32() - theirs).abs().max())}


def main(out_path: str) -> None:
    from clients.sglang_cases import BATCHES, CONTEXT_MODES, DSA_BATCHES, FP4_BATCH, POOLS

    t0 = time.perf_counter()
    results, header = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ep_dir = _entry_point_dir(tmp)
        if ep_dir:
            sys.path.append(ep_dir)
        header["entry_point_from_temp_dist_info"] = ep_dir is not None
        model_dir = setup_sglang(tmp)
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.plugins import load_plugins, load_plugins_by_group
        from sglang.srt.plugins.hook_registry import HookRegistry

        from mla_ext.sglang import chunked_prefix, plugin

        header["import_s"] = round(time.perf_counter() - t0, 1)
        attn = build_attention(model_dir)
        RaggedStandIn = ragged_stand_in_class()
        cases = []
        for pool_dtype, page_size in POOLS:
            for i, (name, prefix, new, capacity) in enumerate(BATCHES):
                case = Case(attn, getattr(torch, pool_dtype), page_size, prefix, new, seed=100 * i + page_size)
                cases.append((pool_dtype, page_size, name, capacity, case,
                              RaggedStandIn(case.pool, case.req_pool)))
        probe = MLATokenToKVPool(64, 1, torch.bfloat16, 512, 64, layer_num=LAYER_ID + 1, device="cpu",
                                 enable_memory_saver=False)
        probe_backend = RaggedStandIn(probe, None)

        # 1. Without the plugin: SGLang's own loop (and handler choices).
        header["dispatch_without"] = dispatch_table(attn, probe_backend)
        outs = {}
        for pool_dtype, page_size, name, capacity, case, backend in cases:
            key = (pool_dtype, page_size, name)
            try:
                out, fb = run_core(case, backend, capacity)
                outs[key] = {"out": out, "chunks": fb.num_prefix_chunks, "calls": dict(backend.calls)}
            except Exception as exc:
                outs[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}

        # 2. The plugin, inert when not asked: SGLang's loader finds it; register() with MLA_EXT_SGLANG=0 hooks nothing.
        found = load_plugins_by_group("sglang.srt.plugins")
        header["entry_point_found"] = "mla_ext" in found
        os.environ[plugin.ENV] = "0"
        plugin.register()
        header["hooks_when_off"] = sorted(t for t in plugin.HOOK_TARGETS if HookRegistry._hooks.get(t))
        del os.environ[plugin.ENV]

        # 3. With the plugin, loaded by SGLang's own load_plugins (asked through SGLANG_PLUGINS=mla_ext).
        load_plugins()
        header["hooks_when_on"] = sorted(t for t in plugin.HOOK_TARGETS if t in HookRegistry._patched)
        header["dispatch_with"] = dispatch_table(attn, probe_backend)
        for mode in CONTEXT_MODES:
            os.environ[chunked_prefix.CONTEXT_ENV] = mode
            for pool_dtype, page_size, name, capacity, case, backend in cases:
                key = (pool_dtype, page_size, name)
                rec = {"pool": pool_dtype, "page_size": page_size, "batch": name, "capacity": capacity, "mode": mode}
                t = time.perf_counter()
                try:
                    before, base = dict(chunked_prefix.STATS), dict(backend.calls)
                    out, fb = run_core(case, backend, capacity)
                    oracle = case.oracle()
                    sg = outs[key]
                    if "error" in sg:
                        rec.update(sglang_error=sg["error"], sglang_traceback=sg["traceback"])
                    else:
                        rec.update(sglang_vs_oracle=rel_fro(sg["out"], oracle), sglang_chunks=sg["chunks"],
                                   sglang_prefix_chunk_calls=sg["calls"]["prefix_chunk"],
                                   plugin_vs_sglang=rel_fro(out, sg["out"]))
                    rec.update(plugin_vs_oracle=rel_fro(out, oracle), has_prefix=any(case.prefix_lens),
                               plugin_prefix_chunk_calls=backend.calls["prefix_chunk"] - base["prefix_chunk"],
                               finite=bool(torch.isfinite(out).all()),
                               **{f"plugin_{k}": chunked_prefix.STATS[k] - before[k] for k in before})
                except Exception as exc:
                    rec.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
                rec["seconds"] = round(time.perf_counter() - t, 3)
                results.append(rec)

        # 4. The DSA fp8 pool (SGLang's writer), read by the plugin as fp8_ds_mla. SGLang's own
        # chunked loop cannot read these rows (its DSA layers take one-shot MHA or MLA, with
        # their own dequantization), so only the plugin runs; the oracle gets the context
        # as SGLang's dequantize_k_cache_paged_dsa decodes it.
        for i, (name, prefix, new, capacity) in enumerate(DSA_BATCHES):
            case = Case(attn, torch.float8_e4m3fn, 64, prefix, new, seed=500 + i, dsa=True)
            ctx = torch.cat([sl[:p] for sl, p in zip(case.slots, prefix)])
            fmt, ours = case.mla_ext_decode(ctx)
            decoded = rel_fro(ours, case.pool_values(ctx))
            oracle = case.oracle()
            for mode in CONTEXT_MODES:
                os.environ[chunked_prefix.CONTEXT_ENV] = mode
                rec = {"pool": "dsa_fp8", "page_size": 64, "batch": name, "capacity": capacity, "mode": mode,
                       "format": fmt, "decode_vs_sglang_dequant": decoded}
                t = time.perf_counter()
                try:
                    backend = RaggedStandIn(case.pool, case.req_pool)
                    before = dict(chunked_prefix.STATS)
                    out, fb = run_core(case, backend, capacity)
                    rec.update(plugin_vs_oracle=rel_fro(out, oracle), plugin_prefix_chunk_calls=backend.calls["prefix_chunk"],
                               finite=bool(torch.isfinite(out).all()),
                               **{f"plugin_{k}": chunked_prefix.STATS[k] - before[k] for k in before})
                except Exception as exc:
                    rec.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
                rec["seconds"] = round(time.perf_counter() - t, 3)
                results.append(rec)

        try:
            header["fp8_kv_b_proj"] = fp8_kv_b_proj_check(model_dir)
        except Exception as exc:
            header["fp8_kv_b_proj"] = {"error": f"{type(exc).__name__}: {exc}",
                                       "traceback": traceback.format_exc()[-3000:]}

        # 5. SGLang's FP4 pool: left to SGLang's own loop, said once (two calls, one warning).
        said = []
        catcher = logging.Handler()
        catcher.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("mla_ext.sglang").addHandler(catcher)
        name, prefix, new, capacity = FP4_BATCH
        case = Case(attn, torch.float4_e2m1fn_x2, 16, prefix, new, seed=900, fp4=True)
        oracle = case.oracle()
        for mode in CONTEXT_MODES:
            os.environ[chunked_prefix.CONTEXT_ENV] = mode
            rec = {"pool": "fp4", "page_size": 16, "batch": name, "capacity": capacity, "mode": mode}
            try:
                backend = RaggedStandIn(case.pool, case.req_pool)
                before = dict(chunked_prefix.STATS)
                out, fb = run_core(case, backend, capacity)
                rec.update(sglang_vs_oracle=rel_fro(out, oracle), sglang_chunks=fb.num_prefix_chunks,
                           sglang_prefix_chunk_calls=backend.calls["prefix_chunk"],
                           **{f"plugin_{k}": chunked_prefix.STATS[k] - before[k] for k in before})
            except Exception as exc:
                rec.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            results.append(rec)
        header["fp4_warnings"] = [m for m in said if "FP4" in m]
        header["fp4_dispatch_with"] = dispatch_table(attn, RaggedStandIn(case.pool, None))
        os.environ.pop(chunked_prefix.CONTEXT_ENV, None)
        header["total_s"] = round(time.perf_counter() - t0, 1)
    Path(out_path).write_text(json.dumps({"header": header, "cases": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
