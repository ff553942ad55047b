"""README's "API in model code" runs as written and gives DeepSeek-V3's softmax scale
(not the bare 1/sqrt(P+R) a reader might copy), and its output is the model's: checked
against the prefill oracle with the scale DeepSeek's own code computes."""
import math
import re
from pathlib import Path

import pytest
import torch

from mla_ext.cache import reference as cache_ref
from mla_ext.prefill.reference import mla_prefill_reference
from helpers.numeric import rel_fro

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TRANSFORMERS_DOC = ROOT / "docs" / "transformers.md"


def model_code_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## The API in model code", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "README's 'The API in model code' section has no python block"
    return block.group(1)


def test_readme_model_code_runs_as_written_and_is_right(capsys):
    env: dict = {}
    exec(compile(model_code_example(), str(README), "exec"), env)
    printed = capsys.readouterr().out
    attn, model, out = env["attn"], env["model"], env["out"]
    ctx, new, i = env["ctx"], env["new"], env["i"]

    # DeepSeek-V3's own scale: (128+64)^-0.5 * (0.1 * 1.0 * ln 40 + 1)^2, not 192^-0.5.
    want = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
    assert abs(attn.softmax_scale - want) < 1e-9 and abs(want - 0.13523) < 1e-5
    assert "softmax scale 0.13523" in printed

    assert out.shape == (new, 16, 128) and torch.isfinite(out).all()
    rows = env["caches"][i].reshape(-1, 656)[env["slots"][:ctx]].cpu()
    lat, rope, _ = cache_ref.decode_ds_mla_row(rows)
    w = attn.kv_b_proj.weight_format.dequantize_fp32().cpu()
    kv_c, k_pe, q = (env[k][ctx:].cpu() if k != "q" else env[k].cpu() for k in ("kv_c", "k_pe", "q"))

    def ref(scale):
        return mla_prefill_reference(q, kv_c, k_pe, [lat], [rope.float()], [new], w, 128, 128, scale)

    good = ref(want)
    err = rel_fro(out.cpu(), good)
    assert err <= 1e-2, f"README example vs oracle: relative error {err:.3g} (SPEC §9 bf16: 1e-2)"
    # The scale matters: the bare 1/sqrt(P+R) would be far off (the bug this guards).
    naive = ref(192 ** -0.5)
    assert rel_fro(naive, good) > 0.05


def transformers_example() -> str:
    """The python block of docs/transformers.md's 'One call shape for every family' section."""
    text = TRANSFORMERS_DOC.read_text(encoding="utf-8")
    section = text.split("## One call shape for every family", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/transformers.md's 'One call shape for every family' section has no python block"
    return block.group(1)


def _tiny_layers(family):
    """(a stand-in `model` whose model.layers[i].self_attn is a tiny `family` attention module, i)."""
    import types

    if family == "deepseek_v32":
        from helpers.sparse import tiny_model

        return types.SimpleNamespace(model=tiny_model(family, topk=16, L=512, R=64, heads=2, index_dim=128)), 0
    from mla_ext.integrations.transformers_random import random_family_attention

    attn = random_family_attention(family, kv_lora_rank=512, qk_rope_head_dim=64)
    layers = [None, types.SimpleNamespace(self_attn=attn)]
    return types.SimpleNamespace(model=types.SimpleNamespace(layers=layers)), 1



@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v3"])
def test_readme_transformers_example_is_one_call_shape_for_every_family(family):
    """docs/transformers.md's block runs as written on a DSA (DeepSeek-V3.2) and a dense
    (DeepSeek-V3) layer: the DSA one sparse past index_topk (40 context + 5 new > 16)."""
    pytest.importorskip("transformers")
    model, i = _tiny_layers(family)
    hidden = model.model.layers[i].self_attn.config.hidden_size
    ctx, new, B = 40, 5, 64
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ctx + new, hidden, generator=gen)
    nb = 2
    table = torch.tensor([[1]], dtype=torch.int32)
    env = dict(torch=torch, model=model, i=i, num_blocks=nb, ctx_hidden=x[:ctx], ctx_positions=torch.arange(ctx),
               ctx_slots=torch.arange(B, B + ctx), new_hidden=x[ctx:], new_positions=torch.arange(ctx, ctx + new),
               block_table=table, ctx_lens=[ctx], new_lens=[new])
    exec(compile(transformers_example(), str(TRANSFORMERS_DOC), "exec"), env)
    layer, out, y = env["layer"], env["out"], env["y"]
    assert out.shape == (new, layer.model.num_heads, layer.model.V) and torch.isfinite(out).all()
    assert y.shape == (new, hidden)
    if family == "deepseek_v32":
        assert env["index_cache"] is not None and layer.last_selection.shape == (new, 16)
        sel = layer.last_selection  # 16 of the keys each new token sees: causal, all filled
        assert ((sel >= 0) & (sel <= ctx + torch.arange(new)[:, None])).all()
    else:
        assert env["index_cache"] is None and layer.last_selection is None
