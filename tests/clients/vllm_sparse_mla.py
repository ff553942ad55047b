"""vLLM 0.33's own DSA (sparse MLA) code, on the CPU with compute capability 8.6 stated, building
and running a tiny DeepSeek-V3.2 / GLM-5 attention layer on mla_ext's sparse backend and indexer
ops; prints one JSON object of what it measured (tests/clients/test_vllm_sparse_mla.py asserts).

    PYTHONPATH=<vllm tree>:<repo> VLLM_PLUGINS=mla_ext python tests/clients/vllm_sparse_mla.py

What is vLLM's own code here: its plugin loader (loads mla_ext's register()), ModelConfig /
VllmConfig reading the saved transformers config, the attention selector
``get_attn_backend(..., use_mla=True, use_sparse=True)`` with CUDA's own candidate list and
validation (``CudaPlatformBase.get_attn_backend_cls`` / ``get_valid_backends``), the model code
``vllm.models.deepseek_v32.attention.DeepseekV32Attention`` -- the class vLLM 0.33 builds for both
DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``) on a CUDA GPU (vllm/models/deepseek_v32/__init__.py maps
GlmMoeDsaForCausalLM to the same nvidia DeepseekV32ForCausalLM) -- with its indexer
(DeepseekV32Indexer, DeepseekV32IndexerCache), MLAAttention's construction, weight processing
(W_UK_T / W_UV) and forward_impl, ``sparse_attn_indexer``, the indexer's metadata builder
(DeepseekV32IndexerMetadataBuilder), the sparse backend's builder (a SparseMLACommonMetadataBuilder),
SparseMLACommonImpl.forward_mqa, vLLM's linear layers and rotary caches, and (with the MLA_EXT
prefill backend configured, nothing to drop) the layer's dense-MHA prefill route (forward_mha).
What mla_ext serves (the plugin's registration and ROUTES): the backend class (FLASHMLA_SPARSE on
8.x, CUSTOM) and its kernel hook, fused_norm_rope / fused_q (no fp8e4nv below sm_89), the DeepGEMM
logits ops and the _C indexer ops (top-k, indexer-cache gather). vLLM's own Triton kernels (the
top-k -> cache-slot conversion among them) run in Triton's interpreter.

Config mapping: transformers' config saved and read by vLLM's ModelConfig; rms_norm_eps 1e-6
(transformers' GLM-5 latent RMSNorms ignore the config's eps, vLLM's use it) and, for GLM-5,
indexer_rope_interleave=true as GLM-5's checkpoints state (transformers' GlmMoeDsaConfig drops the
key; its indexer is always interleaved).

Stand-ins (plumbing only; none computes anything the comparison checks):
* platform (tests/clients/stated_platform.py): vLLM's UnspecifiedPlatform with tensors on the
  CPU, no pinned memory, stating capability 8.6, whose backend selection is CudaPlatformBase's own
  two methods (cuda.py is imported with ``vllm._C_stable_libtorch`` as an empty module: vLLM's
  compiled library is not in the pure-Python tree). is_cuda() stays False, so vLLM's CUDA-only
  branches are not taken: the indexer builder asks for no DeepGEMM schedule metadata
  (get_paged_mqa_logits_metadata is not called), the decode top-k is vLLM's "per_row" choice
  (top_k_per_row_decode, mla_ext's) where a GPU would pick "persistent" (vLLM's _C).
* distributed: a one-process gloo group (world size 1) for vLLM's TP/DCP/PCP state.
* workspace manager: vLLM's own ``init_workspace_manager`` on the CPU device.
* forward context: vLLM's ``set_forward_context`` with the metadata and slot mappings the model
  runner would pass; the KV caches are allocated here in the spec's shape and bound with the
  layers' own ``bind_kv_cache`` (what the runner does).
* streams/events: SparseMLAIndexGroup's side stream, events and current stream are no-op objects
  (it orders its top-k conversion on a side stream; the CPU has one stream).
* torch.cuda.is_current_stream_capturing() answers False (nothing is captured on the CPU; the
  query itself needs a CUDA driver): asked on the dense-MHA prefill route.
* Triton: CUDA_VISIBLE_DEVICES="" so vLLM's Triton check (exactly one active GPU driver, relaxed
  when the visible devices are set empty) keeps Triton; vLLM's kernels then run in Triton's
  interpreter (TRITON_INTERPRET=1). The layer is built under the model dtype as torch's default
  and run under no_grad, as vLLM's loader and runner do.
* the batch description (CommonAttentionMetadata) is built here as the model runner would:
  decodes first, block tables from a seeded page layout, slots from them.

The reference is transformers' own attention module of the same family with the same weights
(tests/helpers/sparse.py builds it), run per request through the same steps with a DynamicCache:
* ``own``: its own indexer (fp32 scoring); rows whose selected set equals vLLM's are compared;
* ``fed``: its indexer's output replaced by vLLM's logical selection (its attention otherwise
  untouched) -- every row compared; with fp8_ds_mla (or a bf16 model) the latents it caches are
  replaced by the cache's rows, dequantised (what the cache holds); a bf16 model's reference is
  the module in fp32;
* ``dense``: its indexer's output replaced by every position (the causal mask limits it).
vLLM's selection is checked against the top-k of the scores of what its indexer holds (the index
cache's dequantised keys, fused_q's quantised query and folded weights, float64): equal up to ties;
those scores against transformers' indexer in float64: within e4m3 rounding.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_PLUGINS", "mla_ext")
os.environ.setdefault("TRITON_INTERPRET", "1")
# Stand-in: vLLM disables Triton unless exactly one GPU driver is active, except where the visible
# devices are set empty (its "distributed init" leniency); the kernels then run in the interpreter.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: helpers.sparse

import torch  # noqa: E402

from vllm.platforms.interface import DeviceCapability  # noqa: E402

from clients.stated_platform import install_cpu_streams, install_stated_platform  # noqa: E402

STATED = DeviceCapability(8, 6)
BLOCK = 64  # the indexer cache insists on 64-token pages
TOPK = 128  # vLLM's top-k conversion works in 128-wide tiles
MAX_LEN = 256
# Per step, the tokens of requests 0 and 1: step 1 prefills both from scratch (past index_topk);
# step 2 is mixed -- request 0 decodes one token, request 1 prefills 40 more against its 160
# cached; step 3 decodes both.
STEPS = ((150, 160), (1, 40), (1, 1))


install_stated_platform(f"{STATED.major}.{STATED.minor}", cuda_backend_selection=True)


def setup_vllm(tmp: str):
    from vllm.distributed import parallel_state
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.workspace import init_workspace_manager

    load_general_plugins()  # vLLM's loader: mla_ext's register() (backend + ROUTES for 8.6)
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{tmp}/dist", backend="gloo")
    with set_current_vllm_config(VllmConfig()):
        parallel_state.initialize_model_parallel(1, 1)
    init_workspace_manager(torch.device("cpu"))
    install_cpu_streams()


# ----------------------------------------------------------------------------------------------
# configs


SEEDS = {"deepseek_v32": 0, "glm_moe_dsa": 1}


def tiny_transformers(family: str, topk: int, dtype: torch.dtype):
    from helpers.sparse import tiny_model

    # GLM-5's checkpoints say indexer_rope_interleave=true (transformers' GLM indexer is always
    # interleaved; its config class does not keep the key), and vLLM reads it from the config.
    extra = {"indexer_rope_interleave": True} if family == "glm_moe_dsa" else {}
    seed = SEEDS[family]
    # rms_norm_eps 1e-6: transformers' GLM-5 (glm_moe_dsa) q_a / kv_a RMSNorms use their default 1e-6
    # whatever the config says (1e-5 by default) while vLLM uses config.rms_norm_eps: equal here.
    return tiny_model(family, topk=topk, seed=seed, dtype=dtype, L=512, R=64, P=32, V=32, heads=2,
                      index_heads=4, index_dim=128, max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, **extra)


def vllm_config_for(model, tmp: str, kv_cache_dtype: str, dtype: torch.dtype, backend: str | None = None,
                    prefill: str | None = None):
    from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig

    path = Path(tmp) / f"{model.config.model_type}-{model.config.index_topk}"
    if not path.exists():
        cfg = model.config
        cfg.architectures = ["GlmMoeDsaForCausalLM" if cfg.model_type == "glm_moe_dsa" else "DeepseekV32ForCausalLM"]
        cfg.save_pretrained(path)
    mc = ModelConfig(model=str(path), tokenizer=str(path), skip_tokenizer_init=True,
                     dtype=str(dtype).removeprefix("torch."), max_model_len=MAX_LEN)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK, cache_dtype=kv_cache_dtype),
                      attention_config=AttentionConfig(backend=backend, mla_prefill_backend=prefill))


def selection(model, tmp) -> list[dict]:
    """(a): vLLM's selector for this family's attention, no flag and CUSTOM, both cache dtypes and
    the dtypes the backend states."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    out = []
    for backend in (None, "CUSTOM"):
        for fmt in ("auto", "fp8_ds_mla", "fp8"):
            for dtype in (torch.float32, torch.bfloat16):
                rec = {"flag": backend, "kv_cache_dtype": fmt, "dtype": str(dtype).removeprefix("torch.")}
                try:
                    config = vllm_config_for(model, tmp, fmt, dtype, backend)
                    with set_current_vllm_config(config):
                        cls = get_attn_backend(576, dtype, fmt, use_mla=True, use_sparse=True,
                                               num_heads=model.config.num_attention_heads)
                    rec["backend"] = f"{cls.__module__}.{cls.__qualname__}"
                except Exception as exc:  # noqa: BLE001 -- reported, the test decides
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
                out.append(rec)
    return out


# ----------------------------------------------------------------------------------------------
# vLLM's layer


def build_layer(model, config):
    """vLLM's DeepseekV32Attention (the model's top-k buffer and index group, as
    DeepseekV32Model makes them) with the transformers module's weights."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention
    from vllm.v1.attention.backends.mla.index_group import (SparseMLAIndexGroupBuilder,
                                                            get_sparse_mla_index_group_max_rows)

    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = config.model_config.hf_config
    # vLLM's model loader builds the model under the model dtype as torch's default
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        topk_buffer = torch.empty(config.scheduler_config.max_num_batched_tokens, hf.index_topk, dtype=torch.int32)
        group = SparseMLAIndexGroupBuilder(topk_buffer, get_sparse_mla_index_group_max_rows(config))
        layer = DeepseekV32Attention(config, hf, prefix="model.layers.0.self_attn", topk_indices_buffer=topk_buffer,
                                     index_group_builder=group)
    load_weights(layer, model.layers[0].self_attn)
    layer.process_weights_after_loading(config.model_config.dtype)
    return layer, topk_buffer


def load_weights(layer, attn) -> None:
    """transformers' parameters into vLLM's (vLLM's fused projections are concatenations)."""
    ix = attn.indexer
    with torch.no_grad():
        put = lambda dst, src: dst.copy_(src.to(dst.dtype))  # noqa: E731
        put(layer.fused_qkv_a_proj.weight, torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]))
        put(layer.q_a_layernorm.weight, attn.q_a_layernorm.weight)
        put(layer.q_b_proj.weight, attn.q_b_proj.weight)
        put(layer.kv_a_layernorm.weight, attn.kv_a_layernorm.weight)
        put(layer.kv_b_proj.weight, attn.kv_b_proj.weight)
        put(layer.o_proj.weight, attn.o_proj.weight)
        put(layer.indexer.wq_b.weight, ix.wq_b.weight)
        put(layer.indexer.wk_weights_proj.weight, torch.cat([ix.wk.weight, ix.weights_proj.weight]))
        put(layer.indexer.k_norm.weight, ix.k_norm.weight)
        put(layer.indexer.k_norm.bias, ix.k_norm.bias)
    eps = (layer.q_a_layernorm.variance_epsilon, layer.kv_a_layernorm.variance_epsilon, layer.indexer.k_norm.eps)
    want = (attn.q_a_layernorm.variance_epsilon, attn.kv_a_layernorm.variance_epsilon, ix.k_norm.eps)
    if eps != want:
        raise ValueError(f"norm eps: vLLM {eps} vs transformers {want}")


def allocate_caches(layer, config, num_blocks: int):
    """Both caches in their specs' shapes ([blocks, 1, block, entry]), poisoned, bound as the
    model runner binds them."""
    spec = layer.get_kv_cache_spec(config)
    entry = spec.state_content_bytes or spec.head_size
    kv = torch.empty(num_blocks, 1, BLOCK, entry, dtype=spec.dtype if not spec.state_content_bytes else torch.uint8)
    kv.view(torch.uint8).fill_(0x7F)  # NaN in fp32/bf16 and e4m3 alike
    layer.bind_kv_cache(kv)
    ispec = layer.indexer.k_cache.get_kv_cache_spec(config)
    ik = torch.full((num_blocks, 1, BLOCK, ispec.head_size), 0x7F, dtype=ispec.dtype)
    layer.indexer.k_cache.bind_kv_cache(ik)
    return spec, ispec


# ----------------------------------------------------------------------------------------------
# one step


def common_metadata(q_lens, seq_lens, block_table, positions):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = q_lens_t.cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    slots = torch.cat([block_table[r, p // BLOCK].long() * BLOCK + p % BLOCK
                       for r, p in enumerate(positions)])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(q_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slots, seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=torch.tensor([q > 1 for q in q_lens]),
        positions=torch.cat(positions)), slots


class Spy:
    """Records what a routed function returned (fused_q's quantised indexer query and weights)."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __call__(self, *args, **kwargs):
        self.last = self.fn(*args, **kwargs)
        return self.last


def run_vllm(layer, topk_buffer, config, builders, hidden_per_req, block_table):
    """The steps through vLLM's layer; per step the outputs, the logical selections and the
    quantised indexer queries (row order: requests in order, decodes first as the runner orders)."""
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v32 import attention as v32

    mla_builder, idx_builder = builders
    spy = Spy(v32.fused_q)
    v32.fused_q = spy
    done = [0] * len(hidden_per_req)
    steps = []
    try:
        for step in STEPS:
            order = sorted(range(len(step)), key=lambda r: step[r] > 1)  # decodes first
            q_lens = [step[r] for r in order]
            positions = [torch.arange(done[r], done[r] + step[r]) for r in order]
            seq_lens = [done[r] + step[r] for r in order]
            cm, slots = common_metadata(q_lens, seq_lens, block_table[order], positions)
            with_meta = {
                layer.layer_name: mla_builder.build(0, cm),
                layer.indexer.k_cache.prefix: idx_builder.build(0, cm),
            }
            hidden = torch.cat([hidden_per_req[r][done[r]:done[r] + step[r]] for r in order])
            pos = torch.cat(positions)
            with set_forward_context(with_meta, config, slot_mapping={layer.layer_name: slots,
                                                                      layer.indexer.k_cache.prefix: slots}), \
                    torch.no_grad():  # the model runner runs under inference mode
                out = layer(pos, hidden.to(config.model_config.dtype))
            T = hidden.shape[0]
            q8, w, _ = spy.last
            steps.append({"order": order, "q_lens": q_lens, "done": [done[r] for r in order], "out": out.float(),
                          "sel": topk_buffer[:T].clone(), "q8": q8.float().clone(), "w": w.float().clone(),
                          "mla_meta": with_meta[layer.layer_name],
                          "idx_meta": with_meta[layer.indexer.k_cache.prefix]})
            for r in order:
                done[r] += step[r]
    finally:
        v32.fused_q = spy.fn
    return steps


# ----------------------------------------------------------------------------------------------
# what the caches hold


def cache_rows(layer, block_table, r, n, fmt):
    """Request r's first n MLA cache rows as the cache holds them: kv_c [n, L], k_pe [n, R]
    (float32; fp8_ds_mla dequantised)."""
    from mla_ext.cache.reference import decode_cache_rows

    p = torch.arange(n)
    flat = layer.kv_cache.reshape(-1, layer.kv_cache.shape[-1])
    rows = flat[block_table[r, p // BLOCK].long() * BLOCK + p % BLOCK]
    dec = rows.float() if fmt == "auto" else decode_cache_rows(rows, fmt).float()
    return dec[:, :layer.kv_lora_rank], dec[:, layer.kv_lora_rank:]


def index_keys(layer, block_table, r, n):
    """Request r's first n indexer keys as the index cache holds them (fp8 x fp32 scale, vLLM's
    page layout: a block's values, then its scales), float64."""
    cache = layer.indexer.k_cache.kv_cache.view(torch.uint8)
    D = layer.indexer.head_dim
    p = torch.arange(n)
    blk, off = block_table[r, p // BLOCK].long(), p % BLOCK
    page = cache.reshape(cache.shape[0], -1)
    idx_v = (off * D).unsqueeze(1) + torch.arange(D)
    vals = page[blk.unsqueeze(1), idx_v].view(torch.float8_e4m3fn).double()
    idx_s = (BLOCK * D + off * 4).unsqueeze(1) + torch.arange(4)
    scales = page[blk.unsqueeze(1), idx_s].contiguous().view(torch.float32).double()
    return vals * scales


# ----------------------------------------------------------------------------------------------
# transformers


def transformers_steps(model, hidden, chunks, mode, sel=None, fed_kv=None):
    """transformers' attention module of layer 0 over one request, chunk by chunk with a
    DynamicCache; its outputs per token [n, hidden] (after o_proj), and its own selection.
    mode: "own" (its indexer), "fed" (its indexer's output replaced by `sel` [n, k] logical
    positions, -1 padded) or "dense" (every position)."""
    from transformers import DynamicCache

    attn = model.layers[0].self_attn
    rotary = model.rotary_emb
    cache = DynamicCache(config=model.config)
    state = {"start": 0}

    def replace_selection(mod, args, kwargs, output):
        s, q = state["start"], output.shape[1]
        if mode == "dense":
            want = torch.arange(s + q, dtype=torch.int32).expand(q, s + q)  # the causal mask limits it
        else:
            want = sel[s:s + q].clone()
            first = want[:, :1].clamp_min(0)
            want = torch.where(want < 0, first, want)  # pad with a selected position (a no-op)
        return want.unsqueeze(0)

    seen = []

    def grab_idx(mod, args, kwargs, output):
        seen.append(output[0].clone())

    hooks = [attn.indexer.register_forward_hook(grab_idx, with_kwargs=True)]
    if mode != "own":
        hooks.append(attn.indexer.register_forward_hook(replace_selection, with_kwargs=True))
    if fed_kv is not None:
        kv_c, k_pe = fed_kv  # vLLM's k_pe layout is interleaved; transformers' de-interleaved
        k_rot = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)
        original = cache.update

        def update(k, v, layer_idx, *a, **kw):
            s, q = state["start"], k.shape[2]
            k = kv_c[s:s + q].to(k.dtype).view(1, 1, q, -1)
            v = k_rot[s:s + q].to(v.dtype).view(1, 1, q, -1)
            return original(k, v, layer_idx, *a, **kw)

        cache.update = update
    outs = []
    try:
        with torch.no_grad():
            for q in chunks:
                s = state["start"]
                x = hidden[s:s + q].unsqueeze(0).to(next(model.parameters()).dtype)
                pos = torch.arange(s, s + q).unsqueeze(0)
                pe = rotary(x, pos)
                mask = causal_mask(s, q, x.dtype)
                out = attn(hidden_states=x, position_embeddings=pe, attention_mask=mask, past_key_values=cache,
                           position_ids=pos)[0]  # (output, weights[, ...]): GLM-5's returns more
                outs.append(out[0].float())
                state["start"] += q
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(outs), seen


def causal_mask(start: int, q: int, dtype) -> torch.Tensor:
    keys = torch.arange(start + q)
    allowed = keys.unsqueeze(0) <= (start + torch.arange(q)).unsqueeze(1)
    m = torch.zeros(q, start + q, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return m.view(1, 1, q, start + q)


# ----------------------------------------------------------------------------------------------
# comparisons


def per_request(steps, n_req):
    """Stitch the steps' rows back per request: outputs, selections, q8, w (token order)."""
    out = [[] for _ in range(n_req)]
    for st in steps:
        row = 0
        for r, q in zip(st["order"], st["q_lens"]):
            out[r].append({k: st[k][row:row + q] for k in ("out", "sel", "q8", "w")})
            row += q
    return [{k: torch.cat([c[k] for c in chunks]) for k in ("out", "sel", "q8", "w")} for chunks in out]


def index_scores(q8, w, keys, start: int = 0) -> torch.Tensor:
    """float64 indexer scores of what vLLM's indexer holds: sum_h w[t,h] relu(q8[t,h] . k[s]),
    causal (-inf past the token)."""
    s = torch.einsum("thd,sd->ths", q8.double(), keys).relu()
    sc = (s * w.double().unsqueeze(-1)).sum(1)
    t = torch.arange(q8.shape[0]).unsqueeze(1) + start
    return sc.masked_fill(torch.arange(keys.shape[0]).unsqueeze(0) > t, float("-inf"))


def exact_index_scores(model, hidden) -> torch.Tensor:
    """transformers' indexer of layer 0 over one request's tokens in float64 (mla_ext's projection of
    the module's own weights: tests/sparse compare it to the module), causal scores [n, n]."""
    from mla_ext.integrations import transformers_indexer as ft
    from mla_ext.sparse.reference import indexer_scores_reference

    attn = model.layers[0].self_attn
    n = hidden.shape[0]
    cos, sin = model.rotary_emb(hidden[None], torch.arange(n)[None])
    x = ft.project(attn, ft.IndexerParams.from_module(attn), hidden, cos[0], sin[0])
    return indexer_scores_reference(x.q_idx, [x.k_idx], x.w_idx, [n], [0])[0]


def compare_case(family, fmt, dtype, tmp, topk=TOPK, prefill=None) -> dict:
    """One model through vLLM's layer (three steps) and through transformers' module. A bf16
    model's reference is the same module in fp32 (its bf16 weights upcast) fed the bf16 inputs."""
    import copy

    from helpers.numeric import rel_fro
    from helpers.sparse import tie_equivalent
    from vllm.config import set_current_vllm_config

    t0 = time.perf_counter()
    model = tiny_transformers(family, topk, dtype)
    ref_model = model if dtype == torch.float32 else copy.deepcopy(model).float()
    seed = SEEDS[family]
    config = vllm_config_for(model, tmp, fmt, dtype, prefill=prefill)
    with set_current_vllm_config(config):
        layer, topk_buffer = build_layer(model, config)
        totals = [sum(s[r] for s in STEPS) for r in range(len(STEPS[0]))]
        per_req_blocks = [-(-n // BLOCK) for n in totals]
        num_blocks = sum(per_req_blocks) + 3
        gen = torch.Generator().manual_seed(seed + 7)
        perm = torch.randperm(num_blocks - 1, generator=gen)[:sum(per_req_blocks)] + 1  # block 0 never used
        width = max(per_req_blocks)
        block_table = torch.zeros(len(totals), width, dtype=torch.int32)
        at = 0
        for r, nb in enumerate(per_req_blocks):
            block_table[r, :nb] = perm[at:at + nb].int()
            at += nb
        spec, ispec = allocate_caches(layer, config, num_blocks)
        mla_builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], config, torch.device("cpu"))
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder

        idx_builder = DeepseekV32IndexerMetadataBuilder(ispec, [layer.indexer.k_cache.prefix], config,
                                                        torch.device("cpu"), block_table_width=width)
        g = torch.Generator().manual_seed(seed + 100)
        hidden = [torch.randn(n, model.config.hidden_size, generator=g).to(dtype).float() for n in totals]
        steps = run_vllm(layer, topk_buffer, config, (mla_builder, idx_builder), hidden, block_table)
    rec = {"family": family, "kv_cache_dtype": fmt, "dtype": str(dtype).removeprefix("torch."), "topk": topk,
           "prefill": prefill,
           "backend": f"{layer.attn_backend.__module__}.{layer.attn_backend.__qualname__}",
           "impl": f"{type(layer.impl).__module__}.{type(layer.impl).__qualname__}",
           "builder": f"{type(mla_builder).__module__}.{type(mla_builder).__qualname__}",
           "steps": [{"num_decodes": st["mla_meta"].num_decodes, "num_prefills": st["mla_meta"].num_prefills,
                      "num_decode_tokens": st["mla_meta"].num_decode_tokens,
                      "indexer_num_decodes": st["idx_meta"].num_decodes,
                      "indexer_num_prefills": st["idx_meta"].num_prefills,
                      "dense_prefill": bool(getattr(st["mla_meta"].prefill, "use_dense_mha", False))}
                     for st in steps],
           "all_written": bool(all(torch.isfinite(st["out"]).all() for st in steps))}
    got = per_request(steps, len(totals))
    reqs = []
    for r, n in enumerate(totals):
        chunks = [s[r] for s in STEPS]
        v = got[r]
        # what the cache holds, where it differs from transformers' own fp32 latents
        fed_kv = cache_rows(layer, block_table, r, n, fmt) if fmt != "auto" or dtype != torch.float32 else None
        own, own_sel = transformers_steps(ref_model, hidden[r], chunks, "own", fed_kv=fed_kv)
        fed, _ = transformers_steps(ref_model, hidden[r], chunks, "fed", sel=v["sel"], fed_kv=fed_kv)
        dense = transformers_steps(ref_model, hidden[r], chunks, "dense", fed_kv=fed_kv)[0] if topk >= n else None
        width = max(x.shape[1] for x in own_sel)  # min(index_topk, keys so far) per chunk
        own_sel = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1) for x in own_sel])
        scores = index_scores(v["q8"], v["w"], index_keys(layer, block_table, r, n))
        exact = exact_index_scores(ref_model, hidden[r])
        finite = torch.isfinite(exact)
        if not torch.equal(finite, torch.isfinite(scores)):
            raise AssertionError("vLLM's indexer scores and transformers' disagree on which positions are visible")
        visible = torch.tensor([min(topk, t + 1) for t in range(n)])
        ref_sel = scores.topk(min(topk, n), dim=-1).indices
        bad = tie_equivalent(v["sel"], ref_sel, scores, rtol=1e-5)
        same_ref = sum({int(i) for i in v["sel"][t] if i >= 0} == {int(i) for i in ref_sel[t][:visible[t]]}
                       for t in range(n))
        same_tf = [t for t in range(n) if {int(i) for i in v["sel"][t] if i >= 0}
                   == {int(i) for i in own_sel[t] if 0 <= i <= t}]
        # the fp32 cache: its own latents equal what fed would feed (a check of the feeding itself)
        reqs.append({
            "tokens": n, "dropped_rows": int((torch.arange(n) + 1 > topk).sum()),
            "sel_counts_ok": bool(torch.equal((v["sel"] >= 0).sum(1), visible)),
            "sel_bad_rows_vs_cache_scores": bad, "sel_exact_rows": same_ref,
            "sel_tie_rows": n - same_ref - len(bad),
            # what vLLM's indexer holds (fp8 keys and queries) against transformers' indexer in float64
            "index_scores_rel": rel_fro(scores[finite], exact[finite]),
            "sel_equal_transformers_rows": len(same_tf),
            "max_err_fed": float((v["out"] - fed).abs().max()), "rel_fed": rel_fro(v["out"], fed),
            "max_ref_fed": float(fed.abs().max()),
            "max_err_own_same_rows": float((v["out"][same_tf] - own[same_tf]).abs().max()) if same_tf else None,
            "rel_own_same_rows": rel_fro(v["out"][same_tf], own[same_tf]) if same_tf else None,
            "max_err_dense": None if dense is None else float((v["out"] - dense).abs().max()),
            "rel_dense": None if dense is None else rel_fro(v["out"], dense),
        })
    rec["requests"] = reqs
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


# (family, kv cache dtype, index_topk): 128 drops tokens (sequences of 152 and 201); 256 drops none
# (the layer must then equal dense attention).
F32, BF16 = torch.float32, torch.bfloat16
# (family, kv cache dtype, index_topk, model dtype, MLA prefill backend): index_topk 128 drops tokens
# (sequences of 152 and 201), 256 drops none. With no prefill backend (none serves this CPU
# platform) every token takes the sparse path; with mla_ext's MLA_EXT prefill backend, vLLM runs
# the prefills no longer than index_topk as dense MHA (its forward_mha) and only the decodes sparse.
CASES = [("deepseek_v32", "auto", TOPK, F32, None), ("glm_moe_dsa", "auto", TOPK, F32, None),
         ("deepseek_v32", "fp8_ds_mla", TOPK, F32, None), ("glm_moe_dsa", "fp8_ds_mla", TOPK, F32, None),
         ("deepseek_v32", "auto", 256, F32, None), ("glm_moe_dsa", "fp8_ds_mla", 256, F32, None),
         ("deepseek_v32", "fp8_ds_mla", TOPK, BF16, None), ("glm_moe_dsa", "auto", TOPK, BF16, None),
         ("deepseek_v32", "auto", 256, F32, "MLA_EXT"),
         # a bf16 model: the new tokens' latents (vLLM's dense MHA takes them fresh) equal the cache's
         ("glm_moe_dsa", "auto", 256, BF16, "MLA_EXT")]


def main() -> None:
    from mla_ext.vllm import sparse_plugin

    result = {"stated_capability": f"{STATED.major}.{STATED.minor}", "cases": [], "selection": {}}
    with tempfile.TemporaryDirectory() as tmp:
        setup_vllm(tmp)
        only = os.environ.get("VPROOF_ONLY")
        for family in ("deepseek_v32", "glm_moe_dsa"):
            if only and family not in only:
                continue
            result["selection"][family] = selection(tiny_transformers(family, TOPK, torch.float32), tmp)
        for family, fmt, topk, dtype, prefill in CASES:
            name = str(dtype).removeprefix("torch.")
            if only and f"{family}:{fmt}:{topk}:{name}:{prefill}" not in only:
                continue
            try:
                result["cases"].append(compare_case(family, fmt, dtype, tmp, topk, prefill))
            except Exception as exc:  # noqa: BLE001 -- reported per case
                result["cases"].append({"family": family, "kv_cache_dtype": fmt, "topk": topk, "dtype": name,
                                        "prefill": prefill, "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()[-4000:]})
        result["routed"] = sorted(sparse_plugin.routed())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
