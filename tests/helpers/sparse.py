"""Tiny DeepSeek-V3.2 / GLM-5 (glm_moe_dsa) attention layers and their own forward with context,
for the sparse (DSA) tests: one request at a time through transformers with a DynamicCache
(context forward, then the new tokens), capturing the attention's input, output and the
indexer's selection."""
from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32Model"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaModel"),
}


def tiny_model(family: str, *, topk: int = 16, seed: int = 0, dtype=torch.float32, index_heads: int = 4,
               L: int = 32, R: int = 8, P: int = 16, V: int = 16, heads: int = 4, index_dim: int = 16,
               **extra):
    mod = importlib.import_module(f"transformers.models.{family}")
    cfg_cls, model_cls = (getattr(mod, n) for n in FAMILIES[family])
    kw = dict(vocab_size=32, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
              q_lora_rank=24, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=P, v_head_dim=V,
              index_topk=topk, index_n_heads=index_heads, index_head_dim=index_dim,
              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
              max_position_embeddings=4096, attn_implementation="eager")
    kw.update(extra)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(dtype).eval()
    with torch.no_grad():  # random, non-trivial norms (the init is ones / zeros)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    return model


class Captured(NamedTuple):
    hidden: torch.Tensor  # [ctx + q_len, hidden]: the attention's input, context then new tokens
    out: torch.Tensor  # [q_len, hidden]: the attention's output (after o_proj) for the new tokens
    topk: torch.Tensor  # [q_len, k]: the indexer's selection for the new tokens (int32)
    cos: torch.Tensor  # [ctx + q_len, R]
    sin: torch.Tensor


def run_with_context(model, ctx: int, q_len: int, seed: int, layer_idx: int = 0) -> Captured:
    """transformers' own forward: ctx tokens, then q_len new tokens against the cache; what layer
    `layer_idx`'s attention saw and gave (topk None for a layer without an indexer)."""
    from transformers import DynamicCache

    layer = model.layers[layer_idx].self_attn
    seen = {}

    def grab_attn(mod, args, kwargs, output):
        seen.setdefault("hidden", []).append(kwargs.get("hidden_states", args[0] if args else None).detach()[0])
        seen.setdefault("out", []).append(output[0].detach()[0])
        seen.setdefault("pe", []).append(tuple(t.detach()[0] for t in kwargs["position_embeddings"]))

    def grab_idx(mod, args, kwargs, output):
        seen.setdefault("topk", []).append(output.detach()[0])

    h1 = layer.register_forward_hook(grab_attn, with_kwargs=True)
    h2 = layer.indexer.register_forward_hook(grab_idx, with_kwargs=True) if layer.indexer is not None else None
    g = torch.Generator().manual_seed(seed)
    dt = next(model.parameters()).dtype
    emb = torch.randn(1, ctx + q_len, model.config.hidden_size, generator=g).to(dt)
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            if ctx:
                model(inputs_embeds=emb[:, :ctx], past_key_values=cache, use_cache=True)
            model(inputs_embeds=emb[:, ctx:], past_key_values=cache, use_cache=True)
    finally:
        h1.remove()
        if h2 is not None:
            h2.remove()
    cat = lambda xs: torch.cat(xs, dim=0)
    return Captured(cat(seen["hidden"]), seen["out"][-1], seen["topk"][-1] if "topk" in seen else None,
                    cat([p[0] for p in seen["pe"]]), cat([p[1] for p in seen["pe"]]))


class RefLayer(NamedTuple):
    inputs: object  # mla_ext.integrations.transformers_indexer.DsaInputs over ctx + q_len tokens (float64)
    scores: torch.Tensor  # [q_len, ctx + q_len] float64
    selected: torch.Tensor  # [q_len, topk] int32
    o: torch.Tensor  # [q_len, N, V] float32 (before o_proj)
    lse: torch.Tensor  # [N, q_len]
    out: torch.Tensor  # [q_len, hidden] float64 (after o_proj)


def reference_layer(model, cap: Captured, ctx: int, topk: int | None = None) -> RefLayer:
    """mla_ext's float64 oracle of the same layer, from the captured attention input."""
    from mla_ext.integrations import transformers_indexer as ft
    from mla_ext.sparse import reference as ref

    attn = model.layers[0].self_attn
    ix = ft.IndexerParams.from_module(attn)
    k = topk or ix.topk
    x = ft.project(attn, ix, cap.hidden, cap.cos, cap.sin)
    q_len = cap.hidden.shape[0] - ctx
    new = slice(ctx, ctx + q_len)
    scores = ref.indexer_scores_reference(x.q_idx[new], [x.k_idx], x.w_idx[new], [q_len], [ctx])[0]
    sel = ref.topk_reference(scores, k)
    o, lse = ref.sparse_latent_attention_reference(x.q[new], [x.kv_c], [x.k_pe], sel, [q_len],
                                                   attn.kv_b_proj.weight, attn.qk_nope_head_dim,
                                                   attn.v_head_dim, attn.scaling)
    out = o.to(torch.float64).reshape(q_len, -1) @ attn.o_proj.weight.to(torch.float64).t()
    return RefLayer(x, scores, sel, o, lse, out)


def tie_equivalent(selected: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, rtol: float = 1e-5) -> list:
    """Rows where the two selections differ beyond ties at the k-th score: every position in one set and
    not the other must score (within rtol) the lowest selected score. Positions scoring -inf (not
    visible) are dropped from both (transformers pads a short row with masked positions)."""
    bad = []
    for t in range(selected.shape[0]):
        row = scores[t]
        a = {int(i) for i in selected[t] if i >= 0 and row[int(i)] > float("-inf")}
        b = {int(i) for i in theirs[t] if i >= 0 and row[int(i)] > float("-inf")}
        if a == b:
            continue
        if len(a) != len(b):
            bad.append(t)
            continue
        kth = min(float(row[i]) for i in a)
        tol = rtol * max(1.0, abs(kth))
        if any(abs(float(row[i]) - kth) > tol for i in a ^ b):
            bad.append(t)
    return bad
