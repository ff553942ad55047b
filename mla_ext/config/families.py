"""The MLA model families transformers ships, and what differs between them.

Every family computes the same MLA attention over a latent cache (kv_c_normed
[L] + k_pe [R] per token, up-projected through kv_b_proj); they differ in how q,
the latents and the softmax scale are made, and in what joins the softmax. This
table holds only what mla_ext must know beyond the config's dims (read from each
family's modeling file in transformers 5.23.0):

- `yarn_in_scale`: the attention multiplies its softmax scale by yarn's
  mscale(factor, mscale_all_dim)^2 when the rope parameters carry one (DeepSeek's
  `yarn_apply_mscale`). dots3_note, glm5_next and kimi_linear never do, whatever
  the config's rope block says: their scale is (P+R)^-0.5.
- `sparse`: a DSA indexer picks `index_topk` keys per query. mla_ext's dense
  attention equals it only while every query sees at most `index_topk` keys.
- `sinks`: a learnable per-head logit joins every softmax (hy_v4).
- `attention`: the module's attention class (and its rotary embedding class,
  None where the family applies no rotary embedding or builds it per layer type).
- `sliding`: some layers attend within a window (`sliding_window` keys);
  dense attention equals them only while a query sees at most that many keys.

The rest (q LoRA or not, norms and rescales of the latents, rope style, query
temperature, output gates, no-rope and KV-sharing layers) is computed by the
module's own code in the transformers integration, not re-implemented here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # transformers.models.<module>.modeling_<module>
    attention: str  # the MLA attention class in that file
    yarn_in_scale: bool = True
    sparse: bool = False
    sinks: bool = False
    sliding: bool = False
    # The attention_mask its forward takes: "causal" (additive [B, 1, S, S]) or
    # "padding" (boolean [B, S]; glm5_next's indexer builds causality itself).
    mask: str = "causal"
    # An input-dependent gate between the attention and o_proj (the module's own).
    output_gate: bool = False
    # Which MLA layers run the DSA indexer's selection (sparse families): "mla" every
    # one, "indexed" only its indexed_attention layers (dots3_note's sliding layers
    # have no indexer).
    sparse_layers: str = "mla"
    # Whether its attention reads these config keys (transformers' modules of the
    # other families ignore them, so mla_ext's readers do too).
    reads_no_rope_layers: bool = False
    reads_kv_source_layers: bool = False
    # MLA modules per decoder layer: longcat_flash has two (self_attn[0], self_attn[1]);
    # transformers and vLLM number them 2*d + k, which is mla_ext's layer index.
    attention_per_layer: int = 1
    note: str = ""


def _f(model_type, attention, **kw) -> Family:
    return Family(model_type, model_type, attention, **kw)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _f("deepseek_v2", "DeepseekV2Attention", note="complex rotary of interleaved pairs"),
    _f("deepseek_v3", "DeepseekV3Attention"),
    _f("deepseek_v32", "DeepseekV32Attention", sparse=True),
    _f("axk1", "AXK1Attention"),
    _f("axk2", "AXK2Attention", sparse=True, output_gate=True, note="sigmoid output gate"),
    _f("bailing_hybrid", "BailingHybridAttention", output_gate=True,
       note="MLA on its full_attention layers only (the others are linear attention)"),
    _f("dots3_note", "Dots3NoteTextAttention", yarn_in_scale=False, sparse=True, sliding=True,
       output_gate=True, sparse_layers="indexed",
       note="per-layer dims on sliding layers; latents rescaled and k_pe normed"),
    _f("glm4_moe_lite", "Glm4MoeLiteAttention"),
    _f("glm5_next", "Glm5NextTextAttention", yarn_in_scale=False, sparse=True, mask="padding",
       note="no rope part (R = 0); MLA on its indexed layers only"),
    _f("glm_moe_dsa", "GlmMoeDsaAttention", sparse=True),
    _f("hy_v4", "HYV4Attention", sparse=True, sinks=True),
    _f("kimi_linear", "KimiLinearAttention", yarn_in_scale=False,
       note="no rotary embedding; MLA on its full_attention layers only"),
    _f("longcat_flash", "LongcatFlashMLA", attention_per_layer=2,
       note="latents rescaled; two MLA sublayers per decoder layer"),
    _f("minicpm3", "MiniCPM3Attention"),
    _f("mistral4", "Mistral4Attention", note="position-dependent query temperature"),
    _f("mistral_large4", "MistralLarge4TextAttention", sparse=True, reads_no_rope_layers=True,
       reads_kv_source_layers=True,
       note="no-rope layers, KV-sharing layers, position-dependent query temperature"),
    _f("youtu", "YoutuAttention"),
)}


def family_name(model_type) -> str | None:
    """The family of a config's model_type ("dots3_note_text" -> "dots3_note"), or None."""
    if not isinstance(model_type, str):
        return None
    key = model_type.strip().lower()
    key = key.removesuffix("_text")
    return key if key in FAMILIES else None


def family_of(model_type) -> Family | None:
    name = family_name(model_type)
    return FAMILIES[name] if name is not None else None
