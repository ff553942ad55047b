"""The DSA indexer's weights and the layer's projections from a transformers module.

Reads a `DeepseekV32Attention` / `GlmMoeDsaAttention` (transformers 5.23,
models/deepseek_v32, models/glm_moe_dsa): its `indexer` holds wq_b
[H*D, q_lora_rank], wk [D, hidden], k_norm (LayerNorm over D), weights_proj
[H, hidden]; the indexer's queries come from the attention's q_resid =
q_a_layernorm(q_a_proj(x)). The two families differ only in the indexer's RoPE
pairing (INDEXER_ROPE_INTERLEAVED); GLM-5's "shared" layers (indexer None)
reuse the previous full layer's selection and are refused here.

`project(...)` computes everything the sparse path needs from hidden states in
float64 with this library's own code (the oracle for the tests); a checkpoint
user builds `IndexerParams` from the tensors directly. `indexer_inputs_captured`
records what the module's own forward hands its indexer (hidden states, q_resid,
cos/sin), so `TransformersMLA` takes the indexer's inputs from the same forward
that gives it q and the latents.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from mla_ext.sparse.reference import indexer_weights, rope

# Attention class -> whether its indexer pairs RoPE dims interleaved (2i, 2i+1).
# Only families with a parity test are listed.
INDEXER_ROPE_INTERLEAVED = {"DeepseekV32Attention": False, "GlmMoeDsaAttention": True}


@dataclass(frozen=True)
class IndexerParams:
    wq_b: Tensor  # [H*D, q_lora_rank]
    wk: Tensor  # [D, hidden]
    k_norm_weight: Tensor  # [D]
    k_norm_bias: Tensor | None  # [D]
    k_norm_eps: float
    weights_proj: Tensor  # [H, hidden]
    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int
    rope_interleaved: bool

    def __post_init__(self):
        H, D = self.n_heads, self.head_dim
        if tuple(self.wq_b.shape[:1]) != (H * D,) or self.wk.shape[0] != D or self.weights_proj.shape[0] != H:
            raise ValueError(f"indexer weights: expected wq_b [{H * D}, q_lora], wk [{D}, hidden], weights_proj "
                             f"[{H}, hidden]; got {tuple(self.wq_b.shape)}, {tuple(self.wk.shape)}, "
                             f"{tuple(self.weights_proj.shape)}")
        if not 0 <= self.rope_dim <= D or self.rope_dim % 2 or self.topk < 1:
            raise ValueError(f"indexer: expected an even rope_dim in [0, {D}] and topk >= 1, got "
                             f"rope_dim={self.rope_dim}, topk={self.topk}")

    @classmethod
    def from_module(cls, attention) -> "IndexerParams":
        kind = type(attention).__name__
        if kind not in INDEXER_ROPE_INTERLEAVED:
            raise ValueError(f"attention module: expected one of {sorted(INDEXER_ROPE_INTERLEAVED)}, got {kind}")
        ix = getattr(attention, "indexer", None)
        if ix is None:
            raise ValueError(f"attention module (layer {getattr(attention, 'layer_idx', '?')}): has no indexer "
                             f"(a GLM-5 'shared' layer reuses the previous full layer's top-k)")
        return cls(wq_b=ix.wq_b.weight.detach(), wk=ix.wk.weight.detach(),
                   k_norm_weight=ix.k_norm.weight.detach(),
                   k_norm_bias=None if ix.k_norm.bias is None else ix.k_norm.bias.detach(),
                   k_norm_eps=float(ix.k_norm.eps), weights_proj=ix.weights_proj.weight.detach(),
                   n_heads=int(ix.n_heads), head_dim=int(ix.head_dim), rope_dim=int(ix.qk_rope_head_dim),
                   topk=int(ix.index_topk), rope_interleaved=INDEXER_ROPE_INTERLEAVED[kind])

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str, config, rope_interleaved: bool) -> "IndexerParams":
        """From checkpoint tensors named `{prefix}wq_b.weight`, `wk.weight`, `k_norm.weight`,
        `k_norm.bias` (optional), `weights_proj.weight` (transformers' and DeepSeek's names, e.g.
        prefix 'model.layers.3.self_attn.indexer.'), dims from the model config (dict or object)."""
        raw = config if isinstance(config, dict) else config.to_dict()

        def get(name, required=True):
            t = state.get(prefix + name)
            if t is None and required:
                raise ValueError(f"state: missing {prefix + name!r}")
            return t

        return cls(wq_b=get("wq_b.weight"), wk=get("wk.weight"), k_norm_weight=get("k_norm.weight"),
                   k_norm_bias=get("k_norm.bias", False), k_norm_eps=float(raw.get("index_norm_eps", 1e-6)),
                   weights_proj=get("weights_proj.weight"), n_heads=int(raw["index_n_heads"]),
                   head_dim=int(raw["index_head_dim"]), rope_dim=int(raw["qk_rope_head_dim"]),
                   topk=int(raw["index_topk"]), rope_interleaved=bool(rope_interleaved))

    def keys(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """k_I [T, D] float64: LayerNorm(wk(hidden)), RoPE on its first rope_dim dims."""
        f = torch.float64
        k = F.layer_norm(hidden.to(f) @ self.wk.to(f).t(), (self.head_dim,), self.k_norm_weight.to(f),
                         None if self.k_norm_bias is None else self.k_norm_bias.to(f), self.k_norm_eps)
        return rope(k, cos.to(f), sin.to(f), self.rope_interleaved)

    def queries(self, hidden: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """(q_I [T, H, D], w [T, H]) float64 for the new tokens."""
        f = torch.float64
        q = (q_resid.to(f) @ self.wq_b.to(f).t()).view(-1, self.n_heads, self.head_dim)
        q = rope(q, cos.to(f)[:, None], sin.to(f)[:, None], self.rope_interleaved)
        w = indexer_weights(hidden.to(f) @ self.weights_proj.to(f).t(), self.n_heads, self.head_dim)
        return q, w


class DsaInputs(NamedTuple):
    q: Tensor  # [T, N, P+R] (q_pe rotated)
    kv_c: Tensor  # [T, L] normed
    k_pe: Tensor  # [T, R] rotated
    q_idx: Tensor  # [T, H, D]
    k_idx: Tensor  # [T, D]
    w_idx: Tensor  # [T, H]


def _lin(x: Tensor, layer) -> Tensor:
    y = x @ layer.weight.to(x.dtype).t()
    return y if layer.bias is None else y + layer.bias.to(x.dtype)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight.to(x.dtype) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def project(attention, indexer: IndexerParams | None, hidden: Tensor, cos: Tensor, sin: Tensor) -> DsaInputs:
    """Every per-token input of the sparse layer from hidden [T, hidden], in float64: the main
    attention's q / kv_c_normed / k_pe (interleaved RoPE in both families) and the indexer's
    q_I / k_I / w. cos, sin [T, R]: the model's rotary table at the tokens' positions."""
    f = torch.float64
    a = attention
    x = hidden.to(f)
    q_resid = _rms(_lin(x, a.q_a_proj), a.q_a_layernorm.weight, a.q_a_layernorm.variance_epsilon)
    N, P, R, L = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    q = (q_resid @ a.q_b_proj.weight.to(f).t()).view(-1, N, P + R)
    q_pe = rope(q[..., P:], cos.to(f)[:, None], sin.to(f)[:, None], True)
    kv = _lin(x, a.kv_a_proj_with_mqa)
    kv_c = _rms(kv[:, :L], a.kv_a_layernorm.weight, a.kv_a_layernorm.variance_epsilon)
    k_pe = rope(kv[:, L:], cos.to(f), sin.to(f), True)
    q = torch.cat([q[..., :P], q_pe], dim=-1)
    if indexer is None:  # a layer that reuses another layer's selection
        return DsaInputs(q, kv_c, k_pe, None, None, None)
    q_idx, w_idx = indexer.queries(x, q_resid, cos, sin)
    return DsaInputs(q, kv_c, k_pe, q_idx, indexer.keys(x, cos, sin), w_idx)


@contextlib.contextmanager
def indexer_inputs_captured(attention):
    """Within the block, each call of `attention.indexer` records its inputs (hidden_states [B, S, H],
    q_resid [B, S, q_lora_rank], (cos, sin) [B, S, R]) into the yielded dict; nothing for a layer
    without an indexer. Both families call it as indexer(hidden_states, q_resid, position_embeddings,
    mask, position_ids, past_key_values=...)."""
    seen: dict = {}
    ix = getattr(attention, "indexer", None)

    def grab(mod, args, kwargs):
        names = ("hidden_states", "q_resid", "position_embeddings")
        got = dict(zip(names, args))
        got.update({k: kwargs[k] for k in names if k in kwargs})
        seen.update({k: tuple(t.detach() for t in v) if isinstance(v, tuple) else v.detach()
                     for k, v in got.items()})

    handle = ix.register_forward_pre_hook(grab, with_kwargs=True) if ix is not None else None
    try:
        yield seen
    finally:
        if handle is not None:
            handle.remove()


def indexer_inputs_from(params: IndexerParams, seen: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(q_I [T, H, D] and k_I [T, D] in `dtype`, w [T, H] float32) of the tokens whose indexer inputs
    `indexer_inputs_captured` recorded ([B, S, .] flattened batch-major), computed in float64 by
    IndexerParams (the module's indexer never surfaces its q or weights)."""
    if "q_resid" not in seen:
        raise RuntimeError("the module's forward never called its indexer; this transformers version "
                           "computes it another way")
    cos, sin = seen["position_embeddings"]
    hidden, q_resid = seen["hidden_states"], seen["q_resid"]

    def flat(t: Tensor) -> Tensor:
        return t.reshape(-1, t.shape[-1])

    q, w = params.queries(flat(hidden), flat(q_resid), flat(cos), flat(sin))
    k = params.keys(flat(hidden), flat(cos), flat(sin))
    return q.to(dtype), k.to(dtype), w.to(torch.float32)
